r"""Serves a reward model over HTTP, batching concurrent requests together.

  python -m jaxrm.serve --model=runs/rm [--step=N] [--host=127.0.0.1] [--port=8000] [--api_key=...]

A training run is served at its best checkpoint unless ``--step`` names another; the step and why
it was taken are printed before the model loads, and the port is checked free before that.

Endpoints (JSON in and out; errors are ``{"error": message}`` with a 4xx/5xx status; every answer
carries an ``X-Request-ID`` header, which a 500's message names and the server's log records with
the cause):

* ``POST /get_reward`` -- OpenRLHF's remote reward model: ``{"query": [text, ...]}`` ->
  ``{"rewards": [float, ...]}``. Each text is a whole prompt + response, scored as sent (no chat
  template: OpenRLHF sends rendered texts); ``--openrlhf_text`` strips pad/eos and appends one eos,
  as OpenRLHF's own ``serve_rm`` does. ``prompts`` and ``labels`` are ignored.
* ``POST /score`` -- ``{"conversations": [[{"role", "content"}, ...], ...]}`` (each rendered with
  the chat template), or ``{"prompts": [...], "completions": [...]}`` (pairs joined as training
  joins them) -> ``{"rewards": [...]}``. A body with vLLM's score fields instead (``text_1`` and
  ``text_2``, or ``queries`` and ``documents``) is vLLM's score request, answered as vLLM does.
* ``POST /classify`` -- vLLM's ``{"input": ...}`` / ``{"messages": ...}`` -> its classification
  response; SGLang's ``{"text": ...}`` / ``{"input_ids": ...}`` -> ``{"embedding": [reward], ...}``.
* ``POST /pooling``, ``/v1/classify``, ``/v1/score`` -- vLLM's pooling, classification and score
  requests. vLLM's answers are sigmoid(reward) for a preference model, as vLLM's are, unless the
  request sends ``"use_activation": false``. See :mod:`jaxrm.server.formats`.
* ``POST /score_steps`` -- a process reward model's ``{"prompts": [...], "completions": [...]}``
  (each completion cut into steps at the model's step separator) or ``{"prompts", "steps": [[step,
  ...], ...]}`` -> ``{"step_rewards": [[P(step correct), ...], ...], "rewards": [...]}``, each
  reward the solution's step probabilities aggregated by ``--step_aggregation`` (min, last,
  product, mean; a request's ``"aggregation"`` overrides it). Such a model's ``/score`` answers
  those rewards; its other endpoints refuse it.
* ``POST /compare`` -- a pairwise judge (``reward.type=pairwise``) ranks one prompt's responses:
  ``{"prompt": text or messages, "responses": [text or messages, ...], "strategy": "round_robin" |
  "circular" | "reference", "aggregate": "bradley_terry" | "win_rate", "reference": text}`` ->
  ``{"rewards": [one per response], "log_odds": [[row i better than column j, or null]]}``, as
  ``RewardModel.score_groups`` gives them. A group of G costs G(G-1) judge texts under
  round_robin, 2G otherwise, counted against ``--max_batch``. A judge's other endpoints answer 400
  naming /compare; a reward model's /compare answers 400 naming /score.
* ``GET /health`` -- ``{"status": "ok"}``; 503 ``"starting"`` while the batch shapes needed first
  compile (``--warm_up``), 500 ``"failed"`` if they could not (the log says why). With
  ``--api_key``, a request bearing it also gets the model's name (``--served_model_name``).
* ``GET /metrics`` -- Prometheus text: requests, items, tokens, batch sizes, queue depth, bytes held,
  latency, batch shapes compiled, responses ranked and judge texts scored by /compare.

Limits and timeouts are flags (``--help``); see :class:`jaxrm.server.ServerConfig`. The server
binds 127.0.0.1 unless told otherwise; ``--api_key`` (or ``$JAXRM_API_KEY``) makes every endpoint
but /health ask for ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import ipaddress
import logging
import os

from jaxrm.run import host_memory

if __name__ == "__main__":  # first: glibc reads its tunables only when a process starts
  host_memory.restart_with_huge_pages()

from jaxrm import cli
from jaxrm.scoring import step_rewards
from jaxrm.server import ServerConfig, make_server
from jaxrm.server.app import ENDPOINTS

log = logging.getLogger("jaxrm.serve")

API_KEY_ENV = "JAXRM_API_KEY"
DEFAULTS = ServerConfig()


def _define_flags() -> None:
  from absl import flags

  d = DEFAULTS
  flags.DEFINE_string(
    "model", None, "HF checkpoint dir, .gguf file, embedded:NAME, or a jaxrm run dir.", required=True
  )
  flags.DEFINE_string(
    "host",
    "127.0.0.1",
    "Address to bind; anything but loopback exposes the model to the network: set --api_key.",
  )
  flags.DEFINE_integer("port", 8000, "Port (0: any free port).")
  flags.DEFINE_string(
    "api_key", None, f"Bearer token every endpoint but /health asks for (default: ${API_KEY_ENV})."
  )
  flags.DEFINE_string(
    "served_model_name",
    None,
    "The model's name in answers that name one (vLLM's \"model\", "
    "/health to a key holder; default: the last part of --model). The --model path itself "
    "is never sent.",
  )
  flags.DEFINE_integer("max_batch", d.max_batch, "Most texts, conversations or pairs per request.")
  flags.DEFINE_integer("max_request_bytes", d.max_request_bytes, "Largest request body, in bytes.")
  flags.DEFINE_integer(
    "max_messages", d.max_messages, "Most chat messages per request, all conversations together."
  )
  flags.DEFINE_integer(
    "max_pending_bytes",
    d.max_pending_bytes,
    "Bytes of request bodies being read or waiting "
    "to be tokenized, all requests together, before new requests get 503 + Retry-After.",
  )
  flags.DEFINE_integer(
    "max_client_pending_bytes",
    None,
    "One client's share of --max_pending_bytes (a peer address, with the API key it sends), "
    "before its new requests get 429 (default: half, and at least --max_request_bytes).",
  )
  flags.DEFINE_integer(
    "max_tokenize_chars",
    d.max_tokenize_chars,
    "Characters one request may have tokenized, each distinct text once (413 past them).",
  )
  flags.DEFINE_integer(
    "tokenizers",
    d.tokenizers,
    "Tokenizers at work at once, taking requests' items fairly; one keeps to short items.",
  )
  flags.DEFINE_integer(
    "max_length",
    None,
    "Most tokens per item (default: the training run's data.max_length, "
    "which a run and an export of it record; else 2048, or the model's context if "
    "shorter); conversations lose their oldest turns to fit.",
  )
  flags.DEFINE_integer("batch_size", d.batch_size, "Rows per forward pass.")
  flags.DEFINE_integer(
    "batch_tokens", None, "Padded tokens per forward pass (default: batch_size x max_length)."
  )
  flags.DEFINE_list("buckets", None, "Padded lengths (default: 64, 128, ... up to max_length).")
  flags.DEFINE_string(
    "warm_up",
    d.warm_up,
    "Batch shapes (rows x length) compiled before the server is ready: cover, the fewest that "
    "hold every other, the rest compiled in the background when no request waits (a batch is "
    "padded to a compiled shape holding it meanwhile: same rewards); all, every shape.",
  )
  flags.DEFINE_float("batch_wait_ms", d.batch_wait_ms, "How long to wait for more requests to join a batch.")
  flags.DEFINE_bool(
    "share_prefix",
    d.share_prefix,
    "Score rows that share a prefix of at least 64 tokens (a "
    "prompt's completions, in one request or several) together, the prefix once; the rewards "
    "are those of rows scored alone, up to float rounding.",
  )
  flags.DEFINE_integer(
    "max_queued_tokens",
    d.max_queued_tokens,
    "Tokens queued, all requests together, before new requests get 503 + Retry-After.",
  )
  flags.DEFINE_float(
    "request_timeout",
    d.request_timeout,
    "Seconds from a request's headers to its answer: "
    "reading its body, tokenizing and scoring it (504 past them).",
  )
  flags.DEFINE_float(
    "header_timeout",
    d.header_timeout,
    "Seconds a connection may take to send request headers before it is dropped.",
  )
  flags.DEFINE_float("body_timeout", d.body_timeout, "Seconds a request may take to send its body (408).")
  flags.DEFINE_float("keep_alive", d.keep_alive, "Seconds an idle keep-alive connection is kept.")
  flags.DEFINE_integer(
    "max_connections",
    d.max_connections,
    "Open connections; past them an idle one is closed, or new ones get 503 if none is idle; "
    "also the most requests waiting to be scored.",
  )
  flags.DEFINE_integer(
    "max_client_connections",
    None,
    "One peer address's share of --max_connections, before its new ones get 429 (default: half).",
  )
  flags.DEFINE_bool(
    "openrlhf_text",
    False,
    "/get_reward: strip pad/eos tokens from each text and append one "
    "eos, as OpenRLHF's serve_rm does (for models trained with OpenRLHF).",
  )
  flags.DEFINE_bool(
    "normalize",
    False,
    "Return (reward - mean) / std with the statistics recorded at validation (models saved by training).",
  )
  flags.DEFINE_string(
    "combine",
    None,
    "A regression model's outputs combined into one reward: an attribute's "
    "name, or 'name=weight,...' (see RewardModel.score).",
  )
  flags.DEFINE_bool(
    "access_log", False, "Log one line per scoring request: client, endpoint, status, seconds and request id."
  )
  flags.DEFINE_enum(
    "step_aggregation",
    d.step_aggregation,
    list(step_rewards.AGGREGATIONS),
    "A process reward "
    "model's step probabilities made one reward per solution (/score, and /score_steps' "
    '"rewards"), unless a request sends its own "aggregation".',
  )
  cli.define_compute_flags()
  cli.define_step_flag()
  cli.define_verifier_flags()


def check_port(host: str, port: int) -> None:
  """Refuses an address the server could not listen on (a port in use), before the model loads."""
  import errno
  import socket

  from jaxrm.errors import UserError

  if port == 0:
    return
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  try:
    socket.create_server((host, port), family=family).close()  # as the server binds it
  except OSError as e:
    if e.errno == errno.EADDRINUSE:
      raise UserError(
        f"--port={port}: {host}:{port} is in use (another server?); stop what listens there, or "
        "choose another --port (--port=0: any free port)"
      ) from None
    raise UserError(f"--host={host} --port={port}: cannot listen there: {e.strerror or e}") from None


def server_config(f) -> ServerConfig:
  """The ServerConfig of the parsed flags."""
  from jaxrm.errors import ConfigError

  try:
    buckets = tuple(int(b) for b in f.buckets) if f.buckets else None
  except ValueError:
    raise ConfigError(
      f"--buckets={','.join(f.buckets)}: give token lengths, e.g. --buckets=128,512,2048"
    ) from None
  return ServerConfig(
    max_batch=f.max_batch,
    max_request_bytes=f.max_request_bytes,
    max_pending_bytes=f.max_pending_bytes,
    max_client_pending_bytes=f.max_client_pending_bytes,
    max_tokenize_chars=f.max_tokenize_chars,
    tokenizers=f.tokenizers,
    max_client_connections=f.max_client_connections,
    max_messages=f.max_messages,
    max_length=f.max_length,
    batch_size=f.batch_size,
    batch_tokens=f.batch_tokens,
    buckets=buckets,
    batch_wait_ms=f.batch_wait_ms,
    share_prefix=f.share_prefix,
    max_queued_tokens=f.max_queued_tokens,
    request_timeout=f.request_timeout,
    header_timeout=f.header_timeout,
    body_timeout=f.body_timeout,
    keep_alive=f.keep_alive,
    max_connections=f.max_connections,
    openrlhf_text=f.openrlhf_text,
    normalize=f.normalize,
    combine=f.combine,
    step_aggregation=f.step_aggregation,
    access_log=f.access_log,
    warm_up=f.warm_up,
    api_key=f.api_key or os.environ.get(API_KEY_ENV) or None,
  )


def served_model_name(f) -> str:
  """--served_model_name, else the last part of --model: its name, not where it lies."""
  return f.served_model_name or os.path.basename(os.path.normpath(f.model))


def main() -> None:
  from absl import flags

  from jaxrm.scoring.reward_model import RewardModel

  cli.setup_logging(logging.INFO, timestamps=True)
  f = flags.FLAGS
  config = server_config(f)
  check_port(f.host, f.port)
  rm = RewardModel.from_pretrained(
    cli.located_model(f.model, f.step),
    dtype=f.dtype,
    attention_impl=f.attention,
    **cli.asker_requests(f),
  )
  server = make_server(rm, f.host, f.port, config=config, model_name=served_model_name(f))
  host = server.address[0]
  if not ipaddress.ip_address(host).is_loopback and config.api_key is None:
    log.warning(
      "listening on %s without --api_key: anyone who can reach this address can use the model", host
    )
  packed = server.batcher.packed_buckets
  log.info(
    "max_length=%d tokens per item, buckets %s, %d rows per batch; %s",
    server.config.max_length,
    ",".join(map(str, server.config.buckets)),
    server.config.batch_size,
    f"rows sharing a prefix packed in rows of {','.join(map(str, packed))} tokens"
    if packed
    else "every row scored alone",
  )
  print(f"jaxrm: serving {f.model} on {server.url} ({ENDPOINTS})", flush=True)
  server.serve_forever()


if __name__ == "__main__":
  cli.run(main, define_flags=_define_flags)
