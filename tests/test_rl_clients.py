"""RL loops' own reward clients against a jaxrm server on loopback, pointed at it by the lines of
their docs pages.

* OpenRLHF (0.11.2, installed without its dependencies): ``SingleTurnAgentExecutor`` itself, its
  vLLM engine stood in by one that answers a fixed completion (the policy is not under test).
* slime: ``remote_rm`` of ``slime/rollout/rm_hub/__init__.py``, copied below (slime is not on PyPI),
  with aiohttp as slime sends it.

Each score is checked against ``rm.score`` of the same text or conversation; the server's
``/metrics`` and OpenRLHF's ``extra_logs`` carry the reward's health."""

import asyncio
import dataclasses
import functools
import os
import re
import types

import pytest
from helpers import SERVER_CONFIG, approx, assistant, metric, serving, user

from jaxrm.scoring import reward_health

aiohttp = pytest.importorskip("aiohttp", reason="the loops' HTTP client: pip install aiohttp")

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "rl")
HOST = "http://RM_HOST:8000"  # the docs pages' server, replaced by the test server's address


def doc_flag(page, flag):
  """The value that a docs page (of docs/rl/) sets ``flag`` to."""
  with open(os.path.join(DOCS, page)) as f:
    (value,) = re.findall(rf"^\s*{re.escape(flag)}[ =](\S+)", f.read(), re.M)
  return value


# The reward range a validation would have recorded: the tiny model's rewards fall either side of it.
STATS = {"mean": -0.9, "std": 0.1, "min": -0.95, "max": -0.85, "from": "validation-default"}


@pytest.fixture(scope="module")
def url(tiny_rm):
  from jaxrm import RewardModel
  from jaxrm.scoring.loading import ScoringInfo

  with serving(RewardModel(tiny_rm.model, tiny_rm.tokenizer, ScoringInfo(reward_stats=STATS))) as s:
    yield s.url


# ------------------------------------------------------------------ OpenRLHF


class Completion:
  """vLLM's RequestOutput, as OpenRLHF's executor reads it: one completion, finished by its eos."""

  def __init__(self, token_ids):
    self.outputs = [types.SimpleNamespace(token_ids=token_ids, finish_reason="stop", logprobs=None)]


class Engine:
  """Stands in for OpenRLHF's vLLM engine: answers every prompt with ``reply``'s tokens."""

  def __init__(self, reply_ids):
    self.reply_ids = reply_ids

  async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
    return Completion(list(self.reply_ids))


def test_openrlhf_executor_gets_rewards_scores_and_health(url, tiny_rm):
  agent = pytest.importorskip("openrlhf.utils.agent", reason="pip install --no-deps openrlhf==0.11.2")
  with open(os.path.join(os.path.dirname(agent.__file__), "..", "cli", "train_ppo_ray.py")) as f:
    assert '"--reward.remote_url"' in f.read()  # the flag the page sets is OpenRLHF's
  remote_rm_url = doc_flag("openrlhf.md", "--reward.remote_url").replace(HOST, url)
  executor = agent.SingleTurnAgentExecutor(remote_rm_url)
  tokenizer = tiny_rm.tokenizer
  params = types.SimpleNamespace(max_tokens=16, logprobs=None)

  async def rollouts():
    out = []
    for question, answer in [("What is 2 + 2?", "4"), ("What is 3 + 5?", "It is 35.")]:
      # OpenRLHF's prompt: the policy's chat template applied to the dataset's prompt (--apply_chat_template).
      prompt = tokenizer.apply_chat_template([user(question)], tokenize=False, add_generation_prompt=True)
      reply = tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
      out.append(await executor.execute(prompt, None, params, 64, tokenizer, Engine(reply)))
    return out

  outputs = asyncio.run(rollouts())
  for out in outputs:
    query = tokenizer.decode(out["observation_tokens"], skip_special_tokens=False)
    want = tiny_rm.score_ids([tokenizer(query, add_special_tokens=False)["input_ids"]])
    assert out["reward"] == approx(want), out
    assert out["scores"] == out["reward"]
  health = outputs[-1]["extra_logs"]
  signals = {"reward_mean", "reward_std", "reward_length_corr", "reward_out_of_range", "truncated"}
  assert set(health) == {f"reward_health/{n}" for n in signals}
  # The server's health over its last rewards, as its /metrics reports it.
  for name in signals:
    assert health[f"reward_health/{name}"] == [metric(url, f"jaxrm_{name}")]


# ------------------------------------------------------------------ slime


_shared_session = None


def _get_shared_session():
  # slime/rollout/rm_hub/__init__.py
  global _shared_session
  if _shared_session is None or _shared_session.closed:
    connector = aiohttp.TCPConnector(limit=64, enable_cleanup_closed=True)
    timeout = aiohttp.ClientTimeout(total=120)
    _shared_session = aiohttp.ClientSession(connector=connector, timeout=timeout)
  return _shared_session


async def remote_rm(args, sample, max_retries=1):
  # slime/rollout/rm_hub/__init__.py, its retries left out (a refusal here is the test's failure)
  payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
  session = _get_shared_session()
  async with session.post(args.rm_url, json=payload) as resp:
    resp.raise_for_status()
    return await resp.json()


def slime_rewards(rm_url, samples):
  """slime's batched_async_rm with ``--rm-type remote_rm``: one request per sample, gathered."""
  global _shared_session
  args = types.SimpleNamespace(rm_url=rm_url, rm_type="remote_rm", custom_rm_path=None)

  async def batch():
    global _shared_session
    try:
      return await asyncio.gather(*(remote_rm(args, s) for s in samples))
    finally:
      await _shared_session.close()
      _shared_session = None

  return asyncio.run(batch())


def test_slime_remote_rm_takes_the_body_as_the_reward(url, tiny_rm):
  assert doc_flag("slime.md", "--rm-type") == "remote_rm"
  rm_url = doc_flag("slime.md", "--rm-url").replace(HOST, url)
  tokenizer = tiny_rm.tokenizer
  chat = [user("What is 2 + 2?")]
  text_prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
  samples = [
    # --apply-chat-template: the prompt is the template's text, the response what the policy wrote.
    types.SimpleNamespace(prompt=text_prompt, response="4<|im_end|>", label="4"),
    types.SimpleNamespace(prompt=text_prompt, response="5<|im_end|>", label=None),
    # Without it, the prompt is the dataset's messages.
    types.SimpleNamespace(prompt=chat, response="4", label={"answer": 4}),
  ]
  rewards = slime_rewards(rm_url, samples)
  assert all(type(r) is float for r in rewards)
  want = [
    *tiny_rm.score(prompts=[text_prompt] * 2, completions=["4<|im_end|>", "5<|im_end|>"]),
    *tiny_rm.score([[*chat, assistant("4")]]),
  ]
  assert rewards == approx(want)


def test_slime_remote_rm_of_a_prm_is_its_solution_reward(tiny_prm):
  from jaxrm.scoring import reward_funcs

  samples = [
    types.SimpleNamespace(prompt="Q: 12 * 3 + 4?", response="12 * 3 = 36.\n36 + 4 = 40.", label="40"),
    types.SimpleNamespace(prompt=[user("Q: 7 - 9?")], response="7 - 9 = -2.", label="-2"),
  ]
  config = dataclasses.replace(SERVER_CONFIG, step_aggregation="min")
  with serving(tiny_prm, config) as s:
    rewards = slime_rewards(s.url + "/reward", samples)
  local = reward_funcs.as_reward_func(tiny_prm, step_aggregation="min")
  want = local(prompts=[x.prompt for x in samples], completions=[x.response for x in samples])
  assert rewards == approx(want)


# ------------------------------------------------------------------ TRL


def python_blocks(page):
  with open(os.path.join(DOCS, page)) as f:
    return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def test_trl_page_blocks_run(tiny_rm, monkeypatch):
  """docs/rl/trl.md's blocks: its reward functions (runs/rm standing in by the tiny model) called as
  GRPOTrainer calls them, and its GRPOConfig lines, which TRL takes."""
  trl = pytest.importorskip("trl", minversion="1.16", reason="pip install trl==1.16.0")
  from jaxrm import RewardModel

  # This machine has no GPU: TRL's config asks to be told so.
  monkeypatch.setattr(trl, "GRPOConfig", functools.partial(trl.GRPOConfig, use_cpu=True))

  functions, config = python_blocks("trl.md")
  monkeypatch.setattr(RewardModel, "from_pretrained", lambda path, **kwargs: tiny_rm)
  namespace = {}
  exec(functions, namespace)
  (f,) = namespace["reward_funcs"]
  assert namespace["remote"].__name__ == f.__name__ == "rm"
  logged = {}
  rewards = f(
    prompts=["Q: 1 + 1?"] * 2,
    completions=[" 2", " 11"],
    completion_ids=[[1], [2, 3]],
    log_metric=logged.__setitem__,
    log_extra=lambda column, values: None,
  )
  assert rewards == approx(tiny_rm.score(["Q: 1 + 1? 2", "Q: 1 + 1? 11"]))
  assert set(logged) == {f"reward_health/rm/{n}" for n in reward_health.NAMES[:3]}
  exec(config, namespace)
  assert len(namespace["args"].reward_weights) == len(namespace["reward_funcs"])
