"""The server's warm-up: ready once the covering batch shapes are compiled, the others compiled
after; a batch whose own shape is not compiled yet is padded to a compiled one that holds it, and
gets the rewards of its own shape and of ``rm.score``."""

import asyncio
import dataclasses
import logging
import sys
import threading
import time

import numpy as np
import pytest
import tiny_run
from helpers import GRPO_COMPLETIONS, GRPO_PROMPT, SERVER_CONFIG, approx, user

from jaxrm.errors import ConfigError
from jaxrm.scoring import shared_prefix
from jaxrm.server import ServerConfig, app
from jaxrm.server.batcher import PACKED, ROWS, Batcher, Job, covering
from jaxrm.server.metrics import Metrics

# 8 rows of 64 tokens, 4 of 128 or 2 of 256 in 512 tokens; packed rows of 128, 256 and 512.
SMALL = ServerConfig(batch_size=8, max_length=256, buckets=(64, 128, 256), batch_tokens=512).resolved(8192)
SHAPES = [(1, 64), (2, 64), (4, 64), (8, 64), (1, 128), (2, 128), (4, 128), (1, 256), (2, 256)]
PACKED_SHAPES = [(1, 128), (2, 128), (4, 128), (1, 256), (2, 256), (1, 384), (1, 512)]
# By hand: each length's most rows; none is held by a longer length's (each has fewer rows).
COVER = [(8, 64), (4, 128), (2, 256)]
PACKED_COVER = [(4, 128), (2, 256), (1, 512)]
# 4 rows of 64 or 128 tokens in 512; packed rows of 128, 256 and 512.
MODEL_CONFIG = dataclasses.replace(SERVER_CONFIG, max_length=128, buckets=(64, 128), batch_size=4)


def recording_batcher(config: ServerConfig) -> tuple[Batcher, list]:
  """A Batcher without a model; ``calls`` gets (kind, shape, ready then) of every forward pass."""
  calls = []

  def score_fn(ids, mask):
    calls.append((ROWS, ids.shape, batcher.ready.is_set()))
    return np.zeros(ids.shape[0], np.float32)

  def packed_fn(shared):
    calls.append((PACKED, shared.batch.input_ids.shape, batcher.ready.is_set()))
    return np.zeros(len(shared.rows), np.float32)

  batcher = Batcher(
    score_fn,
    config,
    0,
    Metrics(),
    packed_fn=packed_fn,
    group_fn=lambda rows: [[k] for k in range(len(rows))],
    packed_buckets=config.packed_buckets(),
  )
  return batcher, calls


def test_the_covering_shapes_hold_every_shape():
  batcher, _ = recording_batcher(SMALL)
  assert SMALL.packed_buckets() == (128, 256, 384, 512)  # 384: between two powers of two
  assert batcher.shapes() == SHAPES and batcher.packed_shapes() == PACKED_SHAPES
  assert covering(batcher.shapes()) == COVER
  assert covering(batcher.packed_shapes()) == PACKED_COVER
  for shapes, cover in ((SHAPES, COVER), (PACKED_SHAPES, PACKED_COVER)):
    for b, t in shapes:
      assert any(b <= cb and t <= ct for cb, ct in cover), (b, t)
  # A longer length with as many rows holds the shorter one: (8, 64) covers (8, 32) too.
  assert covering([(8, 32), (8, 64), (4, 128), (1, 128)]) == [(8, 64), (4, 128)]


def warmed_up(config: ServerConfig, caplog) -> tuple[Batcher, list]:
  """A started recording batcher, once every shape is compiled."""
  batcher, calls = recording_batcher(config)
  with caplog.at_level(logging.INFO, logger="jaxrm.server"):
    batcher.start()
    try:
      assert batcher.all_compiled.wait(60)
    finally:
      batcher.stop()
  return batcher, calls


def test_cover_is_ready_after_the_covering_shapes_then_compiles_the_others(caplog):
  batcher, calls = warmed_up(SMALL, caplog)
  before = [(kind, shape) for kind, shape, ready in calls if not ready]
  assert before == [(ROWS, s) for s in COVER] + [(PACKED, s) for s in PACKED_COVER]
  after = sorted((kind, shape) for kind, shape, ready in calls if ready)
  assert after == sorted(
    [(ROWS, s) for s in SHAPES if s not in COVER]
    + [(PACKED, s) for s in PACKED_SHAPES if s not in PACKED_COVER]
  )
  log = caplog.text
  assert "compiled 6 of 16 batch shapes (3 of them of packed rows) in" in log, log
  assert "the other 10 compile in the background" in log, log
  assert "compiling in the background done: 16 of 16 batch shapes compiled, 10 of them after ready" in log, (
    log
  )
  metrics = batcher.metrics.text().decode()
  assert "jaxrm_compiled_shapes 16.0" in metrics and "jaxrm_batch_shapes 16.0" in metrics


def test_after_ready_full_batches_compile_first():
  # 4 rows of 64 or of 128 tokens: (4, 128) covers all; a busy server's full batches of 64 come next.
  batcher, _ = recording_batcher(MODEL_CONFIG.resolved(128))
  cover, later = batcher.compile_order()
  assert cover == [(ROWS, (4, 128)), (PACKED, (4, 128)), (PACKED, (2, 256)), (PACKED, (1, 512))]
  assert later[:1] == [(ROWS, (4, 64))]
  assert sorted(cover + later) == sorted(
    [(ROWS, s) for s in batcher.shapes()] + [(PACKED, s) for s in batcher.packed_shapes()]
  )


def test_all_compiles_every_shape_before_ready(caplog):
  batcher, calls = warmed_up(dataclasses.replace(SMALL, warm_up="all"), caplog)
  assert not any(ready for _, _, ready in calls)
  assert sorted((kind, shape) for kind, shape, _ in calls) == sorted(
    [(ROWS, s) for s in SHAPES] + [(PACKED, s) for s in PACKED_SHAPES]
  )
  assert "compiled 16 batch shapes (7 of them of packed rows) in" in caplog.text
  assert "background" not in caplog.text


def test_a_wrong_warm_up_is_one_line_naming_the_flag():
  message = (
    "warm_up='some': give cover (the server is ready once the shapes that hold all others are "
    "compiled) or all (once every shape is) (--warm_up)"
  )
  with pytest.raises(ConfigError) as refused:
    ServerConfig(warm_up="some")
  assert str(refused.value) == message
  proc = tiny_run.run([sys.executable, "-m", "jaxrm.serve", "--model=/nonexistent/model", "--warm_up=some"])
  assert (proc.returncode, proc.stderr) == (2, f"error: {message}\n"), tiny_run.describe(proc)


# ------------------------------------------------------------------ padded to a covering shape


def model_batcher(rm, config: ServerConfig) -> tuple[Batcher, list]:
  """``rm``'s server batcher, not started: the test compiles shapes and scores in its own thread.
  ``shapes`` gets (kind, shape) of every forward pass."""
  batcher = app.batcher(rm, config.resolved(rm.config.max_position_embeddings), Metrics())
  shapes = []
  score_fn, packed_fn = batcher.score_fn, batcher.packed_fn

  def recorded_score(ids, mask):
    shapes.append((ROWS, ids.shape))
    return score_fn(ids, mask)

  def recorded_packed(shared):
    shapes.append((PACKED, shared.batch.input_ids.shape))
    return packed_fn(shared)

  batcher.score_fn, batcher.packed_fn = recorded_score, recorded_packed
  return batcher, shapes


def scored(batcher: Batcher, rows: list[list[int]]) -> list:
  """The outputs of ``rows`` sent as one request, scored on the worker's path in this thread."""
  loop = asyncio.new_event_loop()
  try:
    job = Job(rows, loop, loop.create_future(), [None] * len(rows), len(rows), sum(map(len, rows)))
    batcher.score_jobs([job])
    return loop.run_until_complete(job.future)
  finally:
    loop.close()


def scored_in(rm, compiled: list, rows: list[list[int]], kind: str) -> tuple:
  """(outputs, the shape they were scored in) by a new batcher of ``rm`` with ``compiled`` its only
  compiled shapes."""
  batcher, shapes = model_batcher(rm, MODEL_CONFIG)
  for shape in compiled:
    batcher.compile(kind, shape)
  shapes.clear()
  out = scored(batcher, rows)
  [(used_kind, shape)] = shapes
  assert used_kind == kind
  return out, shape


def test_a_batch_is_padded_to_a_covering_shape_with_the_same_rewards(tiny_rm):
  batcher, _ = model_batcher(tiny_rm, MODEL_CONFIG)
  assert covering(batcher.shapes()) == [(4, 128)]
  texts = ["Short.", "A little longer, but still short."]
  rows = [tiny_rm.encode(t) for t in texts]
  assert max(map(len, rows)) < 64
  want = tiny_rm.score(texts)
  padded, shape = scored_in(tiny_rm, [(4, 128)], rows, ROWS)
  assert shape == (4, 128)  # 2 empty rows and 64 tokens of right padding
  own, shape = scored_in(tiny_rm, [(4, 128), (2, 64)], rows, ROWS)
  assert shape == (2, 64)
  assert padded == approx(own) and padded == approx(want)


def test_packed_rows_are_padded_to_a_covering_shape_with_the_same_rewards(tiny_rm):

  batcher, _ = model_batcher(tiny_rm, MODEL_CONFIG)
  assert covering(batcher.packed_shapes()) == [(4, 128), (2, 256), (1, 512)]
  rows = [tiny_rm.encode(GRPO_PROMPT, c) for c in GRPO_COMPLETIONS]
  want = tiny_rm.score(prompts=[GRPO_PROMPT] * 6, completions=GRPO_COMPLETIONS, share_prefix=False)
  own, shape = scored_in(tiny_rm, [(1, 256)], rows, PACKED)
  assert shape == (1, 256)  # one packed row: the prompt once, then the six replies
  in_rows, shape = scored_in(tiny_rm, [(2, 256), (1, 512)], rows, PACKED)
  assert shape == (2, 256)  # as few slots as (1, 512), and shorter: one empty row
  longer, shape = scored_in(tiny_rm, [(1, 512)], rows, PACKED)
  assert shape == (1, 512)  # 256 tokens of right padding, and a reward slot for each
  for out in (in_rows, longer):
    assert out == approx(own) and out == approx(want)


def test_padded_packed_rows_keep_each_rows_place():
  rows = [[5] * 70 + [k] * (k + 1) for k in range(1, 4)] + [[9] * 70 + [1, 2]] * 2
  [shared] = shared_prefix.shared_batches(
    rows, [[0, 1, 2], [3, 4]], batch_size=4, buckets=(128, 256), max_tokens=512, pad_id=0, slot_per_token=True
  )
  padded = shared.padded(4, 256, pad_id=0)
  b, t = shared.batch.input_ids.shape
  assert (b, t) == (2, 128)  # a group per row: padded, row 1's reward slots move
  assert padded.batch.input_ids.shape == padded.batch.reward_positions.shape == (4, 256)
  assert np.array_equal(padded.batch.input_ids[:b, :t], shared.batch.input_ids)
  assert not padded.batch.attention_mask[b:].any() and not padded.batch.segment_ids[:, t:].any()
  # The same rewards and token logits read from the model's outputs at each row's slots.
  rewards = np.arange(b * t, dtype=np.float32).reshape(b, t)
  big = np.full((4, 256), -1.0, np.float32)
  big[:b, :t] = rewards
  assert np.array_equal(padded.rewards(big), shared.rewards(rewards))
  logits = np.arange(b * t * 2, dtype=np.float32).reshape(b, t, 2)
  big_logits = np.zeros((4, 256, 2), np.float32)
  big_logits[:b, :t] = logits
  for got, want in zip(padded.logits(big_logits), shared.logits(logits)):
    assert np.array_equal(got, want)


def test_a_process_models_steps_through_a_covering_shape(tiny_prm):
  problems = ["What is 3 * 4 + 2?", [user("What is 10 - 3 * 2?")]]
  solutions = [["3 * 4 = 12", "12 + 2 = 14", "The answer is 14."], ["3 * 2 = 6", "10 - 6 = 4"]]
  encoded = [tiny_prm.encode_steps(p, s) for p, s in zip(problems, solutions)]
  rows = [ids for ids, _ in encoded]
  assert max(map(len, rows)) < 64
  want = tiny_prm.score_steps_batch(problems, solutions, share_prefix=False)
  padded, shape = scored_in(tiny_prm, [(4, 128)], rows, ROWS)
  assert shape == (4, 128)
  own, shape = scored_in(tiny_prm, [(2, 64)], rows, ROWS)
  assert shape == (2, 64)
  for p, o, w, (_, labels) in zip(padded, own, want, encoded):
    assert list(p) == approx(o) and list(p[labels]) == approx(w)


def _job(rows: int, length: int) -> Job:
  return Job([[7] * length] * rows, None, None, [None] * rows, rows, rows * length)


@pytest.mark.parametrize("sharing", [True, False])
def test_the_worker_waits_for_requests_while_its_rows_would_not_fill_a_pass(sharing):
  """A GRPO group's 8 completions are batch_size rows but pack into one row: with prefixes
  shared, the worker waits (batch_wait_ms) for more requests until batch_tokens tokens are taken;
  without, batch_size rows fill a pass and it does not wait."""
  config = ServerConfig(batch_size=8, max_length=256, batch_wait_ms=5000, share_prefix=sharing).resolved(8192)
  batcher, _ = recording_batcher(config)
  if not sharing:
    batcher.packed_fn = None
  first, second = _job(8, 200), _job(8, 200)  # 1,600 tokens each, of batch_tokens 2,048
  batcher.put(first)
  taken = []
  worker = threading.Thread(target=lambda: taken.append((batcher.collect(), time.monotonic())))
  start = time.monotonic()
  worker.start()
  time.sleep(1.0)  # the second request arrives 1 s after the first, well within 5 s
  batcher.put(second)
  worker.join(10)
  [(jobs, end)] = taken
  if sharing:
    assert jobs == [first, second]
    assert end - start < 3.5  # 3,200 tokens taken fill a pass: no waiting out the 5 s
  else:
    assert jobs == [first] and end - start < 1.0
