"""Unpacked micro-batches padded each to its own bucket, and length-grouped training order: the
shapes, the per-host slices, the tokens fed, and training that still updates as one big batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tiny_run
from flax import nnx

from jaxrm import sharding
from jaxrm.config import RewardSpec
from jaxrm.data import grouping, pipeline, registry
from jaxrm.data.drops import DropReport
from jaxrm.data.tokenize import PreferenceExample, TokenizeOptions, pad_id, tokenize_all
from jaxrm.run import steps

BUCKETS = (8, 16, 24, 32, 40)
# The longest completion of group i (the other is one token shorter); sorted, groups 0, 3, 6, 2
# (5 to 12 tokens) make the short micro-batch and 5, 7, 1, 4 (18 to 33) the long one.
LENGTHS = (5, 30, 12, 7, 33, 18, 9, 25)
# SGD at learning rate 1: the first update is minus the mean-loss gradient, which micro-batches of
# other lengths must compute alike up to float32 sums in another order (a few float32 epsilons
# of the largest element, as in test_micro_batches.py); a group counted twice or missed moves
# elements by a large fraction of the largest.
UPDATE_RTOL = 1e-4


def pair(i, length):
  """Group i: two completions of ``length`` and ``length - 1`` tokens, each token 1000 * i + 1."""
  ids = tuple(np.full(length - j, 1000 * i + 1, np.int32) for j in range(2))
  return PreferenceExample(input_ids=ids, ranks=(0, 1), margin=0.0, source=f"group {i}", meta={})


def groups_of(batch):
  """The group of each pair of rows, read off its tokens."""
  return (batch.input_ids[::2, 0] // 1000).tolist()


def micro_collator(process_index=0, process_count=1, n=2):
  collate = pipeline.Collator(
    batch_size=8 // n // process_count,
    buckets=BUCKETS,
    num_completions=2,
    process_index=process_index,
    process_count=process_count,
  )
  return pipeline.MicroBatchCollator(collate, n)


def test_each_micro_batch_is_padded_to_its_own_bucket():
  groups = [pair(i, n) for i, n in enumerate(LENGTHS)]
  short, long = micro_collator()(groups)
  assert groups_of(short) == [0, 3, 6, 2] and groups_of(long) == [5, 7, 1, 4]
  assert short.input_ids.shape == (8, 16) and long.input_ids.shape == (8, 40)
  # Every token of a group is where it was: completion j of group i holds LENGTHS[i] - j tokens.
  for batch in (short, long):
    for row, i in enumerate(np.repeat(groups_of(batch), 2)):
      assert batch.attention_mask[row].sum() == LENGTHS[i] - row % 2
  # One batch padded to its longest sequence would feed 8 x 2 x 40 = 640 token slots.
  real = sum(2 * n - 1 for n in LENGTHS)
  assert pipeline.token_counts((short, long)) == (real, real / (4 * 2 * 16 + 4 * 2 * 40))
  assert pipeline.Collator(8, BUCKETS, num_completions=2)(groups).token_counts() == (real, real / 640)


def test_hosts_take_their_slice_of_every_micro_batch():
  groups = [pair(i, n) for i, n in enumerate(LENGTHS)]
  hosts = [micro_collator(p, 2)(groups) for p in range(2)]
  assert [[groups_of(m) for m in h] for h in hosts] == [[[0, 3], [5, 7]], [[6, 2], [1, 4]]]
  # The bucket is the micro-batch's over all hosts: host 0's long slice (at most 25 tokens) is 40 long.
  assert [[m.input_ids.shape for m in h] for h in hosts] == [[(4, 16), (4, 40)]] * 2


def test_micro_batched_iterator_splits_the_same_global_batches_and_resumes():
  examples = [pair(i, 3 + (i * 7) % 30) for i in range(19)]
  kw = dict(batch_size=8, seed=3, buckets=BUCKETS, num_completions=2)
  whole = pipeline.make_train_iterator(examples, **kw)[0]
  split, _ = pipeline.make_train_iterator(examples, micro_batches=4, **kw)
  for _ in range(5):  # two epochs and a half
    micro = next(split)
    assert len(micro) == 4 and all(groups_of(m) for m in micro)
    assert sorted(sum(map(groups_of, micro), [])) == sorted(groups_of(next(whole)))
    # Sorted by length: no micro-batch is padded longer than the next.
    assert [m.input_ids.shape[1] for m in micro] == sorted(m.input_ids.shape[1] for m in micro)
  state = split.get_state()
  resumed, _ = pipeline.make_train_iterator(examples, micro_batches=4, **kw)
  resumed.set_state(state)
  for _ in range(3):
    for a, b in zip(next(split), next(resumed), strict=True):
      np.testing.assert_array_equal(a.input_ids, b.input_ids)


def test_group_by_length_order():
  lengths = [3 + (i * 7) % 30 for i in range(40)]
  examples = [pair(i, n) for i, n in enumerate(lengths)]
  it, stream = pipeline.make_train_iterator(
    examples, batch_size=4, seed=5, buckets=BUCKETS, num_completions=2, group_by_length=True
  )
  assert stream.steps_per_epoch == 10
  for _epoch in range(2):
    order = sum((groups_of(next(it)) for _ in range(10)), [])
    assert sorted(order) == list(range(40))  # every group once an epoch
    assert lengths[order[0]] == max(lengths)  # the longest first: memory fails at step 1 if at all
    # 40 groups in batches of 4 make mega-batches of 2 batches (transformers' choice for 4 of
    # them); each is sorted longest first, apart from the longest group swapped to the front.
    assert grouping.mega_batches(40, 4) == 2
    for m in range(0, 40, 8):
      mega = [lengths[i] for i in order[m : m + 8]]
      assert mega[1:] == sorted(mega[1:], reverse=True)
  firsts = [
    groups_of(
      next(
        pipeline.make_train_iterator(
          examples, batch_size=4, seed=5, buckets=BUCKETS, num_completions=2, group_by_length=True
        )[0]
      )
    )
    for _ in range(2)
  ]
  assert firsts[0] == firsts[1]  # the order comes from the seed alone


def test_group_by_length_lowers_the_tokens_fed():
  """On long-tailed lengths, fed token slots: global-batch padding > per-micro-batch > grouped."""
  rng = np.random.default_rng(0)
  lengths = np.clip(rng.lognormal(np.log(60), 0.8, 256), 4, 400).astype(int)
  examples = [pair(i, n) for i, n in enumerate(lengths)]
  buckets = pipeline.length_buckets(400, 16)
  kw = dict(batch_size=32, seed=0, buckets=buckets, num_completions=2)

  def efficiency(**options):
    it, stream = pipeline.make_train_iterator(examples, **kw, **options)
    counts = [pipeline.token_counts(next(it)) for _ in range(stream.steps_per_epoch)]
    return sum(n for n, _ in counts) / sum(n / share for n, share in counts)

  whole, micro, grouped = (
    efficiency(),
    efficiency(micro_batches=8),
    efficiency(micro_batches=8, group_by_length=True),
  )
  # No batching pads less than each group alone padded to its own bucket.
  bound = sum(2 * n - 1 for n in lengths) / sum(2 * -(-n // 16) * 16 for n in lengths)
  assert whole < micro < grouped <= bound
  # A batch of 32 long-tailed groups nearly always holds one long group, which all are padded to.
  assert whole < 0.5 * micro


def test_group_by_length_refuses_packing():
  from jaxrm.config import DataSpec
  from jaxrm.errors import ConfigError

  with pytest.raises(
    ConfigError,
    match=r"data.group_by_length=True orders unpacked batches; "
    r"data.packing='packed' already fills rows",
  ):
    DataSpec(packing="packed", group_by_length=True)


# ------------------------------------------------------------------ the first update


def test_first_micro_batched_update_equals_the_whole_batch(tiny_rm):
  records = registry.load_records("demo_arithmetic", None, split="train", drops=DropReport())[:64]
  examples = tokenize_all(records, tiny_rm.tokenizer, TokenizeOptions(max_length=96), DropReport())
  buckets = tuple(range(4, 97, 4))  # the demo's pairs are 33 to 41 tokens long
  kw = dict(batch_size=8, seed=1, buckets=buckets, pad_id=pad_id(tiny_rm.tokenizer), num_completions=2)
  whole = next(pipeline.make_train_iterator(examples, **kw)[0])
  micro = next(pipeline.make_train_iterator(examples, micro_batches=2, **kw)[0])
  assert micro[0].input_ids.shape[1] < micro[1].input_ids.shape[1] == whole.input_ids.shape[1]
  loss_fn = steps.make_loss_fn(tiny_rm.model, RewardSpec())

  def update(step_of, batch):
    params = jax.tree.map(jnp.copy, nnx.state(tiny_rm.model))  # a copy: the step donates its arrays
    mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), devices=jax.devices()[:1])
    tx = optax.sgd(1.0)
    state, shardings = steps.init_state(params, tx, seed=0, mesh=mesh)
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
    before = flat(state["params"])
    state, _ = step_of(tx, shardings, mesh)(state, pipeline.to_global_batch(batch, mesh))
    return flat(state["params"]) - before

  want = update(
    lambda tx, sh, mesh: steps.make_train_step(loss_fn, tx, lambda _: 1.0, state_shardings=sh),
    whole,
  )
  got = update(
    lambda tx, sh, mesh: steps.MicroBatchedStep(loss_fn, tx, lambda _: 1.0, state_shardings=sh),
    micro,
  )
  np.testing.assert_allclose(got, want, rtol=0, atol=UPDATE_RTOL * np.abs(want).max())


# ------------------------------------------------------------------ end to end


def test_length_grouped_accumulated_run_resumes_exactly(model_dir, tmp_path, capsys):
  """A run with data.group_by_length and 2 micro-batches of their own lengths, stopped after 2 of
  its 4 steps and continued, logs what the uninterrupted run logs."""
  options = dict(
    data__group_by_length=True,
    data__bucket_multiple=8,
    train__micro_batch_size=4,
    eval__val_period=0,
    checkpointing__save_period=0,
    checkpointing__metric_name="",
  )
  whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
  tiny_run.train(tiny_run.config(model_dir, whole, **options))
  assert "each micro-batch padded to its own length, in length-grouped order" in capsys.readouterr().out
  tiny_run.train(tiny_run.config(model_dir, parts, **options), stop_after_steps=2)
  out = capsys.readouterr().out
  assert "run stopped early (run again to continue): 2 steps in " in out and "run finished" not in out
  tiny_run.train(tiny_run.config(model_dir, parts, **options))
  assert "run finished: 2 steps in " in capsys.readouterr().out
  keys = ("train/loss", "train/accuracy", "train/grad_norm", "train/packing_efficiency")
  # The same programs on the same batches from the same state: equal to the bit.
  tiny_run.assert_resumed_equals_uninterrupted(parts, whole, [1, 2, 3, 4], keys, atol=0)
