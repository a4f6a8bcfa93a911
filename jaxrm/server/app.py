"""The ASGI app (Starlette) and the server that runs it (uvicorn) beside the scoring worker."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
from typing import Callable

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxrm import kinds
from jaxrm.data.tokenize import pad_id
from jaxrm.errors import ConfigError
from jaxrm.server.batcher import Batcher, QueueFull, ScoreFn
from jaxrm.server.bodies import Encoder, RequestError, parse_json
from jaxrm.server.config import ServerConfig
from jaxrm.server.metrics import CONTENT_TYPE, Metrics

log = logging.getLogger("jaxrm.server")

SCORING = {"/get_reward": Encoder.get_reward, "/score": Encoder.score}
ENDPOINTS = "GET /health, GET /metrics, POST /get_reward, POST /score"
RETRY_AFTER = {"Retry-After": "1"}
DEFAULT_CONFIG = ServerConfig()


def score_fn(rm, normalize: bool, combine: str | None = None) -> ScoreFn:
  """``(ids [B, T], mask [B, T]) -> rewards [B]``: the model's one scoring call; a regression
  model's outputs [B, A] are combined by ``combine`` (see ``RewardModel.score``)."""
  weights = None if combine is None else rm.combination(combine)
  return lambda ids, mask: rm.reduce(rm.score_tokens(ids, mask), combine=weights, normalize=normalize)


def check_model(rm, config: ServerConfig) -> None:
  kinds.check_kind(rm, kinds.PREFERENCE, kinds.REGRESSION, use="the server", one_reward=True,
                   combine=config.combine, combine_hint="--combine", error=ConfigError)
  if config.combine is not None:
    try:
      rm.combination(config.combine)
    except ValueError as e:
      raise ConfigError(f"--combine={config.combine!r}: {e}") from None
  if rm.tokenizer is None:
    raise ConfigError("the model has no tokenizer, and the server scores text; load it with tokenizer=")
  if config.normalize and not rm.reward_stats:
    raise ConfigError("normalizing needs the reward mean/std recorded at validation, and this model has "
                      "none: serve a training output directory (or an export of one) whose run validated")


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
  return JSONResponse({"error": message}, status_code=status, headers=headers)


async def _read_body(request: Request, limit: int, timeout: float) -> bytes:
  """The body, within ``limit`` bytes and ``timeout`` seconds; past either, the connection closes
  (its unread rest must not be taken for the next request)."""
  close = {"Connection": "close"}
  size = request.headers.get("content-length")
  if size is not None and not size.isdigit():
    raise RequestError(400, f"Content-Length {size!r} is not a number of bytes", close)
  too_large = RequestError(413, f"the body is over {limit} bytes, the most this server takes "
                           "(--max_request_bytes): send fewer items per request", close)
  if size is not None and int(size) > limit:
    raise too_large
  chunks, n = [], 0
  try:
    async with asyncio.timeout(timeout):
      async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
          raise too_large
        chunks.append(chunk)
  except TimeoutError:
    raise RequestError(408, f"the body took more than {timeout:g} s to arrive (--body_timeout)", close) from None
  return b"".join(chunks)


class App:
  """The endpoints; scoring requests are checked and tokenized here, scored by the batcher."""

  def __init__(self, rm, config: ServerConfig, batcher: Batcher, metrics: Metrics, model_name: str):
    self.config = config
    self.batcher = batcher
    self.metrics = metrics
    self.model_name = model_name
    self.encoder = Encoder(rm, config)
    # The tokenizer runs in worker threads, one at a time: a fast tokenizer is not safe to share
    # across threads that may change its truncation settings.
    self._tokenizing = anyio.CapacityLimiter(1)

  def starlette(self) -> Starlette:
    routes = [Route("/health", self.health, methods=["GET"]), Route("/metrics", self.metrics_text, methods=["GET"])]
    routes += [Route(path, self._scoring(path, parse), methods=["POST"]) for path, parse in SCORING.items()]
    return Starlette(routes=routes, exception_handlers={HTTPException: self._http_error})

  async def health(self, request: Request) -> Response:
    if self.batcher.failed:
      return JSONResponse({"status": "failed", "error": self.batcher.failed}, status_code=500)
    if not self.batcher.ready.is_set():
      return JSONResponse({"status": "starting", "model": self.model_name}, status_code=503, headers=RETRY_AFTER)
    return JSONResponse({"status": "ok", "model": self.model_name})

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
        response = JSONResponse({"rewards": await self._rewards(request, parse)})
      except RequestError as e:
        response = _error(e.status, str(e), e.headers)
      except ClientDisconnect:
        response = _error(400, "the client closed the connection before sending the whole body")
      except Exception as e:  # pylint: disable=broad-except  # a server answers, whatever happened
        log.exception("error while answering %s", path)
        response = _error(500, f"internal error: {type(e).__name__}: {e}")
      self.metrics.request(path, response.status_code, time.perf_counter() - start)
      return response
    return endpoint

  async def _rewards(self, request: Request, parse: Callable) -> list[float]:
    self._authorize(request)
    if self.batcher.failed:
      raise RequestError(500, f"the server could not compile its batch shapes, and scores nothing: "
                         f"{self.batcher.failed}")
    if not self.batcher.ready.is_set():
      raise RequestError(503, "the server is still compiling its batch shapes; retry shortly (GET /health "
                         "says \"ok\" once it is ready)", RETRY_AFTER)
    raw = await _read_body(request, self.config.max_request_bytes, self.config.body_timeout)
    rows = await anyio.to_thread.run_sync(lambda: parse(self.encoder, parse_json(raw)),
                                          limiter=self._tokenizing)
    return await self._scored(rows) if rows else []

  async def _scored(self, rows: list[list[int]]) -> list[float]:
    tokens, limit = sum(map(len, rows)), self.config.max_queued_tokens
    if tokens > limit:
      raise RequestError(413, f"the request has {tokens} tokens; this server queues at most {limit} "
                         "(--max_queued_tokens): split the request")
    try:
      job = self.batcher.submit(rows)
    except QueueFull:
      raise RequestError(503, f"the server is busy: {limit} tokens are queued (--max_queued_tokens); "
                         "retry after the Retry-After seconds", RETRY_AFTER) from None
    try:
      return await asyncio.wait_for(job.future, self.config.request_timeout)
    except TimeoutError:
      raise RequestError(504, f"no rewards within {self.config.request_timeout:g} s (--request_timeout): "
                         "the server is overloaded; retry later, or send fewer items", RETRY_AFTER) from None
    finally:
      self.batcher.give_up(job)  # a no-op once answered; else its unscored rows are skipped

  def _authorize(self, request: Request) -> None:
    key = self.config.api_key
    if key is None:
      return
    sent = request.headers.get("authorization", "")
    if not hmac.compare_digest(sent.encode(), f"Bearer {key}".encode()):
      raise RequestError(401, "this server needs an 'Authorization: Bearer <api key>' header with its key",
                         {"WWW-Authenticate": "Bearer"})

  async def _http_error(self, request: Request, e: HTTPException) -> Response:
    if e.status_code == 404:
      return _error(404, f"no endpoint {request.url.path}; this server has {ENDPOINTS}")
    if e.status_code == 405:
      return _error(405, f"{request.url.path} takes {e.headers.get('Allow', 'another method')}", e.headers)
    return _error(e.status_code, str(e.detail), e.headers)


def _busy_reply(max_connections: int) -> bytes:
  body = json.dumps({"error": f"the server has {max_connections} open connections, its most "
                              "(--max_connections): retry after the Retry-After seconds"}).encode()
  head = ("HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
          f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n")
  return head.encode() + body


def _protocol(header_timeout: float, max_connections: int) -> type[H11Protocol]:
  """uvicorn's HTTP/1.1 protocol, refusing connections past ``max_connections`` with a JSON 503,
  and dropping a connection whose request headers take longer than ``header_timeout`` seconds
  from its opening or its previous answer (uvicorn would wait forever)."""
  busy = _busy_reply(max_connections)

  class Protocol(H11Protocol):
    _header_timer: asyncio.TimerHandle | None = None
    _refused = False

    def connection_made(self, transport):
      super().connection_made(transport)
      if len(self.connections) > max_connections:
        self._refuse(transport)
        return
      self._arm()

    def _refuse(self, transport):
      # Answer, then read and drop what the client sends until it closes (or header_timeout):
      # closing with its request unread would reset the connection, and the answer with it.
      self._refused = True
      self.connections.discard(self)
      transport.write(busy)
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
      super().connection_lost(exc)

    def _arm(self):
      self._disarm()
      if not self.transport.is_closing():
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


class RewardServer:
  """An HTTP server scoring with a sequence-head RewardModel, bound on construction.

  ``serve_forever()`` runs it in this thread, ``start()`` in another (``shutdown()`` stops it).
  ``port=0`` picks a free port: read ``url``.
  """

  def __init__(self, rm, config: ServerConfig = DEFAULT_CONFIG, host: str = "127.0.0.1", port: int = 8000, *,
               model_name: str = ""):
    check_model(rm, config)
    self.config = config.resolved(rm.config.max_position_embeddings, rm.training_max_length)
    self.metrics = Metrics()
    self.batcher = Batcher(score_fn(rm, self.config.normalize, self.config.combine), self.config,
                           pad_id(rm.tokenizer, rm.config.pad_token_id), self.metrics)
    app = App(rm, self.config, self.batcher, self.metrics, model_name).starlette()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    self._socket = socket.create_server((host, port), family=family, backlog=2048)
    self._uvicorn = uvicorn.Server(uvicorn.Config(
        app, http=_protocol(self.config.header_timeout, self.config.max_connections), ws="none",
        lifespan="off", log_config=None, access_log=False, timeout_keep_alive=self.config.keep_alive))
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
    says "starting" until the worker is ready)."""
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

  def wait_ready(self, timeout: float = 600) -> None:
    """Blocks until the batch shapes are compiled (or raises why they could not be)."""
    deadline = time.monotonic() + timeout
    while not self.batcher.ready.wait(0.05):
      if self.batcher.failed or time.monotonic() > deadline:
        raise RuntimeError(f"the server did not get ready: {self.batcher.failed or 'timed out'}")

  def shutdown(self) -> None:
    self._uvicorn.should_exit = True
    if self._thread is not None:
      self._thread.join(timeout=60)


def make_server(rm, host: str = "127.0.0.1", port: int = 8000, *, config: ServerConfig = DEFAULT_CONFIG,
                model_name: str = "") -> RewardServer:
  """A :class:`RewardServer` scoring with ``rm``; call ``serve_forever()`` or ``start()``."""
  return RewardServer(rm, config, host, port, model_name=model_name)
