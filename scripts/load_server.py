r"""The reward server under load, a quarter of its clients hostile: do the honest ones keep their answers?

CPU, the embedded SmolLM2-135M-Instruct (a new reward head), 64 clients of which 16 hostile, 60 s::

  python scripts/load_server.py --clients=64 --hostile=16 --seconds=60

and with valid but costly requests beside them, and one client holding connections and bodies::

  python scripts/load_server.py --clients=64 --hostile=16 --costly=4 --hog --seconds=60

The server is ``python -m jaxrm.serve`` in its own process (so the clients' threads do not share
its interpreter), with its default limits except those set below; ``--url`` loads a server already
running instead. Honest clients each send one ``/score`` request of ``--items`` chat pairs (a
question and its answer), wait for the answer, and send the next. Hostile clients take turns at:

* ``slow_headers``: a request's headers, a few bytes a second (dropped at ``header_timeout``);
* ``headers_only``: whole headers announcing a body of ``max_request_bytes``, then nothing (408 at
  ``body_timeout``; the announced bytes hold nothing meanwhile);
* ``huge_turns``: one conversation of 10,000 turns (413 at ``max_messages``);
* ``oversized``: a Content-Length over ``max_request_bytes`` (413), or a chunked body that grows
  past it;
* ``malformed``: bodies that are not JSON, hold a lone surrogate, are sent as text/plain, or stop
  half way.

``--costly`` clients send requests that break no limit but cost the tokenizer much, taking turns at:

* ``long_text``: vLLM's ``/pooling`` of one text of nearly ``max_request_bytes`` characters, cut to
  its last ``max_length`` tokens (``truncate_prompt_tokens: -1``);
* ``many_pairs``: vLLM's ``/v1/score`` of one ``text_1`` of half ``max_request_bytes`` with 64
  short ``text_2``, each pair cut likewise;
* ``many_turns``: one conversation of 3,000 turns (fewer where ``max_request_bytes`` is under
  300 KB), whose oldest turns are cut to fit.

``--hog`` adds one client, from another loopback address (127.0.0.2: a peer of its own), that keeps
``--hog_connections`` connections open and idle, reopening each as it drops, and ``--hog_bodies``
connections each sending ``max_request_bytes - 1`` bytes of a body one byte longer and stalling.

Reported: honest requests, their errors (any answer but 200, or none) and latencies (p50, p99,
max) against ``request_timeout``; each hostile and costly kind's answers by status (with the
costly ones' latencies), the hog's; the machine's CPUs.
:func:`run_load` is the load itself, against any URL (tests/test_serve_load.py runs a small one).
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import platform
import re
import selectors
import socket
import subprocess
import sys
import threading
import time
import urllib.request

HOSTILE_KINDS = ("slow_headers", "headers_only", "huge_turns", "oversized", "malformed")
MESSAGES = 20_000  # huge_turns: 10,000 turns of a question and an answer
COSTLY_KINDS = ("long_text", "many_pairs", "many_turns")
COSTLY_PATHS = {"long_text": "/pooling", "many_pairs": "/v1/score", "many_turns": "/score"}
COSTLY_TURNS = 3_000
HOG_PEER = "127.0.0.2"  # another loopback address: the server sees another client


def honest_body(i: int, items: int) -> bytes:
  pairs = [(f"What is {i} + {k}?", f"{i + k}") for k in range(items)]
  return json.dumps(
    {
      "prompts": [[{"role": "user", "content": q}] for q, _ in pairs],
      "completions": [[{"role": "assistant", "content": a}] for _, a in pairs],
    }
  ).encode()


def huge_turns_body() -> bytes:
  roles = ("user", "assistant")
  conversation = [{"role": roles[i % 2], "content": f"turn {i}"} for i in range(MESSAGES)]
  return json.dumps({"conversations": [conversation]}).encode()


def costly_body(kind: str, max_request_bytes: int) -> bytes:
  """A request of ``kind`` within every limit, of nearly ``max_request_bytes``."""
  words = " ".join(f"word{i % 977}" for i in range(max_request_bytes // 8))
  if kind == "long_text":
    text = words[: max_request_bytes - 200]
    return json.dumps({"input": text, "truncate_prompt_tokens": -1}).encode()
  if kind == "many_pairs":
    answers = [f"answer {k}: {'yes' if k % 2 else 'no'}" for k in range(64)]
    first = words[: max_request_bytes // 2]
    return json.dumps({"text_1": first, "text_2": answers, "truncate_prompt_tokens": -1}).encode()
  roles = ("user", "assistant")
  turns = min(COSTLY_TURNS, max_request_bytes // 100)  # each about 90 bytes
  conversation = [{"role": roles[i % 2], "content": f"turn {i}: {words[:40]}"} for i in range(turns)]
  return json.dumps({"conversations": [conversation]}).encode()


def _head(path: str, extra: str = "", content_type: str = "application/json") -> bytes:
  return f"POST {path} HTTP/1.1\r\nHost: load\r\nContent-Type: {content_type}\r\n{extra}".encode()


def _status(reply: bytes) -> str:
  found = re.match(rb"HTTP/1\.1 (\d{3}) ", reply)
  return found.group(1).decode() if found else "dropped"


class Raw:
  """One request on its own connection, written as given: what a hostile client sends."""

  def __init__(self, host: str, port: int, timeout: float):
    self.sock = socket.create_connection((host, port), timeout=timeout)

  def send(self, data: bytes) -> bool:
    try:
      self.sock.sendall(data)
      return True
    except OSError:  # the server closed the connection: as it should, past a limit
      return False

  def reply(self) -> str:
    chunks = []
    try:
      while chunk := self.sock.recv(65536):
        chunks.append(chunk)
        if b"\r\n\r\n" in b"".join(chunks):
          break
    except OSError:
      pass
    return _status(b"".join(chunks))

  def close(self) -> None:
    self.sock.close()


def hostile_request(kind: str, n: int, host: str, port: int, limits: dict, stop: threading.Event) -> str:
  """One hostile request of ``kind`` (its ``n``-th); the status it got, or "dropped"."""
  raw = Raw(host, port, timeout=limits["request_timeout"] + 30)
  try:
    if kind == "slow_headers":
      for byte in _head("/score", "X-Slow: " + "x" * 200):
        if stop.is_set() or not raw.send(bytes([byte])):
          break
        time.sleep(0.25)
      return raw.reply()
    if kind == "headers_only":
      raw.send(_head("/score", f"Content-Length: {limits['max_request_bytes']}\r\n\r\n"))
      return raw.reply()
    if kind == "huge_turns":
      body = huge_turns_body()
      raw.send(_head("/score", f"Content-Length: {len(body)}\r\n\r\n") + body)
      return raw.reply()
    if kind == "oversized":
      if n % 2 == 0:
        raw.send(_head("/score", f"Content-Length: {limits['max_request_bytes'] + 1}\r\n\r\n"))
      else:
        raw.send(_head("/score", "Transfer-Encoding: chunked\r\n\r\n"))
        chunk = b" " * 65536
        for _ in range(limits["max_request_bytes"] // len(chunk) + 2):
          if not raw.send(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"):
            break
      return raw.reply()
    bodies = [
      (b'{"prompts": [', "application/json"),
      (b'{"conversations": [[{"role": "user", "content": "\\ud800"}]]}', "application/json"),
      (honest_body(n, 1), "text/plain"),
      (b"[1, 2, 3]", "application/json"),
    ]
    if n % 5 == 4:  # a body that stops half way, its connection then closed
      raw.send(_head("/score", "Content-Length: 1000\r\n\r\n") + b'{"prompts": ')
      return "dropped"
    body, content_type = bodies[n % 5]
    raw.send(_head("/score", f"Content-Length: {len(body)}\r\n\r\n", content_type) + body)
    return raw.reply()
  finally:
    raw.close()


def percentile(values: list[float], q: float) -> float:
  if not values:
    return float("nan")
  ordered = sorted(values)
  return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Hog:
  """One client (:data:`HOG_PEER`) holding ``connections`` idle connections and ``bodies`` stalled
  bodies of ``max_request_bytes - 1`` bytes, each reopened as the server drops it; what it got."""

  def __init__(self, host: str, port: int, limits: dict, connections: int, bodies: int):
    self.host, self.port, self.limits = host, port, limits
    self.connections, self.bodies = connections, bodies
    self.answers: collections.Counter = collections.Counter()
    self.held_most = 0

  def run(self, stop: threading.Event) -> None:
    selector = selectors.DefaultSelector()
    stalled: set[socket.socket] = set()
    while not stop.is_set():
      idle = len(selector.get_map()) - len(stalled)
      for _ in range(max(0, self.bodies - len(stalled))):
        sock = self._open(stalled_body=True)
        if sock is not None:
          stalled.add(sock)
          selector.register(sock, selectors.EVENT_READ)
      for _ in range(min(64, max(0, self.connections - idle))):  # a burst at a time
        sock = self._open(stalled_body=False)
        if sock is not None:
          selector.register(sock, selectors.EVENT_READ)
      self.held_most = max(self.held_most, len(selector.get_map()))
      for key, _ in selector.select(timeout=0.2):
        sock = key.fileobj
        selector.unregister(sock)
        stalled.discard(sock)
        self.answers[_status(_read_some(sock))] += 1
        sock.close()
      time.sleep(0.05)  # reopen as fast as the server drops them, not faster
    for key in list(selector.get_map().values()):
      key.fileobj.close()

  def _open(self, *, stalled_body: bool) -> socket.socket | None:
    try:
      sock = socket.create_connection((self.host, self.port), timeout=5, source_address=(HOG_PEER, 0))
    except OSError:
      self.answers["not_connected"] += 1
      return None
    try:
      if stalled_body:
        size = self.limits["max_request_bytes"]
        sock.sendall(_head("/score", f"Content-Length: {size}\r\n\r\n") + b" " * (size - 1))
    except OSError:  # refused before the body was sent: read the answer
      self.answers[_status(_read_some(sock))] += 1
      sock.close()
      return None
    sock.setblocking(False)
    return sock


def _read_some(sock: socket.socket) -> bytes:
  sock.settimeout(1)
  try:
    return sock.recv(65536)
  except OSError:
    return b""


def costly_request(kind: str, host: str, port: int, limits: dict, body: bytes) -> str:
  """One costly request of ``kind``: its status."""
  conn = http.client.HTTPConnection(host, port, timeout=limits["request_timeout"] + 30)
  try:
    conn.request("POST", COSTLY_PATHS[kind], body, {"Content-Type": "application/json"})
    reply = conn.getresponse()
    reply.read()
    return str(reply.status)
  finally:
    conn.close()


def run_load(
  url: str,
  *,
  clients: int,
  hostile: int,
  seconds: float,
  items: int,
  limits: dict,
  costly: int = 0,
  hog: Hog | None = None,
) -> dict:
  """``clients`` threads against the server at ``url`` for ``seconds``, ``hostile`` of them hostile
  (taking turns at :data:`HOSTILE_KINDS`) and ``costly`` of them sending costly requests (at
  :data:`COSTLY_KINDS`), beside ``hog`` if given; what each got. ``limits`` are the server's
  ``request_timeout`` and ``max_request_bytes``."""
  host, port = url.removeprefix("http://").rsplit(":", 1)
  port = int(port)
  stop = threading.Event()
  lock = threading.Lock()
  latencies: list[float] = []
  honest_errors: collections.Counter = collections.Counter()
  answers: dict[str, collections.Counter] = {k: collections.Counter() for k in HOSTILE_KINDS}
  costly_answers: dict[str, collections.Counter] = {k: collections.Counter() for k in COSTLY_KINDS}
  costly_latencies: list[float] = []
  bodies = {k: costly_body(k, limits["max_request_bytes"]) for k in COSTLY_KINDS} if costly else {}

  def honest(c: int) -> None:
    conn, n = None, 0
    while not stop.is_set():
      body = honest_body(c * 1000 + n, items)
      n += 1
      start = time.monotonic()
      try:
        conn = conn or http.client.HTTPConnection(host, port, timeout=limits["request_timeout"] + 30)
        conn.request("POST", "/score", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        status, data = reply.status, reply.read()
        ok = status == 200 and len(json.loads(data)["rewards"]) == items
        if reply.will_close:
          conn.close()
          conn = None
      except (OSError, http.client.HTTPException) as e:
        status, ok = type(e).__name__, False
        conn = None
      seconds = time.monotonic() - start
      with lock:
        latencies.append(seconds)
        if not ok:
          honest_errors[str(status)] += 1

  def hostile_loop(c: int) -> None:
    n = 0
    while not stop.is_set():
      kind = HOSTILE_KINDS[(c + n) % len(HOSTILE_KINDS)]
      try:
        status = hostile_request(kind, n, host, port, limits, stop)
      except OSError as e:
        status = type(e).__name__
      n += 1
      with lock:
        answers[kind][status] += 1

  def costly_loop(c: int) -> None:
    n = 0
    while not stop.is_set():
      kind = COSTLY_KINDS[(c + n) % len(COSTLY_KINDS)]
      start = time.monotonic()
      try:
        status = costly_request(kind, host, port, limits, bodies[kind])
      except (OSError, http.client.HTTPException) as e:
        status = type(e).__name__
      n += 1
      with lock:
        costly_answers[kind][status] += 1
        costly_latencies.append(time.monotonic() - start)

  def role(c: int):
    if c < hostile:
      return hostile_loop
    return costly_loop if c < hostile + costly else honest

  threads = [threading.Thread(target=role(c), args=(c,), daemon=True) for c in range(clients)]
  if hog is not None:
    threads.append(threading.Thread(target=hog.run, args=(stop,), daemon=True))
  start = time.monotonic()
  for t in threads:
    t.start()
  time.sleep(seconds)
  stop.set()
  for t in threads:
    t.join(timeout=limits["request_timeout"] + 60)
  return {
    "clients": clients,
    "hostile_clients": hostile,
    "seconds": time.monotonic() - start,
    "honest": {
      "requests": len(latencies),
      "errors": sum(honest_errors.values()),
      "errors_by_status": dict(honest_errors),
      "p50_s": percentile(latencies, 0.50),
      "p99_s": percentile(latencies, 0.99),
      "max_s": max(latencies, default=float("nan")),
      "request_timeout_s": limits["request_timeout"],
    },
    "hostile": {k: dict(v) for k, v in answers.items()},
    **(
      {
        "costly_clients": costly,
        "costly": {k: dict(v) for k, v in costly_answers.items()},
        "costly_p50_s": percentile(costly_latencies, 0.50),
        "costly_max_s": max(costly_latencies, default=float("nan")),
      }
      if costly
      else {}
    ),
    **(
      {
        "hog": {
          "connections": hog.connections,
          "bodies": hog.bodies,
          "held_most": hog.held_most,
          "answers": dict(hog.answers),
        }
      }
      if hog is not None
      else {}
    ),
    "machine": machine(),
  }


def machine() -> dict:
  model = platform.processor()
  try:
    with open("/proc/cpuinfo") as f:
      model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
  except OSError:
    pass
  return {
    "cpu": model,
    "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
  }


def start_server(args) -> tuple[subprocess.Popen, str]:
  command = [
    sys.executable,
    "-m",
    "jaxrm.serve",
    f"--model={args.model}",
    "--port=0",
    f"--max_length={args.max_length}",
    f"--request_timeout={args.request_timeout}",
    f"--max_request_bytes={args.max_request_bytes}",
    f"--max_pending_bytes={4 * args.max_request_bytes}",
    f"--batch_size={args.batch_size}",
  ]
  server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
  for line in server.stdout:
    found = re.search(r" on (http://\S+) ", line)
    if found:
      url = found.group(1)
      break
  else:
    raise SystemExit(f"the server exited ({server.wait()}) before it served")
  threading.Thread(target=server.stdout.read, daemon=True).start()
  deadline = time.monotonic() + 900
  while time.monotonic() < deadline:
    try:
      with urllib.request.urlopen(url + "/health", timeout=5) as reply:
        if json.loads(reply.read())["status"] == "ok":
          return server, url
    except OSError:
      pass
    time.sleep(1)
  server.terminate()
  raise SystemExit("the server did not get ready within 900 s")


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="embedded:SmolLM2-135M-Instruct", help="What jaxrm.serve loads.")
  p.add_argument("--url", default=None, help="a server already running, instead of starting one")
  p.add_argument("--clients", type=int, default=64)
  p.add_argument("--hostile", type=int, default=16, help="how many of the clients are hostile")
  p.add_argument("--costly", type=int, default=0, help="how many of the clients send costly requests")
  p.add_argument("--hog", action="store_true", help="add one client holding connections and bodies")
  p.add_argument("--hog_connections", type=int, default=1100)
  p.add_argument("--hog_bodies", type=int, default=4)
  p.add_argument("--seconds", type=float, default=60.0)
  p.add_argument("--items", type=int, default=4, help="chat pairs per honest request")
  p.add_argument("--max_length", type=int, default=256)
  p.add_argument("--batch_size", type=int, default=16)
  p.add_argument("--request_timeout", type=float, default=60.0)
  p.add_argument("--max_request_bytes", type=int, default=2**20)
  p.add_argument("--json", default=None, help="write the result here")
  return p.parse_args(argv)


def main(argv=None) -> None:
  args = parse_args(argv)
  server, url = (None, args.url) if args.url else start_server(args)
  try:
    limits = {"request_timeout": args.request_timeout, "max_request_bytes": args.max_request_bytes}
    host, port = url.removeprefix("http://").rsplit(":", 1)
    hog = Hog(host, int(port), limits, args.hog_connections, args.hog_bodies) if args.hog else None
    result = run_load(
      url,
      clients=args.clients,
      hostile=args.hostile,
      seconds=args.seconds,
      items=args.items,
      limits=limits,
      costly=args.costly,
      hog=hog,
    )
  finally:
    if server is not None:
      server.terminate()
      server.wait(timeout=60)
  result["command"] = " ".join(
    ["python", "scripts/load_server.py", *(argv if argv is not None else sys.argv[1:])]
  )
  print(json.dumps(result, indent=2))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
