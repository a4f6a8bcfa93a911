"""``ServerConfig``: what the reward server accepts, how it batches, and how long it waits."""

from __future__ import annotations

import dataclasses

from jaxrm.errors import ConfigError
from jaxrm.scoring import step_rewards
from jaxrm.scoring.shared_prefix import Sharing

# Tokens per item when neither the caller nor the model's training run says: long enough for
# most RL rollouts, short enough that a batch of them is not a model's whole context per row.
DEFAULT_MAX_LENGTH = 2048
SMALLEST_BUCKET = 64
# How much the server compiles before it answers: the covering shapes (then the rest in the
# background), or every shape.
WARM_UPS = ("cover", "all")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """Limits, batching and timeouts of one server; each field is the CLI flag of the same name.

  Attributes:
    max_batch: items (texts, conversations or pairs) per request.
    max_messages: chat messages per request, all its conversations together (a conversation over
      max_length loses its oldest turns, which takes time in proportion to its length).
    max_request_bytes: size of a request body.
    max_pending_bytes: bytes of request bodies being read or waiting to be tokenized, all requests
      together, counted as they arrive; past it, 503. At least max_request_bytes.
    max_client_pending_bytes: the share of max_pending_bytes one client may hold (a client: a
      peer address, and the API key it sends); past it, 429 while the others keep theirs. None:
      half of max_pending_bytes, and at least max_request_bytes.
    max_tokenize_chars: characters one request may have tokenized, each distinct text once (a
      text that extends one already tokenized, as vLLM's score pairs share ``text_1``, only past
      their shared part; a chat message counts 64 more for its template); past it, 413 before
      the text is tokenized (:mod:`jaxrm.server.tokenizing`).
    tokenizers: tokenizers working at once, each a copy of the model's, taking requests' items
      one at a time, the request that has had the fewest characters tokenized first. With two or
      more, one only takes items under 64 Ki characters, so a short request never waits for a
      long item.
    max_length: tokens per item. A longer conversation loses its oldest turns (as in training),
      a longer text or last message is refused. None: ``DEFAULT_MAX_LENGTH`` (or the model's
      context, if shorter) unless the model records its training run's ``data.max_length``.
    batch_size: rows per forward pass.
    batch_tokens: padded tokens per forward pass (rows x bucket length); None: batch_size x max_length.
    buckets: padded lengths a batch may have; None: powers of two from 64 up to max_length, and
      max_length.
    batch_wait_ms: how long the scoring worker waits for more requests to join a batch, while
      what it has taken would not fill one (``batch_size`` rows; with ``share_prefix``,
      ``batch_tokens`` tokens).
    share_prefix: rows that share a token prefix of at least 64 tokens (a prompt's completions,
      sent in one request or in many at once) are scored as shared-prompt packed rows, the prefix
      once (:mod:`jaxrm.scoring.shared_prefix`); their rewards are those of rows scored alone, up to float
      rounding. Packed rows have lengths of their own (``packed_buckets``).
    warm_up: which batch shapes (rows x bucket length, of plain and of packed rows) are compiled
      before the server is ready. ``"cover"``: the fewest that hold every other (the most rows of
      each length, less those a longer length has as many rows of); the others compile one at a
      time in the scoring worker whenever its queue is empty (a request arriving meanwhile waits
      for that one), and until a batch's own shape is compiled it is padded (empty rows and right
      padding, which leave its outputs as they are) to the smallest compiled one that holds it.
      ``"all"``: every shape.
    max_queued_tokens: tokens waiting or being scored, all requests together; past it, 503.
    request_timeout: seconds from a request's headers to its answer -- reading its body, waiting
      for the tokenizer, tokenizing, queueing and scoring -- before 504. A request past it stops
      tokenizing at its next item, so that the tokenizer goes to the requests behind it.
    header_timeout: seconds a connection may take to send a request's headers before it is dropped.
    body_timeout: seconds a request may take to send its body before 408.
    keep_alive: seconds an idle keep-alive connection is kept.
    max_connections: open connections; past it, an idle one (waiting for a request's headers),
      of the peer holding the most idle ones, is closed for the new one, and if none is idle the
      new one gets 503. It also bounds the scoring queue: at most as many requests wait to be scored, those
      given up (timed out, disconnected) keeping their places, without their rows, until the
      scoring worker drops them unscored.
    max_client_connections: the share of max_connections one peer address may hold; past it,
      its new connections get 429. None: half of max_connections (at least 1).
    openrlhf_text: strip pad/eos tokens from each ``/get_reward`` text, append one eos and
      tokenize without adding special tokens, as OpenRLHF's ``serve_rm`` does, so a model trained
      by OpenRLHF scores what it was trained on (a text over max_length is refused, not cut).
    normalize: return (reward - mean) / std with the statistics recorded at validation.
    combine: a regression model's outputs combined into one reward (``RewardModel.score``'s
      ``combine``: an attribute's name or ``"name=weight,..."``); required for such a model.
    step_aggregation: a process reward model's step probabilities made one reward per solution
      (:mod:`jaxrm.scoring.step_rewards`: min, last, product or mean), unless a request says otherwise.
    api_key: if set, every endpoint but ``/health`` needs ``Authorization: Bearer <api_key>``.
    access_log: log one line per scoring request (endpoint, status, items, seconds, request id).
  """

  max_batch: int = 256
  max_messages: int = 4096
  max_request_bytes: int = 16 * 2**20
  # Four bodies of the largest size: more would only wait longer for the tokenizers, while
  # max_connections such bodies would be 16 GiB.
  max_pending_bytes: int = 64 * 2**20
  max_client_pending_bytes: int | None = None
  # About 4 Mi characters: a few seconds of one tokenizer on a loaded CPU, and a batch of 256
  # items of 2048 tokens in English text.
  max_tokenize_chars: int = 2**22
  tokenizers: int = 2
  max_length: int | None = None
  batch_size: int = 8
  batch_tokens: int | None = None
  buckets: tuple[int, ...] | None = None
  batch_wait_ms: float = 5.0
  share_prefix: bool = True
  max_queued_tokens: int = 2**20
  request_timeout: float = 60.0
  header_timeout: float = 10.0
  body_timeout: float = 30.0
  keep_alive: float = 5.0
  max_connections: int = 1024
  max_client_connections: int | None = None
  openrlhf_text: bool = False
  normalize: bool = False
  combine: str | None = None  # a regression model's outputs combined into one reward
  step_aggregation: str = step_rewards.DEFAULT_AGGREGATION
  api_key: str | None = dataclasses.field(default=None, repr=False)
  access_log: bool = False
  warm_up: str = "cover"

  def __post_init__(self):
    for name in (
      "max_batch",
      "max_messages",
      "max_request_bytes",
      "max_pending_bytes",
      "max_length",
      "batch_size",
      "batch_tokens",
      "max_queued_tokens",
      "max_connections",
      "max_client_connections",
      "max_client_pending_bytes",
      "max_tokenize_chars",
      "tokenizers",
    ):
      value = getattr(self, name)
      if value is not None and value < 1:
        raise ConfigError(f"{name}={value}: must be at least 1 (--{name})")
    for name in ("batch_wait_ms", "request_timeout", "header_timeout", "body_timeout", "keep_alive"):
      if not getattr(self, name) >= 0:
        raise ConfigError(f"{name}={getattr(self, name)}: must be 0 or more (--{name})")
    if self.max_pending_bytes < self.max_request_bytes:
      raise ConfigError(
        f"max_pending_bytes={self.max_pending_bytes} < max_request_bytes={self.max_request_bytes}: "
        "a body of max_request_bytes could never be read; raise --max_pending_bytes or lower "
        "--max_request_bytes"
      )
    if self.max_client_pending_bytes is not None and self.max_client_pending_bytes < self.max_request_bytes:
      raise ConfigError(
        f"max_client_pending_bytes={self.max_client_pending_bytes} < max_request_bytes="
        f"{self.max_request_bytes}: a body of max_request_bytes could never be read; raise "
        "--max_client_pending_bytes or lower --max_request_bytes"
      )
    try:
      step_rewards.check_aggregation(self.step_aggregation)
    except ValueError as e:
      raise ConfigError(f"{e} (--step_aggregation)") from None
    if self.warm_up not in WARM_UPS:
      raise ConfigError(
        f"warm_up={self.warm_up!r}: give cover (the server is ready once the shapes that hold all "
        "others are compiled) or all (once every shape is) (--warm_up)"
      )
    if self.buckets is not None and (not self.buckets or min(self.buckets) < 1):
      raise ConfigError(f"buckets={self.buckets}: give positive lengths, e.g. --buckets=128,512,2048")

  @property
  def client_pending_bytes(self) -> int:
    """The bytes of pending bodies one client may hold."""
    if self.max_client_pending_bytes is not None:
      return min(self.max_client_pending_bytes, self.max_pending_bytes)
    return max(self.max_request_bytes, self.max_pending_bytes // 2)

  @property
  def client_connections(self) -> int:
    """The open connections one peer address may hold."""
    if self.max_client_connections is not None:
      return min(self.max_client_connections, self.max_connections)
    return max(1, self.max_connections // 2)

  def resolved(self, context_length: int, training_max_length: int | None = None) -> ServerConfig:
    """This config with max_length, batch_tokens and buckets filled in for a model's context and,
    when it was trained by jaxrm, the training run's ``data.max_length``."""
    max_length = self.max_length or default_max_length(context_length, training_max_length)
    if max_length > context_length:
      raise ConfigError(
        f"max_length={max_length} is longer than the model's context ({context_length} "
        "tokens): lower --max_length"
      )
    batch_tokens = self.batch_tokens or self.batch_size * max_length
    if batch_tokens < max_length:
      raise ConfigError(
        f"batch_tokens={batch_tokens} < max_length={max_length}: an item of max_length "
        "tokens would fit no batch; raise --batch_tokens or lower --max_length"
      )
    buckets = tuple(
      sorted({b for b in self.buckets or _powers_of_two(max_length) if b < max_length} | {max_length})
    )
    return dataclasses.replace(self, max_length=max_length, batch_tokens=batch_tokens, buckets=buckets)

  def packed_buckets(self, sharing: Sharing = Sharing()) -> tuple[int, ...]:
    """Lengths a packed row may have (of a :meth:`resolved` config): the buckets long enough for two
    rows sharing a prefix, then powers of two and the midpoints between them (1.5 times one) up to
    the longest packed row (``sharing.row_length`` or ``batch_tokens``, the shorter), and that; none
    without ``share_prefix``, or when no row is long enough to share ``sharing.min_prefix`` tokens.

    A group of completions packs to a length of its own (a prompt plus G completions), so the
    midpoints pad a packed row by at most a third rather than a half (GRPO groups of 8 from
    SmolLM2's bench: 1,450 tokens padded to 1,536, not 2,048). Where ``batch_tokens`` is a power of
    two (the default's is where batch_size and max_length are), the shapes they add are held by
    the powers of two's: a server warming up with the covering shapes compiles no more before it
    is ready."""
    if not self.share_prefix or self.max_length <= sharing.min_prefix:
      return ()
    limit = min(sharing.row_length, self.batch_tokens)
    steps = _powers_of_two(limit)
    longer = {b for b in steps + [b * 3 // 2 for b in steps] if self.max_length < b < limit}
    return tuple(sorted({b for b in self.buckets if sharing.min_prefix + 1 < b <= limit} | longer | {limit}))


def default_max_length(context_length: int, training_max_length: int | None) -> int:
  """Tokens per item a scorer takes unless told: the training run's ``data.max_length``, else
  ``DEFAULT_MAX_LENGTH`` or the model's context if shorter."""
  return training_max_length or min(DEFAULT_MAX_LENGTH, context_length)


def _powers_of_two(limit: int) -> list[int]:
  out, b = [], SMALLEST_BUCKET
  while b < limit:
    out.append(b)
    b *= 2
  return out
