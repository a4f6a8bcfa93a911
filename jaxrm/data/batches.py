"""The batch layouts that the data pipeline builds and the train and eval steps consume.

Eight frozen pytrees, one per layout: :class:`PreferenceBatch`, :class:`StepwiseBatch`,
:class:`RegressionBatch` and :class:`LabelledBatch` hold one sequence per row (built by ``data.pipeline.Collator``),
:class:`PackedPreferenceBatch`, :class:`PackedStepwiseBatch`, :class:`PackedRegressionBatch` and
:class:`PackedLabelledBatch` several (built by ``data.packing``). Their arrays are numpy on the
host that collated them and ``jax.Array`` once ``pipeline.to_global_batch`` has placed them. Where
n micro-batches are stacked for gradient accumulation, every array gets a leading ``[n]`` axis and
the batch is still one object.

In every layout G is the number of groups (preference) or sequences (stepwise, regression), T the
row length, A the number of rated attributes. A row or slot that holds nothing real (an absent
completion, a filler group that pads the last eval batch) is hidden by ``ranks == -1``,
``labels == IGNORE_INDEX``, ``label_mask == 0`` or ``example_mask == 0``.

Each batch runs the model on itself (:meth:`outputs`, the array its loss takes) and counts its
real tokens on the host (:meth:`token_counts`).
"""

from __future__ import annotations

from typing import ClassVar

import jax
import numpy as np
from flax import struct

IGNORE_INDEX = -100  # label of a position that carries no step label

Array = np.ndarray | jax.Array


@struct.dataclass
class PreferenceBatch:
  """G groups of K completions, one per row; completion j of group i is row i*K + j.

  T is the smallest length bucket that holds the longest sequence of the *global* batch, so that
  every host builds the same shapes. An absent completion or a filler group repeats a real
  sequence of the batch instead of being all padding, because a row with no attended token can
  turn attention into NaN.
  """

  input_ids: Array  # [G*K, T] int32, right-padded with pad_id
  attention_mask: Array  # [G*K, T] int32
  ranks: Array  # [G, K] int32: position in preference order (0 = best), -1 = no completion
  margin: Array  # [G] float32
  example_mask: Array  # [G] float32: 0 for filler groups
  strength: Array | None = None  # [G] float32: annotated preference strength, 1 where none is given

  # Unpacked batches are split into micro-batches by the train step, packed ones by the collator.
  packed: ClassVar[bool] = False

  def outputs(self, model) -> jax.Array:
    """Rewards [G, K]."""
    return model(self.input_ids, self.attention_mask).reshape(self.ranks.shape)

  def token_counts(self) -> tuple[int, float]:
    """(tokens of the real completions, their share of the token slots), on the host."""
    mask = np.asarray(self.attention_mask)
    return _unpacked_counts(mask, np.asarray(self.ranks).reshape(mask.shape[:-1]) >= 0)


class _OneRowEach:
  """Rows that each hold one example's sequence, filler rows marked by ``example_mask``."""

  packed: ClassVar[bool] = False

  def token_counts(self) -> tuple[int, float]:
    """(tokens of the real rows, their share of the token slots), on the host."""
    return _unpacked_counts(np.asarray(self.attention_mask), np.asarray(self.example_mask) > 0)


class _OneOutputPerRow(_OneRowEach):
  def outputs(self, model) -> jax.Array:
    """The model's outputs shaped as ``labels``: predictions [G, A] or log-odds [G]."""
    return model(self.input_ids, self.attention_mask).reshape(self.labels.shape)


@struct.dataclass
class StepwiseBatch(_OneRowEach):
  """G sequences, one per row, labelled at the last token of each step."""

  input_ids: Array  # [G, T] int32, right-padded with pad_id
  attention_mask: Array  # [G, T] int32
  labels: Array  # [G, T] int32: 1 = step correct, 0 = step in error, IGNORE_INDEX = no step
  example_mask: Array  # [G] float32: 0 for filler sequences

  def outputs(self, model) -> jax.Array:
    """Logits [G, T, C]."""
    return model(self.input_ids, self.attention_mask)


@struct.dataclass
class RegressionBatch(_OneOutputPerRow):
  """G responses, one per row, each rated on A attributes (a missing rating is masked)."""

  input_ids: Array  # [G, T] int32, right-padded with pad_id
  attention_mask: Array  # [G, T] int32
  labels: Array  # [G, A] float32: the ratings, 0 where missing
  label_mask: Array  # [G, A] float32: 1 where rated
  group: Array  # [G] int32: rows that answer one prompt share it (validation's same-prompt pairs)
  example_mask: Array  # [G] float32: 0 for filler rows


@struct.dataclass
class LabelledBatch(_OneOutputPerRow):
  """G labelled items, one per row: a completion after its prompt, good (1) or bad (0); a
  generative verifier's unpaired data (:mod:`jaxrm.tasks.verifier`)."""

  input_ids: Array  # [G, T] int32, right-padded with pad_id
  attention_mask: Array  # [G, T] int32
  labels: Array  # [G] float32: 1 = good, 0 = bad
  example_mask: Array  # [G] float32: 0 for filler rows


@struct.dataclass
class PackedPreferenceBatch:
  """G groups of up to K completions packed into B rows; every completion of a group shares a row.

  Plain packing writes each completion as a sequence of its own (block-diagonal attention);
  shared-prompt packing writes the tokens the completions share (the prompt) once, then each
  completion's own tokens, which see the prompt and themselves only. Absent completions and
  filler groups take no room: their ``reward_index`` points at slot 0.
  """

  input_ids: Array  # [B, T] int32, pad_id after a row's last sequence
  attention_mask: Array  # [B, T] int32
  positions: Array  # [B, T] int32: from 0 in each sequence; a completion continues its prompt's
  segment_ids: Array  # [B, T] int32: 1, 2, ... per sequence (shared-prompt: per group), 0 = padding
  branch_ids: Array  # [B, T] int32: 0 = shared prompt or plain sequence, j + 1 = completion j
  reward_positions: Array  # [B, R] int32: index in its row of each completion's last token, -1 = unused
  reward_index: Array  # [G, K] int32: where group g's completion k sits in rewards.reshape(-1)
  ranks: Array  # [G, K] int32: as in PreferenceBatch
  margin: Array  # [G] float32
  example_mask: Array  # [G] float32
  strength: Array | None = None  # [G] float32: as in PreferenceBatch

  packed: ClassVar[bool] = True

  def outputs(self, model) -> jax.Array:
    """Rewards [G, K], read at ``reward_positions`` and gathered into the unpacked layout."""
    rewards = model(*_rows(self), reward_positions=self.reward_positions)  # [B, R]
    return group_rewards(rewards, self.reward_index)

  def token_counts(self) -> tuple[int, float]:
    """(tokens of the real completions, share of the token slots that hold a real token).

    Each completion counts whole, a shared prompt once per completion, so that a batch counts the
    same tokens whether it is packed, shared-prompt packed or unpacked.
    """
    mask, ends = np.asarray(self.attention_mask), np.asarray(self.reward_positions)
    # A completion ends at position length - 1.
    lengths = np.take_along_axis(np.asarray(self.positions), np.maximum(ends, 0), axis=-1) + 1
    return int(lengths[ends >= 0].sum()), float(mask.sum()) / mask.size

  def padded(self, num_rows: int, length: int, num_rewards: int, pad_id: int) -> PackedPreferenceBatch:
    """This batch (numpy) in ``num_rows`` rows of ``length`` tokens with ``num_rewards`` reward
    slots each: empty rows, right padding and unused slots added. Padding is segment 0, which no
    token attends to, so every completion's outputs are unchanged."""
    b, t = self.input_ids.shape
    r = self.reward_positions.shape[1]

    def grown(x, value, columns):  # [B, T] or [B, R] -> [num_rows, T or R + columns]
      return np.pad(np.asarray(x), ((0, num_rows - b), (0, columns)), constant_values=value)

    index = np.asarray(self.reward_index)  # row * R + slot -> row * num_rewards + slot
    return self.replace(
      input_ids=grown(self.input_ids, pad_id, length - t),
      attention_mask=grown(self.attention_mask, 0, length - t),
      positions=grown(self.positions, 0, length - t),
      segment_ids=grown(self.segment_ids, 0, length - t),
      branch_ids=grown(self.branch_ids, 0, length - t),
      reward_positions=grown(self.reward_positions, -1, num_rewards - r),
      reward_index=(index // r * num_rewards + index % r).astype(np.int32),
    )


@struct.dataclass
class PackedStepwiseBatch:
  """G sequences packed into B rows; filler sequences take no room (``token_index`` 0)."""

  input_ids: Array  # [B, T] int32
  attention_mask: Array  # [B, T] int32
  positions: Array  # [B, T] int32: from 0 in each sequence
  segment_ids: Array  # [B, T] int32: 1, 2, ... per sequence, 0 = padding
  branch_ids: Array  # [B, T] int32: all 0
  token_index: Array  # [G, T] int32: where token i of sequence g sits in logits.reshape(B * T, C)
  labels: Array  # [G, T] int32: the unpacked labels, IGNORE_INDEX past each sequence
  example_mask: Array  # [G] float32

  packed: ClassVar[bool] = True

  def outputs(self, model) -> jax.Array:
    """Logits [G, T, C], sequence g's tokens first, as ``labels`` has them."""
    return group_logits(model(*_rows(self)), self.token_index)

  def token_counts(self) -> tuple[int, float]:
    """(real tokens, their share of the token slots): fillers take no room, so every attended
    token is real."""
    mask = np.asarray(self.attention_mask)
    return int(mask.sum()), float(mask.sum()) / mask.size


@struct.dataclass
class _PackedOneEach:
  """Items of one sequence each packed into B rows, each a sequence of its own (block-diagonal
  attention) read at its last token; filler items take no room (``reward_index`` 0)."""

  input_ids: Array  # [B, T] int32, pad_id after a row's last sequence
  attention_mask: Array  # [B, T] int32
  positions: Array  # [B, T] int32: from 0 in each sequence
  segment_ids: Array  # [B, T] int32: 1, 2, ... per sequence, 0 = padding
  branch_ids: Array  # [B, T] int32: all 0
  reward_positions: Array  # [B, R] int32: index in its row of each item's last token, -1 = unused
  reward_index: Array  # [G] int32: where item g's outputs sit in outputs.reshape(B * R, ...)
  example_mask: Array  # [G] float32

  packed: ClassVar[bool] = True

  def outputs(self, model) -> jax.Array:
    """The model's outputs shaped as ``labels`` (as the unpacked batch gives them): predictions
    [G, A] or log-odds [G], read at ``reward_positions``."""
    outputs = model(*_rows(self), reward_positions=self.reward_positions)  # [B, R] or [B, R, A]
    return group_rewards(outputs, self.reward_index).reshape(self.labels.shape)

  def token_counts(self) -> tuple[int, float]:
    """(real tokens, their share of the token slots): fillers take no room, so every attended
    token is real."""
    mask = np.asarray(self.attention_mask)
    return int(mask.sum()), float(mask.sum()) / mask.size


@struct.dataclass
class PackedRegressionBatch(_PackedOneEach):
  """G rated responses packed into B rows (the rows as in the other packed layouts)."""

  labels: Array  # [G, A] float32: as in RegressionBatch, 0 for fillers
  label_mask: Array  # [G, A] float32: as in RegressionBatch, 0 for fillers
  group: Array  # [G] int32: as in RegressionBatch


@struct.dataclass
class PackedLabelledBatch(_PackedOneEach):
  """G labelled items packed into B rows (the rows as in the other packed layouts)."""

  labels: Array  # [G] float32: as in LabelledBatch, 0 for fillers


Batch = (
  PreferenceBatch
  | StepwiseBatch
  | RegressionBatch
  | LabelledBatch
  | PackedPreferenceBatch
  | PackedStepwiseBatch
  | PackedRegressionBatch
  | PackedLabelledBatch
)


def group_rewards(rewards_br, reward_index_gk):
  """Packed rewards [B, R] -> the [G, K] layout of the unpacked batch (jax or numpy arrays).

  Several outputs per reward slot, [B, R, A], give [G, K, A]; an index [G] of one slot per item
  gives [G] ([G, A]).
  """
  return rewards_br.reshape(-1, *rewards_br.shape[2:])[reward_index_gk]


def group_logits(logits_btc, token_index_gt):
  """Packed token logits [B, T, C] -> [G, T, C], sequence g's tokens first in row g."""
  return logits_btc.reshape(-1, logits_btc.shape[-1])[token_index_gt]


def _rows(batch: PackedPreferenceBatch | PackedStepwiseBatch | _PackedOneEach) -> tuple[Array, ...]:
  """The model's row inputs, in the order it takes them."""
  return (batch.input_ids, batch.attention_mask, batch.positions, batch.segment_ids, batch.branch_ids)


def _unpacked_counts(mask: np.ndarray, real_rows: np.ndarray) -> tuple[int, float]:
  """Attended tokens of the real rows, and their share of ``mask``'s slots.

  Absent completions and filler groups repeat real rows; they are not counted.
  """
  tokens = int(mask[real_rows].sum())
  return tokens, tokens / mask.size
