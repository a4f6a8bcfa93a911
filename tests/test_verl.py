"""jaxrm's rewards in verl's reward loop: ``jaxrm.integrations.verl.compute_score`` loaded and called
as verl 0.9.1 loads and calls a custom reward function, and the body verl posts to a reward
model's ``/classify``, each against a live jaxrm server on loopback.

verl itself needs Ray, tensordict and a transformers older than this project's, so its calls are
copied here from its source (verl 0.9.1): ``verl/trainer/ppo/reward.py`` (get_custom_reward_fn),
``verl/utils/import_utils.py`` (load_extern_object), and
``verl/experimental/reward_loop/reward_manager/naive.py`` (NaiveRewardManager.run_single)."""

import asyncio
import dataclasses
import importlib.util
import inspect
import os
import re
from functools import partial

import pytest
from helpers import PARITY_ATOL, SERVER_CONFIG, approx, call, serving

from jaxrm.integrations import verl
from jaxrm.scoring import reward_funcs, step_rewards

SECRET = "s3cret"  # the process reward model's server's --api_key

# ------------------------------------------------------------------ verl's calls, as verl 0.9.1 makes them


async def _call_with_kwargs_async(raw_fn, extra_kwargs, *args, **kwargs):
  # verl/trainer/ppo/reward.py
  merged_kwargs = {**kwargs, **extra_kwargs}
  return await raw_fn(*args, **merged_kwargs)


def get_custom_reward_fn(path, name, reward_kwargs):
  """verl's get_custom_reward_fn of ``reward.custom_reward_function`` {path, name, reward_kwargs},
  its file loaded as load_extern_object loads a file path."""
  spec = importlib.util.spec_from_file_location(f"custom_module_{hash(os.path.abspath(path))}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  raw_fn = getattr(module, name)
  assert inspect.iscoroutinefunction(raw_fn)  # verl awaits it rather than run it in an executor
  return partial(_call_with_kwargs_async, raw_fn, dict(reward_kwargs))


async def run_single(compute_score, data_source, response_str, ground_truth, extra_info):
  """NaiveRewardManager.run_single from the decoded response on, without a reward router (verl
  serves no reward model of its own here): the reward and its extra info."""
  extra_info = dict(extra_info)
  extra_info["num_turns"] = None
  extra_info["rollout_reward_scores"] = {}
  result = await compute_score(
    data_source=data_source, solution_str=response_str, ground_truth=ground_truth, extra_info=extra_info
  )
  if isinstance(result, dict):
    return {"reward_score": result["score"], "reward_extra_info": dict(result)}
  return {"reward_score": result, "reward_extra_info": {"acc": result}}


def verl_rewards(reward_kwargs, items):
  """The rewards of ``items`` (response, extra_info), each scored in its own task and all gathered,
  as verl's RewardLoopWorker.compute_score_batch runs them."""
  compute_score = get_custom_reward_fn(verl.__file__, "compute_score", reward_kwargs)

  async def batch():
    tasks = [run_single(compute_score, "openai/gsm8k", r, "4", info) for r, info in items]
    return await asyncio.gather(*tasks)

  outputs = asyncio.run(batch())
  for out in outputs:
    assert out["reward_extra_info"] == {"score": out["reward_score"]}
    assert type(out["reward_score"]) is float
  return [out["reward_score"] for out in outputs]


# ------------------------------------------------------------------ a preference model's server


@pytest.fixture(scope="module")
def url(tiny_rm):
  with serving(tiny_rm) as s:
    yield s.url


QUESTIONS = ["What is 2 + 2?", "What is 3 + 5?"]
RESPONSES = [["4", "5"], ["8", "It is 35."]]
ITEMS = [
  (r, {"split": "train", "index": i, "question": q}) for i, q in enumerate(QUESTIONS) for r in RESPONSES[i]
]


def conversation(question, response):
  return [{"role": "user", "content": question}, {"role": "assistant", "content": response}]


def test_compute_score_scores_the_question_and_response_as_a_chat(url, tiny_rm):
  got = verl_rewards({"url": url}, ITEMS)
  want = tiny_rm.score([conversation(info["question"], r) for r, info in ITEMS])
  assert got == approx(want)
  assert len(set(got)) == len(got)


def test_compute_score_takes_a_prompt_of_messages_or_joins_strings(url, tiny_rm):
  system = {"role": "system", "content": "Be brief."}
  items = [
    (r, {"prompt": [system, {"role": "user", "content": q}]}) for r, q in (("4", "2 + 2?"), ("5", "2 + 2?"))
  ]
  got = verl_rewards({"url": url}, items)
  assert got == approx(
    tiny_rm.score([[*info["prompt"], {"role": "assistant", "content": r}] for r, info in items])
  )
  items = [(" A: 4", {"text": "Q: 2 + 2?"}), (" A: 5", {"text": "Q: 2 + 2?"})]
  got = verl_rewards({"url": url, "prompt_key": "text", "chat": False}, items)
  assert got == approx(tiny_rm.score(prompts=["Q: 2 + 2?"] * 2, completions=[" A: 4", " A: 5"]))


def test_compute_score_reads_the_url_from_the_environment(url, tiny_rm, monkeypatch):
  monkeypatch.setenv(verl.URL_ENV, url)
  got = verl_rewards({}, ITEMS[:1])
  assert got == approx(tiny_rm.score([conversation(QUESTIONS[0], RESPONSES[0][0])]))


def test_compute_score_errors_say_what_to_set(url, monkeypatch):
  monkeypatch.delenv(verl.URL_ENV, raising=False)
  with pytest.raises(
    ValueError,
    match=r"^jaxrm_verl: no reward server given: set \+reward.custom_reward_function.reward_kwargs.url="
    r"http://HOST:8000 \(where `python -m jaxrm.serve` listens\), or \$JAXRM_REWARD_URL",
  ):
    verl_rewards({}, ITEMS[:1])
  with pytest.raises(
    ValueError,
    match=r"^jaxrm_verl: extra_info has no 'prompt' or 'question' to score the response against "
    r"\(it has 'index', 'num_turns', 'rollout_reward_scores'\): put each row's prompt",
  ):
    verl_rewards({"url": url}, [("4", {"index": 0})])
  with pytest.raises(ValueError, match=r"^jaxrm_verl: extra_info\['question'\] is int; expected the prompt"):
    verl_rewards({"url": url}, [("4", {"question": 7})])
  with pytest.raises(
    ValueError, match=r"^step_aggregation='max' is not an aggregation of step probabilities"
  ):
    verl_rewards({"url": url, "step_aggregation": "max"}, ITEMS[:1])
  with pytest.raises(ValueError, match=r"^jaxrm_verl: 'localhost:8000' is not a server address"):
    verl_rewards({"url": "localhost:8000"}, ITEMS[:1])


# ------------------------------------------------------------------ a process reward model's server


@pytest.fixture(scope="module")
def prm_url(tiny_prm):
  with serving(tiny_prm, dataclasses.replace(SERVER_CONFIG, api_key=SECRET)) as s:
    yield s.url


SOLUTIONS = [
  ("Q: 12 * 3 + 4?", "12 * 3 = 36.\n36 + 4 = 40.\n"),
  ("Q: 12 * 3 + 4?", "12 * 3 = 35.\nSo 39."),
  ("Q: 7 - 9?", "-2"),
]


@pytest.mark.parametrize("how", step_rewards.AGGREGATIONS)
def test_compute_score_of_a_prm_aggregates_as_the_reward_functions_do(prm_url, tiny_prm, how):
  items = [(solution, {"question": q}) for q, solution in SOLUTIONS]
  got = verl_rewards({"url": prm_url, "api_key": SECRET, "step_aggregation": how}, items)
  local = reward_funcs.as_reward_func(tiny_prm, step_aggregation=how)
  chats = [[{"role": "user", "content": q}] for q, _ in SOLUTIONS]
  want = local(prompts=chats, completions=[[{"role": "assistant", "content": s}] for _, s in SOLUTIONS])
  assert got == approx(want)


def test_compute_score_of_a_prm_with_no_steps(prm_url, monkeypatch):
  monkeypatch.setenv(verl.API_KEY_ENV, SECRET)
  settings = {"url": prm_url, "steps": True}
  assert verl_rewards({**settings, "no_steps_score": 0.0}, [("\n\n", {"question": "Q"})]) == [0.0]
  with pytest.raises(
    ValueError,
    match=r"^jaxrm_verl: the process reward model found no step in the response '\\n\\n' \(empty, or only "
    r"step separators\), and verl needs a number for every response: set "
    r"\+reward.custom_reward_function.reward_kwargs.no_steps_score",
  ):
    verl_rewards(settings, [("\n\n", {"question": "Q"})])
  monkeypatch.setenv(verl.API_KEY_ENV, "wrong")
  with pytest.raises(ValueError, match=r"^jaxrm_verl: .*/score_steps answered 401: this server needs an"):
    verl_rewards(settings, [("1 + 1 = 2.", {"question": "Q"})])


# ------------------------------------------------------------------ verl's own reward-model request


def test_verl_reward_loop_disrm_classify_body(url, tiny_rm):
  """verl/experimental/reward_loop/reward_loop.py (RewardLoopWorker, verl 0.9.1): the prompt is
  raw_prompt + the response as the assistant's, rendered by the reward model's tokenizer
  (_preprocess_reward_inputs), then posted to ``/classify`` (compute_score_disrm, vllm engine)."""
  tokenizer = tiny_rm.tokenizer
  chat = conversation(QUESTIONS[0], RESPONSES[0][0])
  rm_prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
  if tokenizer.bos_token is not None and rm_prompt.startswith(tokenizer.bos_token):
    rm_prompt = rm_prompt[len(tokenizer.bos_token) :]
  payloads = {"model": "/models/reward", "input": rm_prompt, "use_activation": False}
  status, output, _ = call(url, "/classify", payloads)
  assert status == 200, output
  rm_score = output["data"][-1]["probs"][-1]
  # Scored as vLLM scores that text: tokenized as sent, special tokens added as the tokenizer adds
  # them. SmolLM2's bos_token is <|im_start|>, which its tokenizer does not add, so the text verl
  # sends has lost the conversation's first token: verl's own path scores another row than the
  # conversation (docs/verl.md), which compute_score sends as messages instead.
  assert [rm_score] == approx(tiny_rm.score([rm_prompt]))
  assert not rm_prompt.startswith("<|im_start|>")


def test_verl_reward_loop_disrm_sglang_embeddings_body(url, tiny_rm, model_dir):
  """The same worker with SGLang as the engine (compute_score_disrm, verl 0.9.1): ``{"model",
  "input"}`` to ``/v1/embeddings``, read at ``data[-1].embedding[-1]``, posted with aiohttp and
  checked as _post_request does (raise_for_status, then the JSON)."""
  aiohttp = pytest.importorskip("aiohttp", reason="verl's HTTP client: pip install aiohttp")
  tokenizer = tiny_rm.tokenizer
  chat = conversation(QUESTIONS[1], RESPONSES[1][1])
  disrm_prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
  if tokenizer.bos_token is not None and disrm_prompt.startswith(tokenizer.bos_token):
    disrm_prompt = disrm_prompt[len(tokenizer.bos_token) :]

  async def post(payload, endpoint):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
      async with session.post(f"{url}/{endpoint}", json=payload) as resp:
        resp.raise_for_status()
        return await resp.json()

  payloads = {"model": "/models/reward", "input": disrm_prompt}
  output = asyncio.run(post(payloads, "v1/embeddings"))
  rm_score = output["data"][-1]["embedding"][-1]
  # Tokenized as SGLang tokenizes the text: special tokens added as the tokenizer adds them; the
  # score is transformers' on that text.
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
  with torch.no_grad():
    want = hf(**tokenizer(disrm_prompt, return_tensors="pt")).logits[0, 0].item()
  assert rm_score == pytest.approx(want, abs=PARITY_ATOL)


def test_docs_page_lines_are_those_verl_loads(url, tiny_rm):
  """docs/verl.md's config lines, read as verl's hydra overrides: its custom function, found at
  its pkg:// path, scores with the reward_kwargs the page sets."""
  with open(os.path.join(os.path.dirname(__file__), "..", "docs", "verl.md")) as f:
    lines = dict(re.findall(r"^\+?reward\.custom_reward_function\.([\w.]+)=(\S+)", f.read(), re.M))
  assert lines["path"] == "pkg://jaxrm.integrations.verl" and lines["name"] == "compute_score"
  module_file = importlib.util.find_spec(lines["path"].removeprefix("pkg://")).origin
  kwargs = {k.removeprefix("reward_kwargs."): v for k, v in lines.items() if k.startswith("reward_kwargs.")}
  assert kwargs == {"url": "http://RM_HOST:8000", "api_key": "$JAXRM_API_KEY"}
  compute_score = get_custom_reward_fn(module_file, lines["name"], {"url": url})
  got = asyncio.run(run_single(compute_score, "gsm8k", "4", "4", {"question": QUESTIONS[0]}))
  assert [got["reward_score"]] == approx(tiny_rm.score([conversation(QUESTIONS[0], "4")]))
