"""Reward functions called exactly as TRL's GRPOTrainer and CoMLRL's multi-agent trainers call them."""

import inspect
import socket
import types

import numpy as np
import pytest
import torch
from helpers import REBATCHED, serving

from jaxrm import RewardModel, reward_funcs, step_rewards
from jaxrm.loading import ScoringInfo
from jaxrm.server import ServerConfig

STATS = {"mean": 0.25, "std": 2.0, "from": "validation-default"}
# Normalizing is one float32 subtraction and division, against numpy's: a rounding or two apart.
NORMALIZED_RTOL = 1e-6


@pytest.fixture(scope="module")
def validated_rm(tiny_rm):
  """The tiny model with the reward mean/std (STATS) that a validation would have recorded."""
  return RewardModel(tiny_rm.model, tiny_rm.tokenizer, ScoringInfo(reward_stats=STATS))


def trl_call(reward_func, prompts, completions, **columns):
  """What GRPOTrainer does with a plain-function reward: keyword call, None -> NaN, float32 tensor."""
  out = reward_func(
    prompts=prompts,
    completions=completions,
    completion_ids=[[7] * len(str(c)) for c in completions],
    trainer_state=None,
    **columns,
  )
  out = [r if r is not None else torch.nan for r in out]
  return torch.tensor(out, dtype=torch.float32).numpy()


def comlrl_call(reward_func, prompts, agent_completions, item):
  """CoMLRL's dispatch (call_reward_function) for one task item, down the branches a jaxrm function takes."""
  params = inspect.signature(reward_func).parameters
  kinds = {p.kind for p in params.values()}
  assert inspect.Parameter.VAR_POSITIONAL in kinds and "batch_items" in params
  kwargs = {"batch_items": [item]}
  if "prompts" in params or inspect.Parameter.VAR_KEYWORD in kinds:
    kwargs["prompts"] = prompts
  return [float(r) for r in reward_func(*agent_completions, **kwargs)]


def test_trl_standard_format(validated_rm):
  f = validated_rm.as_reward_func()
  assert f.__name__ == "jaxrm_reward"
  prompts = ["Q: 1 + 1?", "Q: 1 + 1?", "Q: 2 + 3?", "Q: 2 + 3?"]  # two generations per prompt
  completions = [" A: 2", " A: 11", " A: 5", " A: 23"]
  got = trl_call(f, prompts, completions, answer=["2", "2", "5", "5"])
  expected = validated_rm.score([p + c for p, c in zip(prompts, completions)])
  np.testing.assert_array_equal(got, expected)
  raw = f(prompts=prompts, completions=completions)
  assert isinstance(raw, list) and all(type(r) is float for r in raw)
  assert len(set(raw)) == 4


def test_trl_conversational_format(validated_rm):
  f = reward_funcs.as_reward_func(validated_rm, name="rm_helpfulness")
  assert f.__name__ == "rm_helpfulness"
  prompts = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}],
    [{"role": "user", "content": "2 + 2?"}],
  ]
  completions = [[{"role": "assistant", "content": "Paris."}], [{"role": "assistant", "content": "4"}]]
  got = trl_call(f, prompts, completions)
  np.testing.assert_array_equal(got, validated_rm.score([p + c for p, c in zip(prompts, completions)]))


def test_normalized_rewards(validated_rm):
  prompts, completions = ["Q: 1 + 1?"] * 2, [" A: 2", " A: 3"]
  raw = trl_call(validated_rm.as_reward_func(), prompts, completions)
  normalized = trl_call(validated_rm.as_reward_func(normalize=True), prompts, completions)
  np.testing.assert_allclose(normalized, (raw - 0.25) / 2.0, rtol=NORMALIZED_RTOL)


def test_comlrl_multi_agent_text_formatter(validated_rm):
  item = {"prompt": "Describe a city in the clouds.", "target_min": 2.0}

  def formatter(item, brief, detailed):
    return f"{item['prompt']}\n\nBrief: {brief}\n\nDetailed: {detailed}"

  f = validated_rm.as_multi_agent_reward_func(formatter)
  brief = ["Floating towers.", "Mist.", "A city."]
  detailed = ["Towers float on mist, linked by bridges.", "Everything is mist.", "A city above the sky."]
  got = comlrl_call(f, ["p1", "p2"], [brief, detailed], item)
  expected = validated_rm.score([formatter(item, b, d) for b, d in zip(brief, detailed)])
  assert got == expected.tolist() and len(set(got)) == 3


def test_comlrl_chat_formatter_and_per_row_items(validated_rm):
  def formatter(item, *completions):
    reply = "\n".join(f"Agent {i}: {c}" for i, c in enumerate(completions))
    return [{"role": "user", "content": item["prompt"]}, {"role": "assistant", "content": reply}]

  f = reward_funcs.as_multi_agent_reward_func(validated_rm, formatter, normalize=True)
  agents = [["one", "uno"], ["two", "dos"], ["three", "tres"]]
  items = [{"prompt": "Count in English."}, {"prompt": "Count in Spanish."}]
  got = f(*agents, batch_items=items)
  chats = [formatter(item, *joint) for item, joint in zip(items, zip(*agents))]
  np.testing.assert_allclose(got, (validated_rm.score(chats) - 0.25) / 2.0, rtol=NORMALIZED_RTOL)


def test_errors(validated_rm, tmp_path):
  f = validated_rm.as_multi_agent_reward_func(lambda item, a, b: item["prompt"] + a + b, name="pair_rm")
  with pytest.raises(ValueError, match=r"pair_rm: each agent must give as many completions; got \[2, 1\]"):
    f(["a", "b"], ["c"], batch_items=[{"prompt": "p"}])
  with pytest.raises(ValueError, match="pair_rm: batch_items .* is required"):
    f(["a"], ["b"])
  with pytest.raises(ValueError, match="pair_rm: 2 batch_items for 3 joint responses"):
    f(["a", "b", "c"], ["d", "e", "f"], batch_items=[{"prompt": "p"}] * 2)
  other = types.SimpleNamespace(config=validated_rm.config.replace(head="token", num_labels=3))
  with pytest.raises(
    ValueError,
    match=r"a reward function needs a sequence-head reward model .* or a "
    r"token-head \(process reward\) model with 2 labels .*; this model has a "
    r"token head with 3",
  ):
    reward_funcs.as_reward_func(other)


# ------------------------------------------------------------------ remote: a jaxrm server on loopback


@pytest.fixture(scope="module")
def server_url(validated_rm):
  with serving(validated_rm, ServerConfig(max_length=64, batch_size=4)) as server:
    yield server.url


def test_remote_reward_func_returns_the_local_rewards(validated_rm, server_url):
  remote = reward_funcs.remote_reward_func(server_url, name="remote_rm")
  assert remote.__name__ == "remote_rm"
  local = validated_rm.as_reward_func()
  standard = (["Q: 1 + 1?", "Q: 1 + 1?", "Q: 2 + 3?"], [" A: 2", " A: 11", " A: 5"])
  chat = (
    [[{"role": "user", "content": "Capital of France?"}]] * 2,
    [[{"role": "assistant", "content": "Paris."}], [{"role": "assistant", "content": "Lyon."}]],
  )
  for prompts, completions in (standard, chat):
    got = trl_call(remote, prompts, completions, answer=["x"] * len(prompts))
    # Exactly equal: one request alone on the server is sorted, padded and batched as rm.score
    # does it here (rows of at most 64 tokens padded to 64, 2 or 3 rows padded to 2 or 4 rows),
    # so the same compiled program sees the same inputs.
    np.testing.assert_array_equal(got, trl_call(local, prompts, completions))
  raw = remote(prompts=standard[0], completions=standard[1])
  assert isinstance(raw, list) and all(type(r) is float for r in raw)


def test_remote_reward_func_raises_the_servers_message(server_url):
  remote = reward_funcs.remote_reward_func(server_url, name="remote_rm")
  with pytest.raises(ValueError, match=r"remote_rm: .*/score answered 400: 1 prompts but 2 completions"):
    remote(prompts=["a"], completions=["b", "c"])


def test_remote_reward_func_names_a_server_that_is_not_up():
  with socket.socket() as s:  # a port nothing listens on: bound, then closed
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  remote = reward_funcs.remote_reward_func(f"http://127.0.0.1:{port}/", name="remote_rm")
  with pytest.raises(
    ConnectionError,
    match=rf"^remote_rm: cannot reach the reward server at "
    rf"http://127.0.0.1:{port}/score \(\[Errno \d+\] Connection refused\)\. "
    rf"Is `python -m jaxrm.serve` running there\? A server that was just "
    rf"started may still be loading its model, and takes connections once "
    rf"GET http://127.0.0.1:{port}/health answers: wait for it and try again$",
  ):
    remote(prompts=["p"], completions=["a"])


def test_remote_reward_func_retries_a_busy_server_with_its_key():
  """Against a stand-in server that is busy every other request: the same request is sent again."""
  import http.server
  import json
  import threading

  seen = []

  class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
      body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
      seen.append((self.path, self.headers["Authorization"], body))
      busy = len(seen) % 2 == 1
      reply = json.dumps({"error": "busy"} if busy else {"rewards": [0.5, -1]}).encode()
      self.send_response(503 if busy else 200)
      self.send_header("Retry-After", "0")
      self.send_header("Content-Length", str(len(reply)))
      self.end_headers()
      self.wfile.write(reply)

    def log_message(self, *args):
      pass

  stand_in = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
  threading.Thread(target=stand_in.serve_forever, daemon=True).start()
  host, port = stand_in.server_address[:2]
  url = f"http://{host}:{port}"
  try:
    remote = reward_funcs.remote_reward_func(url + "/", api_key="k")
    assert remote(prompts=["p", "p"], completions=["a", "b"], trainer_state=None) == [0.5, -1.0]
    assert seen == [("/score", "Bearer k", {"prompts": ["p", "p"], "completions": ["a", "b"]})] * 2
    with pytest.raises(ValueError, match="answered 503: busy"):
      reward_funcs.remote_reward_func(url, retries=0)(prompts=["p"], completions=["a"])
    assert len(seen) == 3
  finally:
    stand_in.shutdown()
    stand_in.server_close()


# ------------------------------------------------------------------ remote: a process reward model's server


# The client's half of /score_steps is written against the real server; it runs once the server
# has the endpoint.
@pytest.fixture(scope="module")
def prm_server_url(tiny_prm):
  with serving(tiny_prm, ServerConfig(max_length=64, batch_size=4)) as server:
    yield server.url


def test_remote_reward_func_of_a_prm_returns_the_local_rewards(tiny_prm, prm_server_url):
  prompts = ["Q: 12 * 3 + 4?", "Q: 12 * 3 + 4?", "Q: 7 - 9?", "Q: 7 - 9?"]
  completions = [" 12 * 3 = 36.\n 36 + 4 = 40.\n", " 12 * 3 = 35.\n 35 + 4 = 39.", " -2", "\n"]
  chat = (
    [[{"role": "user", "content": "What is 2 + 2?"}]] * 2,
    [[{"role": "assistant", "content": "2 + 2 = 4.\nSo 4."}], [{"role": "assistant", "content": "5"}]],
  )
  for how in (None,) + step_rewards.AGGREGATIONS:
    remote = reward_funcs.remote_reward_func(
      prm_server_url, steps=True, step_aggregation=how, name="remote_prm"
    )
    local = reward_funcs.as_reward_func(tiny_prm, step_aggregation=how)
    for p, c in ((prompts, completions), chat):
      got = remote(prompts=p, completions=c, trainer_state=None)
      want = local(prompts=p, completions=c)
      assert [r is None for r in got] == [r is None for r in want]
      # The server batches and pads rows its own way: equal up to the roundings of other shapes.
      assert [r for r in got if r is not None] == pytest.approx(
        [r for r in want if r is not None], rel=REBATCHED["rtol"], abs=REBATCHED["atol"]
      )
  assert got[0] is not None and got[1] is not None


def test_remote_prm_reward_func_raises_the_servers_message(prm_server_url):
  remote = reward_funcs.remote_reward_func(prm_server_url, steps=True, name="remote_prm")
  with pytest.raises(
    ValueError,
    match=r"remote_prm: .*/score_steps answered 400: cannot score prompts\[1\] "
    r"\+ completions\[1\]: .* longer than max_length=64 tokens \(--max_length\)",
  ):
    remote(prompts=["a", "a"], completions=["b", "word " * 100])
  with pytest.raises(ValueError, match=r"^remote_prm: 1 prompts but 2 completions$"):
    remote(prompts=["a"], completions=["b", "c"])


def test_remote_reward_func_checks_its_aggregation():
  with pytest.raises(
    ValueError, match=r"^step_aggregation='max' is not an aggregation of step probabilities"
  ):
    reward_funcs.remote_reward_func("http://127.0.0.1:1", step_aggregation="max")
