"""jaxrm.serve: real HTTP requests on 127.0.0.1 against a tiny random model: well-formed, concurrent,
malformed, stalled and overflowing ones; every reward is checked against ``rm.score`` of the same items."""

import concurrent.futures
import dataclasses
import os
import queue
import re
import subprocess
import sys
import threading
import types

import pytest
import tiny_run
from helpers import (
  GRPO_COMPLETIONS,
  GRPO_PROMPT,
  REBATCHED,
  SERVER_CONFIG,
  SERVER_TEXTS,
  SOCKET_TIMEOUT,
  approx,
  assistant,
  call,
  metric,
  raw_connection,
  read_all,
  serving,
  user,
)

from jaxrm.errors import ConfigError, DataError
from jaxrm.scoring.loading import ScoringInfo
from jaxrm.server import ServerConfig, make_server


@pytest.fixture(scope="module")
def server(tiny_rm):
  with serving(tiny_rm) as s:
    yield s


@pytest.fixture(scope="module")
def url(server):
  return server.url


def rewards_of(url, texts):
  status, reply, _ = call(url, "/get_reward", {"query": texts})
  assert status == 200, reply
  return reply["rewards"]


CONVERSATIONS = [
  [user("Capital of France?"), assistant("Paris")],
  [{"role": "system", "content": "Be brief."}, user("Capital of France?"), assistant("Lyon")],
]

# ------------------------------------------------------------------ endpoints


def test_get_reward_is_openrlhf_compatible(url, tiny_rm):
  # OpenRLHF's remote_rm_fn posts the rendered texts with their prompts and labels.
  status, reply, _ = call(
    url, "/get_reward", {"query": SERVER_TEXTS, "prompts": ["p"] * 3, "labels": [""] * 3}
  )
  assert status == 200
  assert reply["rewards"] == approx(tiny_rm.score(SERVER_TEXTS))


def test_score_conversations_and_pairs(url, tiny_rm):
  status, reply, _ = call(url, "/score", {"conversations": CONVERSATIONS})
  assert status == 200
  assert reply["rewards"] == approx(tiny_rm.score(CONVERSATIONS))
  prompts, completions = ["Q: 1 + 1?", "Q: 2 + 3?"], [" A: 2", " A: 5"]
  status, reply, _ = call(url, "/score", {"prompts": prompts, "completions": completions})
  assert status == 200
  assert reply["rewards"] == approx(tiny_rm.score(prompts=prompts, completions=completions))
  chat_prompts = [c[:-1] for c in CONVERSATIONS]
  chat_completions = [c[-1:] for c in CONVERSATIONS]
  status, reply, _ = call(url, "/score", {"prompts": chat_prompts, "completions": chat_completions})
  assert status == 200
  assert reply["rewards"] == approx(tiny_rm.score(CONVERSATIONS))


def test_long_conversations_lose_their_oldest_turns(url, tiny_rm):
  long = [user("one two " * 30), assistant("Noted."), user("Capital of France?"), assistant("Paris")]
  status, reply, _ = call(url, "/score", {"conversations": [long]})
  assert status == 200
  assert reply["rewards"] == approx(tiny_rm.score([long], max_length=SERVER_CONFIG.max_length))
  assert reply["rewards"] == approx(tiny_rm.score([long[2:]]))


def test_openrlhf_text_strips_pad_and_eos_then_appends_one(tiny_rm):
  eos = tiny_rm.tokenizer.eos_token
  with serving(tiny_rm, dataclasses.replace(SERVER_CONFIG, openrlhf_text=True)) as s:
    got = rewards_of(s.url, [f"{eos}{eos}Hello world{eos}{eos}{eos}", "Hello world"])
    status, reply, _ = call(s.url, "/get_reward", {"query": ["one two " * 40]})
    assert status == 400
    assert re.fullmatch(
      r"cannot score query\[0\]: \d+ tokens, longer than max_length=64 \(--max_length\)", reply["error"]
    )
  # SmolLM2's tokenizer adds no special tokens, so rm.score (which lets it) tokenizes alike.
  expected = tiny_rm.score([f"Hello world{eos}"] * 2)
  assert got == approx(expected)
  assert got[:1] != approx(tiny_rm.score(["Hello world"]))  # the eos changes the reward


def test_normalized_rewards(tiny_rm):
  from jaxrm import RewardModel

  with pytest.raises(ConfigError, match="normalizing needs the reward mean/std recorded at validation"):
    make_server(tiny_rm, "127.0.0.1", 0, config=ServerConfig(normalize=True))
  stats = {"mean": 0.5, "std": 2.0, "from": "validation-default"}
  validated = RewardModel(tiny_rm.model, tiny_rm.tokenizer, ScoringInfo(reward_stats=stats))
  with serving(validated, dataclasses.replace(SERVER_CONFIG, normalize=True)) as s:
    got = rewards_of(s.url, SERVER_TEXTS)
  raw = tiny_rm.score(SERVER_TEXTS)
  # Other padding (REBATCHED), then one float32 subtraction and division against numpy's.
  assert got == pytest.approx((raw - 0.5) / 2.0, rel=REBATCHED["rtol"], abs=REBATCHED["atol"])


def test_empty_batches_health_and_metrics(url):
  assert call(url, "/get_reward", {"query": []})[:2] == (200, {"rewards": [], "scores": [], "extra_logs": {}})
  assert call(url, "/score", {"conversations": []})[:2] == (200, {"rewards": []})
  assert call(url, "/health")[:2] == (200, {"status": "ok"})  # the model's name only to key holders
  assert metric(url, 'jaxrm_requests_total{endpoint="/get_reward",status="200"}') >= 1


def test_access_log_is_one_line_per_request_when_asked(sharing_server, caplog):
  with caplog.at_level("INFO", logger="jaxrm.server"):
    status, _, headers = call(sharing_server.url, "/get_reward", {"query": ["a"]})
    call(sharing_server.url, "/score", {"nothing": 1})
  lines = [r.getMessage() for r in caplog.records if " POST /" in r.getMessage()]
  assert len(lines) == 2, lines
  request_id = headers["X-Request-ID"]
  assert re.fullmatch(rf"127\.0\.0\.1 POST /get_reward 200 \d+\.\d{{3}} s request {request_id}", lines[0])
  assert " POST /score 400 " in lines[1]


def test_no_access_log_by_default(url, caplog):
  with caplog.at_level("INFO", logger="jaxrm.server"):
    assert call(url, "/get_reward", {"query": ["a"]})[0] == 200
  assert not [r for r in caplog.records if " POST /" in r.getMessage()]


def test_models_of_other_kinds_are_refused():
  other = types.SimpleNamespace(config=types.SimpleNamespace(head="token", num_labels=3), tokenizer=object())
  with pytest.raises(
    ConfigError,
    match=r"the server needs a sequence-head reward model .* or a token-head "
    r"\(process reward\) model with 2 labels .*; this model has a token head "
    r"with 3 labels",
  ):
    make_server(other, "127.0.0.1", 0)


def test_config_errors_say_which_flag():
  with pytest.raises(ConfigError, match=r"max_queued_tokens=0: must be at least 1 \(--max_queued_tokens\)"):
    ServerConfig(max_queued_tokens=0)
  with pytest.raises(ConfigError, match="batch_tokens=32 < max_length=64: .* raise --batch_tokens"):
    ServerConfig(max_length=64, batch_tokens=32).resolved(128)
  with pytest.raises(ConfigError, match="longer than the model's context"):
    ServerConfig(max_length=256).resolved(128)
  assert ServerConfig(max_length=300).resolved(8192).buckets == (64, 128, 256, 300)
  assert ServerConfig().resolved(8192).max_length == 2048


def test_every_server_setting_is_a_flag():
  helped = tiny_run.run([sys.executable, "-m", "jaxrm.serve", "--help"])
  flags = set(re.findall(r"^\s+--(?:\[no\])?(\w+)", helped.stdout, re.M))
  assert {f.name for f in dataclasses.fields(ServerConfig)} <= flags, helped.stdout
  assert {"verifier", "verifier_question", "verifier_answers"} <= flags, helped.stdout


def test_api_key(tiny_rm):
  with serving(tiny_rm, dataclasses.replace(SERVER_CONFIG, api_key="s3cret")) as s:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
      status, reply, reply_headers = call(s.url, "/get_reward", {"query": SERVER_TEXTS}, headers=headers)
      assert status == 401 and "Authorization: Bearer" in reply["error"]
      assert reply_headers["WWW-Authenticate"] == "Bearer"
    status, reply, _ = call(
      s.url, "/get_reward", {"query": SERVER_TEXTS}, headers={"Authorization": "Bearer s3cret"}
    )
    assert status == 200 and reply["rewards"] == approx(tiny_rm.score(SERVER_TEXTS))
    assert call(s.url, "/health")[0] == 200  # probes need no key
    assert call(s.url, "/metrics")[0] == 401


# ------------------------------------------------------------------ concurrency and batching


def test_concurrent_clients_get_their_own_rewards_in_shared_batches(url, tiny_rm):
  words = "alpha beta gamma delta epsilon zeta eta theta".split()
  # 64 requests of 1 to 4 texts, 2 to 50 tokens: every text differs, so a reward given to the
  # wrong request or in the wrong order shows.
  bodies = [
    [
      f"request {r} item {i}: " + " ".join(words[(r + i + k) % 8] for k in range((r * 7 + i * 5) % 45))
      for i in range(1 + r % 4)
    ]
    for r in range(64)
  ]
  batches_before = metric(url, "jaxrm_batch_requests_count")
  alone_before = metric(url, 'jaxrm_batch_requests_bucket{le="1.0"}')
  start = threading.Barrier(64, timeout=SOCKET_TIMEOUT)

  def client(texts):
    start.wait()  # all 64 send at once
    return call(url, "/get_reward", {"query": texts})

  with concurrent.futures.ThreadPoolExecutor(max_workers=64) as pool:
    replies = list(pool.map(client, bodies))
  for texts, (status, reply, _) in zip(bodies, replies):
    assert status == 200, reply
    assert reply["rewards"] == approx(tiny_rm.score(texts))
  batches = metric(url, "jaxrm_batch_requests_count") - batches_before
  shared = batches - (metric(url, 'jaxrm_batch_requests_bucket{le="1.0"}') - alone_before)
  assert shared > 0, "no forward pass held rows of more than one request"
  assert metric(url, "jaxrm_queue_tokens") == 0


# ------------------------------------------------------------------ shared prefixes

SHARING_CONFIG = dataclasses.replace(
  SERVER_CONFIG,
  max_batch=8,
  max_request_bytes=8192,
  max_length=128,
  buckets=(64, 128),
  batch_wait_ms=200,
  access_log=True,
)


@pytest.fixture(scope="module")
def sharing_server(tiny_rm):
  with serving(tiny_rm, SHARING_CONFIG, all_shapes=True) as s:  # its tests count padded tokens
    yield s


def computed_tokens(url, send):
  """(real tokens, positions fed to the model) while ``send()`` runs."""
  before = metric(url, "jaxrm_tokens_total"), metric(url, "jaxrm_padded_tokens_total")
  send()
  return metric(url, "jaxrm_tokens_total") - before[0], metric(url, "jaxrm_padded_tokens_total") - before[1]


def test_a_prompts_completions_are_scored_with_the_prompt_once(sharing_server, tiny_rm):
  from jaxrm.scoring import reward_model

  url = sharing_server.url
  want = tiny_rm.score(prompts=[GRPO_PROMPT] * 6, completions=GRPO_COMPLETIONS, share_prefix=False)
  assert len(tiny_rm.encode(GRPO_PROMPT, GRPO_COMPLETIONS[0])) > 64  # long enough to share
  compiled = reward_model.packed_programs()
  replies = []
  real, fed = computed_tokens(
    url,
    lambda: replies.append(
      call(url, "/score", {"prompts": [GRPO_PROMPT] * 6, "completions": GRPO_COMPLETIONS})
    ),
  )
  [(status, reply, _)] = replies
  assert status == 200, reply
  assert reply["rewards"] == approx(want)
  # One packed row holds the prompt once and the six replies: fewer positions than the six rows'
  # own tokens.
  assert fed in sharing_server.batcher.packed_buckets and fed < real
  assert reward_model.packed_programs() == compiled  # its shape was compiled at start


def test_completions_of_one_prompt_share_it_across_requests(sharing_server, tiny_rm):
  url = sharing_server.url
  want = tiny_rm.score(prompts=[GRPO_PROMPT] * 6, completions=GRPO_COMPLETIONS, share_prefix=False)
  start = threading.Barrier(6, timeout=SOCKET_TIMEOUT)

  def client(completion):
    start.wait()  # all six at once, within batch_wait_ms
    return call(url, "/score", {"prompts": [GRPO_PROMPT], "completions": [completion]})

  replies = []
  with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
    real, fed = computed_tokens(url, lambda: replies.extend(pool.map(client, GRPO_COMPLETIONS)))
  for w, (status, reply, _) in zip(want, replies):
    assert status == 200, reply
    assert reply["rewards"] == approx([w])
  assert fed < real


def test_share_prefix_off_scores_every_row_alone(tiny_rm):
  config = dataclasses.replace(SHARING_CONFIG, share_prefix=False)
  assert config.resolved(128).packed_buckets() == ()
  assert SHARING_CONFIG.resolved(128).packed_buckets() == (128, 192, 256, 384, 512)  # up to 4 x 128
  assert SERVER_CONFIG.resolved(128).packed_buckets() == ()  # no row of 64 tokens shares 64 tokens
  with serving(tiny_rm, config, all_shapes=True) as s:  # it counts padded tokens
    assert s.batcher.packed_shapes() == []
    real, fed = computed_tokens(
      s.url, lambda: call(s.url, "/score", {"prompts": [GRPO_PROMPT] * 6, "completions": GRPO_COMPLETIONS})
    )
  assert fed == 6 * 128 > real  # six rows padded to 128 tokens: a batch of 4 rows and one of 2


# ------------------------------------------------------------------ process reward models

PROBLEMS = ["What is 3 * 4 + 2?", [user("What is 10 - 3 * 2?")]]
SOLUTIONS = [["3 * 4 = 12", "12 + 2 = 14", "The answer is 14."], ["3 * 2 = 6", "10 - 6 = 4"]]


@pytest.fixture(scope="module")
def prm_url(tiny_prm):
  config = dataclasses.replace(SERVER_CONFIG, max_length=128, buckets=(64, 128))
  with serving(tiny_prm, config, all_shapes=True) as s:  # its tests count padded tokens
    yield s.url


def test_score_steps_answers_each_steps_probability(prm_url, tiny_prm):
  from jaxrm.scoring import step_rewards

  want = [tiny_prm.score_steps(p, steps) for p, steps in zip(PROBLEMS, SOLUTIONS)]
  sep = tiny_prm.step_separator
  texts = [sep.join(steps) for steps in SOLUTIONS]  # as a policy writes them: the steps, separated
  for body in ({"prompts": PROBLEMS, "steps": SOLUTIONS}, {"prompts": PROBLEMS, "completions": texts}):
    status, reply, _ = call(prm_url, "/score_steps", body)
    assert status == 200, reply
    assert [len(s) for s in reply["step_rewards"]] == [3, 2]
    for got, w in zip(reply["step_rewards"], want):
      assert got == approx(w)
    assert reply["rewards"] == approx([min(w) for w in want])  # the server's default: the weakest step
  for how in step_rewards.AGGREGATIONS:
    status, reply, _ = call(
      prm_url, "/score_steps", {"prompts": PROBLEMS, "steps": SOLUTIONS, "aggregation": how}
    )
    assert reply["rewards"] == approx([step_rewards.aggregate(w, how) for w in want]), how
  status, reply, _ = call(prm_url, "/score", {"prompts": PROBLEMS, "completions": texts})
  assert status == 200 and reply == {"rewards": approx([min(w) for w in want])}


def test_solutions_of_one_problem_share_it(prm_url, tiny_prm):
  problem = (
    "A shop sells pencils at 3 for 40 cents and erasers at 25 cents each, and on Mondays it takes "
    "a tenth off every ruler. Sam buys 12 pencils, 4 erasers and a ruler for 1 dollar 20 cents on a "
    "Tuesday, and pays with a 10 dollar note. How much change does Sam get back?"
  )
  solutions = [
    ["12 pencils cost 160 cents.", "4 erasers cost 100 cents.", "Change: 10 - 3.80 = 6.20."],
    ["12 pencils cost 4 x 40 = 160 cents.", "Total 3.80, change 6.20."],
    ["The answer is 5."],
  ]
  rows = [tiny_prm.encode_steps(problem, steps)[0] for steps in solutions]
  assert len(os.path.commonprefix(rows)) >= 64  # long enough to share
  want = tiny_prm.score_steps_batch([problem] * 3, solutions, share_prefix=False)
  replies = []
  real, fed = computed_tokens(
    prm_url,
    lambda: replies.append(call(prm_url, "/score_steps", {"prompts": [problem] * 3, "steps": solutions})),
  )
  [(status, reply, _)] = replies
  assert status == 200, reply
  for got, w in zip(reply["step_rewards"], want):
    assert got == approx(w)
  assert fed < real  # the problem's tokens once


@pytest.mark.parametrize(
  "path, body, message",
  [
    (
      "/score_steps",
      {"prompts": ["p"], "steps": [["a"]], "aggregation": "max"},
      "aggregation='max' is not an aggregation of step probabilities; choose one of min, last, product, mean",
    ),
    ("/score_steps", {"prompts": ["p", "q"], "steps": [["a"]]}, "2 prompts but 1 steps; send one per prompt"),
    ("/score_steps", {"prompts": ["p"]}, "send 'prompts' with 'completions'"),
    (
      "/score_steps",
      {"prompts": ["p"], "steps": [[1, 2]]},
      "steps[0] holds an integer; expected a list of step texts (strings)",
    ),
    (
      "/get_reward",
      {"query": ["a"]},
      "/get_reward scores whole sequences, and this server's model is a process "
      "reward model: POST /score_steps",
    ),
    ("/score", {"conversations": [[user("a"), assistant("b")]]}, "send 'prompts' with 'completions'"),
    ("/score", {"text_1": "a", "text_2": "b"}, "vLLM's score request scores whole sequences"),
  ],
)
def test_score_steps_refuses_what_it_cannot_score(prm_url, path, body, message):
  status, reply, _ = call(prm_url, path, body)
  assert status == 400 and message in reply["error"], reply


def test_python_and_http_agree_on_solutions_without_steps_and_on_steps_as_one_string(prm_url, tiny_prm):
  sep = tiny_prm.step_separator
  # No steps: no reward (TRL's None; null over HTTP), whichever way the solution came.
  assert tiny_prm.score_steps("p", []) == []
  assert tiny_prm.as_reward_func()(prompts=["p", "p"], completions=["", sep * 2]) == [None, None]
  want = tiny_prm.score_steps("p", ["a"])
  for body in (
    {"prompts": ["p", "p", "p"], "completions": ["a", "", sep * 2]},
    {"prompts": ["p", "p"], "steps": [["a"], []]},
  ):
    n = len(body["prompts"])
    status, reply, _ = call(prm_url, "/score_steps", body)
    assert status == 200, reply
    assert reply["step_rewards"][0] == approx(want) and reply["step_rewards"][1:] == [[]] * (n - 1)
    assert reply["rewards"][:1] == approx([min(want)]) and reply["rewards"][1:] == [None] * (n - 1)
    status, reply, _ = call(prm_url, "/score", body)
    assert status == 200 and reply["rewards"][1:] == [None] * (n - 1), reply
  status, reply, _ = call(prm_url, "/score_steps", {"prompts": ["p"], "steps": [[]]})
  assert status == 200 and reply == {"step_rewards": [[]], "rewards": [None]}, reply
  # Steps given as one string: refused by both, each saying how to have it cut into steps.
  with pytest.raises(DataError, match=r"score_steps: steps is one string; pass a list of steps \(e\.g\. "):
    tiny_prm.score_steps("p", f"a{sep}b")
  status, reply, _ = call(prm_url, "/score_steps", {"prompts": ["p"], "steps": [f"a{sep}b"]})
  assert status == 400, reply
  assert reply["error"].startswith("steps[0] is one string; pass a list of steps (or send the solution as")


def test_a_sequence_models_server_has_no_steps_to_score(url):
  status, reply, _ = call(url, "/score_steps", {"prompts": ["p"], "steps": [["a"]]})
  assert (
    status == 400
    and "/score_steps scores the steps of solutions with a process reward model" in reply["error"]
  )


def test_a_process_model_is_served_without_sequence_options(tiny_prm):
  with pytest.raises(ConfigError, match="--normalize applies to sequence rewards"):
    make_server(tiny_prm, "127.0.0.1", 0, config=dataclasses.replace(SERVER_CONFIG, normalize=True))
  with pytest.raises(
    ConfigError, match=r"step_aggregation='max' is not an aggregation .*\(--step_aggregation\)"
  ):
    ServerConfig(step_aggregation="max")


# ------------------------------------------------------------------ hostile and malformed requests


@pytest.mark.parametrize(
  "path, body, status, message",
  [
    ("/get_reward", b"{not json", 400, "the body is not valid JSON: Expecting property name"),
    ("/get_reward", b"\xff\xfe\x00", 400, "the body is not valid JSON"),
    ("/get_reward", b"", 400, "the body is empty; send a JSON object"),
    ("/get_reward", b"[" * 2000, 400, "the body is not valid JSON: it nests too deeply"),
    ("/get_reward", b"[1, 2]", 400, "the body is a list; expected a JSON object"),
    ("/get_reward", {"texts": ["a"]}, 400, "the body has no 'query'; send {\"query\": a list of strings"),
    ("/get_reward", {"query": "a"}, 400, "'query' is a string; expected a list of strings"),
    ("/get_reward", {"query": ["a", 3]}, 400, "query[1] is an integer; expected a string"),
    ("/get_reward", {"query": ["a", None]}, 400, "query[1] is null; expected a string"),
    (
      "/get_reward",
      {"query": ["a"] * 5},
      413,
      "'query' has 5 items; this server scores at most 4 per request (--max_batch): split the request",
    ),
    (
      "/get_reward",
      {"query": ["ok", "one two " * 40]},
      400,
      "cannot score query[1]: the completion alone is longer than max_length=64 tokens (--max_length)",
    ),
    ("/get_reward", {"query": ["ok", ""]}, 400, "cannot score query[1]: no tokens to score"),
    ("/get_reward", {"query": ["x" * 3000]}, 413, "the most this server takes (--max_request_bytes)"),
    (
      "/score",
      {"conversations": [[user("hi")], [{"role": "robot", "content": "x"}]]},
      400,
      "request: field 'conversations[1][0].role': unknown role 'robot'",
    ),
    (
      "/score",
      {"conversations": [[user("hi")], [{"role": "user", "content": 7}]]},
      400,
      "field 'conversations[1][0].content': expected a string, got an integer",
    ),
    (
      "/score",
      {"conversations": [user("hi")]},
      400,
      "field 'conversations[0]': expected a list of messages, got an object",
    ),
    ("/score", {"conversations": [[]]}, 400, "conversations[0] has no messages"),
    (
      "/get_reward",
      b'{"query": ["ok", "a\\ud800b"]}',
      400,
      "field 'query[1]' holds a lone surrogate (an escape in \\ud800-\\udfff), which is not text",
    ),
    (
      "/score",
      b'{"conversations": [[{"role": "user", "content": "\\udfff"}]]}',
      400,
      "field 'conversations[0][0].content' holds a lone surrogate",
    ),
    ("/score", b'{"\\ud800": 1}', 400, "a key of the body holds a lone surrogate"),
    ("/score", {"conversations": {"a": 1}}, 400, "'conversations' is an object; expected a list"),
    ("/score", {"prompts": ["a", "b"], "completions": ["c"]}, 400, "2 prompts but 1 completions"),
    (
      "/score",
      {"prompts": ["a"], "completions": [[assistant("c")]]},
      400,
      "the prompt is plain text but the completion is a conversation",
    ),
    ("/score", {"query": ["a"]}, 400, "the body has neither 'conversations' nor 'prompts' and 'completions'"),
    (
      "/get_rewards",
      {"query": ["a"]},
      404,
      ("no endpoint /get_rewards; this server has GET /health, GET /metrics, POST /get_reward, POST /score"),
    ),
  ],
)
def test_malformed_requests_get_4xx_with_a_message(url, path, body, status, message):
  raw = body if isinstance(body, bytes) else None
  code, reply, _ = call(url, path, None if raw is not None else body, raw=raw)
  assert code == status
  assert message in reply["error"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", ""])
def test_a_body_that_is_not_declared_json_is_refused(url, content_type):
  """What a web page may post to any address without asking is not scored (415)."""
  status, reply, _ = call(url, "/get_reward", {"query": ["a"]}, headers={"Content-Type": content_type})
  assert status == 415
  assert reply["error"] == (
    f"the body's Content-Type is {content_type or 'not given'}; send it as application/json "
    "(curl: -H 'Content-Type: application/json')"
  )
  assert (
    call(url, "/get_reward", {"query": ["a"]}, headers={"Content-Type": "application/json; charset=utf-8"})[0]
    == 200
  )


def test_wrong_method(url):
  status, reply, headers = call(url, "/score", method="GET")
  assert (status, reply) == (405, {"error": "/score takes POST"})
  assert headers["Allow"] == "POST"


def test_unicode_and_control_characters_are_scored_as_sent(url, tiny_rm):
  texts = ["Ünïcode ✓ 数学 😀", "tab\there\x00nul\x07bell\x1b[31m escape", "\u202eright-to-left\ufeff"]
  assert rewards_of(url, texts) == approx(tiny_rm.score(texts))


def test_hostile_clients_do_not_stop_a_well_formed_request(url, tiny_rm):
  # A body that never ends, headers that never end, a Content-Length that is no number, garbage
  # instead of HTTP: each gets its error or is dropped, while a good request is answered.
  stalled_body = raw_connection(url)
  stalled_body.sendall(
    b"POST /get_reward HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    b'Content-Length: 100\r\n\r\n{"query": ['
  )
  stalled_headers = raw_connection(url)
  stalled_headers.sendall(b"POST /get_reward HTTP/1.1\r\nHost: t\r\nContent-Le")
  garbage = raw_connection(url)
  garbage.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
  bad_length = raw_connection(url)
  bad_length.sendall(b"POST /get_reward HTTP/1.1\r\nHost: t\r\nContent-Length: lots\r\n\r\n{}")
  try:
    assert rewards_of(url, SERVER_TEXTS) == approx(tiny_rm.score(SERVER_TEXTS))
    reply = read_all(stalled_body)
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert b'"the body took more than 1 s to arrive (--body_timeout)"' in reply
    assert read_all(stalled_headers) == b""  # dropped after header_timeout
    for sock in (garbage, bad_length):
      assert read_all(sock).startswith(b"HTTP/1.1 400 ")
  finally:
    for sock in (stalled_body, stalled_headers, garbage, bad_length):
      sock.close()
  assert rewards_of(url, SERVER_TEXTS[:1]) == approx(tiny_rm.score(SERVER_TEXTS[:1]))


def test_queue_overflow_503_then_timeout_504_then_recovery(tiny_rm):
  first, second = SERVER_TEXTS[:2], SERVER_TEXTS[2:]
  tokens = [sum(len(tiny_rm.encode(t)) for t in texts) for texts in (first, second)]
  # Room for the first request alone; the scoring worker is held while it is in, so it stays queued.
  config = dataclasses.replace(SERVER_CONFIG, max_queued_tokens=tokens[0] + tokens[1] - 1, request_timeout=4)
  with serving(tiny_rm, config, all_shapes=True) as s:  # it swaps score_fn: every compile done first
    gate, score = threading.Event(), s.batcher.score_fn
    s.batcher.score_fn = lambda ids, mask: (gate.wait(SOCKET_TIMEOUT), score(ids, mask))[1]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      held = pool.submit(call, s.url, "/get_reward", {"query": first})
      for _ in range(1000):  # until the first request's tokens are queued
        if metric(s.url, "jaxrm_queue_tokens") == tokens[0]:
          break
        threading.Event().wait(0.01)
      status, reply, headers = call(s.url, "/get_reward", {"query": second})
      assert (status, headers["Retry-After"]) == (503, "1")
      assert "the server is busy" in reply["error"] and "--max_queued_tokens" in reply["error"]
      assert call(s.url, "/health")[:2] == (200, {"status": "ok"})
      status, reply, _ = held.result(timeout=SOCKET_TIMEOUT)
      assert status == 504 and "(--request_timeout)" in reply["error"]
    gate.set()
    assert metric(s.url, "jaxrm_queue_tokens") == 0
    assert rewards_of(s.url, second) == approx(tiny_rm.score(second))
    assert rewards_of(s.url, first) == approx(tiny_rm.score(first))


def test_request_larger_than_the_queue_is_refused(tiny_rm):
  config = dataclasses.replace(SERVER_CONFIG, max_queued_tokens=10)
  with serving(tiny_rm, config) as s:
    status, reply, _ = call(s.url, "/get_reward", {"query": SERVER_TEXTS})
    assert status == 413 and "this server queues at most 10 (--max_queued_tokens): split" in reply["error"]


def test_connections_past_the_limit_get_503(tiny_rm):
  # Bodies may take long here: the connections below, each in a request, hold their places for
  # the whole test (an idle one would be closed for a new one).
  config = dataclasses.replace(
    SERVER_CONFIG, max_connections=2, max_client_connections=2, body_timeout=SOCKET_TIMEOUT
  )
  with serving(tiny_rm, config) as s:
    idle = [raw_connection(s.url) for _ in range(2)]
    try:
      for sock in idle:
        sock.sendall(
          b"POST /get_reward HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
          b"Content-Length: 10\r\n\r\n{"
        )
      threading.Event().wait(0.2)  # their headers are read
      status, reply, headers = call(s.url, "/get_reward", {"query": SERVER_TEXTS})
      assert (status, headers["Retry-After"]) == (503, "1")
      assert "2 open connections, none of them idle, its most (--max_connections)" in reply["error"]
    finally:
      for sock in idle:
        sock.close()
    for _ in range(1000):  # until the server has seen the idle connections close
      status, reply, _ = call(s.url, "/get_reward", {"query": SERVER_TEXTS})
      if status == 200:
        break
      threading.Event().wait(0.01)
    assert reply["rewards"] == approx(tiny_rm.score(SERVER_TEXTS))


# ------------------------------------------------------------------ command line


def test_cli_serves_until_stopped(model_dir):
  proc = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "jaxrm.serve",
      f"--model={model_dir}",
      "--port=0",
      "--max_length=32",
      "--batch_size=2",
    ],
    cwd=tiny_run.ROOT,
    env=tiny_run.subprocess_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  lines = queue.Queue()
  threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
  try:
    first = lines.get(timeout=180)
    assert first.startswith(f"jaxrm: serving {model_dir} on http://127.0.0.1:"), first
    server_url = first.split(" on ")[1].split()[0]
    for _ in range(1200):  # "starting" while the batch shapes compile
      status, reply, _ = call(server_url, "/health")
      if status == 200:
        break
      assert (status, reply["status"]) == (503, "starting")
      threading.Event().wait(0.1)
    assert (status, reply) == (200, {"status": "ok"})  # no model path to clients
  finally:
    proc.terminate()
    proc.wait(timeout=60)
  assert "Traceback" not in proc.stderr.read()  # stopped cleanly (uvicorn then re-raises the SIGTERM)


def test_cli_error_without_traceback():
  proc = tiny_run.run([sys.executable, "-m", "jaxrm.serve", "--model=/nonexistent/model", "--port=0"])
  assert proc.returncode == 1
  assert proc.stderr.startswith("error: /nonexistent/model: no such file or directory"), proc.stderr
  assert "Traceback" not in proc.stderr
