"""The ASGI app (Starlette) and the server that runs it (uvicorn) beside the scoring worker."""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxrm import tasks
from jaxrm.data.tokenize import pad_id
from jaxrm.errors import ConfigError
from jaxrm.models.heads import correct_probability
from jaxrm.scoring import kinds, reward_health, shared_prefix
from jaxrm.server.batcher import Batcher, PackedFn, QueueFull, ScoreFn
from jaxrm.server.bodies import RETRY_AFTER, Encoder, RequestError, parse_json, timed_out
from jaxrm.server.config import ServerConfig
from jaxrm.server.formats import COUNTERS, ROUTES
from jaxrm.server.limits import CLIENT, HeldBody, PendingBytes
from jaxrm.server.metrics import CONTENT_TYPE, Metrics
from jaxrm.server.tokenizing import Tokenizers
from jaxrm.tasks.routes import Meta, Scoring

log = logging.getLogger("jaxrm.server")

ENDPOINTS = "GET /health, GET /metrics, " + ", ".join(f"POST {path}" for path in ROUTES)
CLOSE = {"Connection": "close"}
REQUEST_ID = "X-Request-ID"
CLIENT_GONE = 499  # nginx's status for a client that closed its connection before the answer
DEFAULT_CONFIG = ServerConfig()
# Requests parsed at once, each in a thread of its own; their items share the tokenizers fairly.
PARSING_THREADS = 64


def score_fn(rm, normalize: bool, combine: str | None = None) -> ScoreFn:
  """``(ids [B, T], mask [B, T]) -> rewards [B]``: the model's one scoring call; a regression
  model's outputs [B, A] are combined by ``combine`` (see ``RewardModel.score``). A process
  model's: P(step correct) [B, T] at every token, read at the step labels by the endpoint."""
  if tasks.scores_of(rm.kind) == "steps":
    return lambda ids, mask: correct_probability(rm.score_tokens(ids, mask))
  weights = None if combine is None else rm.combination(combine)
  return lambda ids, mask: rm.reduce(rm.score_tokens(ids, mask), combine=weights, normalize=normalize)


def packed_fn(rm, normalize: bool, combine: str | None = None) -> PackedFn:
  """``SharedRows -> rewards [N]``: :func:`score_fn` for rows packed with a shared prefix (a
  process model's: each row's P(step correct) [T_i] at every token)."""
  if tasks.scores_of(rm.kind) == "steps":
    return lambda shared: [correct_probability(logits) for logits in rm.score_shared(shared)]
  weights = None if combine is None else rm.combination(combine)
  return lambda shared: rm.reduce(rm.score_shared(shared), combine=weights, normalize=normalize)


def batcher(rm, config: ServerConfig, metrics: Metrics) -> Batcher:
  """The scoring worker of ``rm`` for a resolved ``config``."""
  sharing = shared_prefix.Sharing()
  return Batcher(
    score_fn(rm, config.normalize, config.combine),
    config,
    pad_id(rm.tokenizer, rm.config.pad_token_id),
    metrics,
    packed_fn=packed_fn(rm, config.normalize, config.combine),
    group_fn=lambda rows: shared_prefix.scoring_groups(rows, sharing, rm.config, config.batch_tokens),
    packed_buckets=config.packed_buckets(sharing),
  )


def check_model(rm, config: ServerConfig) -> None:
  kind = kinds.check_kind(
    rm,
    *tasks.scoring("reward", "attributes", "steps", "comparisons"),
    use="the server",
    one_reward=True,
    combine=config.combine,
    combine_hint="--combine",
    error=ConfigError,
  )
  instead = tasks.named(kind).route_instead if kind in tasks.TASKS else None
  if instead is not None and (config.combine is not None or config.normalize):
    raise ConfigError(
      f"--{'combine' if config.combine is not None else 'normalize'} applies to rewards scored one "
      f"per response, and this server's model is {instead}"
    )
  if tasks.scores_of(kind) == "steps" and (config.combine is not None or config.normalize):
    raise ConfigError(
      f"--{'combine' if config.combine is not None else 'normalize'} applies to sequence rewards; "
      "a process reward model's rewards are step probabilities, made one per solution by "
      "--step_aggregation"
    )
  if config.combine is not None:
    try:
      rm.combination(config.combine)
    except ValueError as e:
      raise ConfigError(f"--combine={config.combine!r}: {e}") from None
  if rm.tokenizer is None:
    raise ConfigError("the model has no tokenizer, and the server scores text; load it with tokenizer=")
  if config.normalize and not rm.reward_stats:
    raise ConfigError(
      "normalizing needs the reward mean/std recorded at validation, and this model has "
      "none: serve a training output directory (or an export of one) whose run validated"
    )


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
  return JSONResponse({"error": message}, status_code=status, headers=headers)


class ClientGone(Exception):
  """The client closed its connection while its request was tokenized or scored."""


def _too_large(limit: int) -> RequestError:
  return RequestError(
    413,
    f"the body is over {limit} bytes, the most this server takes (--max_request_bytes): "
    "send fewer items per request",
    CLOSE,
  )


def _too_many(limit: int) -> RequestError:
  return RequestError(
    503,
    f"the server holds {limit} bytes of request bodies waiting to be tokenized, its most "
    "(--max_pending_bytes): retry after the Retry-After seconds",
    {**RETRY_AFTER, **CLOSE},
  )


def _client_too_many(limit: int) -> RequestError:
  return RequestError(
    429,
    f"this client holds {limit} bytes of request bodies waiting to be tokenized, its share "
    "(--max_client_pending_bytes): retry after the Retry-After seconds",
    {**RETRY_AFTER, **CLOSE},
  )


def _client(request: Request, config: ServerConfig) -> tuple[str, str]:
  """Whose share a request's bytes count in: its peer address, and the API key it sends where the
  server has keys (without, any header would do, and a client could take share after share)."""
  key = request.headers.get("authorization", "") if config.api_key is not None else ""
  return (request.client.host if request.client else "", key)


def _declared_size(request: Request, config: ServerConfig) -> None:
  """Refuses a Content-Length that is not a number, or over max_request_bytes. It holds nothing
  in max_pending_bytes: the bytes count as they arrive, so headers alone hold none."""
  size = request.headers.get("content-length")
  if size is None:
    return
  if not size.isdigit():
    raise RequestError(400, f"Content-Length {size!r} is not a number of bytes", CLOSE)
  if int(size) > config.max_request_bytes:
    raise _too_large(config.max_request_bytes)


async def _read_body(request: Request, held: HeldBody, config: ServerConfig, deadline: float) -> bytes:
  """The body, within max_request_bytes, max_pending_bytes (``held`` counts each chunk as it
  arrives) and body_timeout seconds, before ``deadline`` (the request's); past any, the connection
  closes (its unread rest must not be taken for the next request)."""
  _declared_size(request, config)
  body_deadline = min(asyncio.get_running_loop().time() + config.body_timeout, deadline)
  chunks, n = [], 0
  try:
    async with asyncio.timeout_at(body_deadline):
      async for chunk in request.stream():
        n += len(chunk)
        if n > config.max_request_bytes:
          raise _too_large(config.max_request_bytes)
        refused = held.take(len(chunk))
        if refused == CLIENT:
          raise _client_too_many(config.client_pending_bytes)
        if refused:
          raise _too_many(config.max_pending_bytes)
        chunks.append(chunk)
  except TimeoutError:
    if body_deadline == deadline:
      raise timed_out(config.request_timeout, CLOSE) from None
    raise RequestError(
      408, f"the body took more than {config.body_timeout:g} s to arrive (--body_timeout)", CLOSE
    ) from None
  return b"".join(chunks)


async def _disconnected(request: Request) -> None:
  """Returns when the client closes its connection. Called once the body is read: uvicorn's
  receive() then waits until the connection closes (or the answer is sent)."""
  while (await request.receive())["type"] != "http.disconnect":
    pass


def _retrieved(task: asyncio.Future) -> None:
  if not task.cancelled():
    task.exception()  # marks it seen: asyncio logs an exception never retrieved


def _with_request_id(app: Callable) -> Callable:
  """ASGI middleware: every request gets an id (``request.state.request_id``) that its answer
  carries in an X-Request-ID header, and the log names when something fails."""

  async def asgi(scope, receive, send):
    if scope["type"] != "http":
      return await app(scope, receive, send)
    request_id = uuid.uuid4().hex
    scope.setdefault("state", {})["request_id"] = request_id

    async def send_with_id(message):
      if message["type"] == "http.response.start":
        message["headers"] = [*message.get("headers", []), (REQUEST_ID.lower().encode(), request_id.encode())]
      await send(message)

    return await app(scope, receive, send_with_id)

  return asgi


class App:
  """The endpoints. A scoring request is read, then tokenized (in a worker thread, its items sharing
  the tokenizers with other requests': :mod:`jaxrm.server.tokenizing`), then scored by the batcher,
  all within its request_timeout."""

  def __init__(self, rm, config: ServerConfig, batcher: Batcher, metrics: Metrics, model_name: str):
    self.config = config
    self.batcher = batcher
    self.metrics = metrics
    self.model_name = model_name
    self.encoder = Encoder(rm, config)
    self.pending = PendingBytes(config.max_pending_bytes, metrics.pending, config.client_pending_bytes)
    self.tokenizers = Tokenizers(rm, config.tokenizers, config.max_tokenize_chars, config.request_timeout)
    self._tokenizing = anyio.CapacityLimiter(PARSING_THREADS)

  def asgi(self) -> Callable:
    routes = [
      Route("/health", self.health, methods=["GET"]),
      Route("/metrics", self.metrics_text, methods=["GET"]),
    ]
    routes += [Route(path, self._scoring(path, parse), methods=["POST"]) for path, parse in ROUTES.items()]
    return _with_request_id(Starlette(routes=routes, exception_handlers={HTTPException: self._http_error}))

  async def health(self, request: Request) -> Response:
    """The status; a request bearing the API key also learns the model's name (without a key
    configured, no request does: /health is for probes, and needs no key)."""
    if self.batcher.failed:
      status, code, headers = "failed", 500, None  # the log says why
    elif not self.batcher.ready.is_set():
      status, code, headers = "starting", 503, RETRY_AFTER
    else:
      status, code, headers = "ok", 200, None
    body = {"status": status}
    if self.config.api_key is not None and self._authorized(request):
      body["model"] = self.model_name
    return JSONResponse(body, status_code=code, headers=headers)

  async def metrics_text(self, request: Request) -> Response:
    try:
      self._authorize(request)
    except RequestError as e:
      return _error(e.status, str(e), e.headers)
    return Response(self.metrics.text(), media_type=CONTENT_TYPE)

  def _scoring(self, path: str, parse: Callable) -> Callable:
    async def endpoint(request: Request) -> Response:
      start = time.perf_counter()
      try:
        response = JSONResponse(await self._answer(request, parse))
      except RequestError as e:
        response = _error(e.status, str(e), e.headers)
      except ClientDisconnect:
        response = _error(400, "the client closed the connection before sending the whole body")
      except ClientGone:
        response = _error(CLIENT_GONE, "the client closed the connection before its answer")
      except Exception:  # pylint: disable=broad-except  # a server answers, whatever happened
        request_id = request.state.request_id
        log.exception("request %s to %s failed", request_id, path)
        response = _error(
          500, f"internal error; the server's log has its cause under request id {request_id}"
        )
      seconds = time.perf_counter() - start
      self.metrics.request(path, response.status_code, seconds)
      if self.config.access_log:
        client = request.client.host if request.client else "-"
        log.info(
          "%s POST %s %d %.3f s request %s",
          client,
          path,
          response.status_code,
          seconds,
          request.state.request_id,
        )
      return response

    return endpoint

  async def _answer(self, request: Request, parse: Callable):
    """The answer's JSON; reading, tokenizing and scoring all end by the request's deadline."""
    deadline = asyncio.get_running_loop().time() + self.config.request_timeout
    # The same instant on the tokenizing thread's clock: it stops there, between two items.
    until, gave_up = time.monotonic() + self.config.request_timeout, self._gave_up(request)
    encoder = self.encoder.for_request(until, gave_up)
    encoder.rm = self.tokenizers.for_request(until, gave_up)
    self._check_scoring(request)
    held = HeldBody(self.pending, _client(request, self.config))
    try:
      raw = await _read_body(request, held, self.config, deadline)
      work = asyncio.ensure_future(
        self._tokenized_and_scored(raw, parse, held, encoder, request.state.request_id)
      )
      return await self._until_answered(request, work, deadline)
    finally:
      held.abandon()  # a no-op once the tokenizer has the body: it gives the bytes back itself
      request.state.answered = True  # a tokenizer still at it stops before its next item

  @staticmethod
  def _gave_up(request: Request) -> Callable[[], bool]:
    return lambda: getattr(request.state, "answered", False)

  def _check_scoring(self, request: Request) -> None:
    self._authorize(request)
    # A browser posts text/plain or form bodies to any address without asking (a "simple"
    # request); application/json it must ask for first, which this server never grants.
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
      raise RequestError(
        415,
        f"the body's Content-Type is {media or 'not given'}; send it as application/json "
        "(curl: -H 'Content-Type: application/json')",
      )
    if self.batcher.failed:
      raise RequestError(
        500,
        "the server could not compile its batch shapes, and scores nothing; its log says "
        f"why (request id {request.state.request_id})",
      )
    if not self.batcher.ready.is_set():
      raise RequestError(
        503,
        "the server is still compiling its batch shapes; retry shortly (GET /health "
        'says "ok" once it is ready)',
        RETRY_AFTER,
      )

  async def _until_answered(self, request: Request, work: asyncio.Future, deadline: float):
    """``work``'s result, unless the deadline passes (504) or the client leaves first; either way
    the work is cancelled, which gives up its place in the tokenizer or the scoring queue."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
      timeout = max(0.0, deadline - asyncio.get_running_loop().time())
      done, _ = await asyncio.wait({work, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
      if work in done:
        return work.result()
      if gone in done:
        raise ClientGone()
      raise timed_out(self.config.request_timeout)
    finally:
      for task in (work, gone):
        task.cancel()
        # Either may have failed just as the other ended: its error is not an answer any more.
        task.add_done_callback(_retrieved)

  async def _tokenized_and_scored(
    self, raw: bytes, parse: Callable, held: HeldBody, encoder: Encoder, request_id: str
  ):
    scoring = await anyio.to_thread.run_sync(
      lambda: self._tokenized(raw, parse, held, encoder), limiter=self._tokenizing
    )
    rewards = await self._scored(scoring.rows, request_id) if scoring.rows else []
    self.metrics.count(scoring.counts)
    # Outputs that are no rewards (a judge's log-odds) leave the reward's health alone.
    health = self.metrics.scored(rewards, scoring.rows, scoring.truncated) if scoring.reward_rows else {}
    return scoring.write(rewards, Meta(request_id, self.model_name, int(time.time()), health))

  def _tokenized(self, raw: bytes, parse: Callable, held: HeldBody, encoder: Encoder) -> Scoring | None:
    """In the tokenizing thread; None if the request gave up before its turn came (its work is
    cancelled then, so None is never read)."""
    if not held.claim():
      return None
    try:
      encoder.check_time()
      return parse(encoder, parse_json(raw))
    finally:
      held.release()

  async def _scored(self, rows: list[list[int]], request_id: str) -> list[float]:
    tokens, limit = sum(map(len, rows)), self.config.max_queued_tokens
    if tokens > limit:
      raise RequestError(
        413,
        f"the request has {tokens} tokens; this server queues at most {limit} "
        "(--max_queued_tokens): split the request",
      )
    try:
      job = self.batcher.submit(rows, request_id)
    except QueueFull as e:
      raise RequestError(503, str(e), RETRY_AFTER) from None
    try:
      return await job.future
    finally:
      self.batcher.give_up(job)  # a no-op once answered; else its rows are not scored

  def _authorized(self, request: Request) -> bool:
    key = self.config.api_key
    sent = request.headers.get("authorization", "")
    return key is None or hmac.compare_digest(sent.encode(), f"Bearer {key}".encode())

  def _authorize(self, request: Request) -> None:
    if not self._authorized(request):
      raise RequestError(
        401,
        "this server needs an 'Authorization: Bearer <api key>' header with its key",
        {"WWW-Authenticate": "Bearer"},
      )

  async def _http_error(self, request: Request, e: HTTPException) -> Response:
    if e.status_code == 404:
      return _error(404, f"no endpoint {request.url.path}; this server has {ENDPOINTS}")
    if e.status_code == 405:
      return _error(405, f"{request.url.path} takes {e.headers.get('Allow', 'another method')}", e.headers)
    return _error(e.status_code, str(e.detail), e.headers)


def _refusal(status: str, message: str) -> bytes:
  body = json.dumps({"error": message}).encode()
  head = (
    f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
    f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
  )
  return head.encode() + body


def _protocol(config: ServerConfig) -> type[H11Protocol]:
  """uvicorn's HTTP/1.1 protocol: a new connection past ``max_connections`` closes an idle one
  (waiting for a request's headers) of the peer holding the most idle ones, or is refused with a
  JSON 503 if none is idle; one past its peer's share (``max_client_connections``) is refused
  with a JSON 429. A connection whose request headers take longer than ``header_timeout`` seconds
  from its opening or its previous answer is dropped (uvicorn would wait forever)."""
  header_timeout, most, share = config.header_timeout, config.max_connections, config.client_connections
  busy = _refusal(
    "503 Service Unavailable",
    f"the server has {most} open connections, none of them idle, its most (--max_connections): "
    "retry after the Retry-After seconds",
  )
  peers: dict[str, set] = {}  # each peer address's open connections

  class Protocol(H11Protocol):
    _header_timer: asyncio.TimerHandle | None = None
    _refused = False
    _idle_since = 0.0
    _peer = ""

    def connection_made(self, transport):
      super().connection_made(transport)
      peer = transport.get_extra_info("peername")
      self._peer = peer[0] if peer else ""
      mine = peers.setdefault(self._peer, set())
      over_share = len(mine) >= share
      if len(self.connections) > most and (over_share or not self._close_an_idle_one()):
        self._refuse(transport, busy)
        return
      if over_share:
        self._refuse(transport, _refusal("429 Too Many Requests", _over_share(self._peer, share)))
        return
      mine.add(self)
      self._arm()

    def _close_an_idle_one(self) -> bool:
      """Closes the connection idle longest of the peer holding the most idle ones, if any is
      idle (waiting for a request's headers)."""
      idle = [c for c in self.connections if c is not self and c._header_timer is not None]
      if not idle:
        return False
      counts = collections.Counter(c._peer for c in idle)
      victim = min(idle, key=lambda c: (-counts[c._peer], c._idle_since))
      victim._forget()
      victim.transport.close()
      return True

    def _forget(self):
      self.connections.discard(self)
      mine = peers.get(self._peer)
      if mine is not None:
        mine.discard(self)
        if not mine:
          del peers[self._peer]

    def _refuse(self, transport, reply: bytes):
      # Answer, then read and drop what the client sends until it closes (or header_timeout):
      # closing with its request unread would reset the connection, and the answer with it.
      self._refused = True
      self.connections.discard(self)
      if not peers.get(self._peer):
        peers.pop(self._peer, None)
      transport.write(reply)
      transport.write_eof()
      self._header_timer = self.loop.call_later(header_timeout, self._drop)

    def data_received(self, data):
      if not self._refused:
        super().data_received(data)

    def on_response_complete(self):
      self._arm()  # before: the next, pipelined, request may be handled in there
      super().on_response_complete()

    def handle_events(self):
      cycle = self.cycle
      super().handle_events()
      if self.cycle is not cycle:  # a request's headers arrived
        self._disarm()

    def connection_lost(self, exc):
      self._disarm()
      if not self._refused:
        self._forget()
      super().connection_lost(exc)

    def _arm(self):
      self._disarm()
      if not self.transport.is_closing():
        self._idle_since = self.loop.time()
        self._header_timer = self.loop.call_later(header_timeout, self._drop)

    def _disarm(self):
      if self._header_timer is not None:
        self._header_timer.cancel()
        self._header_timer = None

    def _drop(self):
      self._header_timer = None
      if not self.transport.is_closing():
        self.transport.close()

  return Protocol


def _over_share(peer: str, share: int) -> str:
  return (
    f"the server holds {share} open connections of {peer}, its share (--max_client_connections): "
    "close idle ones, or retry after the Retry-After seconds"
  )


class RewardServer:
  """An HTTP server scoring with a sequence-head RewardModel (or ranking with a pairwise judge's,
  on /compare), bound on construction.

  ``serve_forever()`` runs it in this thread, ``start()`` in another (``shutdown()`` stops it).
  ``port=0`` picks a free port: read ``url``.
  """

  def __init__(
    self,
    rm,
    config: ServerConfig = DEFAULT_CONFIG,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    model_name: str = "",
  ):
    check_model(rm, config)
    self.config = config.resolved(rm.config.max_position_embeddings, rm.training_max_length)
    self.metrics = Metrics(reward_health.validation_range(rm, normalize=self.config.normalize), COUNTERS)
    self.batcher = batcher(rm, self.config, self.metrics)
    app = App(rm, self.config, self.batcher, self.metrics, model_name).asgi()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    self._socket = socket.create_server((host, port), family=family, backlog=2048)
    self._uvicorn = uvicorn.Server(
      uvicorn.Config(
        app,
        http=_protocol(self.config),
        ws="none",
        lifespan="off",
        log_config=None,
        access_log=False,
        timeout_keep_alive=self.config.keep_alive,
      )
    )
    self._thread: threading.Thread | None = None

  @property
  def address(self) -> tuple[str, int]:
    return self._socket.getsockname()[:2]

  @property
  def url(self) -> str:
    host, port = self.address
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

  def serve_forever(self) -> None:
    """Compiles the batch shapes in the scoring worker and answers requests meanwhile (``/health``
    says "starting" until the worker is ready, its covering shapes compiled; see
    ``ServerConfig.warm_up``)."""
    self.batcher.start()
    try:
      self._uvicorn.run(sockets=[self._socket])
    finally:
      self.batcher.stop()
      self._socket.close()

  def start(self) -> RewardServer:
    self._thread = threading.Thread(target=self.serve_forever, name="jaxrm-server", daemon=True)
    self._thread.start()
    return self

  def wait_ready(self, timeout: float = 600, *, all_shapes: bool = False) -> None:
    """Blocks until the server is ready, its covering batch shapes compiled (every one with
    ``warm_up="all"``), or raises why it could not be. ``all_shapes``: until every batch shape is
    compiled, those compiled after ready too."""
    deadline = time.monotonic() + timeout
    event = self.batcher.all_compiled if all_shapes else self.batcher.ready
    while not event.wait(0.05):
      if self.batcher.failed or time.monotonic() > deadline:
        raise RuntimeError(f"the server did not get ready: {self.batcher.failed or 'timed out'}")

  def shutdown(self) -> None:
    """Stops the server, started or never started, and lets go of its port."""
    self._uvicorn.should_exit = True
    if self._thread is not None:
      self._thread.join(timeout=60)
    self._socket.close()


def make_server(
  rm,
  host: str = "127.0.0.1",
  port: int = 8000,
  *,
  config: ServerConfig = DEFAULT_CONFIG,
  model_name: str = "",
) -> RewardServer:
  """A :class:`RewardServer` scoring with ``rm``; call ``serve_forever()`` or ``start()``."""
  return RewardServer(rm, config, host, port, model_name=model_name)
