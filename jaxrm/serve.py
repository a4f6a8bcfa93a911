r"""Serves a reward model over HTTP.

  python -m jaxrm.serve --model=runs/rm [--host=127.0.0.1] [--port=8000]

Endpoints (JSON in and out):

* ``POST /get_reward`` -- OpenRLHF's remote reward model: ``{"query": [text, ...]}`` ->
  ``{"rewards": [float, ...]}``. Each text is a whole prompt + response, scored as it is (without
  the chat template; OpenRLHF sends texts it already rendered). Other keys (``prompts``,
  ``labels``) are ignored. Point OpenRLHF at it with ``--remote_rm_url http://HOST:PORT/get_reward``.
* ``POST /score`` -- conversations: ``{"conversations": [[{"role", "content"}, ...], ...]}`` ->
  ``{"rewards": [float, ...]}``, each rendered with the model's chat template.
* ``GET /health`` -- ``{"status": "ok", "model": ...}``.

Bodies larger than ``--max_request_bytes`` get 413; more than ``--max_batch`` items, or a malformed
body get 400; every error is ``{"error": message}``. A conversation longer than ``--max_length``
tokens loses its oldest turns, as in training; a text (or a last message) that alone is longer gets
400. ``--normalize`` returns ``(reward - mean) / std`` with the statistics recorded at validation.
The server binds 127.0.0.1 unless told otherwise, and has no authentication. Requests are
answered concurrently but scored one batch at a time.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import jinja2

from jaxrm import cli
from jaxrm.data.formats import kind, validate_messages
from jaxrm.errors import ConfigError, DataError

log = logging.getLogger("jaxrm.serve")


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one request may ask for.

  Attributes:
    max_batch: items (texts or conversations) per request.
    max_request_bytes: size of a request body.
    max_length: tokens per item; a longer conversation loses its oldest turns (as in training),
      a longer text or last message is refused. None: the model's max_position_embeddings.
  """

  max_batch: int = 256
  max_request_bytes: int = 16 * 2**20
  max_length: int | None = None

  def __post_init__(self):
    for name in ("max_batch", "max_request_bytes", "max_length"):
      value = getattr(self, name)
      if value is not None and value < 1:
        raise ConfigError(f"{name}={value}: must be at least 1 (--{name})")


class RequestError(Exception):
  """A request the server refuses, with the HTTP status to answer."""

  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status = status


class RewardService:
  """Checks request bodies and scores them with a RewardModel, one call at a time."""

  def __init__(self, rm, limits: Limits = Limits(), *, batch_size: int = 8, normalize: bool = False):
    if rm.config.head != "sequence" or rm.config.num_labels != 1:
      raise ConfigError("the server scores with one reward per sequence; this model has a "
                        f"{rm.config.head} head with {rm.config.num_labels} labels (a process reward model "
                        "scores steps: use rm.score_steps)")
    if rm.tokenizer is None:
      raise ConfigError("the model has no tokenizer, and the server scores text; load it with tokenizer=")
    if normalize and not rm.reward_stats:
      raise ConfigError("normalizing needs the reward mean/std recorded at validation, and this model has "
                        "none: serve a training output directory (or an export of one) whose run validated")
    self.rm = rm
    self.limits = limits
    self.batch_size = batch_size
    self.normalize = normalize
    # One batch at a time: concurrent forward passes would only compete for the same device memory.
    self._lock = threading.Lock()

  def get_reward(self, body: dict[str, Any]) -> dict[str, list[float]]:
    """OpenRLHF's ``{"query": [text, ...]}`` -> ``{"rewards": [...]}``."""
    texts = self._items(body, "query", "a list of strings (prompt + response texts)")
    for i, text in enumerate(texts):
      if not isinstance(text, str):
        raise RequestError(400, f"query[{i}] is {kind(text)}; expected a string")
    return {"rewards": self._score(texts, "query")}

  def score(self, body: dict[str, Any]) -> dict[str, list[float]]:
    """``{"conversations": [[message, ...], ...]}`` -> ``{"rewards": [...]}``."""
    conversations = self._items(body, "conversations", "a list of conversations (lists of "
                                "{\"role\", \"content\"} messages)")
    try:
      conversations = [validate_messages(c, "request", f"conversations[{i}]")
                       for i, c in enumerate(conversations)]
    except DataError as e:
      raise RequestError(400, str(e)) from None
    for i, c in enumerate(conversations):
      if not c:
        raise RequestError(400, f"conversations[{i}] has no messages")
    return {"rewards": self._score(conversations, "conversations")}

  def _items(self, body: dict[str, Any], key: str, expected: str) -> list:
    if key not in body:
      raise RequestError(400, f"the body has no '{key}'; send {{\"{key}\": {expected}}}")
    items = body[key]
    if not isinstance(items, list):
      raise RequestError(400, f"'{key}' is {kind(items)}; expected {expected}")
    if len(items) > self.limits.max_batch:
      raise RequestError(400, f"'{key}' has {len(items)} items; this server scores at most "
                         f"{self.limits.max_batch} per request (--max_batch): split the request")
    return items

  def _score(self, items: list, key: str) -> list[float]:
    if not items:
      return []
    with self._lock:
      try:
        rewards = self.rm.score(items, batch_size=self.batch_size, max_length=self.limits.max_length,
                                normalize=self.normalize)
      except (ValueError, jinja2.TemplateError) as e:  # an over-long or empty item, a template refusing it
        raise RequestError(400, f"cannot score the {key}: {e}") from None
    return [float(r) for r in rewards]


def _handler_class(service: RewardService, model_name: str) -> type[BaseHTTPRequestHandler]:
  """The request handler of one server, bound to its service."""
  routes: dict[str, Callable[[dict], dict]] = {"/get_reward": service.get_reward, "/score": service.score}

  class Handler(BaseHTTPRequestHandler):
    server_version = "jaxrm"

    def do_GET(self):  # noqa: N802 (the name http.server calls)
      if self.path == "/health":
        self._reply(200, {"status": "ok", "model": model_name})
      elif self.path in routes:
        self._reply(405, {"error": f"{self.path} takes POST"}, allow="POST")
      else:
        self._not_found()

    def do_POST(self):  # noqa: N802
      if self.path not in routes:
        self._not_found()
        return
      try:
        self._reply(200, routes[self.path](self._json_body()))
      except RequestError as e:
        self._reply(e.status, {"error": str(e)})
      except Exception as e:  # pylint: disable=broad-except  # a server answers, whatever happened
        log.exception("error while answering %s", self.path)
        self._reply(500, {"error": f"internal error: {type(e).__name__}: {e}"})

    def _json_body(self) -> dict[str, Any]:
      size = self.headers.get("Content-Length")
      if size is None:
        raise RequestError(411, "the request has no Content-Length header")
      if not size.isdigit():
        raise RequestError(400, f"Content-Length {size!r} is not a number of bytes")
      limit = service.limits.max_request_bytes
      if int(size) > limit:
        self.close_connection = True  # the unread body must not be taken for the next request
        raise RequestError(413, f"the body is {size} bytes; this server takes at most {limit} "
                           "(--max_request_bytes): send fewer items per request")
      raw = self.rfile.read(int(size))
      try:
        body = json.loads(raw)
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(400, f"the body is not valid JSON: {e}") from None
      if not isinstance(body, dict):
        raise RequestError(400, f"the body is {kind(body)}; expected a JSON object")
      return body

    def _not_found(self):
      known = ", ".join(["GET /health"] + [f"POST {p}" for p in routes])
      self._reply(404, {"error": f"no endpoint {self.path}; this server has {known}"})

    def _reply(self, status: int, payload: dict, **headers: str):
      data = json.dumps(payload).encode()
      self.send_response(status)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      for name, value in headers.items():
        self.send_header(name.capitalize(), value)
      self.end_headers()
      self.wfile.write(data)

    def log_message(self, format, *args):  # pylint: disable=redefined-builtin
      log.info("%s %s", self.address_string(), format % args)

  return Handler


def make_server(rm, host: str = "127.0.0.1", port: int = 8000, *, limits: Limits = Limits(),
                batch_size: int = 8, normalize: bool = False, model_name: str = "") -> ThreadingHTTPServer:
  """An HTTP server scoring with ``rm`` (a sequence-head RewardModel); call ``serve_forever()``.

  ``port=0`` picks a free port: read it from ``server.server_address``.
  """
  service = RewardService(rm, limits, batch_size=batch_size, normalize=normalize)
  server = ThreadingHTTPServer((host, port), _handler_class(service, model_name))
  server.daemon_threads = True
  return server


# ---------------------------------------------------------------------------------------------- CLI

def _define_flags() -> None:
  from absl import flags
  flags.DEFINE_string("model", None, "HF checkpoint dir, .gguf file, embedded:NAME, or a jaxrm run dir.",
                      required=True)
  flags.DEFINE_string("host", "127.0.0.1", "Address to bind; anything but loopback exposes the model to "
                      "the network, with no authentication.")
  flags.DEFINE_integer("port", 8000, "Port (0: any free port).")
  flags.DEFINE_integer("max_batch", Limits.max_batch, "Most texts or conversations per request.")
  flags.DEFINE_integer("max_request_bytes", Limits.max_request_bytes, "Largest request body, in bytes.")
  flags.DEFINE_integer("max_length", None, "Most tokens per item (default: the model's context length); "
                       "conversations lose their oldest turns to fit.")
  flags.DEFINE_bool("normalize", False, "Return (reward - mean) / std with the statistics recorded at "
                    "validation (models saved by training).")
  flags.DEFINE_integer("batch_size", 8, "Sequences per forward pass.")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
  flags.DEFINE_string("attention", "auto", "Attention implementation: auto (a fused kernel on GPU, the "
                      "reference path elsewhere) | reference | pallas | cudnn.")


def main() -> None:
  from absl import flags

  from jaxrm.reward_model import RewardModel

  cli.setup_logging(logging.INFO, timestamps=True)
  f = flags.FLAGS
  rm = RewardModel.from_pretrained(f.model, dtype=f.dtype, attention_impl=f.attention)
  limits = Limits(max_batch=f.max_batch, max_request_bytes=f.max_request_bytes, max_length=f.max_length)
  server = make_server(rm, f.host, f.port, limits=limits, batch_size=f.batch_size, normalize=f.normalize,
                       model_name=f.model)
  host, port = server.server_address[:2]
  if not ipaddress.ip_address(host).is_loopback:
    log.warning("listening on %s: anyone who can reach this address can use the model", host)
  print(f"jaxrm: serving {f.model} on http://{host}:{port} (POST /get_reward, POST /score, GET /health)",
        flush=True)
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()


if __name__ == "__main__":
  cli.run(main, define_flags=_define_flags)
