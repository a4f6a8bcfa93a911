"""Batch layout, determinism, per-host split and exact resume of the Grain pipeline."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from helpers import numbered_pref, numbered_stepwise

from jaxrm import sharding
from jaxrm.data import pipeline as pl
from jaxrm.data.batches import PreferenceBatch, StepwiseBatch
from jaxrm.data.packing import PackSpec
from jaxrm.errors import DataError

BUCKETS = (16, 32, 40)


def group_ids(batch, k=2):
  return (batch.input_ids[::k, 0] // 1000).tolist()


def take(it, n):
  return [next(it) for _ in range(n)]


def arrays(batch):
  """A batch's arrays by field name."""
  return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert type(x) is type(y)
    for key, value in arrays(x).items():
      np.testing.assert_array_equal(value, getattr(y, key), err_msg=key)


def train(examples, **kw):
  kw = {"batch_size": 2, "seed": 7, "buckets": BUCKETS, **kw}
  return pl.make_train_iterator(examples, **kw)


def test_length_buckets():
  assert pl.length_buckets(200) == (64, 128, 192, 200)
  assert pl.length_buckets(128) == (64, 128)
  assert pl.length_buckets(1024)[-2:] == (960, 1024)


def test_same_seed_same_batches_and_reshuffled_epochs():
  examples = [numbered_pref(i) for i in range(11)]
  it, stream = train(examples)
  assert stream.steps_per_epoch == 5 and stream.epoch(4) == 0 and stream.epoch(5) == 1
  batches = take(it, 10)
  assert_batches_equal(batches, take(train(examples)[0], 10))
  epochs = [sum((group_ids(b) for b in batches[e * 5 : e * 5 + 5]), []) for e in range(2)]
  for order in epochs:  # each epoch: 10 distinct groups, the 11th left over
    assert len(set(order)) == 10
  assert epochs[0] != epochs[1]
  assert epochs[0] != list(range(10))  # shuffled, not in file order
  other = sum((group_ids(b) for b in take(train(examples, seed=8)[0], 5)), [])
  assert other not in epochs  # seeds 7 and 8 do not share orders an epoch apart


def test_group_integrity_and_bucket_shapes():
  examples = [numbered_pref(i) for i in range(8)]
  for batch in take(train(examples, batch_size=4)[0], 4):
    assert isinstance(batch, PreferenceBatch)
    groups = group_ids(batch)
    longest = max(len(examples[g].input_ids[0]) for g in groups)
    assert batch.input_ids.shape == (8, min(b for b in BUCKETS if b >= longest))
    assert batch.input_ids.dtype == batch.attention_mask.dtype == np.int32
    for i, g in enumerate(groups):
      for j in range(2):
        row, ids = i * 2 + j, examples[g].input_ids[j]
        np.testing.assert_array_equal(batch.input_ids[row, : len(ids)], ids)
        assert (batch.input_ids[row, len(ids) :] == 0).all()
        assert batch.attention_mask[row].tolist() == [1] * len(ids) + [0] * (
          batch.input_ids.shape[1] - len(ids)
        )
    np.testing.assert_array_equal(batch.ranks, [[0, 1]] * 4)
    assert batch.ranks.dtype == np.int32
    np.testing.assert_array_equal(batch.margin, np.array(groups, np.float32))
    np.testing.assert_array_equal(batch.example_mask, np.ones(4, np.float32))


def test_ranked_groups_pad_absent_slots():
  examples = [numbered_pref(0, n=3), numbered_pref(1, n=2)]
  [batch] = pl.make_eval_batches(examples, batch_size=2, buckets=BUCKETS, pad_id=5)
  np.testing.assert_array_equal(batch.ranks, [[0, 1, 2], [0, 1, -1]])
  assert batch.input_ids.shape == (6, 16)
  # The absent slot repeats the group's best completion, so no row is all padding.
  np.testing.assert_array_equal(batch.input_ids[5], batch.input_ids[3])
  assert batch.attention_mask[5].sum() == len(examples[1].input_ids[0])
  assert (batch.input_ids[3, len(examples[1].input_ids[0]) :] == 5).all()  # pad_id
  # Real completions of 3 + 2 + 1 and 10 + 9 tokens; the repeated best completion is not counted.
  assert batch.token_counts() == (25, 25 / 96)


def test_eval_covers_everything_once_with_fillers():
  examples = [numbered_pref(i) for i in range(5)]
  batches = pl.make_eval_batches(examples, batch_size=2, buckets=BUCKETS)
  assert [group_ids(b) for b in batches] == [[0, 1], [2, 3], [4, 4]]
  last = batches[-1]
  np.testing.assert_array_equal(last.example_mask, [1.0, 0.0])
  np.testing.assert_array_equal(last.ranks, [[0, 1], [-1, -1]])
  np.testing.assert_array_equal(last.margin, [4.0, 0.0])
  assert last.attention_mask[2:].sum() > 0  # filler rows attend to real tokens
  assert last.token_counts() == (31 + 30, (31 + 30) / (4 * 32))  # the filler group is not counted


def test_eval_per_host_split():
  examples = [numbered_pref(i) for i in range(5)]
  hosts = [
    pl.make_eval_batches(examples, batch_size=1, buckets=BUCKETS, process_index=p, process_count=2)
    for p in range(2)
  ]
  assert [[group_ids(b) for b in h] for h in hosts] == [[[0], [2], [4]], [[1], [3], [4]]]
  assert [b.example_mask[0] for b in hosts[1]] == [1.0, 1.0, 0.0]
  for b0, b1 in zip(*hosts):
    assert b0.input_ids.shape == b1.input_ids.shape


def test_per_host_batches_are_halves_of_the_global_batch():
  examples = [numbered_pref(i) for i in range(13)]
  whole = take(train(examples, batch_size=4)[0], 6)
  halves = [take(train(examples, process_index=p, process_count=2)[0], 6) for p in range(2)]
  for b, h0, h1 in zip(whole, *halves):
    assert not set(group_ids(h0)) & set(group_ids(h1))
    for key, value in arrays(b).items():  # every array is split along its leading dimension
      np.testing.assert_array_equal(np.concatenate([getattr(h0, key), getattr(h1, key)]), value, err_msg=key)


def test_resume_from_state_is_exact():
  examples = [numbered_pref(i) for i in range(11)]
  it, _ = train(examples)
  take(it, 3)
  state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
  expected = take(it, 4)  # crosses the epoch boundary at step 5
  fresh, _ = train(examples)
  fresh.set_state(state)
  assert_batches_equal(take(fresh, 4), expected)


@pytest.mark.parametrize("pack", [None, PackSpec(row_length=64, shared_prompt=True)])
def test_worker_processes_give_the_same_batches(pack):
  examples = [numbered_pref(i) for i in range(11)]
  kw = dict(batch_size=4, pack=pack, micro_batches=2 if pack else 1)
  it, _ = train(examples, num_workers=1, **kw)
  batches = take(it, 3)
  it.close()
  assert_batches_equal(batches, take(train(examples, **kw)[0], 3))


def test_stepwise_batches():
  examples = [numbered_stepwise(i) for i in range(3)]
  batches = pl.make_eval_batches(examples, batch_size=2, buckets=BUCKETS, pad_id=9)
  first, last = batches
  assert isinstance(first, StepwiseBatch)
  assert first.labels.shape == first.input_ids.shape == (2, 16)
  assert first.labels.dtype == np.int32
  assert first.labels[0].tolist() == [-100, 0] + [-100] * 14
  assert first.labels[1].tolist() == [-100, -100, 1] + [-100] * 13
  assert first.input_ids[0].tolist() == [1, 2] + [9] * 14
  np.testing.assert_array_equal(last.example_mask, [1.0, 0.0])
  assert (last.labels[1] == -100).all() and last.attention_mask[1].sum() == 4
  assert first.token_counts() == (2 + 3, 5 / 32) and last.token_counts() == (4, 4 / 32)
  it, stream = train([numbered_stepwise(i) for i in range(4)])
  assert stream.steps_per_epoch == 2 and next(it).input_ids.shape == (2, 16)


def test_to_global_batch_shards_the_batch_dimension():
  mesh = sharding.make_mesh()
  [local] = pl.make_eval_batches(
    [numbered_pref(i) for i in range(2 * mesh.size)], batch_size=2 * mesh.size, buckets=BUCKETS
  )
  batch = pl.to_global_batch(local, mesh)
  assert isinstance(batch, PreferenceBatch)
  for key, value in arrays(local).items():
    assert getattr(batch, key).sharding == sharding.batch_sharding(mesh, value.ndim)
    np.testing.assert_array_equal(np.asarray(getattr(batch, key)), value)
  # Two stacked micro-batches: rows are the second axis.
  stacked = jax.tree.map(lambda x: x.reshape(2, -1, *x.shape[1:]), local)
  batch = pl.to_global_batch(stacked, mesh, stacked=True)
  for key, value in arrays(stacked).items():
    assert getattr(batch, key).sharding == sharding.batch_sharding(mesh, value.ndim, stacked=True)
    np.testing.assert_array_equal(np.asarray(getattr(batch, key)), value)
  assert stacked.token_counts() == local.token_counts()


def test_errors_say_what_to_do():
  with pytest.raises(
    DataError,
    match=r"the training set has 3 examples after dropped rows; one "
    r"global batch needs 4 \(batch_size 2 x 2 hosts\)",
  ):
    train([numbered_pref(i) for i in range(3)], process_count=2)
  with pytest.raises(
    ValueError,
    match=r"a sequence of 17 tokens \(row 2\) exceeds the largest "
    r"length bucket 16",
  ):
    pl.make_eval_batches([numbered_pref(0), numbered_pref(2)], batch_size=2, buckets=(8, 16))
  with pytest.raises(ValueError, match="row 0 has 3 completions but batches hold num_completions=2"):
    pl.make_eval_batches([numbered_pref(0, n=3)], batch_size=1, buckets=BUCKETS, num_completions=2)
