"""Packed and shared-prompt rows: exact layouts, the attention they allow, and equality with the
unpacked computation on a tiny random model."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
  REORDERED_ATOL,
  VOCAB,
  jitted,
  pref,
  random_groups,
  stepwise,
  tiny_decoder_config,
  tiny_model,
)

from jaxrm.data import packing
from jaxrm.data.batches import IGNORE_INDEX, PackedPreferenceBatch, PackedStepwiseBatch
from jaxrm.data.pipeline import Collator
from jaxrm.models import layers as L
from jaxrm.run import steps
from jaxrm.tasks import losses

ROW = 64  # packed row length of the model tests
UNPACKED = 32  # unpacked bucket of the model tests


# ------------------------------------------------------------------------------------- layouts


def test_shared_prompt_layout():
  a = pref([5, 6, 7, 8], [5, 6, 9], margin=0.5)
  b = pref([10, 11], [10, 12, 13])  # shortest is 2 tokens: at most 1 shared
  batch = packing.pack_preference(
    [a, b], packing.PackSpec(row_length=9, shared_prompt=True, rewards_multiple=1)
  )
  assert isinstance(batch, PackedPreferenceBatch)
  np.testing.assert_array_equal(batch.input_ids, [[5, 6, 7, 8, 9, 10, 11, 12, 13]])
  np.testing.assert_array_equal(batch.positions, [[0, 1, 2, 3, 2, 0, 1, 1, 2]])
  np.testing.assert_array_equal(batch.segment_ids, [[1, 1, 1, 1, 1, 2, 2, 2, 2]])
  np.testing.assert_array_equal(batch.branch_ids, [[0, 0, 1, 1, 2, 0, 1, 2, 2]])
  np.testing.assert_array_equal(batch.attention_mask, np.ones((1, 9)))
  np.testing.assert_array_equal(batch.reward_positions, [[3, 4, 6, 8]])
  np.testing.assert_array_equal(batch.reward_index, [[0, 1], [2, 3]])
  np.testing.assert_array_equal(batch.ranks, [[0, 1], [0, 1]])
  np.testing.assert_array_equal(batch.margin, [0.5, 0.0])
  np.testing.assert_array_equal(batch.example_mask, [1, 1])
  # Each completion counts whole (4 + 3 + 2 + 3 tokens), though the prompts are written once.
  assert batch.token_counts() == (12, 1.0)


def test_plain_layout_with_fillers_and_absent_completions():
  a = pref([5, 6, 7, 8], [5, 6, 9])
  b = pref([10, 11], [10, 12, 13])
  spec = packing.PackSpec(row_length=9, pad_id=1, rewards_multiple=2)
  batch = packing.pack_preference([a, b], spec, num_groups=3, num_completions=3)
  # a (7 tokens) fills row 0 first; b (5) no longer fits beside it.
  np.testing.assert_array_equal(
    batch.input_ids, [[5, 6, 7, 8, 5, 6, 9, 1, 1], [10, 11, 10, 12, 13, 1, 1, 1, 1]]
  )
  np.testing.assert_array_equal(batch.attention_mask, [[1] * 7 + [0] * 2, [1] * 5 + [0] * 4])
  np.testing.assert_array_equal(batch.positions, [[0, 1, 2, 3, 0, 1, 2, 0, 0], [0, 1, 0, 1, 2, 0, 0, 0, 0]])
  np.testing.assert_array_equal(batch.segment_ids, [[1, 1, 1, 1, 2, 2, 2, 0, 0], [1, 1, 2, 2, 2, 0, 0, 0, 0]])
  np.testing.assert_array_equal(batch.branch_ids, np.zeros((2, 9)))
  np.testing.assert_array_equal(batch.reward_positions, [[3, 6], [1, 4]])
  np.testing.assert_array_equal(batch.reward_index, [[0, 1, 0], [2, 3, 0], [0, 0, 0]])
  np.testing.assert_array_equal(batch.ranks, [[0, 1, -1], [0, 1, -1], [-1, -1, -1]])
  np.testing.assert_array_equal(batch.example_mask, [1, 1, 0])
  assert batch.token_counts() == (12, 12 / 18)  # the filler and absent slots take no room


def test_stepwise_layout():
  s1 = stepwise([3, 4, 5], [IGNORE_INDEX, IGNORE_INDEX, 1])
  s2 = stepwise([6, 7], [IGNORE_INDEX, 0])
  s3 = stepwise([8, 9, 10, 11], [IGNORE_INDEX, 1, IGNORE_INDEX, 0])
  batch = packing.pack_stepwise([s1, s2, s3], packing.PackSpec(row_length=6), num_examples=4)
  assert isinstance(batch, PackedStepwiseBatch)
  np.testing.assert_array_equal(batch.input_ids, [[8, 9, 10, 11, 6, 7], [3, 4, 5, 0, 0, 0]])
  np.testing.assert_array_equal(batch.positions, [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 0, 0]])
  np.testing.assert_array_equal(batch.segment_ids, [[1, 1, 1, 1, 2, 2], [1, 1, 1, 0, 0, 0]])
  np.testing.assert_array_equal(
    batch.token_index, [[6, 7, 8, 0, 0, 0], [4, 5, 0, 0, 0, 0], [0, 1, 2, 3, 0, 0], [0] * 6]
  )
  np.testing.assert_array_equal(
    batch.labels[:, :4],
    [
      [IGNORE_INDEX, IGNORE_INDEX, 1, IGNORE_INDEX],
      [IGNORE_INDEX, 0, IGNORE_INDEX, IGNORE_INDEX],
      [IGNORE_INDEX, 1, IGNORE_INDEX, 0],
      [IGNORE_INDEX] * 4,
    ],
  )
  assert (batch.labels[:, 4:] == IGNORE_INDEX).all()
  np.testing.assert_array_equal(batch.example_mask, [1, 1, 1, 0])
  assert batch.token_counts() == (9, 9 / 12)
  # The group layout reads each sequence's tokens back in order.
  flat = batch.input_ids.reshape(-1)
  np.testing.assert_array_equal(flat[batch.token_index[2, :4]], s3.input_ids)


def test_group_longer_than_a_row_is_an_error():
  with pytest.raises(
    ValueError,
    match=r"data.jsonl:3 needs 7 tokens in one row but rows hold "
    r"row_length=6; raise row_length",
  ):
    packing.pack_preference(
      [pref([5, 6, 7, 8], [5, 6, 9], source="data.jsonl:3")], packing.PackSpec(row_length=6)
    )


def test_too_few_rows_is_an_error():
  groups = [pref([5, 6, 7], [5, 8]), pref([9, 10, 11], [9, 12])]
  with pytest.raises(ValueError, match=r"packing needs 2 rows of 5 tokens but num_rows=1"):
    packing.pack_preference(groups, packing.PackSpec(row_length=5), num_rows=1)


def test_packed_collator_gives_every_host_the_same_shapes():
  groups = [
    pref([5, 6, 7, 8], [5, 9]),
    pref([10, 11], [10, 12]),
    pref([13, 14, 15], [13, 16]),
    pref([17] * 9, [17] * 8 + [18]),
  ]
  spec = packing.PackSpec(row_length=10, shared_prompt=True, rewards_multiple=1)
  host = [packing.PackedCollator(2, spec, process_index=i, process_count=2)(groups) for i in range(2)]
  assert {k: v.shape for k, v in vars(host[0]).items()} == {k: v.shape for k, v in vars(host[1]).items()}
  # Host 1's groups take 10 and 4 tokens: two rows, which host 0 (5 + 3 tokens) pads to.
  assert host[0].input_ids.shape == (2, 10) and host[0].attention_mask[1].sum() == 0
  np.testing.assert_array_equal(host[1].input_ids, [[17] * 9 + [18], [13, 14, 15, 16] + [0] * 6])
  # Indices point into the global batch, host 0's rows first.
  rewards = np.concatenate([h.reward_positions for h in host])  # stands in for [B, R] rewards
  index = np.concatenate([h.reward_index for h in host])
  np.testing.assert_array_equal(packing.group_rewards(rewards, index), [[3, 4], [6, 7], [2, 3], [8, 9]])


def test_stacked_micro_batches_count_tokens_as_one_batch():
  groups = [pref([5, 6, 7], [5, 8]), pref([9, 10], [9, 11, 12]), pref([13], [14]), pref([15, 16], [17])]
  spec = packing.PackSpec(row_length=8, shared_prompt=True, rewards_multiple=1)
  batch = packing.PackedCollator(4, spec, micro_batches=2)(groups)
  assert batch.input_ids.shape == (2, 1, 8)
  # Micro-batch 0 holds groups 0 and 2 (prompt [5] once: 4 + 2 slots), micro-batch 1 groups 1
  # and 3 (prompt [9] once: 4 + 3 slots); their completions have 5 + 2 + 5 + 3 tokens.
  assert batch.token_counts() == (15, 13 / 16)
  unpacked = Collator(batch_size=4, buckets=(8,), num_completions=2)(groups)
  assert unpacked.token_counts()[0] == 15


# ------------------------------------------------------------------ attention on packed rows


def packed_sequences(batch):
  """Each reward slot's sequence as the model sees it: the ids of every key its query attends."""
  mask = np.asarray(
    L.attention_mask(batch.attention_mask, batch.positions, batch.segment_ids, branch_ids_bt=batch.branch_ids)
  )
  return mask, {
    (b, q): tuple(batch.input_ids[b][mask[b, q]]) for b, q in zip(*np.nonzero(batch.attention_mask))
  }


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_tokens_see_exactly_their_own_sequence(shared_prompt):
  groups = random_groups(np.random.default_rng(1), 5, 3)
  batch = packing.pack_preference(groups, packing.PackSpec(ROW, shared_prompt=shared_prompt))
  mask, seen = packed_sequences(batch)
  sequences = [tuple(s) for e in groups for s in e.input_ids]
  # Every real token sees a prefix of one real sequence, as long as its position says...
  for (b, q), keys in seen.items():
    assert len(keys) == batch.positions[b, q] + 1
    assert any(s[: len(keys)] == keys for s in sequences), (b, q)
  # ...and a reward is read where that prefix is the whole completion.
  flat = batch.reward_positions.reshape(-1)
  r = batch.reward_positions.shape[1]
  for g, e in enumerate(groups):
    for j, ids in enumerate(e.input_ids):
      slot = batch.reward_index[g, j]
      assert seen[(slot // r, flat[slot])] == tuple(ids)
  # Padding sees nothing, and nothing sees padding.
  assert not mask[batch.attention_mask == 0].any()
  assert not mask.transpose(0, 2, 1)[batch.attention_mask == 0].any()


# --------------------------------------------------------------------- equality with unpacked


@pytest.fixture(scope="module")
def seq_forward():
  return jitted(tiny_model(tiny_decoder_config()))


def unpacked_rewards(forward, groups):
  # K = 3 slots for pairs too (the third absent): one compile serves every test.
  batch = Collator(batch_size=len(groups), buckets=(UNPACKED,), num_completions=3)(groups)
  return forward(batch), batch


bradley_terry = jax.jit(losses.bradley_terry_loss)
plackett_luce = jax.jit(losses.plackett_luce_loss)


def pack(groups, shared_prompt):
  # Fixed shapes: every packed batch of these tests compiles once.
  spec = packing.PackSpec(ROW, shared_prompt=shared_prompt)
  return packing.pack_preference(groups, spec, num_groups=4, num_completions=3, num_rows=4, num_rewards=12)


@pytest.mark.parametrize("shared_prompt", [False, True])
@pytest.mark.parametrize("k", [2, 3])
def test_packed_rewards_and_losses_equal_unpacked(seq_forward, shared_prompt, k):
  groups = random_groups(np.random.default_rng(k), 4, k)
  expected, ref = unpacked_rewards(seq_forward, groups)
  batch = pack(groups, shared_prompt)
  got = seq_forward(batch)
  real = ref.ranks >= 0
  assert real[:, :k].any(axis=0).all() and not real[:, k:].any()
  np.testing.assert_array_equal(batch.ranks, ref.ranks)
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(expected)[real], atol=REORDERED_ATOL, rtol=0)
  assert np.ptp(np.asarray(expected)[real]) > 0.1  # rewards differ: the check above can fail
  args = (batch.ranks, batch.example_mask)
  if k == 2:
    ref_loss, ref_m = bradley_terry(expected, ref.ranks, ref.example_mask, ref.margin)
    loss, m = bradley_terry(got, *args, batch.margin)
  else:
    ref_loss, ref_m = plackett_luce(expected, ref.ranks, ref.example_mask)
    loss, m = plackett_luce(got, *args)
  # A mean of softplus (or log-sum-exp) terms of the rewards, whose slopes are below 1: the loss
  # differs about as much as the rewards do.
  np.testing.assert_allclose(loss, ref_loss, atol=REORDERED_ATOL, rtol=0)
  # A count of right groups: exact in float32 (the default rtol=1e-7 allows no more).
  np.testing.assert_allclose(m["accuracy"].total, ref_m["accuracy"].total)


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_other_segments_cannot_change_a_reward(seq_forward, shared_prompt):
  groups = random_groups(np.random.default_rng(7), 4, 3, prefix_case=False)
  batch = pack(groups, shared_prompt)
  base = np.asarray(seq_forward(batch))
  # Rewrite every token of group 0's completion 1 (in shared mode: its own tokens only).
  r = batch.reward_positions.shape[1]
  slot = batch.reward_index[0, 1]
  row = slot // r
  end = batch.reward_positions[row, slot % r]
  mine = (batch.segment_ids[row] == batch.segment_ids[row, end]) & (
    batch.branch_ids[row] == batch.branch_ids[row, end]
  )
  changed = batch.replace(input_ids=batch.input_ids.copy())
  changed.input_ids[row, mine] = (changed.input_ids[row, mine] + 1) % VOCAB
  after = np.asarray(seq_forward(changed))
  others = batch.ranks >= 0
  others[0, 1] = False
  assert np.abs(after[0, 1] - base[0, 1]) > 1e-3  # the rewritten completion did change
  np.testing.assert_array_equal(after[others], base[others])


def test_packed_stepwise_logits_and_loss_equal_unpacked():
  cfg = tiny_decoder_config(head="token", num_labels=2, head_bias=True)
  forward = jitted(tiny_model(cfg, seed=3))
  rng = np.random.default_rng(3)
  examples = []
  for i in range(5):
    n = int(rng.integers(4, 30))
    labels = np.where(rng.random(n) < 0.3, rng.integers(0, 2, n), IGNORE_INDEX)
    examples.append(stepwise(rng.integers(3, VOCAB, n), labels, source=f"seq {i}"))
  ref = Collator(batch_size=5, buckets=(UNPACKED,))(examples)
  expected = forward(ref)
  batch = packing.pack_stepwise(examples, packing.PackSpec(ROW))
  assert batch.input_ids.shape[0] < 5  # sequences did share rows
  got = forward(batch)[:, :UNPACKED]
  real = ref.attention_mask.astype(bool)
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(expected)[real], atol=REORDERED_ATOL, rtol=0)
  np.testing.assert_array_equal(batch.labels[:, :UNPACKED], ref.labels)
  stepwise_loss = jax.jit(losses.stepwise_loss)
  ref_loss, ref_m = stepwise_loss(expected, ref.labels, ref.example_mask)
  loss, m = stepwise_loss(got, batch.labels[:, :UNPACKED], batch.example_mask)
  # Cross-entropy's slopes in the logits are below 1: the loss differs about as much as they do.
  np.testing.assert_allclose(loss, ref_loss, atol=REORDERED_ATOL, rtol=0)
  # Counts of steps: sums of 0s and 1s, exact in float32 (the default rtol=1e-7 allows no more).
  for name in ("step_accuracy", "first_error_found"):
    np.testing.assert_allclose(m[name].total, ref_m[name].total)
    np.testing.assert_allclose(m[name].count, ref_m[name].count)


def test_length_multiple_shortens_rows_to_the_longest_group():
  groups = [pref([5, 6, 7], [5, 8]), pref([9, 10, 11, 12], [9, 13, 14])]  # 5 and 7 tokens
  spec = packing.PackSpec(row_length=64, length_multiple=4)
  batch = packing.pack_preference(groups, spec)
  assert batch.input_ids.shape == (2, 8)  # 7 rounds up to 8; 5 + 7 do not share a row
  np.testing.assert_array_equal(batch.input_ids[0], [9, 10, 11, 12, 9, 13, 14, 0])
  np.testing.assert_array_equal(batch.input_ids[1], [5, 6, 7, 5, 8, 0, 0, 0])
  # Hosts agree on the longest row any of them needs.
  host0 = packing.PackedCollator(1, spec, process_index=0, process_count=2)(groups)
  assert host0.input_ids.shape == (1, 8)


def test_compiled_per_shape_compiles_once_per_batch_shape():
  step = steps.CompiledPerShape("sum", jax.jit(lambda batch: jnp.sum(batch.input_ids)))
  spec = packing.PackSpec(row_length=8, rewards_multiple=1)
  a = packing.pack_preference([pref([5, 6, 7], [5, 8])], spec)
  b = packing.pack_preference([pref([9, 10], [9, 11, 12])], spec)
  longer = packing.pack_preference([pref([5, 6, 7], [5, 8])], dataclasses.replace(spec, row_length=9))
  assert step.compile(a) is step.compile(b)
  assert step.compile(longer) is not step.compile(a)
  assert int(step(b)) == 9 + 10 + 9 + 11 + 12
