"""The server's Prometheus metrics, in a registry of its own (two servers in one process keep theirs apart)."""

from __future__ import annotations

import numbers
from collections.abc import Mapping

import prometheus_client as prom

from jaxrm.scoring import reward_health

# Powers of two: batches have 1, 2, 4... rows (row_sizes), and requests per batch grow alike.
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# The rewards the health gauges are read over: the last this many scored, whichever requests sent
# them (RL loops send one completion per request).
HEALTH_WINDOW = 256
# One request adds at most this many of its rewards (evenly spaced through it) to the window: no
# single request, however large, replaces the window every client's health is read from.
HEALTH_SHARE = HEALTH_WINDOW // 8
HEALTH_GAUGES = {
  reward_health.MEAN: f"Mean of the last {HEALTH_WINDOW} rewards",
  reward_health.STD: f"Standard deviation of the last {HEALTH_WINDOW} rewards",
  reward_health.LENGTH_CORR: f"Pearson's r of the last {HEALTH_WINDOW} rewards with their rows' lengths",
  reward_health.OUT_OF_RANGE: f"Share of the last {HEALTH_WINDOW} rewards outside the validation range",
  reward_health.TRUNCATED: f"Share of the last {HEALTH_WINDOW} rows cut to fit",
}


class Metrics:
  """Requests, items, tokens, batch sizes, queue depth, bytes held, latency, compiled batch
  shapes, the counters the tasks' routes keep (``counters``: name -> help; a pairwise judge's
  responses ranked and judge texts), and the reward's health over the last rewards scored
  (:mod:`jaxrm.scoring.reward_health`); ``text()`` is /metrics."""

  def __init__(
    self, reward_range: reward_health.Range | None = None, counters: Mapping[str, str] | None = None
  ):
    self.registry = prom.CollectorRegistry()
    r = self.registry
    self._requests = prom.Counter(
      "jaxrm_requests", "Requests answered, by endpoint and status.", ["endpoint", "status"], registry=r
    )
    self._latency = prom.Histogram(
      "jaxrm_request_seconds",
      "Seconds from a request's headers to its answer.",
      ["endpoint"],
      buckets=LATENCY_BUCKETS,
      registry=r,
    )
    self._items = prom.Counter("jaxrm_items", "Items scored.", registry=r)
    self._tokens = prom.Counter("jaxrm_tokens", "Real tokens scored.", registry=r)
    self._padded = prom.Counter(
      "jaxrm_padded_tokens", "Positions fed to the model, padding included.", registry=r
    )
    self._rows = prom.Histogram(
      "jaxrm_batch_rows", "Items per forward pass.", buckets=COUNT_BUCKETS, registry=r
    )
    self._batch_requests = prom.Histogram(
      "jaxrm_batch_requests", "Requests with rows in one forward pass.", buckets=COUNT_BUCKETS, registry=r
    )
    self._queue_items = prom.Gauge("jaxrm_queue_items", "Items waiting or being scored.", registry=r)
    self._queue_tokens = prom.Gauge("jaxrm_queue_tokens", "Tokens waiting or being scored.", registry=r)
    self._queue_requests = prom.Gauge(
      "jaxrm_queue_requests",
      "Requests in the scoring queue, those given up and not yet dropped included.",
      registry=r,
    )
    self._pending_bytes = prom.Gauge(
      "jaxrm_pending_bytes", "Bytes of request bodies being read or waiting to be tokenized.", registry=r
    )
    self._compiled_shapes = prom.Gauge(
      "jaxrm_compiled_shapes", "Batch shapes compiled (of jaxrm_batch_shapes).", registry=r
    )
    self._batch_shapes = prom.Gauge(
      "jaxrm_batch_shapes", "Batch shapes the server may form, plain and packed rows.", registry=r
    )
    self._counters = {name: prom.Counter(name, what, registry=r) for name, what in (counters or {}).items()}
    self._window = reward_health.Window(HEALTH_WINDOW, reward_range)
    # Made at their first value: a gauge never set would read 0 (a share outside a range that the
    # model does not have, a mean before any reward).
    self._health: dict[str, prom.Gauge] = {}

  def request(self, endpoint: str, status: int, seconds: float) -> None:
    self._requests.labels(endpoint, str(status)).inc()
    self._latency.labels(endpoint).observe(seconds)

  def batch(self, rows: int, requests: int) -> None:
    self._items.inc(rows)
    self._rows.observe(rows)
    self._batch_requests.observe(requests)

  def tokens(self, real: int, padded: int) -> None:
    self._tokens.inc(real)
    self._padded.inc(padded)

  def queue(self, items: int, tokens: int, requests: int) -> None:
    self._queue_items.set(items)
    self._queue_tokens.set(tokens)
    self._queue_requests.set(requests)

  def pending(self, size: int) -> None:
    self._pending_bytes.set(size)

  def shapes(self, compiled: int, total: int) -> None:
    self._compiled_shapes.set(compiled)
    self._batch_shapes.set(total)

  def count(self, counts: Mapping[str, int]) -> None:
    """Adds one request's ``counts`` (a route's :attr:`jaxrm.tasks.routes.Scoring.counts`) to its counters."""
    for name, n in counts.items():
      self._counters[name].inc(n)

  def scored(self, rewards: list, rows: list[list[int]], truncated: int = 0) -> dict[str, float]:
    """Adds one request's rewards (with its rows' lengths in tokens, ``truncated`` of them cut to
    fit) to the health window, at most :data:`HEALTH_SHARE` of them; the window's health after it.
    A process model's per-token outputs are not rewards, and an empty request adds none: for both,
    no health."""
    if not rewards or not all(isinstance(x, numbers.Real) for x in rewards):
      return {}
    n = len(rewards)
    kept = range(n) if n <= HEALTH_SHARE else [i * n // HEALTH_SHARE for i in range(HEALTH_SHARE)]
    truncated = round(truncated * len(kept) / n)
    health = self._window.add([float(rewards[i]) for i in kept], [len(rows[i]) for i in kept], truncated)
    for name, value in health.items():
      if name not in self._health:
        what = f"{HEALTH_GAUGES[name]} (jaxrm.scoring.reward_health)."
        self._health[name] = prom.Gauge(f"jaxrm_{name}", what, registry=self.registry)
      self._health[name].set(value)
    return health

  def text(self) -> bytes:
    return prom.generate_latest(self.registry)


CONTENT_TYPE = prom.CONTENT_TYPE_LATEST
