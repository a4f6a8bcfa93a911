"""jaxrm.serve stays fair under requests that break no limit: a short request is answered while a
long one is tokenized, each request's tokenizing has a budget (a text shared by vLLM's score pairs
counted once), and each client has its share of connections and of pending bytes. Real requests on
loopback, every wait bounded."""

import concurrent.futures
import dataclasses
import json
import select
import socket
import threading
import time

from helpers import (
  MARK,
  SERVER_CONFIG,
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

# A second loopback address: requests from it come from another peer.
OTHER_PEER = "127.0.0.2"
HEAD = b"POST /get_reward HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"


def connection_from(url: str, source: str) -> socket.socket:
  host, port = url.removeprefix("http://").split(":")
  return socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT, source_address=(source, 0))


def test_a_short_request_is_answered_while_a_long_one_is_tokenized(tiny_rm):
  # One request's text of 70,000 characters is stuck in a tokenizer; a short request, sent after
  # it, takes the tokenizer kept for short items and is answered meanwhile.
  gate = threading.Event()
  slow = gated(tiny_rm, gate=gate)
  config = dataclasses.replace(SERVER_CONFIG, max_request_bytes=2**17, max_pending_bytes=2**18)
  with serving(slow, config) as s:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      try:
        long = pool.submit(call, s.url, "/get_reward", {"query": [MARK + " word" * 14_000]})
        wait_until(lambda: slow.tokenizer.marked == 1, "the long text is being tokenized")
        (status, reply, _), seconds = timed(call, s.url, "/get_reward", {"query": ["short"]})
        assert status == 200 and len(reply["rewards"]) == 1, reply
        assert seconds < 2 and not long.done()  # 0.02 s here; the long one still waits
      finally:
        gate.set()
      status, reply, _ = long.result(timeout=SOCKET_TIMEOUT)
      assert status == 400 and "longer than max_length" in reply["error"], reply  # tokenized, then refused


def test_tokenizing_has_a_budget_and_a_shared_text_counts_once(tiny_rm):
  config = dataclasses.replace(
    SERVER_CONFIG, max_request_bytes=2**16, max_pending_bytes=2**17, max_tokenize_chars=8000
  )
  query = " ".join(f"a question, part {i} of it;" for i in range(200))  # 5,000 characters or so
  answers = ["Yes.", " No, never.", "\nPerhaps", " maybe so"]
  pair = {"truncate_prompt_tokens": -1, "use_activation": False}
  with serving(tiny_rm, config) as s:
    status, reply, _ = call(s.url, "/get_reward", {"query": ["x" * 9000]})
    assert status == 413, reply
    assert "9000 characters tokenized" in reply["error"] and "(--max_tokenize_chars)" in reply["error"]
    # Four pairs sharing text_1: tokenized apart, they would be 4 x 5,000 characters.
    status, reply, _ = call(s.url, "/v1/score", {"text_1": query, "text_2": answers, **pair})
    assert status == 200, reply
    one_by_one = [call(s.url, "/v1/score", {"text_1": query, "text_2": a, **pair}) for a in answers]
    assert all(status == 200 for status, _, _ in one_by_one)
    assert [d["score"] for d in reply["data"]] == approx(r["data"][0]["score"] for _, r, _ in one_by_one)


def test_one_peer_over_its_share_is_refused_while_another_is_served(tiny_rm):
  config = dataclasses.replace(
    SERVER_CONFIG,
    max_connections=4,
    max_client_connections=2,
    max_pending_bytes=8192,
    max_client_pending_bytes=2048,  # = max_request_bytes
    header_timeout=SOCKET_TIMEOUT,
    body_timeout=SOCKET_TIMEOUT,
  )
  with serving(tiny_rm, config) as s:
    held = [connection_from(s.url, OTHER_PEER) for _ in range(2)]
    try:
      # The peer's first body stalls after 1,500 bytes; its next would bring it past its share,
      # whatever Authorization header it sends (the server has no keys).
      held[0].sendall(HEAD + b"Content-Length: 2000\r\n\r\n" + b" " * 1500)
      wait_until(lambda: metric(s.url, "jaxrm_pending_bytes") == 1500, "the stalled bytes are held")
      body = json.dumps({"query": ["two"]}).encode() + b" " * 900
      head = HEAD + b"Authorization: Bearer another\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode()
      held[1].sendall(head + body)
      refused = read_all(held[1])
      assert refused.startswith(b"HTTP/1.1 429 ") and b"(--max_client_pending_bytes)" in refused, refused
      # Two connections in requests, none idle: the peer's third is refused.
      held[1] = connection_from(s.url, OTHER_PEER)
      held[1].sendall(HEAD + b"Content-Length: 10\r\n\r\n{")
      wait_until(lambda: metric(s.url, "jaxrm_pending_bytes") == 1501, "the second body is begun")
      with connection_from(s.url, OTHER_PEER) as third:
        refused = read_all(third)
      assert refused.startswith(b"HTTP/1.1 429 ") and b"(--max_client_connections)" in refused, refused
      # Another peer (127.0.0.1) keeps its connections and its bytes meanwhile.
      body = json.dumps({"query": ["three"]}).encode() + b" " * 1500
      status, reply, _ = call(s.url, "/get_reward", raw=body)
      assert status == 200 and len(reply["rewards"]) == 1, reply
    finally:
      for sock in held:
        sock.close()


def test_a_full_pool_closes_an_idle_connection_first(tiny_rm):
  config = dataclasses.replace(
    SERVER_CONFIG,
    max_connections=3,
    max_client_connections=3,
    header_timeout=SOCKET_TIMEOUT,
    body_timeout=SOCKET_TIMEOUT,
  )
  with serving(tiny_rm, config) as s:
    busy = raw_connection(s.url)  # in a request, its body half sent
    idle = [connection_from(s.url, OTHER_PEER) for _ in range(2)]
    try:
      body = json.dumps({"query": ["busy"]}).encode()
      busy.sendall(HEAD + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:5])
      time.sleep(0.2)  # the server has seen the three connections, the busy one's headers
      status, reply, _ = call(s.url, "/get_reward", {"query": ["new"]})  # a fourth: over the pool
      assert status == 200, reply
      closed, _, _ = select.select(idle, [], [], SOCKET_TIMEOUT)
      assert len(closed) == 1 and closed[0].recv(1) == b""  # an idle one closed for it, unanswered
      busy.sendall(body[5:])
      assert read_all_until_answer(busy).startswith(b"HTTP/1.1 200 ")  # the busy one kept its place
    finally:
      for sock in [busy, *idle]:
        sock.close()


def read_all_until_answer(sock) -> bytes:
  data = b""
  while b"\r\n\r\n" not in data and (chunk := sock.recv(65536)):
    data += chunk
  return data
