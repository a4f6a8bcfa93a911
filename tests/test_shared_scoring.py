"""Scoring rows that share a token prefix together (``jaxrm.scoring.shared_prefix``) equals scoring each
row alone: every family, sequence, regression and token heads, the reference attention and the
Pallas kernel; no branch sees a sibling; the grouping rule, split groups, rows that share nothing.
"""

import dataclasses

import hf_tiny
import jax
import numpy as np
import pytest
import torch
import transformers
from helpers import REBATCHED, VOCAB

from jaxrm import RewardModel
from jaxrm.models import decoder
from jaxrm.models import layers as L
from jaxrm.models.config import ModelConfig
from jaxrm.scoring import shared_prefix
from jaxrm.scoring.shared_prefix import Sharing

# Shared and unshared scoring are the same float32 arithmetic over other shapes (a packed row of a
# prefix and its branches against right-padded rows of other lengths), so outputs agree to float32
# rounding: REBATCHED (rtol 1e-5, atol 1e-6) from helpers. Measured on these models: <= 6e-7 on
# outputs up to ~1.6, while a branch that sees its siblings moves its reward by ~0.4 or more.

BREAK_EVEN = 240.0  # shared_prefix.break_even_length of the hf_tiny models: 64 wide, 4 heads of 16
SMOLLM2 = ModelConfig(
  family="llama",
  vocab_size=49152,
  hidden_size=576,
  intermediate_size=1536,
  num_layers=30,
  num_heads=9,
  num_kv_heads=3,
  head_dim=64,
)


def grpo_rows(seed=0, prompts=(64, 72, 81), completions=4, alone=(5, 23, 38)):
  """Rows of a GRPO-like batch, shuffled: each prompt (its length in tokens) with ``completions``
  of 1-14 tokens, and rows of ``alone`` lengths that share nothing. Returns the rows and the
  groups of row indices that share a prompt."""
  rng = np.random.default_rng(seed)
  rows, groups = [], []
  for p, length in enumerate(prompts):
    prompt = [3 + p] + rng.integers(3, VOCAB, length - 1).tolist()  # distinct first tokens
    groups.append(list(range(len(rows), len(rows) + completions)))
    rows += [prompt + rng.integers(3, VOCAB, rng.integers(1, 15)).tolist() for _ in range(completions)]
  rows += [[3 + len(prompts) + i] + rng.integers(3, VOCAB, n - 1).tolist() for i, n in enumerate(alone)]
  perm = rng.permutation(len(rows))
  where = np.argsort(perm)  # new index of each old row
  return [rows[i] for i in perm], sorted(sorted(int(where[i]) for i in g) for g in groups)


def shared_groups(rows, sharing=Sharing(), break_even=BREAK_EVEN, planned=None):
  """The groups of two or more rows that ``prefix_groups`` forms (or ``planned`` holds), each
  sorted, in order."""
  planned = shared_prefix.prefix_groups(rows, sharing, break_even) if planned is None else planned
  return sorted(sorted(g) for g in planned if len(g) > 1)


def load(tmp_path, model, **overrides):
  model.save_pretrained(tmp_path)
  return RewardModel.from_pretrained(tmp_path, dtype="float32", **overrides)


def regression_model(family):
  """A random three-output sequence head (a regression model's layout)."""
  torch.manual_seed(0)
  cfg = hf_tiny.tiny_config(family, num_labels=3)
  return transformers.AutoModelForSequenceClassification.from_config(cfg, attn_implementation="eager").eval()


def assert_shared_equals_unshared(rm, rows, groups, **kwargs):
  """Outputs with and without sharing agree, and sharing did group the rows as ``groups`` says."""
  assert shared_groups(rows, planned=rm.prefix_groups(rows, batch_size=4, bucket=16)) == groups
  shared = rm.outputs_of_ids(rows, batch_size=4, bucket=16, **kwargs)
  alone = rm.outputs_of_ids(rows, batch_size=4, bucket=16, share_prefix=False, **kwargs)
  assert [x.shape for x in shared] == [x.shape for x in alone]
  for x, y in zip(shared, alone):
    np.testing.assert_allclose(x, y, **REBATCHED)
  return shared


# ------------------------------------------------------------------ shared == unshared


@pytest.mark.parametrize("family", hf_tiny.FAMILIES)
@pytest.mark.parametrize("head", ["sequence", "token"])
def test_shared_scoring_equals_unshared(family, head, tmp_path):
  rm = load(tmp_path, hf_tiny.build(family, head))
  rows, groups = grpo_rows()
  out = assert_shared_equals_unshared(rm, rows, groups)
  if head == "token":  # each row's logits, the prefix's included
    assert [x.shape for x in out] == [(len(r), 2) for r in rows]


def test_regression_head_shares_every_output(tmp_path):
  rm = load(tmp_path, regression_model("qwen2"))
  rows, groups = grpo_rows(seed=1)
  assert rm.score_ids(rows, batch_size=4, bucket=16).shape == (len(rows), 3)
  assert_shared_equals_unshared(rm, rows, groups)


@pytest.mark.parametrize("family", hf_tiny.KERNEL_FAMILIES)
def test_shared_scoring_through_the_pallas_kernel(family, tmp_path):
  """The flash kernel (interpret mode off a GPU) reads the tree from the rows' segment and branch
  ids: Gemma 2's soft-capping and the sliding windows of Mistral and Gemma 2 on packed rows."""
  rm = load(tmp_path, hf_tiny.build(family, "sequence"), attention_impl="pallas")
  assert decoder.attention_route(rm.config) == "pallas"
  assert_shared_equals_unshared(rm, *grpo_rows(seed=2))


def test_pallas_token_head(tmp_path):
  rm = load(tmp_path, hf_tiny.build("gemma2", "token"), attention_impl="pallas")
  assert_shared_equals_unshared(rm, *grpo_rows(seed=3))


def test_score_and_score_steps_share_a_prompts_rows(tiny_rm, tiny_prm):
  """Through the tokenizer: completions of one chat prompt, and step lists of one problem."""
  chat = [
    {
      "role": "user",
      "content": "Name three colours that go well with a deep shade of green, for the walls "
      "of a small north-facing room with old oak floors, white window frames "
      "and a grey sofa that the owners mean to keep for many years.",
    }
  ]
  completions = [
    [{"role": "assistant", "content": c}] for c in ("Blue.", "Gold, cream and rust.", "Red?", "Grey")
  ]
  rows = [tiny_rm.encode(chat, c) for c in completions]
  assert shared_groups(rows, planned=tiny_rm.prefix_groups(rows)) == [[0, 1, 2, 3]]
  shared = tiny_rm.score(prompts=[chat] * 4, completions=completions)
  np.testing.assert_allclose(
    shared, tiny_rm.score(prompts=[chat] * 4, completions=completions, share_prefix=False), **REBATCHED
  )
  problem = (
    "A shop sells pencils in boxes of 12 and pens in boxes of 30. Ana buys one box of each, then "
    "buys as many again. How many pencils and pens does she have in all? Give the number."
  )
  steps = [
    ["12 + 30 = 42", "42 * 2 = 84", "The answer is 84."],
    ["12 + 30 = 42", "42 * 2 = 82"],
    ["12 + 30 = 43", "The answer is 86."],
  ]
  rows = [tiny_prm.encode_steps(problem, s)[0] for s in steps]
  # The problem alone is under min_prefix tokens; with their common first step, two solutions share.
  assert shared_groups(rows, planned=tiny_prm.prefix_groups(rows)) == [[0, 1]]
  shared = tiny_prm.score_steps_batch([problem] * 3, steps)
  alone = tiny_prm.score_steps_batch([problem] * 3, steps, share_prefix=False)
  assert [len(s) for s in shared] == [3, 2, 2]
  for x, y in zip(shared, alone):
    np.testing.assert_allclose(x, y, **REBATCHED)


# ------------------------------------------------------------------ no branch sees a sibling


def changed_outputs(rm, rows, prompt_length, seed=0):
  """Indices of the rows whose reward moves at all when every other row's own tokens change.

  The replacement tokens keep each row's length and first token of its own, so that the rows sort
  alike and are packed at the same places: each branch's arithmetic is then the same, bit for bit,
  unless it sees another branch.
  """
  rng = np.random.default_rng(seed)
  want = rm.score_ids(rows)
  moved = []
  for target in range(len(rows)):
    own = lambda r: rng.integers(3, VOCAB, len(r) - prompt_length - 1).tolist()
    changed = [r if i == target else r[: prompt_length + 1] + own(r) for i, r in enumerate(rows)]
    if rm.score_ids(changed)[target] != want[target]:
      moved.append(target)
  return moved


def broken_mask(monkeypatch, route):
  """Makes attention ignore branch ids (each branch then sees the siblings before it): every route
  (``route`` names the one under test) reads the token ids the decoder builds once."""
  ids = L.token_ids
  monkeypatch.setattr(L, "token_ids", lambda m, p, s=None, b=None, i=None: ids(m, p, s, None, i))


@pytest.mark.parametrize("route", ["reference", "pallas"])
def test_no_branch_sees_a_sibling(route, tmp_path, monkeypatch):
  rm = load(tmp_path, hf_tiny.build("mistral", "sequence"), attention_impl=route)
  rng = np.random.default_rng(4)
  prompt = rng.integers(3, VOCAB, 64).tolist()
  rows = [prompt + [10 + k] + rng.integers(3, VOCAB, n).tolist() for k, n in enumerate((9, 3, 12, 6))]
  assert shared_groups(rows) == [[0, 1, 2, 3]]
  assert changed_outputs(rm, rows, len(prompt)) == []
  # The check catches a mask that lets branches see each other: every branch but the first moves.
  with monkeypatch.context() as m:
    broken_mask(m, route)
    jax.clear_caches()  # no program traced with the right mask is reused
    assert changed_outputs(rm, rows, len(prompt)) == [1, 2, 3]
  jax.clear_caches()


# ------------------------------------------------------------------ split groups, rows alone


def test_groups_larger_than_a_row_are_split(tmp_path, monkeypatch):
  rm = load(tmp_path, hf_tiny.build("qwen3", "sequence"))
  rows, _ = grpo_rows(seed=5, prompts=(64,), completions=10, alone=())
  by_rows = Sharing(max_rows=4)
  split = shared_prefix.prefix_groups(rows, by_rows, BREAK_EVEN)
  assert max(map(len, split)) <= 4 and sum(map(len, split)) == 10 and len(split) == 3
  by_tokens = Sharing(row_length=100)
  split = shared_prefix.prefix_groups(rows, by_tokens, BREAK_EVEN)
  lengths = [shared_prefix.packed_length(rows, g) for g in split]
  assert len(split) > 1 and max(lengths) <= 100
  want = rm.score_ids(rows, share_prefix=False)
  for sharing in (by_rows, by_tokens):
    np.testing.assert_allclose(
      rm.score_ids(rows, batch_size=2, bucket=16, share_prefix=sharing), want, **REBATCHED
    )
  # batch_size=1: a packed row holds no more tokens than the longest padded row could (80, one bucket).
  shapes, passes = [], shared_prefix.shared_batches
  monkeypatch.setattr(
    shared_prefix,
    "shared_batches",
    lambda *a, **k: (shapes.append(p.batch.input_ids.shape) or p for p in passes(*a, **k)),
  )
  np.testing.assert_allclose(rm.score_ids(rows, batch_size=1, bucket=16), want, **REBATCHED)
  assert max(len(r) for r in rows) <= 80 and len(shapes) > 1 and all(b == 1 and t <= 80 for b, t in shapes)


def test_rows_that_share_nothing_score_as_before(tmp_path):
  """Bit for bit: the same right-padded batches as without sharing."""
  rm = load(tmp_path, hf_tiny.build("llama", "sequence"))
  rows, _ = grpo_rows(seed=6, prompts=(), alone=(5, 9, 17, 30, 12))
  assert shared_groups(rows) == []
  want = rm.score_ids(rows, batch_size=2, bucket=16, share_prefix=False)
  np.testing.assert_array_equal(rm.score_ids(rows, batch_size=2, bucket=16), want)


def test_score_tokens_scores_what_it_is_given(tmp_path, monkeypatch):
  rm = load(tmp_path, hf_tiny.build("llama", "sequence"))
  rows, _ = grpo_rows(seed=7, prompts=(64,), alone=())
  ids, mask = hf_tiny.batch([len(r) for r in rows])
  for i, r in enumerate(rows):
    ids[i, : len(r)] = r
  monkeypatch.setattr(
    shared_prefix, "prefix_groups", lambda *a, **k: pytest.fail("score_tokens shares nothing")
  )
  np.testing.assert_allclose(
    rm.score_tokens(ids, mask), rm.score_ids(rows, bucket=16, share_prefix=False), **REBATCHED
  )


def test_every_row_shared_calls_no_padded_batch(tmp_path, monkeypatch):
  rm = load(tmp_path, hf_tiny.build("llama", "sequence"))
  rows, _ = grpo_rows(seed=8, alone=())
  want = rm.score_ids(rows, bucket=16, share_prefix=False)
  monkeypatch.setattr(rm, "score_tokens", lambda *a: pytest.fail("a row was scored alone"))
  np.testing.assert_allclose(rm.score_ids(rows, bucket=16), want, **REBATCHED)


# ------------------------------------------------------------------ the grouping rule


def test_grouping_follows_the_shared_prefix():
  rows, groups = grpo_rows(seed=9)
  assert shared_groups(rows) == groups
  got = shared_prefix.prefix_groups(rows, Sharing(), BREAK_EVEN)
  assert sorted(i for g in got for i in g) == list(range(len(rows)))
  # Below min_prefix tokens (the prompts are 64 to 81 long), nothing is shared.
  assert shared_groups(rows, Sharing(min_prefix=83)) == []


def test_sharing_pays_for_its_attention():
  """A packed row's attention grows with the square of its length: rows that share a 70-token
  opening and then run 1000 tokens each are cheaper alone (SmolLM2-135M's shapes), the same rows
  sharing a 600-token prompt cheaper together."""
  assert (
    shared_prefix.break_even_length(SMOLLM2) == 3072
  )  # (576 * (2 * 576 + 2 * 192) + 3 * 576 * 1536) / 1152
  rng = np.random.default_rng(10)
  opening = rng.integers(3, 100, 70).tolist()
  rows = [opening + [100 + i] + rng.integers(3, 100, 999).tolist() for i in range(6)]
  assert shared_groups(rows, break_even=3072) == []
  assert shared_groups(rows, Sharing(row_length=8192), break_even=1e9) == [list(range(6))]  # free attention
  prompt = opening + rng.integers(3, 100, 530).tolist()
  rows = [prompt + r[600:1000] for r in rows]
  assert shared_groups(rows, break_even=3072) == [list(range(6))]


def test_duplicates_and_rows_that_extend_another(tmp_path):
  """A row that is another's prefix, and identical rows: each keeps at least its last token as a
  branch of its own, where its reward is read."""
  rm = load(tmp_path, hf_tiny.build("gemma2", "token"))
  rng = np.random.default_rng(11)
  prompt = rng.integers(3, VOCAB, 70).tolist()
  rows = [prompt, prompt + [5, 6, 7], prompt + [5, 6, 7], prompt + [5]]
  assert shared_groups(rows) == [[0, 1, 2, 3]]
  shared = rm.outputs_of_ids(rows, bucket=16)
  alone = rm.outputs_of_ids(rows, bucket=16, share_prefix=False)
  for x, y in zip(shared, alone):
    np.testing.assert_allclose(x, y, **REBATCHED)


def test_shared_batches_fill_rows_and_passes():
  rows, groups = grpo_rows(seed=12, prompts=(8, 9, 10, 60, 12), completions=2, alone=())
  lengths = sorted(shared_prefix.packed_length(rows, g) for g in groups)
  assert lengths == [15, 24, 28, 32, 71]
  passes = list(
    shared_prefix.shared_batches(
      rows, groups, batch_size=8, buckets=range(16, 641, 16), max_tokens=640, pad_id=0
    )
  )
  assert sorted(i for p in passes for i in p.rows) == list(range(len(rows)))
  # One pass of rows of 80 tokens; the short groups share rows, each its own segment: 3 rows used
  # (71; 32 + 28 + 15; 24), 4 computed (a power of two).
  [p] = passes
  assert p.batch.input_ids.shape == (4, 80)
  assert [len(set(row[row > 0].tolist())) for row in p.batch.segment_ids] == [1, 3, 1, 0]
  smaller = list(
    shared_prefix.shared_batches(
      rows, groups, batch_size=8, buckets=range(16, 257, 16), max_tokens=256, pad_id=0
    )
  )
  assert [p.batch.input_ids.shape for p in smaller] == [(4, 32), (1, 80)]  # at most 256 tokens a pass
  # Every row's tokens come back in order.
  for p in passes + smaller:
    tokens = p.logits(p.batch.input_ids[..., None])
    assert [t[:, 0].tolist() for t in tokens] == [rows[i] for i in p.rows]


def test_shared_batches_take_the_allowed_shape_of_fewest_slots():
  """Given the shapes a pass may have, a pass takes the one of fewest token slots that holds its
  groups as first-fit places them, then the shortest; without them, rows of its bucket."""
  rows, groups = grpo_rows(seed=12, prompts=(8, 9, 10, 60, 12), completions=2, alone=())
  passes = lambda shapes: list(
    shared_prefix.shared_batches(
      rows, groups, batch_size=8, buckets=range(16, 641, 16), max_tokens=640, pad_id=0, shapes=shapes
    )
  )
  # Groups of 71, 32, 28, 24 and 15 tokens (170): by hand, first-fit longest first fills two rows
  # of 96 (71 + 24; 32 + 28 + 15) and one of 176; four rows of 80 is the bucket's default.
  assert [p.batch.input_ids.shape for p in passes(None)] == [(4, 80)]
  assert [p.batch.input_ids.shape for p in passes([(4, 80), (2, 96), (2, 128)])] == [(2, 96)]
  assert [p.batch.input_ids.shape for p in passes([(4, 80), (2, 96), (1, 176)])] == [(1, 176)]
  assert [p.batch.input_ids.shape for p in passes([(4, 80), (2, 88), (1, 192)])] == [(2, 88)]  # 176 < 192
  assert [p.batch.input_ids.shape for p in passes([(1, 64)])] == [(4, 80)]  # none holds them
  for p in passes([(2, 96)]) + passes([(1, 176)]):  # every row's tokens come back in order
    tokens = p.logits(p.batch.input_ids[..., None])
    assert [t[:, 0].tolist() for t in tokens] == [rows[i] for i in p.rows]


def test_share_prefix_values():
  assert shared_prefix.as_sharing(True) == Sharing() and shared_prefix.as_sharing(False) is None
  assert shared_prefix.as_sharing(Sharing(min_prefix=4)).min_prefix == 4
  with pytest.raises(
    TypeError, match="share_prefix must be True, False or a jaxrm.scoring.shared_prefix.Sharing"
  ):
    shared_prefix.as_sharing("yes")
  with pytest.raises(ValueError, match="Sharing needs min_prefix >= 1"):
    Sharing(min_prefix=0)
  assert dataclasses.replace(Sharing(), max_rows=2).max_rows == 2
