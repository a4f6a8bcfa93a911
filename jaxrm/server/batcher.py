"""Dynamic batching: one worker thread owns the model and scores the rows of many requests together.

Request handlers tokenize, then :meth:`Batcher.submit` their rows and await the future it returns.
The worker takes what is queued (waiting up to ``batch_wait_ms`` for a batch to fill). Rows of all
those requests that share a token prefix (a prompt's completions, in one request or many) are
scored as shared-prompt packed rows, the prefix once (:mod:`jaxrm.scoring.shared_prefix`, unless
``share_prefix`` is off); the others are sorted by length and cut into batches of at most
``batch_size`` rows and ``batch_tokens`` padded tokens, each padded to a bucket length.
Every request gets back its own rewards, in its own order.

Before the first request is taken the worker compiles batch shapes (rows x length, of plain and of
packed rows): with ``warm_up="all"`` every one, with ``"cover"`` (the default) only the covering
shapes (:func:`covering`), which hold every other. It then compiles the others one at a time
whenever its queue is empty. A batch whose own shape is not compiled yet is padded to the smallest
compiled shape that holds it: empty rows, whose outputs are dropped, and right padding, which
leaves every row's outputs as they are (a sequence head reads a row's last real token; a packed
row's padding is a segment no token attends to).

The queue holds at most ``max_connections`` requests. A request given up (timed out, its client
gone) keeps its place, without its rows, until the worker takes it and drops it unscored; its tokens
leave ``max_queued_tokens`` at once. Rows already taken into a batch are scored and their rewards
discarded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxrm.data.pipeline import bucket_length, right_padded, scoring_rows
from jaxrm.scoring import shared_prefix
from jaxrm.server.config import ServerConfig
from jaxrm.server.metrics import Metrics

log = logging.getLogger("jaxrm.server")

# ids [B, T] int32, mask [B, T] int32 -> rewards [B] float32 (a sequence head), or per-token
# values [B, T] (a process model's step probabilities, read at each row's step labels by the
# endpoint). The one place scoring happens.
ScoreFn = Callable[[np.ndarray, np.ndarray], np.ndarray]
# Packed rows -> the outputs of the rows they hold, in SharedRows.rows order: rewards [N], or
# each row's per-token values [T_i].
PackedFn = Callable[[shared_prefix.SharedRows], Sequence]
# Token rows -> the groups of row indices scored together (shared_prefix.scoring_groups).
GroupFn = Callable[[list[list[int]]], list[list[int]]]
# A plain batch of right-padded rows, or one of shared-prompt packed rows: each compiles its own shapes.
ROWS, PACKED = "rows", "packed"
# How many full batches of rows the worker takes from the queue at once: enough to sort
# requests of many lengths into buckets, few enough that new arrivals are not kept waiting long.
DRAIN_BATCHES = 8


class QueueFull(Exception):
  """The queue is full (``max_queued_tokens`` or ``max_connections``); the message says which."""


@dataclasses.dataclass(eq=False)
class Job:
  """The rows of one request, and where their rewards go."""

  rows: list[list[int]]
  loop: asyncio.AbstractEventLoop
  future: asyncio.Future
  rewards: list  # each row's reward (float), or its per-token values [T_i] (a process model)
  left: int
  tokens: int
  request_id: str = ""  # names the request in the log
  done: bool = False  # answered, failed or given up: its tokens are no longer queued
  collected: bool = False  # taken from the queue by the worker, which now holds its rows


def row_sizes(batch_size: int) -> list[int]:
  """Rows a batch may have: powers of two below batch_size, and batch_size."""
  sizes, b = [], 1
  while b < batch_size:
    sizes.append(b)
    b *= 2
  return sizes + [batch_size]


def covering(shapes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
  """The (rows, length) of ``shapes`` that no other holds (one with as many rows or more and as
  long or longer): for each length the most rows, less those a longer length has as many of.
  Padded with empty rows and to a longer length, every shape fits one of them."""
  return [s for s in shapes if not any(o != s and o[0] >= s[0] and o[1] >= s[1] for o in shapes)]


def fullest(shapes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
  """The (rows, length) of ``shapes`` with the most rows of their length: the batches a busy server
  forms."""
  return [s for s in shapes if not any(o[1] == s[1] and o[0] > s[0] for o in shapes)]


class Batcher:
  """The scoring worker and its queue."""

  def __init__(
    self,
    score_fn: ScoreFn,
    config: ServerConfig,
    pad_id: int,
    metrics: Metrics,
    *,
    packed_fn: PackedFn | None = None,
    group_fn: GroupFn | None = None,
    packed_buckets: tuple[int, ...] = (),
  ):
    """``packed_fn``, ``group_fn`` and ``packed_buckets`` (the lengths a packed row may have)
    score rows that share a prefix together; without them every row is scored alone."""
    self.score_fn = score_fn
    self.packed_fn = packed_fn if group_fn is not None and packed_buckets else None
    self.group_fn = group_fn
    self.packed_buckets = packed_buckets
    self.config = config
    self.pad_id = pad_id
    self.metrics = metrics
    self.ready = threading.Event()
    self.all_compiled = threading.Event()  # every batch shape, those compiled after ready too
    self._compiled: dict[str, set[tuple[int, int]]] = {ROWS: set(), PACKED: set()}
    self._to_compile: list[tuple[str, tuple[int, int]]] = []  # after ready, in this order
    self._background = 0  # shapes left to compile after ready
    self._compile_s = 0.0  # seconds spent compiling them
    self.failed: str | None = None  # why warm-up failed, if it did: for wait_ready, never for clients
    self._queue: queue.Queue[Job] = queue.Queue(maxsize=config.max_connections)
    self._lock = threading.Lock()
    self._queued_tokens = 0
    self._queued_items = 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="jaxrm-scoring", daemon=True)

  # ------------------------------------------------------------------ handler side

  def submit(self, rows: list[list[int]], request_id: str = "") -> Job:
    """Queues one request's token rows; await ``job.future`` for their outputs, in order: a float
    each, or a process model's per-token values (QueueFull: 503)."""
    loop = asyncio.get_running_loop()
    tokens = sum(map(len, rows))
    cfg = self.config
    with self._lock:
      if self._queued_tokens + tokens > cfg.max_queued_tokens:
        raise QueueFull(
          f"the server is busy: {cfg.max_queued_tokens} tokens are queued (--max_queued_tokens); "
          "retry after the Retry-After seconds"
        )
      job = Job(rows, loop, loop.create_future(), [None] * len(rows), len(rows), tokens, request_id)
      try:
        self._queue.put_nowait(job)
      except queue.Full:
        raise QueueFull(
          f"the server is busy: {cfg.max_connections} requests wait to be scored, as many as it "
          "keeps connections (--max_connections); retry after the Retry-After seconds"
        ) from None
      self._queued_tokens += tokens
      self._queued_items += len(rows)
      self._update_gauges()
    return job

  def put(self, job: Job) -> None:
    """Queues a job made by the caller, as it is (:meth:`submit` makes one of a request's rows): a
    caller driving the worker's steps (:meth:`collect`, :meth:`score_jobs`) itself feeds them so."""
    self._queue.put(job)

  def give_up(self, job: Job) -> None:
    """The handler no longer waits (timeout, disconnect): its rows are not scored. Still queued, it
    lets go of them now; the worker drops it when it comes to it."""
    with self._lock:
      if self._release(job) and not job.collected:
        job.rows = []

  # ------------------------------------------------------------------ worker side

  def start(self) -> None:
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()
    self._thread.join(timeout=60)

  def _run(self) -> None:
    try:
      self._warm_up()
    except Exception as e:  # pylint: disable=broad-except  # /health says "failed" instead of hanging
      log.exception("warm-up failed")
      self.failed = f"{type(e).__name__}: {e}"
      return
    self.ready.set()
    while not self._stop.is_set():
      if self._to_compile and self._queue.empty():
        self._compile_next()
        continue
      jobs = self.collect()
      try:
        self.score_jobs(jobs)
      except Exception as e:  # pylint: disable=broad-except  # fail these requests, keep serving
        log.exception("scoring failed (requests %s)", _ids(jobs))
        for job in jobs:
          self._fail(job, e)

  def shapes(self) -> list[tuple[int, int]]:
    """(rows, length) of every right-padded batch the worker may form."""
    return self._shapes(self.config.buckets)

  def packed_shapes(self) -> list[tuple[int, int]]:
    """(rows, length) of every batch of packed rows the worker may form."""
    return self._shapes(self.packed_buckets) if self.packed_fn is not None else []

  def _shapes(self, lengths) -> list[tuple[int, int]]:
    cfg = self.config
    return [(b, t) for t in lengths for b in row_sizes(cfg.batch_size) if b == 1 or b * t <= cfg.batch_tokens]

  def _warm_up(self) -> None:
    """Compiles the shapes needed before ready: the covering ones (or all), plain rows first."""
    start = time.perf_counter()
    cover, later = self.compile_order()
    if self.config.warm_up == "all":
      cover, later = cover + later, []
    for kind, shape in cover:
      self.compile(kind, shape)
    self._to_compile, self._background = later, len(later)
    seconds, packed = time.perf_counter() - start, len(self._compiled[PACKED])
    if later:
      log.info(
        "compiled %d of %d batch shapes (%d of them of packed rows) in %.1f s; the other %d "
        "compile in the background, their batches padded to a compiled shape meanwhile",
        len(cover),
        len(cover) + len(later),
        packed,
        seconds,
        len(later),
      )
    else:
      log.info("compiled %d batch shapes (%d of them of packed rows) in %.1f s", len(cover), packed, seconds)
      self.all_compiled.set()

  def compile_order(self) -> tuple[list, list]:
    """Every (kind, shape): the covering shapes, then the others, those of full batches (what a
    busy server forms) first; plain rows before packed ones in each."""
    shapes = {ROWS: self.shapes(), PACKED: self.packed_shapes()}
    cover = [(kind, s) for kind in shapes for s in covering(shapes[kind])]
    later = [(kind, s) for kind in shapes for s in fullest(shapes[kind]) if (kind, s) not in cover]
    return cover, later + [
      (kind, s) for kind in shapes for s in shapes[kind] if (kind, s) not in cover + later
    ]

  def compile(self, kind: str, shape: tuple[int, int]) -> None:
    """Runs the model once on a dummy batch of ``shape``: its program compiles."""
    b, t = shape
    if kind == ROWS:
      ids = np.full((b, t), self.pad_id, np.int32)
      mask = np.zeros((b, t), np.int32)
      mask[:, 0] = 1
      self.score_fn(ids, mask)
    else:
      # b groups of two rows whose packed length is t: t - 2 shared tokens and one of each's own.
      rows = [[self.pad_id] * (t - 1) for _ in range(2 * b)]
      groups = [[2 * g, 2 * g + 1] for g in range(b)]
      for shared in self._packed(rows, groups, max_tokens=b * t):
        assert shared.batch.input_ids.shape == (b, t), (shared.batch.input_ids.shape, b, t)
        self.packed_fn(shared)
    self._compiled[kind].add(shape)
    self.metrics.shapes(compiled=self._compiled_count(), total=len(self.shapes()) + len(self.packed_shapes()))

  def _compiled_count(self) -> int:
    return sum(map(len, self._compiled.values()))

  def _compile_next(self) -> None:
    """Compiles the next shape not compiled yet (the worker's queue being empty). One that fails
    is left out: its batches keep the larger compiled shape they are padded to."""
    kind, shape = self._to_compile.pop(0)
    start = time.perf_counter()
    try:
      self.compile(kind, shape)
    except Exception:  # pylint: disable=broad-except  # the covering shapes still score every batch
      log.exception("compiling the batch shape %s of %s failed; its batches stay padded", shape, kind)
    self._compile_s += time.perf_counter() - start
    if not self._to_compile:
      log.info(
        "compiling in the background done: %d of %d batch shapes compiled, %d of them after ready in %.1f s",
        self._compiled_count(),
        len(self.shapes()) + len(self.packed_shapes()),
        self._background,
        self._compile_s,
      )
      self.all_compiled.set()

  def _shape(self, kind: str, rows: int, length: int) -> tuple[int, int]:
    """The compiled shape a batch of ``rows`` rows of ``length`` tokens is scored in: its own, else
    the smallest that holds it (fewest token slots, then shortest); its own if none does."""
    compiled = self._compiled[kind]
    if (rows, length) in compiled:
      return rows, length
    holding = [(b, t) for b, t in compiled if b >= rows and t >= length]
    return shared_prefix.fewest_slots(holding, default=(rows, length))

  def _packed(self, rows: list[list[int]], groups: list[list[int]], max_tokens: int | None = None):
    return shared_prefix.shared_batches(
      rows,
      groups,
      batch_size=self.config.batch_size,
      buckets=self.packed_buckets,
      max_tokens=max_tokens or self.config.batch_tokens,
      pad_id=self.pad_id,
      slot_per_token=True,
      shapes=self.packed_shapes(),  # a pass takes the one of fewest token slots
    )

  def collect(self) -> list[Job]:
    """The worker's first step, the jobs to score next: the first to arrive, those arriving
    within batch_wait_ms while what is taken would not fill a forward pass, and any already queued,
    up to DRAIN_BATCHES batches' worth of rows."""
    first = self._take(0.1)
    if first is None:
      return []
    jobs, rows, tokens = [first], len(first.rows), first.tokens
    deadline = time.monotonic() + self.config.batch_wait_ms / 1000
    while rows < self.config.batch_size * DRAIN_BATCHES:
      job = self._take(0 if self._fills_a_pass(rows, tokens) else deadline - time.monotonic())
      if job is None:
        break
      jobs.append(job)
      rows, tokens = rows + len(job.rows), tokens + job.tokens
    return jobs

  def _fills_a_pass(self, rows: int, tokens: int) -> bool:
    """Whether rows taken so far fill a forward pass: ``batch_size`` of them or, where rows that
    share a prefix are packed together (a GRPO group's completions fill one packed row, not
    ``batch_size`` rows), ``batch_tokens`` tokens."""
    if self.packed_fn is not None:
      return tokens >= self.config.batch_tokens
    return rows >= self.config.batch_size

  def _take(self, wait: float) -> Job | None:
    """The next job still waited for, within ``wait`` seconds (0: only one already queued), or None;
    those given up on the way are dropped."""
    deadline = time.monotonic() + wait
    while True:
      left = deadline - time.monotonic()
      try:
        job = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
      except queue.Empty:
        return None
      with self._lock:
        job.collected = True
        self._update_gauges()
        if not job.done:
          return job

  def score_jobs(self, jobs: list[Job]) -> None:
    """Scores ``jobs`` (as collected) and answers each: the worker's second step."""
    rows = [(job, i) for job in jobs if not job.done for i in range(len(job.rows))]
    groups = self._groups(rows)
    alone = sorted((rows[g[0]] for g in groups if len(g) == 1), key=lambda r: len(r[0].rows[r[1]]))
    for batch in self._plan(alone):
      batch = [(job, i) for job, i in batch if not job.done]  # a handler may have given up since
      if batch:
        self._score_batch(batch, lambda b: self._forward([job.rows[i] for job, i in b]))
    shared = [g for g in groups if len(g) > 1]
    if shared:
      tokens = [job.rows[i] for job, i in rows]
      for packed in self._packed(tokens, shared):
        self._score_batch(
          [rows[k] for k in packed.rows], lambda b, packed=packed: self._forward_packed(packed, b)
        )

  def _groups(self, rows: list[tuple[Job, int]]) -> list[list[int]]:
    """Indices of ``rows`` in groups scored together (each alone without sharing)."""
    if self.packed_fn is None or len(rows) < 2:
      return [[k] for k in range(len(rows))]
    return self.group_fn([job.rows[i] for job, i in rows])

  def _score_batch(self, batch: list[tuple[Job, int]], forward: Callable) -> None:
    """Scores one forward pass's rows (``forward(batch)``: their rewards, in order) and hands each
    request its own; a failure fails the requests with rows in it."""
    if all(job.done for job, _ in batch):  # every handler has given up since (packed rows stay packed)
      return
    try:
      rewards = forward(batch)
    except Exception as e:  # pylint: disable=broad-except  # fail these requests, keep serving
      log.exception("scoring a batch failed (requests %s)", _ids(job for job, _ in batch))
      for job in {job for job, _ in batch}:
        self._fail(job, e)
      return
    self.metrics.batch(rows=len(batch), requests=len({id(job) for job, _ in batch}))
    for (job, i), r in zip(batch, rewards):
      if job.done:
        continue
      job.rewards[i] = r
      job.left -= 1
      if job.left == 0:
        self._answer(job)

  def _plan(self, rows: list[tuple[Job, int]]) -> list[list[tuple[Job, int]]]:
    """Rows sorted by length, cut into batches within batch_size rows and batch_tokens tokens."""
    cfg = self.config
    batches, current = [], []
    for row in rows:
      t = self._bucket(len(row[0].rows[row[1]]))  # the batch's length: rows come shortest first
      if current and (
        len(current) == cfg.batch_size
        or scoring_rows(len(current) + 1, cfg.batch_size) * t > cfg.batch_tokens
      ):
        batches.append(current)
        current = []
      current.append(row)
    return batches + ([current] if current else [])

  def _bucket(self, length: int) -> int:
    return bucket_length(length, self.config.buckets)

  def _forward(self, rows: list[list[int]]) -> np.ndarray:
    """Rewards of rows (at most one batch), right-padded to their shape or a compiled one holding it."""
    b, t = self._shape(
      ROWS, scoring_rows(len(rows), self.config.batch_size), self._bucket(max(map(len, rows)))
    )
    ids, mask = right_padded(rows, length=t, pad_id=self.pad_id, num_rows=b)
    self.metrics.tokens(real=sum(map(len, rows)), padded=ids.size)
    out = np.asarray(self.score_fn(ids, mask))
    return out[: len(rows)] if out.ndim == 1 else [out[j, : len(r)] for j, r in enumerate(rows)]

  def _forward_packed(self, packed: shared_prefix.SharedRows, batch: list[tuple[Job, int]]) -> np.ndarray:
    """Rewards of the rows packed in ``packed`` (``batch``, in its order)."""
    b, t = self._shape(PACKED, *packed.batch.input_ids.shape)
    if (b, t) != packed.batch.input_ids.shape:
      packed = packed.padded(b, t, self.pad_id)
    self.metrics.tokens(real=sum(len(job.rows[i]) for job, i in batch), padded=packed.batch.input_ids.size)
    return self.packed_fn(packed)

  # ------------------------------------------------------------------ results

  def _release(self, job: Job) -> bool:
    """Marks ``job`` done and its tokens no longer queued (False if it already was); holds the lock."""
    if job.done:
      return False
    job.done = True
    self._queued_tokens -= job.tokens
    self._queued_items -= len(job.rows)
    self._update_gauges()
    return True

  def _answer(self, job: Job) -> None:
    with self._lock:
      released = self._release(job)
    if released:
      job.loop.call_soon_threadsafe(
        _set_result, job.future, [r if isinstance(r, np.ndarray) else float(r) for r in job.rewards]
      )

  def _fail(self, job: Job, error: Exception) -> None:
    with self._lock:
      released = self._release(job)
    if released:
      job.loop.call_soon_threadsafe(_set_exception, job.future, error)

  def _update_gauges(self) -> None:
    self.metrics.queue(items=self._queued_items, tokens=self._queued_tokens, requests=self._queue.qsize())


def _ids(jobs) -> str:
  return ", ".join(sorted({job.request_id for job in jobs})) or "unnamed"


def _set_result(future: asyncio.Future, value) -> None:
  if not future.done():  # the handler may have been cancelled meanwhile
    future.set_result(value)


def _set_exception(future: asyncio.Future, error: Exception) -> None:
  if not future.done():
    future.set_exception(error)
