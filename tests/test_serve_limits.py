"""jaxrm.serve keeps its limits: internal errors stay in the log, ``request_timeout`` bounds a whole
request, bodies waiting to be tokenized are bounded in bytes, and the scoring queue is bounded, its
given-up requests dropped unscored. Real requests on 127.0.0.1, every wait bounded."""

import concurrent.futures
import dataclasses
import json
import logging
import threading
import time

import pytest
from helpers import (
  MARK,
  SERVER_CONFIG,
  SERVER_TEXTS,
  SOCKET_TIMEOUT,
  approx,
  call,
  gated,
  metric,
  raw_connection,
  read_all,
  serving,
  timed,
  wait_until,
)

from jaxrm.server import ServerConfig, make_server

# ------------------------------------------------------------------ what reaches clients


def test_internal_errors_reach_the_log_not_the_client(tiny_rm, caplog):
  with serving(tiny_rm, all_shapes=True) as s:  # it swaps score_fn: every compile done first

    def broken(ids, mask):
      raise RuntimeError("disk full writing /srv/secret/model.safetensors")

    healthy, s.batcher.score_fn = s.batcher.score_fn, broken
    with caplog.at_level(logging.ERROR, logger="jaxrm.server"):
      status, reply, headers = call(s.url, "/get_reward", {"query": SERVER_TEXTS[:1]})
    s.batcher.score_fn = healthy
    request_id = headers["X-Request-ID"]
    assert status == 500 and request_id and request_id in reply["error"]
    for secret in ("RuntimeError", "disk full", "/srv/secret"):
      assert secret not in json.dumps(reply)
    assert any(
      request_id in r.getMessage() and r.exc_info and "disk full" in str(r.exc_info[1])
      for r in caplog.records
    ), caplog.text  # the log has the detail, under the same id
    assert call(s.url, "/health")[:2] == (200, {"status": "ok"})  # no model path to anyone
    status, _, headers = call(s.url, "/get_reward", {"query": SERVER_TEXTS[:1]})
    assert status == 200 and headers["X-Request-ID"] != request_id


def test_health_names_the_model_only_to_key_holders(tiny_rm):
  with serving(tiny_rm, dataclasses.replace(SERVER_CONFIG, api_key="s3cret")) as s:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
      assert call(s.url, "/health", headers=headers)[:2] == (200, {"status": "ok"})
    assert call(s.url, "/health", headers={"Authorization": "Bearer s3cret"})[:2] == (
      200,
      {"status": "ok", "model": "tiny"},
    )


def test_a_failed_warm_up_says_failed_and_logs_why(tiny_rm):
  server = make_server(tiny_rm, "127.0.0.1", 0, config=SERVER_CONFIG, model_name="/srv/secret/model")

  def broken(ids, mask):
    raise RuntimeError("out of memory in /srv/secret/cache")

  server.batcher.score_fn = broken
  server.start()
  try:
    wait_until(lambda: call(server.url, "/health")[0] != 503, "warm-up ends")
    assert call(server.url, "/health")[:2] == (500, {"status": "failed"})
    status, reply, headers = call(server.url, "/get_reward", {"query": SERVER_TEXTS[:1]})
    assert status == 500 and headers["X-Request-ID"] in reply["error"]
    for secret in ("out of memory", "/srv/secret", "RuntimeError"):
      assert secret not in reply["error"]
  finally:
    server.shutdown()


# ------------------------------------------------------------------ request_timeout


def test_request_timeout_covers_body_tokenizing_and_scoring(tiny_rm):
  # The tokenizer takes 3 s on each request; request_timeout is 1 s: both requests are answered
  # 504 at 1 s, the second without waiting for the first's tokenizing to end.
  config = dataclasses.replace(SERVER_CONFIG, request_timeout=1, body_timeout=5)
  with serving(gated(tiny_rm, delay=3), config) as s:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      replies = list(
        pool.map(lambda i: timed(call, s.url, "/get_reward", {"query": [f"{MARK} {i}"]}), range(2))
      )
    for (status, reply, _), seconds in replies:
      assert status == 504 and "(--request_timeout)" in reply["error"], reply
      assert seconds < 2.5
    # A body that stops half way: 504 at request_timeout, not 408 at body_timeout, and the
    # connection closes (its unread rest must not be taken for the next request).
    sock = raw_connection(s.url)
    try:
      sock.sendall(
        b"POST /get_reward HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"query": ['
      )
      reply, seconds = timed(read_all, sock)
    finally:
      sock.close()
    assert reply.startswith(b"HTTP/1.1 504 ") and b"connection: close" in reply.lower(), reply
    assert seconds < 2.5


# ------------------------------------------------------------------ bytes held before tokenizing


def padded_body(texts, size: int) -> bytes:
  """A /get_reward body of ``size`` bytes: JSON whitespace after the object makes it long in bytes
  but not in tokens."""
  body = json.dumps({"query": texts}).encode()
  return body + b" " * (size - len(body))


def test_bodies_waiting_to_be_tokenized_are_bounded_in_bytes(tiny_rm):
  gate = threading.Event()
  # max_request_bytes is 2048; one tokenizer, so that the second body waits for the first.
  config = dataclasses.replace(
    SERVER_CONFIG, max_pending_bytes=3000, max_client_pending_bytes=3000, tokenizers=1
  )
  with serving(gated(tiny_rm, gate=gate), config) as s:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      # One body stuck in the tokenizer, one waiting for it: 2600 of the 3000 bytes held.
      stuck = pool.submit(call, s.url, "/get_reward", raw=padded_body([f"{MARK} one"], 1400))
      wait_until(lambda: metric(s.url, "jaxrm_pending_bytes") == 1400, "the first body is held")
      waiting = pool.submit(call, s.url, "/get_reward", raw=padded_body(["two"], 1200))
      wait_until(lambda: metric(s.url, "jaxrm_pending_bytes") == 2600, "the second body is held")
      try:
        status, reply, headers = call(s.url, "/get_reward", raw=padded_body(["three"], 500))
        assert (status, headers["Retry-After"]) == (503, "1"), reply
        assert "(--max_pending_bytes)" in reply["error"]
        # A chunked body has no Content-Length: it is refused once its chunks pass the limit.
        sock = raw_connection(s.url)
        try:
          chunk = padded_body(["four"], 600)
          sock.sendall(
            b"POST /get_reward HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
          )
          refused = read_all(sock)
        finally:
          sock.close()
        assert refused.startswith(b"HTTP/1.1 503 ") and b"--max_pending_bytes" in refused, refused
      finally:
        gate.set()
      assert stuck.result(timeout=SOCKET_TIMEOUT)[0] == 200
      assert waiting.result(timeout=SOCKET_TIMEOUT)[0] == 200
    assert metric(s.url, "jaxrm_pending_bytes") == 0
    assert call(s.url, "/get_reward", raw=padded_body(["three"], 500))[0] == 200


def test_max_pending_bytes_must_hold_one_request():
  from jaxrm.errors import ConfigError

  with pytest.raises(
    ConfigError, match=r"max_pending_bytes=1000 < max_request_bytes=2048: .*--max_pending_bytes"
  ):
    ServerConfig(max_request_bytes=2048, max_pending_bytes=1000)


# ------------------------------------------------------------------ the scoring queue


def _hung(score, entered: threading.Event, gate: threading.Event):
  """``score`` that first says it ``entered`` and waits for ``gate``: a forward pass that hangs."""

  def hung(ids, mask):
    entered.set()
    gate.wait(SOCKET_TIMEOUT)
    return score(ids, mask)

  return hung


def test_scoring_queue_is_bounded_and_given_up_requests_are_not_scored(tiny_rm):
  # The scoring worker hangs in a forward pass; requests queued behind it time out one after
  # another. Their places stay taken until the worker drops them, up to max_connections places:
  # then new requests get 503 at once, and the dropped requests' rows are never scored.
  config = dataclasses.replace(
    SERVER_CONFIG, max_connections=3, max_client_connections=3, request_timeout=0.5
  )
  with serving(tiny_rm, config, all_shapes=True) as s:  # it swaps score_fn: every compile done first
    entered, gate, score = threading.Event(), threading.Event(), s.batcher.score_fn
    hung = _hung(score, entered, gate)
    items_before = metric(s.url, "jaxrm_items_total")
    s.batcher.score_fn = hung
    try:
      with concurrent.futures.ThreadPoolExecutor(1) as pool:
        in_forward = pool.submit(call, s.url, "/get_reward", {"query": SERVER_TEXTS[:2]})
        assert entered.wait(SOCKET_TIMEOUT)
        assert in_forward.result(timeout=SOCKET_TIMEOUT)[0] == 504
      for text in ("queued one", "queued two", "queued three"):  # one at a time: one connection each
        assert call(s.url, "/get_reward", {"query": [text]})[0] == 504
      (status, reply, headers), seconds = timed(call, s.url, "/get_reward", {"query": ["one more"]})
      assert (status, headers["Retry-After"]) == (503, "1"), reply
      assert "wait to be scored" in reply["error"] and "(--max_connections)" in reply["error"]
      assert seconds < config.request_timeout  # refused at once, not after its timeout
    finally:
      gate.set()
    wait_until(lambda: metric(s.url, "jaxrm_queue_requests") == 0, "the worker drops the given-up requests")
    s.batcher.score_fn = score
    assert metric(s.url, "jaxrm_items_total") - items_before == 2  # the forward under way only
    assert metric(s.url, "jaxrm_queue_tokens") == 0
    status, reply, _ = call(s.url, "/get_reward", {"query": SERVER_TEXTS})
    assert status == 200 and reply["rewards"] == approx(tiny_rm.score(SERVER_TEXTS))


def test_a_client_that_leaves_gives_up_its_place_and_is_not_scored(tiny_rm):
  # A request queued behind a hung forward pass; its client closes the connection: its tokens leave
  # the queue at once (not at its request_timeout), and its rows are never scored.
  config = dataclasses.replace(SERVER_CONFIG, request_timeout=SOCKET_TIMEOUT)
  with serving(tiny_rm, config, all_shapes=True) as s:  # it swaps score_fn: every compile done first
    entered, gate, score = threading.Event(), threading.Event(), s.batcher.score_fn
    hung = _hung(score, entered, gate)
    first = SERVER_TEXTS[:2]
    first_tokens = sum(len(tiny_rm.encode(t)) for t in first)
    leaving = json.dumps({"query": ["a client that leaves"]}).encode()
    leaving_tokens = len(tiny_rm.encode("a client that leaves"))
    items_before = metric(s.url, "jaxrm_items_total")
    s.batcher.score_fn = hung
    try:
      with concurrent.futures.ThreadPoolExecutor(1) as pool:
        in_forward = pool.submit(call, s.url, "/get_reward", {"query": first})
        assert entered.wait(SOCKET_TIMEOUT)
        sock = raw_connection(s.url)
        try:
          sock.sendall(
            b"POST /get_reward HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(leaving)}\r\n\r\n".encode()
            + leaving
          )
          wait_until(
            lambda: metric(s.url, "jaxrm_queue_tokens") == first_tokens + leaving_tokens, "it is queued"
          )
        finally:
          sock.close()
        wait_until(lambda: metric(s.url, "jaxrm_queue_tokens") == first_tokens, "its place is given up")
        assert metric(s.url, 'jaxrm_requests_total{endpoint="/get_reward",status="499"}') == 1
        gate.set()
        assert in_forward.result(timeout=SOCKET_TIMEOUT)[0] == 200
    finally:
      gate.set()
    s.batcher.score_fn = score
    wait_until(lambda: metric(s.url, "jaxrm_queue_requests") == 0, "the worker drops it")
    assert metric(s.url, "jaxrm_items_total") - items_before == len(first)


# ------------------------------------------------------------------ hostile clients


def test_headers_alone_hold_no_pending_bytes(tiny_rm):
  # Two clients send the headers of 2048-byte bodies, and nothing more: they once reserved all of
  # max_pending_bytes until body_timeout, and every other request got 503. Bytes count as they
  # arrive now: the gauge stays at 0, and an honest request is scored meanwhile.
  config = dataclasses.replace(SERVER_CONFIG, max_pending_bytes=4096, body_timeout=SOCKET_TIMEOUT)
  with serving(tiny_rm, config) as s:
    socks = [raw_connection(s.url) for _ in range(2)]
    try:
      for sock in socks:
        sock.sendall(
          b"POST /get_reward HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
          b"Content-Length: 2048\r\n\r\n"
        )
      time.sleep(0.5)  # their headers are read (before, they then reserved 4096 bytes)
      assert metric(s.url, "jaxrm_pending_bytes") == 0
      status, reply, _ = call(s.url, "/get_reward", raw=padded_body(SERVER_TEXTS, 600))
      assert status == 200, reply
      assert reply["rewards"] == approx(tiny_rm.score(SERVER_TEXTS, max_length=64))
    finally:
      for sock in socks:
        sock.close()


def long_conversation(messages: int) -> list[dict]:
  return [
    {
      "role": "user" if i % 2 == 0 else "assistant",
      "content": f"{'question' if i % 2 == 0 else 'answer'} {i}",
    }
    for i in range(messages)
  ]


def test_ten_thousand_turns_are_scored_or_refused_within_request_timeout(tiny_rm):
  # Cutting the oldest turns one render at a time took minutes for such a conversation, holding
  # the tokenizer past the request's 504 while every other request waited behind it.
  conversation = long_conversation(10_001)
  body = {"conversations": [conversation]}
  config = dataclasses.replace(
    SERVER_CONFIG, max_request_bytes=2**20, max_pending_bytes=2**20, request_timeout=20
  )
  with serving(tiny_rm, config) as s:
    (status, reply, _), seconds = timed(call, s.url, "/score", body)
    assert status == 413 and "(--max_messages)" in reply["error"], reply
    assert "conversations[0] brings the request to 10001 messages" in reply["error"]
    assert seconds < 2
  with serving(tiny_rm, dataclasses.replace(config, max_messages=20_000)) as s:
    (status, reply, _), seconds = timed(call, s.url, "/score", body)
    assert status == 200, reply
    assert seconds < config.request_timeout
    assert reply["rewards"] == approx(tiny_rm.score([conversation], max_length=64))


def test_a_request_past_its_deadline_stops_tokenizing(tiny_rm):
  # Four texts of 0.4 s each to tokenize, and 0.6 s to answer: the request is answered 504 at
  # 0.6 s, and its tokenizing stops before its third text instead of going on for 1.6 s while
  # the requests behind it wait.
  slow = gated(tiny_rm, delay=0.4)
  config = dataclasses.replace(SERVER_CONFIG, request_timeout=0.6)
  with serving(slow, config) as s:
    status, reply, _ = call(s.url, "/get_reward", {"query": [f"{MARK} {i}" for i in range(4)]})
    assert status == 504, reply
    status, reply, _ = call(s.url, "/get_reward", {"query": ["next"]})  # waits for the tokenizer
    assert status == 200, reply
  assert slow.tokenizer.marked == 2
