"""Reward functions called exactly as TRL's GRPOTrainer and CoMLRL's multi-agent trainers call them."""

import asyncio
import collections
import contextlib
import dataclasses
import http.server
import inspect
import json
import socket
import threading
import types

import numpy as np
import pytest
import torch
from helpers import REBATCHED, serving

from jaxrm import RewardModel, tasks
from jaxrm.integrations import verl
from jaxrm.scoring import reward_funcs, reward_health, step_rewards
from jaxrm.scoring.loading import ScoringInfo
from jaxrm.server import ServerConfig

STATS = {"mean": 0.25, "std": 2.0, "from": "validation-default"}
# Normalizing is one float32 subtraction and division, against numpy's: a rounding or two apart.
NORMALIZED_RTOL = 1e-6


@pytest.fixture(scope="module")
def validated_rm(tiny_rm):
  """The tiny model with the reward mean/std (STATS) that a validation would have recorded."""
  return RewardModel(tiny_rm.model, tiny_rm.tokenizer, ScoringInfo(reward_stats=STATS))


class TrlLogs:
  """GRPOTrainer's _log_metric and _log_completion_extra (TRL 1.16): what reward functions logged."""

  def __init__(self):
    self.metrics = collections.defaultdict(list)
    self.extra = collections.defaultdict(list)

  def log_metric(self, name, value):
    self.metrics[name].append(value)

  def log_extra(self, column, values):
    self.extra[column].extend(values)


def trl_call(reward_func, prompts, completions, logs=None, **columns):
  """What GRPOTrainer does with a plain-function reward: keyword call (awaited for an async
  function) with its log_metric and log_extra, None -> NaN, float32 tensor."""
  logs = logs or TrlLogs()
  out = called(
    reward_func,
    prompts=prompts,
    completions=completions,
    completion_ids=completion_ids(completions),
    trainer_state=None,
    log_extra=logs.log_extra,
    log_metric=logs.log_metric,
    **columns,
  )
  out = [r if r is not None else torch.nan for r in out]
  return torch.tensor(out, dtype=torch.float32).numpy()


def completion_ids(completions):
  return [[7] * len(str(c)) for c in completions]


def called(reward_func, **kwargs):
  """``reward_func(**kwargs)``, awaited if it is an async function, as TRL awaits one."""
  out = reward_func(**kwargs)
  return asyncio.run(out) if inspect.isawaitable(out) else out


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


def test_trl_reward_funcs_log_the_reward_health(tiny_rm):
  """Through TRL's log_metric, the batch's health (jaxrm.scoring.reward_health) under the function's name;
  through log_extra, whether each reward left the validation range, raw or normalized alike."""
  prompts, completions = ["Q: 1 + 1?"] * 4, [" A: 2", " A: 11", " A: 2 or 3", " A: it is 23"]
  raw = sorted(tiny_rm.score(prompts=prompts, completions=completions).tolist())
  # The lowest and highest rewards fall outside, the others well inside.
  low, high = (raw[0] + raw[1]) / 2, (raw[2] + raw[3]) / 2
  stats = {**STATS, "min": low, "max": high}
  ranged = RewardModel(tiny_rm.model, tiny_rm.tokenizer, ScoringInfo(reward_stats=stats))
  for normalize in (False, True):
    logs = TrlLogs()
    got = trl_call(ranged.as_reward_func(normalize=normalize, name="rm"), prompts, completions, logs)
    served = ((low - 0.25) / 2, (high - 0.25) / 2) if normalize else (low, high)
    want = reward_health.batch_health(
      got.tolist(), [len(x) for x in completion_ids(completions)], reward_range=served
    )
    assert set(want) == {"reward_mean", "reward_std", "reward_length_corr", "reward_out_of_range"}
    assert logs.metrics == {f"reward_health/rm/{k}": [pytest.approx(v)] for k, v in want.items()}
    assert logs.metrics["reward_health/rm/reward_out_of_range"] == [0.5]
    assert logs.extra == {"rm_out_of_range": [not served[0] <= r <= served[1] for r in got]}
    assert sum(logs.extra["rm_out_of_range"]) == 2
  # A remote function logs what it can know: no validation range.
  with serving(tiny_rm) as server:
    logs = TrlLogs()
    got = trl_call(reward_funcs.remote_reward_func(server.url, name="far"), prompts, completions, logs)
  assert sorted(logs.metrics) == [
    "reward_health/far/reward_length_corr",
    "reward_health/far/reward_mean",
    "reward_health/far/reward_std",
  ]
  assert logs.metrics["reward_health/far/reward_mean"] == [pytest.approx(float(np.mean(got)))]
  assert not logs.extra


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


class Shares:
  """A task's group rewards (Task.group_rewards) for the test below: each completion's reward is
  its length over its batch's total, whatever its prompt."""

  OPTIONS = {"strategy": "whole_batch", "aggregate": "share"}
  FOR = "a model of shares"

  def settings(self, given, others):
    assert others == {"normalize": False, "combine": None, "step_aggregation": None}
    return {k: given[k] or default for k, default in self.OPTIONS.items()}

  def local(self, rm, prompts, completions, columns, settings, batch_size):
    self.asked = (settings, columns["extra"], batch_size)
    total = sum(len(c) for c in completions)
    return [len(c) / total for c in completions]


def test_a_task_with_group_rewards_is_rewarded_by_them(validated_rm, monkeypatch):
  """The reward function asks the model's task for its group rewards: a model of a task that
  declares them is rewarded through them, whatever the task."""
  shares = Shares()
  task = dataclasses.replace(tasks.PREFERENCE, name="shares", group_rewards=shares)
  monkeypatch.setitem(tasks.TASKS, task.name, task)
  rm = types.SimpleNamespace(
    config=validated_rm.config, attributes=None, info=types.SimpleNamespace(task=task.name)
  )
  f = reward_funcs.as_reward_func(rm, aggregate="most", batch_size=3, name="shares")
  got = f(prompts=["p", "q"], completions=["a", "bcd"], extra="column")
  assert got == [0.25, 0.75]
  assert shares.asked == ({"strategy": "whole_batch", "aggregate": "most"}, "column", 3)
  assert f.__name__ == "shares"
  with pytest.raises(
    ValueError,
    match=r"^strategy= and aggregate= are for a pairwise judge \(its comparisons of a prompt's completions\); this model has a sequence head with 1 output: leave them out$",
  ):
    reward_funcs.as_reward_func(validated_rm, aggregate="win_rate")


# ------------------------------------------------------------------ remote: a jaxrm server on loopback

# Every remote test runs both ways: the plain function, and the async one TRL awaits (the same
# request, sent from a worker thread).
ASYNC = pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])


@pytest.fixture(scope="module")
def server_url(validated_rm):
  with serving(validated_rm, ServerConfig(max_length=64, batch_size=4)) as server:
    yield server.url


@ASYNC
def test_remote_reward_func_returns_the_local_rewards(validated_rm, server_url, asynchronous):
  remote = reward_funcs.remote_reward_func(server_url, name="remote_rm", asynchronous=asynchronous)
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
  raw = called(remote, prompts=standard[0], completions=standard[1])
  assert isinstance(raw, list) and all(type(r) is float for r in raw)


def test_an_async_remote_reward_func_is_one_trl_awaits():
  trl_utils = pytest.importorskip("trl.trainer.utils")
  remote = reward_funcs.remote_reward_func("http://127.0.0.1:1", asynchronous=True)
  assert inspect.iscoroutinefunction(remote) and trl_utils.is_async_callable(remote)
  assert not trl_utils.is_async_callable(reward_funcs.remote_reward_func("http://127.0.0.1:1"))


@ASYNC
def test_remote_reward_func_raises_the_servers_message(server_url, asynchronous):
  remote = reward_funcs.remote_reward_func(server_url, name="remote_rm", asynchronous=asynchronous)
  with pytest.raises(ValueError, match=r"remote_rm: .*/score answered 400: 1 prompts but 2 completions"):
    called(remote, prompts=["a"], completions=["b", "c"])


@ASYNC
def test_remote_reward_func_names_a_server_that_is_not_up(asynchronous):
  with socket.socket() as s:  # a port nothing listens on: bound, then closed
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  remote = reward_funcs.remote_reward_func(
    f"http://127.0.0.1:{port}/", name="remote_rm", asynchronous=asynchronous
  )
  with pytest.raises(
    ConnectionError,
    match=rf"^remote_rm: cannot reach the reward server at "
    rf"http://127.0.0.1:{port}/score \(\[Errno \d+\] Connection refused\)\. "
    rf"Is `python -m jaxrm.serve` running there\? A server that was just "
    rf"started may still be loading its model, and takes connections once "
    rf"GET http://127.0.0.1:{port}/health answers: wait for it and try again$",
  ):
    called(remote, prompts=["p"], completions=["a"])


@pytest.mark.parametrize(
  "url, message",
  [
    (None, r"^remote_rm: the reward server's URL is missing \(got None\); pass the address where "),
    ("", r"^remote_rm: the reward server's URL is missing \(got ''\)"),
    ("127.0.0.1:8000", r"^remote_rm: '127.0.0.1:8000' is not a server address; pass 'http://HOST:PORT'$"),
  ],
)
def test_remote_reward_func_checks_its_url(url, message):
  with pytest.raises(ValueError, match=message):
    reward_funcs.remote_reward_func(url, name="remote_rm")


@contextlib.contextmanager
def stand_in_server(answer):
  """A loopback HTTP server whose every POST is answered by ``answer(path, headers, body) ->
  (status, reply)``, each in its own thread; yields its URL."""

  class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
      body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
      status, reply = answer(self.path, self.headers, body)
      data = json.dumps(reply).encode()
      self.send_response(status)
      self.send_header("Retry-After", "0")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  host, port = server.server_address[:2]
  try:
    yield f"http://{host}:{port}"
  finally:
    server.shutdown()
    server.server_close()


@ASYNC
def test_remote_reward_func_retries_a_busy_server_with_its_key(asynchronous):
  """Against a stand-in server that is busy every other request: the same request is sent again."""
  seen = []

  def busy_every_other(path, headers, body):
    seen.append((path, headers["Authorization"], body))
    busy = len(seen) % 2 == 1
    return (503, {"error": "busy"}) if busy else (200, {"rewards": [0.5, -1]})

  with stand_in_server(busy_every_other) as url:
    remote = reward_funcs.remote_reward_func(url + "/", api_key="k", asynchronous=asynchronous)
    assert called(remote, prompts=["p", "p"], completions=["a", "b"], trainer_state=None) == [0.5, -1.0]
    assert seen == [("/score", "Bearer k", {"prompts": ["p", "p"], "completions": ["a", "b"]})] * 2
    with pytest.raises(ValueError, match="answered 503: busy"):
      called(
        reward_funcs.remote_reward_func(url, retries=0, asynchronous=asynchronous),
        prompts=["p"],
        completions=["a"],
      )
    assert len(seen) == 3


def test_async_remote_reward_funcs_wait_for_their_servers_together():
  """Two async reward functions gathered (as TRL gathers its async rewards) have their requests
  in flight at once: the stand-in answers neither until both have arrived."""
  both = threading.Barrier(2, timeout=30)

  def when_both_arrived(path, headers, body):
    both.wait()
    return 200, {"rewards": [float(len(c)) for c in body["completions"]]}

  with stand_in_server(when_both_arrived) as url:
    first, second = (
      reward_funcs.remote_reward_func(url, name=name, asynchronous=True) for name in ("rm_a", "rm_b")
    )

    async def gathered():
      return await asyncio.gather(
        first(prompts=["p"], completions=["ab"]), second(prompts=["p", "p"], completions=["a", "abc"])
      )

    assert asyncio.run(gathered()) == [[2.0], [1.0, 3.0]]


@ASYNC
def test_remote_group_rewards_post_each_prompts_group(asynchronous):
  """A judge's server (strategy=, aggregate=) is sent one /compare request per prompt's group,
  wherever its rows stand in the batch; a prompt alone gets a group's average reward (0.5 under
  win_rate). Under strategy="reference" the row's reference column joins the key and the body,
  and verl's judge=true compares the response with ground_truth so."""
  seen = []

  def compare(path, headers, body):
    seen.append((path, body))
    return 200, {"rewards": [float(len(r)) for r in body["responses"]]}

  with stand_in_server(compare) as url:
    remote = reward_funcs.remote_reward_func(url, aggregate="win_rate", asynchronous=asynchronous)
    prompts, completions = ["p", "q", "p", "q", "lone"], ["a", "bb", "ccc", "dddd", "e"]
    assert called(remote, prompts=prompts, completions=completions) == [1.0, 2.0, 3.0, 4.0, 0.5]
    settings = {"strategy": "round_robin", "aggregate": "win_rate"}
    assert seen == [
      ("/compare", {"prompt": "p", "responses": ["a", "ccc"], **settings}),
      ("/compare", {"prompt": "q", "responses": ["bb", "dddd"], **settings}),
    ]
    seen.clear()
    against = reward_funcs.remote_reward_func(url, strategy="reference", asynchronous=asynchronous)
    got = called(against, prompts=["p", "p", "p"], completions=["a", "bb", "c"], reference=["r", "s", "r"])
    assert got == [1.0, 2.0, 1.0]
    settings = {"strategy": "reference", "aggregate": "bradley_terry"}
    assert seen == [
      ("/compare", {"prompt": "p", "responses": ["a", "c"], **settings, "reference": "r"}),
      ("/compare", {"prompt": "p", "responses": ["bb"], **settings, "reference": "s"}),
    ]
    with pytest.raises(
      ValueError, match=r"^strategy='reference' compares each completion with its row's 'reference' column"
    ):
      called(against, prompts=["p"], completions=["a"])
    seen.clear()
    scored = asyncio.run(verl.compute_score("gsm8k", "five", 4, {"question": "Q"}, url=url, judge=True))
    assert scored == {"score": 4.0}
    user = [{"role": "user", "content": "Q"}]
    assert seen == [("/compare", {"prompt": user, "responses": ["five"], **settings, "reference": "4"})]
  with pytest.raises(
    ValueError,
    match=r"^remote: steps= and step_aggregation= are a process reward model's; strategy= and aggregate= a judge's: pass one$",
  ):
    reward_funcs.remote_reward_func(url, name="remote", strategy="circular", steps=True)


# ------------------------------------------------------------------ remote: a process reward model's server


# The client's half of /score_steps is written against the real server; it runs once the server
# has the endpoint.
@pytest.fixture(scope="module")
def prm_server_url(tiny_prm):
  with serving(tiny_prm, ServerConfig(max_length=64, batch_size=4)) as server:
    yield server.url


@ASYNC
def test_remote_reward_func_of_a_prm_returns_the_local_rewards(tiny_prm, prm_server_url, asynchronous):
  prompts = ["Q: 12 * 3 + 4?", "Q: 12 * 3 + 4?", "Q: 7 - 9?", "Q: 7 - 9?"]
  completions = [" 12 * 3 = 36.\n 36 + 4 = 40.\n", " 12 * 3 = 35.\n 35 + 4 = 39.", " -2", "\n"]
  chat = (
    [[{"role": "user", "content": "What is 2 + 2?"}]] * 2,
    [[{"role": "assistant", "content": "2 + 2 = 4.\nSo 4."}], [{"role": "assistant", "content": "5"}]],
  )
  for how in (None,) + step_rewards.AGGREGATIONS:
    remote = reward_funcs.remote_reward_func(
      prm_server_url, steps=True, step_aggregation=how, name="remote_prm", asynchronous=asynchronous
    )
    local = reward_funcs.as_reward_func(tiny_prm, step_aggregation=how)
    for p, c in ((prompts, completions), chat):
      got = called(remote, prompts=p, completions=c, trainer_state=None)
      want = local(prompts=p, completions=c)
      assert [r is None for r in got] == [r is None for r in want]
      # The server batches and pads rows its own way: equal up to the roundings of other shapes.
      assert [r for r in got if r is not None] == pytest.approx(
        [r for r in want if r is not None], rel=REBATCHED["rtol"], abs=REBATCHED["atol"]
      )
  assert got[0] is not None and got[1] is not None


@ASYNC
def test_remote_prm_reward_func_raises_the_servers_message(prm_server_url, asynchronous):
  remote = reward_funcs.remote_reward_func(
    prm_server_url, steps=True, name="remote_prm", asynchronous=asynchronous
  )
  with pytest.raises(
    ValueError,
    match=r"remote_prm: .*/score_steps answered 400: cannot score prompts\[1\] "
    r"\+ completions\[1\]: .* longer than max_length=64 tokens \(--max_length\)",
  ):
    called(remote, prompts=["a", "a"], completions=["b", "word " * 100])
  with pytest.raises(ValueError, match=r"^remote_prm: 1 prompts but 2 completions$"):
    called(remote, prompts=["a"], completions=["b", "c"])


@ASYNC
def test_remote_reward_func_checks_its_aggregation(asynchronous):
  with pytest.raises(
    ValueError, match=r"^step_aggregation='max' is not an aggregation of step probabilities"
  ):
    reward_funcs.remote_reward_func("http://127.0.0.1:1", step_aggregation="max", asynchronous=asynchronous)
