"""Packed and shared-prompt rows: exact layouts, the attention they allow, and equality with the
unpacked computation on a tiny random model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrm import losses
from jaxrm.data import packing
from jaxrm.data.pipeline import Collator
from jaxrm.data.tokenize import PreferenceExample, StepwiseExample
from jaxrm.batches import IGNORE_INDEX
from jaxrm.models import layers as L
from jaxrm.models.config import ModelConfig
from jaxrm.models.decoder import Decoder

VOCAB = 128
ROW = 64  # packed row length of the model tests
UNPACKED = 32  # unpacked bucket of the model tests


def pref(*seqs, margin=0.0, source="row"):
  ids = tuple(np.asarray(s, np.int32) for s in seqs)
  return PreferenceExample(ids, tuple(range(len(ids))), margin, source, {})


def step(ids, labels, source="row"):
  return StepwiseExample(np.asarray(ids, np.int32), np.asarray(labels, np.int32), source, {})


# ------------------------------------------------------------------------------------- layouts


def test_shared_prompt_layout():
  a = pref([5, 6, 7, 8], [5, 6, 9], margin=0.5)
  b = pref([10, 11], [10, 12, 13])  # shortest is 2 tokens: at most 1 shared
  batch = packing.pack_preference([a, b], packing.PackSpec(row_length=9, shared_prompt=True,
                                                           rewards_multiple=1))
  np.testing.assert_array_equal(batch["input_ids"], [[5, 6, 7, 8, 9, 10, 11, 12, 13]])
  np.testing.assert_array_equal(batch["positions"], [[0, 1, 2, 3, 2, 0, 1, 1, 2]])
  np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 1, 1, 1, 2, 2, 2, 2]])
  np.testing.assert_array_equal(batch["branch_ids"], [[0, 0, 1, 1, 2, 0, 1, 2, 2]])
  np.testing.assert_array_equal(batch["attention_mask"], np.ones((1, 9)))
  np.testing.assert_array_equal(batch["reward_positions"], [[3, 4, 6, 8]])
  np.testing.assert_array_equal(batch["reward_index"], [[0, 1], [2, 3]])
  np.testing.assert_array_equal(batch["ranks"], [[0, 1], [0, 1]])
  np.testing.assert_array_equal(batch["margin"], [0.5, 0.0])
  np.testing.assert_array_equal(batch["example_mask"], [1, 1])


def test_plain_layout_with_fillers_and_absent_completions():
  a = pref([5, 6, 7, 8], [5, 6, 9])
  b = pref([10, 11], [10, 12, 13])
  spec = packing.PackSpec(row_length=9, pad_id=1, rewards_multiple=2)
  batch = packing.pack_preference([a, b], spec, num_groups=3, num_completions=3)
  # a (7 tokens) fills row 0 first; b (5) no longer fits beside it.
  np.testing.assert_array_equal(batch["input_ids"], [[5, 6, 7, 8, 5, 6, 9, 1, 1],
                                                     [10, 11, 10, 12, 13, 1, 1, 1, 1]])
  np.testing.assert_array_equal(batch["attention_mask"], [[1] * 7 + [0] * 2, [1] * 5 + [0] * 4])
  np.testing.assert_array_equal(batch["positions"], [[0, 1, 2, 3, 0, 1, 2, 0, 0],
                                                     [0, 1, 0, 1, 2, 0, 0, 0, 0]])
  np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 1, 1, 2, 2, 2, 0, 0],
                                                       [1, 1, 2, 2, 2, 0, 0, 0, 0]])
  np.testing.assert_array_equal(batch["branch_ids"], np.zeros((2, 9)))
  np.testing.assert_array_equal(batch["reward_positions"], [[3, 6], [1, 4]])
  np.testing.assert_array_equal(batch["reward_index"], [[0, 1, 0], [2, 3, 0], [0, 0, 0]])
  np.testing.assert_array_equal(batch["ranks"], [[0, 1, -1], [0, 1, -1], [-1, -1, -1]])
  np.testing.assert_array_equal(batch["example_mask"], [1, 1, 0])


def test_stepwise_layout():
  s1 = step([3, 4, 5], [IGNORE_INDEX, IGNORE_INDEX, 1])
  s2 = step([6, 7], [IGNORE_INDEX, 0])
  s3 = step([8, 9, 10, 11], [IGNORE_INDEX, 1, IGNORE_INDEX, 0])
  batch = packing.pack_stepwise([s1, s2, s3], packing.PackSpec(row_length=6), num_examples=4)
  np.testing.assert_array_equal(batch["input_ids"], [[8, 9, 10, 11, 6, 7], [3, 4, 5, 0, 0, 0]])
  np.testing.assert_array_equal(batch["positions"], [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 0, 0]])
  np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 1, 1, 2, 2], [1, 1, 1, 0, 0, 0]])
  np.testing.assert_array_equal(batch["token_index"], [[6, 7, 8, 0, 0, 0], [4, 5, 0, 0, 0, 0],
                                                       [0, 1, 2, 3, 0, 0], [0] * 6])
  np.testing.assert_array_equal(batch["labels"][:, :4], [[IGNORE_INDEX, IGNORE_INDEX, 1, IGNORE_INDEX],
                                                         [IGNORE_INDEX, 0, IGNORE_INDEX, IGNORE_INDEX],
                                                         [IGNORE_INDEX, 1, IGNORE_INDEX, 0],
                                                         [IGNORE_INDEX] * 4])
  assert (batch["labels"][:, 4:] == IGNORE_INDEX).all()
  np.testing.assert_array_equal(batch["example_mask"], [1, 1, 1, 0])
  # The group layout reads each sequence's tokens back in order.
  flat = batch["input_ids"].reshape(-1)
  np.testing.assert_array_equal(flat[batch["token_index"][2, :4]], s3.input_ids)


def test_group_longer_than_a_row_is_an_error():
  with pytest.raises(ValueError, match=r"data.jsonl:3 needs 7 tokens in one row but rows hold "
                                       r"row_length=6; raise row_length"):
    packing.pack_preference([pref([5, 6, 7, 8], [5, 6, 9], source="data.jsonl:3")],
                            packing.PackSpec(row_length=6))


def test_too_few_rows_is_an_error():
  groups = [pref([5, 6, 7], [5, 8]), pref([9, 10, 11], [9, 12])]
  with pytest.raises(ValueError, match=r"packing needs 2 rows of 5 tokens but num_rows=1"):
    packing.pack_preference(groups, packing.PackSpec(row_length=5), num_rows=1)


def test_packed_collator_gives_every_host_the_same_shapes():
  groups = [pref([5, 6, 7, 8], [5, 9]), pref([10, 11], [10, 12]),
            pref([13, 14, 15], [13, 16]), pref([17] * 9, [17] * 8 + [18])]
  spec = packing.PackSpec(row_length=10, shared_prompt=True, rewards_multiple=1)
  host = [packing.PackedCollator(2, spec, process_index=i, process_count=2)(groups) for i in range(2)]
  assert {k: v.shape for k, v in host[0].items()} == {k: v.shape for k, v in host[1].items()}
  # Host 1's groups take 10 and 4 tokens: two rows, which host 0 (5 + 3 tokens) pads to.
  assert host[0]["input_ids"].shape == (2, 10) and host[0]["attention_mask"][1].sum() == 0
  np.testing.assert_array_equal(host[1]["input_ids"], [[17] * 9 + [18], [13, 14, 15, 16] + [0] * 6])
  # Indices point into the global batch, host 0's rows first.
  rewards = np.concatenate([h["reward_positions"] for h in host])  # stands in for [B, R] rewards
  index = np.concatenate([h["reward_index"] for h in host])
  np.testing.assert_array_equal(packing.group_rewards(rewards, index), [[3, 4], [6, 7], [2, 3], [8, 9]])


# ------------------------------------------------------------------ random data for the model


def random_groups(rng, num_groups, k, prefix_case=True):
  """Groups sharing a prompt; one completion is a prefix of another when prefix_case."""
  groups = []
  for g in range(num_groups):
    prompt = rng.integers(3, VOCAB, rng.integers(3, 11))
    n = k if g % 3 else max(2, k - 1)  # some groups have an absent slot when k > 2
    seqs = [np.concatenate([prompt, rng.integers(3, VOCAB, rng.integers(1, 7))]) for _ in range(n)]
    if prefix_case and g == 0:
      seqs[1] = np.concatenate([seqs[0], rng.integers(3, VOCAB, 2)])
    groups.append(pref(*seqs, margin=float(g) / 4, source=f"group {g}"))
  return groups


def packed_sequences(batch):
  """Each reward slot's sequence as the model sees it: the ids of every key its query attends."""
  mask = np.asarray(L.attention_mask(batch["attention_mask"], batch["positions"],
                                     batch["segment_ids"], branch_ids_bt=batch["branch_ids"]))
  return mask, {(b, q): tuple(batch["input_ids"][b][mask[b, q]])
                for b, q in zip(*np.nonzero(batch["attention_mask"]))}


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_tokens_see_exactly_their_own_sequence(shared_prompt):
  groups = random_groups(np.random.default_rng(1), 5, 3)
  batch = packing.pack_preference(groups, packing.PackSpec(ROW, shared_prompt=shared_prompt))
  mask, seen = packed_sequences(batch)
  sequences = [tuple(s) for e in groups for s in e.input_ids]
  # Every real token sees a prefix of one real sequence, as long as its position says...
  for (b, q), keys in seen.items():
    assert len(keys) == batch["positions"][b, q] + 1
    assert any(s[:len(keys)] == keys for s in sequences), (b, q)
  # ...and a reward is read where that prefix is the whole completion.
  flat = batch["reward_positions"].reshape(-1)
  r = batch["reward_positions"].shape[1]
  for g, e in enumerate(groups):
    for j, ids in enumerate(e.input_ids):
      slot = batch["reward_index"][g, j]
      assert seen[(slot // r, flat[slot])] == tuple(ids)
  # Padding sees nothing, and nothing sees padding.
  assert not mask[batch["attention_mask"] == 0].any()
  assert not mask.transpose(0, 2, 1)[batch["attention_mask"] == 0].any()


# --------------------------------------------------------------------- equality with unpacked


def tiny_config(**overrides):
  # A window on one layer of two exercises the window mask on packed rows.
  kw = dict(family="mistral", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
            sliding_window=6, layer_types=("sliding_attention", "full_attention"))
  kw.update(overrides)
  return ModelConfig(**kw)


def tiny_model(cfg, seed=0):
  """A model with large random weights (so that every mask matters), built without compiling."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(seed)

  def init(path, x):
    base = 1.0 if "norm" in jax.tree_util.keystr(path) else 0.0
    return jnp.asarray(base + 0.3 * rng.standard_normal(x.shape), x.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(init, state))


def jitted(model):
  graphdef, state = nnx.split(model)
  return jax.jit(lambda **batch: nnx.merge(graphdef, state)(**batch))


@pytest.fixture(scope="module")
def seq_forward():
  return jitted(tiny_model(tiny_config()))


MODEL_KEYS = ("input_ids", "attention_mask", "positions", "segment_ids", "branch_ids")


def packed_rewards(forward, batch):
  out = forward(reward_positions=batch["reward_positions"], **{k: batch[k] for k in MODEL_KEYS})
  return packing.group_rewards(out, batch["reward_index"])


def unpacked_rewards(forward, groups):
  # K = 3 slots for pairs too (the third absent): one compile serves every test.
  batch = Collator(batch_size=len(groups), buckets=(UNPACKED,), num_completions=3)(groups)
  out = forward(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
  return out.reshape(len(groups), 3), batch


bradley_terry = jax.jit(losses.bradley_terry_loss)
plackett_luce = jax.jit(losses.plackett_luce_loss)


def pack(groups, shared_prompt):
  # Fixed shapes: every packed batch of these tests compiles once.
  spec = packing.PackSpec(ROW, shared_prompt=shared_prompt)
  return packing.pack_preference(groups, spec, num_groups=4, num_completions=3, num_rows=4,
                                 num_rewards=12)


@pytest.mark.parametrize("shared_prompt", [False, True])
@pytest.mark.parametrize("k", [2, 3])
def test_packed_rewards_and_losses_equal_unpacked(seq_forward, shared_prompt, k):
  groups = random_groups(np.random.default_rng(k), 4, k)
  expected, ref = unpacked_rewards(seq_forward, groups)
  batch = pack(groups, shared_prompt)
  got = packed_rewards(seq_forward, batch)
  real = ref["ranks"] >= 0
  assert real[:, :k].any(axis=0).all() and not real[:, k:].any()
  np.testing.assert_array_equal(batch["ranks"], ref["ranks"])
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(expected)[real], atol=1e-5, rtol=0)
  assert np.ptp(np.asarray(expected)[real]) > 0.1  # rewards differ: the check above can fail
  args = (batch["ranks"], batch["example_mask"])
  if k == 2:
    ref_loss, ref_m = bradley_terry(expected, ref["ranks"], ref["example_mask"], ref["margin"])
    loss, m = bradley_terry(got, *args, batch["margin"])
  else:
    ref_loss, ref_m = plackett_luce(expected, ref["ranks"], ref["example_mask"])
    loss, m = plackett_luce(got, *args)
  np.testing.assert_allclose(loss, ref_loss, atol=1e-5, rtol=0)
  np.testing.assert_allclose(m["accuracy"].total, ref_m["accuracy"].total)


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_other_segments_cannot_change_a_reward(seq_forward, shared_prompt):
  groups = random_groups(np.random.default_rng(7), 4, 3, prefix_case=False)
  batch = pack(groups, shared_prompt)
  base = np.asarray(packed_rewards(seq_forward, batch))
  # Rewrite every token of group 0's completion 1 (in shared mode: its own tokens only).
  r = batch["reward_positions"].shape[1]
  slot = batch["reward_index"][0, 1]
  row = slot // r
  end = batch["reward_positions"][row, slot % r]
  mine = ((batch["segment_ids"][row] == batch["segment_ids"][row, end])
          & (batch["branch_ids"][row] == batch["branch_ids"][row, end]))
  changed = dict(batch, input_ids=batch["input_ids"].copy())
  changed["input_ids"][row, mine] = (changed["input_ids"][row, mine] + 1) % VOCAB
  after = np.asarray(packed_rewards(seq_forward, changed))
  others = batch["ranks"] >= 0
  others[0, 1] = False
  assert np.abs(after[0, 1] - base[0, 1]) > 1e-3  # the rewritten completion did change
  np.testing.assert_array_equal(after[others], base[others])


def test_packed_stepwise_logits_and_loss_equal_unpacked():
  cfg = tiny_config(head="token", num_labels=2, head_bias=True)
  forward = jitted(tiny_model(cfg, seed=3))
  rng = np.random.default_rng(3)
  examples = []
  for i in range(5):
    n = int(rng.integers(4, 30))
    labels = np.where(rng.random(n) < 0.3, rng.integers(0, 2, n), IGNORE_INDEX)
    examples.append(step(rng.integers(3, VOCAB, n), labels, source=f"seq {i}"))
  ref = Collator(batch_size=5, buckets=(UNPACKED,))(examples)
  expected = forward(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"])
  batch = packing.pack_stepwise(examples, packing.PackSpec(ROW))
  assert batch["input_ids"].shape[0] < 5  # sequences did share rows
  logits = forward(**{k: batch[k] for k in MODEL_KEYS})
  got = packing.group_logits(logits, batch["token_index"])[:, :UNPACKED]
  real = ref["attention_mask"].astype(bool)
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(expected)[real], atol=1e-5, rtol=0)
  np.testing.assert_array_equal(batch["labels"][:, :UNPACKED], ref["labels"])
  stepwise = jax.jit(losses.stepwise_loss)
  ref_loss, ref_m = stepwise(expected, ref["labels"], ref["example_mask"])
  loss, m = stepwise(got, batch["labels"][:, :UNPACKED], batch["example_mask"])
  np.testing.assert_allclose(loss, ref_loss, atol=1e-5, rtol=0)
  for name in ("step_accuracy", "first_error_found"):
    np.testing.assert_allclose(m[name].total, ref_m[name].total)
    np.testing.assert_allclose(m[name].count, ref_m[name].count)


def test_length_multiple_shortens_rows_to_the_longest_group():
  groups = [pref([5, 6, 7], [5, 8]), pref([9, 10, 11, 12], [9, 13, 14])]  # 5 and 7 tokens
  spec = packing.PackSpec(row_length=64, length_multiple=4)
  batch = packing.pack_preference(groups, spec)
  assert batch["input_ids"].shape == (2, 8)  # 7 rounds up to 8; 5 + 7 do not share a row
  np.testing.assert_array_equal(batch["input_ids"][0], [9, 10, 11, 12, 9, 13, 14, 0])
  np.testing.assert_array_equal(batch["input_ids"][1], [5, 6, 7, 5, 8, 0, 0, 0])
  # Hosts agree on the longest row any of them needs.
  host0 = packing.PackedCollator(1, spec, process_index=0, process_count=2)(groups)
  assert host0["input_ids"].shape == (1, 8)
