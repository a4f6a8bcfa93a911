"""jaxrm.serve: real HTTP requests on 127.0.0.1 against a tiny random model, malformed ones included."""

import concurrent.futures
import contextlib
import http.client
import json
import queue
import subprocess
import sys
import threading
import types
import urllib.error
import urllib.request

import pytest

import tiny_run
from helpers import REBATCHED, assistant, user
from jaxrm import RewardModel
from jaxrm.serve import Limits, RewardService, make_server

LIMITS = Limits(max_batch=4, max_request_bytes=2048, max_length=64)
# Proxies from the environment must not see loopback requests.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@contextlib.contextmanager
def serving(rm, **kwargs):
  """The URL of a server on a free loopback port, run in a thread."""
  server = make_server(rm, "127.0.0.1", 0, limits=LIMITS, batch_size=2, model_name="tiny", **kwargs)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield "http://%s:%d" % server.server_address[:2]
  finally:
    server.shutdown()
    server.server_close()
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def url(tiny_rm):
  with serving(tiny_rm) as u:
    yield u


def call(url, path, body=None, *, raw=None, method=None):
  """(status, decoded JSON reply) of one request; ``raw`` bytes are sent as they are."""
  data = raw if raw is not None else None if body is None else json.dumps(body).encode()
  req = urllib.request.Request(url + path, data=data, method=method or ("GET" if data is None else "POST"),
                               headers={"Content-Type": "application/json"})
  try:
    with OPENER.open(req, timeout=120) as reply:
      return reply.status, json.loads(reply.read())
  except urllib.error.HTTPError as e:
    with e:
      return e.code, json.loads(e.read())


TEXTS = [
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n",
    "Plain text, no template.",
]
CONVERSATIONS = [
    [user("Capital of France?"), assistant("Paris")],
    [{"role": "system", "content": "Be brief."}, user("Capital of France?"), assistant("Lyon")],
]


def test_get_reward_is_openrlhf_compatible(url, tiny_rm):
  # OpenRLHF's remote_rm_fn posts the rendered texts with their prompts and labels.
  status, reply = call(url, "/get_reward", {"query": TEXTS, "prompts": ["p"] * 3, "labels": [""] * 3})
  assert status == 200
  assert reply == {"rewards": tiny_rm.score(TEXTS, batch_size=2).tolist()}


def test_score_conversations(url, tiny_rm):
  status, reply = call(url, "/score", {"conversations": CONVERSATIONS})
  assert status == 200
  assert reply == {"rewards": tiny_rm.score(CONVERSATIONS, batch_size=2).tolist()}


def test_long_conversations_lose_their_oldest_turns(url, tiny_rm):
  long = [user("one two " * 30), assistant("Noted."), user("Capital of France?"), assistant("Paris")]
  status, reply = call(url, "/score", {"conversations": [long]})
  assert status == 200
  assert reply["rewards"] == tiny_rm.score([long], max_length=LIMITS.max_length).tolist()
  assert reply["rewards"] == tiny_rm.score([long[2:]]).tolist()


def test_normalized_rewards(tiny_rm):
  with pytest.raises(ValueError, match="normalizing needs the reward mean/std recorded at validation"):
    make_server(tiny_rm, "127.0.0.1", 0, normalize=True)
  stats = {"mean": 0.5, "std": 2.0, "from": "validation-default"}
  validated = RewardModel(tiny_rm.model, tiny_rm.tokenizer, reward_stats=stats)
  with serving(validated, normalize=True) as u:
    status, reply = call(u, "/get_reward", {"query": TEXTS})
  assert status == 200
  raw = tiny_rm.score(TEXTS, batch_size=2)
  # One float32 subtraction and division against numpy's: a rounding or two apart.
  assert reply["rewards"] == pytest.approx((raw - 0.5) / 2.0, rel=1e-6)


def test_empty_batch_and_health(url):
  assert call(url, "/get_reward", {"query": []}) == (200, {"rewards": []})
  assert call(url, "/score", {"conversations": []}) == (200, {"rewards": []})
  assert call(url, "/health") == (200, {"status": "ok", "model": "tiny"})


@pytest.mark.parametrize("path, body, status, message", [
    ("/get_reward", b"{not json", 400, "the body is not valid JSON: Expecting property name"),
    ("/get_reward", b"\xff\xfe\x00", 400, "the body is not valid JSON"),
    ("/get_reward", b"[1, 2]", 400, "the body is a list; expected a JSON object"),
    ("/get_reward", {"texts": ["a"]}, 400, "the body has no 'query'; send {\"query\": a list of strings"),
    ("/get_reward", {"query": "a"}, 400, "'query' is a string; expected a list of strings"),
    ("/get_reward", {"query": ["a", 3]}, 400, "query[1] is an integer; expected a string"),
    ("/get_reward", {"query": ["a", None]}, 400, "query[1] is null; expected a string"),
    ("/get_reward", {"query": ["a"] * 5}, 400,
     "'query' has 5 items; this server scores at most 4 per request (--max_batch)"),
    ("/get_reward", {"query": ["ok", "one two " * 40]}, 400,
     "cannot score the query: items[1]: the completion alone is longer than max_length=64 tokens"),
    ("/get_reward", {"query": ["ok", ""]}, 400, "cannot score the query: items[1]: no tokens to score"),
    ("/get_reward", {"query": ["x" * 3000]}, 413, "this server takes at most 2048 (--max_request_bytes)"),
    ("/score", {"conversations": [[user("hi")], [{"role": "robot", "content": "x"}]]}, 400,
     "request: field 'conversations[1][0].role': unknown role 'robot'"),
    ("/score", {"conversations": [[user("hi")], [{"role": "user", "content": 7}]]}, 400,
     "field 'conversations[1][0].content': expected a string, got an integer"),
    ("/score", {"conversations": [user("hi")]}, 400,
     "field 'conversations[0]': expected a list of messages, got an object"),
    ("/score", {"conversations": [[]]}, 400, "conversations[0] has no messages"),
    ("/score", {"conversations": {"a": 1}}, 400, "'conversations' is an object; expected a list"),
    ("/get_rewards", {"query": ["a"]}, 404, "no endpoint /get_rewards; this server has GET /health, "
     "POST /get_reward, POST /score"),
])
def test_malformed_requests_get_4xx_with_a_message(url, path, body, status, message):
  raw = body if isinstance(body, bytes) else None
  code, reply = call(url, path, None if raw else body, raw=raw)
  assert code == status
  assert message in reply["error"]


def test_wrong_method_and_missing_length(url):
  assert call(url, "/score", method="GET") == (405, {"error": "/score takes POST"})
  host, port = url.removeprefix("http://").split(":")
  conn = http.client.HTTPConnection(host, int(port), timeout=60)
  try:
    conn.putrequest("POST", "/get_reward")
    conn.endheaders()  # no Content-Length, no body
    reply = conn.getresponse()
    assert reply.status == 411
    assert json.loads(reply.read()) == {"error": "the request has no Content-Length header"}
  finally:
    conn.close()


def test_concurrent_requests_get_their_own_rewards(url, tiny_rm):
  bodies = [TEXTS[i:] for i in range(3)] * 2
  with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
    replies = list(pool.map(lambda texts: call(url, "/get_reward", {"query": texts}), bodies))
  expected = tiny_rm.score(TEXTS, batch_size=2).tolist()
  for texts, (status, reply) in zip(bodies, replies):
    assert status == 200
    # A request of 1 or 2 of the texts scores them in other batches than all 3 do: other padding.
    assert reply["rewards"] == pytest.approx(expected[3 - len(texts):], rel=REBATCHED["rtol"],
                                             abs=REBATCHED["atol"])


def test_process_reward_models_are_refused():
  prm = types.SimpleNamespace(config=types.SimpleNamespace(head="token", num_labels=2), tokenizer=object())
  with pytest.raises(ValueError, match="has a token head with 2 labels"):
    RewardService(prm)


def test_cli_serves_until_stopped(model_dir):
  proc = subprocess.Popen([sys.executable, "-m", "jaxrm.serve", f"--model={model_dir}", "--port=0"],
                          cwd=tiny_run.ROOT, env=tiny_run.subprocess_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  lines = queue.Queue()
  threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
  try:
    first = lines.get(timeout=180)
    assert first.startswith(f"jaxrm: serving {model_dir} on http://127.0.0.1:"), proc.stderr.read()
    server_url = first.split(" on ")[1].split()[0]
    assert call(server_url, "/health") == (200, {"status": "ok", "model": model_dir})
  finally:
    proc.terminate()
    proc.wait(timeout=60)


def test_cli_error_without_traceback():
  proc = tiny_run.run([sys.executable, "-m", "jaxrm.serve", "--model=/nonexistent/model"])
  assert proc.returncode == 1
  assert proc.stderr.startswith("error: /nonexistent/model: no such file or directory")
  assert "Traceback" not in proc.stderr
