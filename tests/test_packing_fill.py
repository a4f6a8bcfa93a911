"""Fitted packed rows (PackSpec.fit_multiple): the share of fed token slots that hold a real token
on the GPU benchmark's rows, exact layouts with every group placed once, hosts and micro-batches
in one shape, and rewards equal to the unpacked computation."""

import os
import sys

import numpy as np
import pytest
from helpers import REORDERED_ATOL, jitted, pref, random_groups, tiny_decoder_config, tiny_model

from jaxrm.data import packing, pipeline
from jaxrm.data.pipeline import Collator

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from bench_common import SHAPES, make_pairs  # noqa: E402

TARGET = 0.95  # real tokens per fed slot on the benchmark's rows (fitted)


def benchmark_batches():
  """The GPU benchmark's 8 timed steps of 8 pairs (bench.py --gpu: max_length 2048, seed 0)."""
  pairs = make_pairs(8 * 9, 2048, SHAPES["qwen2.5-1.5b"].vocab_size, 0)
  return [pairs[8 * s : 8 * (s + 1)] for s in range(1, 9)]


def completions(batch, groups):
  """Each completion read back from the packed rows: the tokens of its segment and branch (and
  of the prompt its branch continues), in row order, with their positions."""
  r = batch.reward_positions.shape[1]
  out = []
  for g, group in enumerate(groups):
    for j in range(len(group.input_ids)):
      row, slot = divmod(int(batch.reward_index[g, j]), r)
      end = batch.reward_positions[row, slot]
      seg, branch = batch.segment_ids[row], batch.branch_ids[row]
      mine = (seg == seg[end]) & ((branch == branch[end]) | (branch == 0)) & (np.arange(seg.size) <= end)
      out.append((batch.input_ids[row, mine], batch.positions[row, mine]))
  return out


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_fitted_rows_fill_the_benchmark_batches(shared_prompt):
  batches = benchmark_batches()
  first_fit = packing.PackSpec(4096, shared_prompt=shared_prompt)
  fitted = packing.PackSpec(8192, shared_prompt=shared_prompt, fit_multiple=512)
  before = packing.fill(batches, packing.PackedCollator(8, first_fit, num_completions=2))
  collate = packing.PackedCollator(8, fitted, num_completions=2)
  after = packing.fill(batches, collate)
  assert before < 0.85 and after >= TARGET, (before, after)
  written = fed = 0
  for groups in batches:
    batch = collate(groups)
    assert batch.input_ids.shape[1] % 512 == 0 and batch.input_ids.shape[1] <= 8192
    written, fed = written + batch.attention_mask.sum(), fed + batch.attention_mask.size
    for (ids, positions), want in zip(completions(batch, groups), [s for g in groups for s in g.input_ids]):
      np.testing.assert_array_equal(ids, want)
      np.testing.assert_array_equal(positions, np.arange(len(want)))
    # The same groups give the same rows.
    np.testing.assert_array_equal(collate(groups).input_ids, batch.input_ids)
  assert written / fed == pytest.approx(after, abs=1e-12)  # fill() is what the rows hold


def test_fitting_finds_rows_that_first_fit_misses():
  # First-fit decreasing puts 4 + 4 in a row of 10 and needs three rows; 4 + 3 + 3 twice fills two.
  lengths = [[4, 4, 3, 3, 3, 3]]
  assert packing.fitted_shape(lengths, packing.PackSpec(10))[:2] == (10, 3)
  t, b, [plan] = packing.fitted_shape(lengths, packing.PackSpec(10, fit_multiple=10))
  assert (t, b) == (10, 2)
  assert sorted(i for row in plan for i in row) == list(range(6))
  assert all(sum(lengths[0][i] for i in row) == 10 for row in plan)
  # Among equal slots, the row length with more factors of two (fewer shapes), then the shorter.
  assert packing.fitted_shape([[3, 3, 3, 3]], packing.PackSpec(12, fit_multiple=3))[:2] == (12, 1)
  assert packing.fitted_shape([[5, 5, 5]], packing.PackSpec(20, fit_multiple=5))[:2] == (5, 3)
  assert packing.fitted_shape([[6, 5, 5]], packing.PackSpec(20, fit_multiple=2))[:2] == (16, 1)
  # The unfitted rows' length is a candidate too, multiple or not: never more slots than unfitted.
  assert packing.fitted_shape([[6, 5, 5]], packing.PackSpec(20, fit_multiple=7))[:2] == (20, 1)
  spec = packing.PackSpec(64, length_multiple=5, fit_multiple=16)
  assert packing.fitted_shape([[5, 5, 5]], spec)[:2] == (5, 3)


def test_fitted_hosts_and_micro_batches_share_one_shape_and_place_every_group():
  rng = np.random.default_rng(3)
  groups = [pref(*random_groups(rng, 1, 2)[0].input_ids, source=f"group {i}") for i in range(8)]
  groups[5] = pref(list(range(3, 40)), list(range(3, 30)) + [50], source="long")
  spec = packing.PackSpec(128, shared_prompt=True, fit_multiple=8, rows_multiple=2, rewards_multiple=1)
  collators = [
    packing.PackedCollator(4, spec, num_completions=2, process_index=p, process_count=2, micro_batches=2)
    for p in range(2)
  ]
  hosts = [collate(groups) for collate in collators]
  assert hosts[0].input_ids.shape == hosts[1].input_ids.shape
  n, b, t = hosts[0].input_ids.shape
  assert (n, b % 2, t % 8) == (2, 0, 0)
  seen = []
  for p, host in enumerate(hosts):
    for m in range(2):
      micro = type(host)(**{k: v[m] for k, v in vars(host).items()})
      local = groups[4 * p : 4 * (p + 1)][m::2]
      # Indices count global rows: host p's rows follow host 0's.
      micro = micro.replace(reward_index=micro.reward_index - p * b * micro.reward_positions.shape[1])
      for (ids, _), want in zip(completions(micro, local), [s for g in local for s in g.input_ids]):
        np.testing.assert_array_equal(ids, want)
      seen += [g.source for g in local]
  assert sorted(seen) == sorted(g.source for g in groups)  # every group once, none dropped


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_fitted_rewards_equal_unpacked(shared_prompt):
  forward = jitted(tiny_model(tiny_decoder_config()))
  groups = random_groups(np.random.default_rng(11), 4, 3)
  ref = Collator(batch_size=4, buckets=(32,), num_completions=3)(groups)
  expected = np.asarray(forward(ref))
  spec = packing.PackSpec(64, shared_prompt=shared_prompt, fit_multiple=16)
  batch = packing.pack_preference(groups, spec, num_completions=3)
  got = np.asarray(forward(batch))
  real = ref.ranks >= 0
  np.testing.assert_array_equal(batch.ranks, ref.ranks)
  np.testing.assert_allclose(got[real], expected[real], atol=REORDERED_ATOL, rtol=0)
  assert np.ptp(expected[real]) > 0.1  # rewards differ: the check above can fail


def test_train_stream_plans_the_fill_of_its_first_batches():
  groups = random_groups(np.random.default_rng(5), 24, 2)
  spec = packing.PackSpec(64, shared_prompt=True, fit_multiple=8)
  it, stream = pipeline.make_train_iterator(groups, batch_size=4, seed=3, buckets=(32,), pack=spec)
  batches = [next(it) for _ in range(stream.steps_per_epoch)]  # fewer than FILL_BATCHES: all planned
  written = sum(int(b.attention_mask.sum()) for b in batches)
  assert stream.fill == pytest.approx(written / sum(b.attention_mask.size for b in batches), abs=1e-12)
  assert stream.fill < 1  # some slot is padding: the equality above compares two fills
  unpacked = pipeline.make_train_iterator(groups, batch_size=4, seed=3, buckets=(32,))[1]
  assert unpacked.fill is None
