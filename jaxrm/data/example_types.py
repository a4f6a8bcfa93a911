"""What the data path does with each kind of tokenized row, said once per kind.

A tokenized row is one of the example classes of :mod:`jaxrm.data.tokenize`. Each has one
:class:`ExampleType` here: how its rows are collated into a batch (:mod:`jaxrm.data.pipeline`),
the pieces it is written as in a packed row and how a packed batch of it is filled
(:mod:`jaxrm.data.packing`), whether it is a group of completions, and the largest example a run
can batch (:mod:`jaxrm.planning.fit_check`). A reward task names the kinds it trains on
(:attr:`jaxrm.tasks.Task.example_types`); the generic modules ask :func:`of_example` instead of
testing an example's class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrm.data.batches import (
  IGNORE_INDEX,
  LabelledBatch,
  PackedLabelledBatch,
  PackedPreferenceBatch,
  PackedRegressionBatch,
  PackedStepwiseBatch,
  PreferenceBatch,
  RegressionBatch,
  StepwiseBatch,
)
from jaxrm.data.records import LabelledRecord, PreferenceRecord, RatedRecord, StepwiseRecord
from jaxrm.data.tokenize import LabelledExample, PreferenceExample, RatedExample, StepwiseExample


@dataclasses.dataclass(frozen=True)
class Piece:
  """Consecutive tokens of one packed unit: its own segment and branch, positions from ``start``."""

  ids: np.ndarray  # int32 [n]
  segment: int  # 0-based within the unit
  branch: int
  start: int
  rewarded: bool  # a reward is read at its last token


# A packed batch's placements, as the packer wrote them: (example index, row, per-piece (start, end)).
Placed = Sequence[tuple[int, int, list[tuple[int, int]]]]


@dataclasses.dataclass(frozen=True, eq=False)  # one object per kind, compared by identity
class ExampleType:
  """One kind of tokenized row, and how the data path batches it.

  Attributes:
    key: its short name ("labelled"): an evaluation reading's where a task reads it besides its own
      data (:attr:`jaxrm.tasks.Task.evaluations`).
    record: the record class its rows are read into (:mod:`jaxrm.data.records`).
    example: the example class (:mod:`jaxrm.data.tokenize`).
    name: its rows in messages, plural ("labelled items").
    fields: what one holds, in messages ("prompt, completion, label").
    grouped: each example is a group of completions; batches hold K of them (``num_completions``).
    collate: ``(examples, n_real, k, length, pad_id) -> batch``: the unpacked batch of
      ``examples`` (the first ``n_real`` real, the rest fillers), sequences padded to ``length``.
    unit: ``(example, shared_prompt) -> [Piece]``: what ``example`` is written as in a packed row.
    rewards: ``example -> int``: the rewards a packed row reads of ``example``.
    pack: ``(examples, units, placed, rows, g, k, r, like, first_row) -> batch``: the packed batch
      of ``examples`` placed into ``rows`` (:class:`jaxrm.data.packing.PackedCollator`'s).
    largest: ``(ids, n, k, attributes) -> [example]``: ``n`` examples whose every sequence is
      ``ids(j)`` for its j-th completion: the most tokens any batch of a run can hold.
    shared_prompt_refused: what its rows are, where ``data.packing='shared_prompt'`` cannot pack
      them (one sequence each, no group whose prompt a row writes once); None where it can.
  """

  key: str
  record: type
  example: type
  name: str
  fields: str
  grouped: bool
  collate: Callable[..., Any]
  unit: Callable[[Any, bool], list[Piece]]
  rewards: Callable[[Any], int]
  pack: Callable[..., Any]
  largest: Callable[..., list]
  shared_prompt_refused: str | None = None

  def sequences(self, example) -> Sequence[np.ndarray]:
    """The token sequences of ``example``: each completion's, or its one sequence."""
    return example.input_ids if self.grouped else (example.input_ids,)

  def num_completions(self, examples: Sequence) -> int | None:
    """K of batches of ``examples``: the most completions of any; None where not grouped."""
    return max((len(e.input_ids) for e in examples), default=0) if self.grouped else None

  def check_packable(self, shared_prompt: bool) -> None:
    """Raises a ValueError that says what to use instead where ``shared_prompt`` cannot pack these."""
    if shared_prompt and self.shared_prompt_refused:
      raise ValueError(
        f"data.packing='shared_prompt' writes a preference group's prompt once; "
        f"{self.shared_prompt_refused} are one sequence each, with no group to share it: use "
        "data.packing='packed'"
      )


def right_padded(
  rows: Sequence[Sequence[int]], *, length: int, num_rows: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
  """``rows`` as input_ids and attention_mask, int32 [num_rows, length], right-padded; filler rows
  past ``len(rows)`` attend to one token (their outputs are to be dropped)."""
  ids = np.full((num_rows, length), pad_id, np.int32)
  mask = np.zeros((num_rows, length), np.int32)
  for j, r in enumerate(rows):
    ids[j, : len(r)] = r
    mask[j, : len(r)] = 1
  mask[len(rows) :, 0] = 1
  return ids, mask


def _example_mask(size: int, n_real: int) -> np.ndarray:
  """[size] float32: 1 for the first ``n_real`` entries, 0 for the fillers after them."""
  return (np.arange(size) < n_real).astype(np.float32)


def _one_row_each(examples: Sequence, length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Each example's one sequence as a right-padded row: input_ids and attention_mask [len, length]."""
  return right_padded([e.input_ids for e in examples], length=length, num_rows=len(examples), pad_id=pad_id)


def _checked_size(source: str, n: int, k: int) -> None:
  if n > k:
    raise ValueError(
      f"{source} has {n} completions but batches hold num_completions={k}; pass num_completions >= {n}"
    )


# ------------------------------------------------------------------ preference groups


def _collate_preference(
  groups: Sequence[PreferenceExample], n_real: int, k: int, length: int, pad_id: int
) -> PreferenceBatch:
  """The first ``n_real`` of ``groups`` are real, the rest fillers."""
  b = len(groups)
  input_ids = np.full((b * k, length), pad_id, np.int32)
  attention_mask = np.zeros((b * k, length), np.int32)
  ranks = np.full((b, k), -1, np.int32)
  margin = np.zeros((b,), np.float32)
  strength = np.ones((b,), np.float32)
  for i, group in enumerate(groups):
    n = len(group.input_ids)
    _checked_size(group.source, n, k)
    for j in range(k):
      # Absent slots repeat the best completion (never an all-padding row); rank -1 hides them.
      ids = group.input_ids[j if j < n else 0]
      input_ids[i * k + j, : len(ids)] = ids
      attention_mask[i * k + j, : len(ids)] = 1
    ranks[i, :n] = np.arange(n)
    margin[i] = group.margin
    strength[i] = 1.0 if group.strength is None else group.strength
  ranks[n_real:] = -1
  margin[n_real:] = 0.0
  strength[n_real:] = 1.0
  return PreferenceBatch(
    input_ids=input_ids,
    attention_mask=attention_mask,
    ranks=ranks,
    margin=margin,
    example_mask=_example_mask(b, n_real),
    strength=strength,
  )


def _preference_unit(group: PreferenceExample, shared_prompt: bool) -> list[Piece]:
  if not shared_prompt:
    return [Piece(ids, j, 0, 0, True) for j, ids in enumerate(group.input_ids)]
  # Every completion keeps at least its last token, where its reward is read.
  shared = min(len(ids) for ids in group.input_ids) - 1
  first = group.input_ids[0]
  for ids in group.input_ids[1:]:
    differs = np.flatnonzero(ids[:shared] != first[:shared])
    shared = int(differs[0]) if differs.size else shared
  pieces = [Piece(first[:shared], 0, 0, 0, False)] if shared else []
  return pieces + [Piece(ids[shared:], 0, j + 1, shared, True) for j, ids in enumerate(group.input_ids)]


def _pack_preference(
  groups: Sequence[PreferenceExample],
  units,
  placed: Placed,
  rows,
  g: int,
  k: int,
  r: int,
  like,
  first_row: int,
) -> PackedPreferenceBatch:
  """The packed preference batch of ``groups``, placed into ``rows``; ``first_row``: the global
  index of ``rows``' first row, where ``reward_index`` starts counting."""
  del like
  b = rows.num_rows
  reward_positions = np.full((b, r), -1, np.int32)
  reward_index = np.zeros((g, k), np.int32)
  ranks = np.full((g, k), -1, np.int32)
  margin = np.zeros((g,), np.float32)
  strength = np.ones((g,), np.float32)
  used = np.zeros((b,), np.int32)
  for i, row, spans in placed:
    n = len(groups[i].input_ids)
    _checked_size(groups[i].source, n, k)
    if used[row] + n > r:
      raise ValueError(f"row {row} holds more than num_rewards={r} completions; raise num_rewards")
    ends = [end - 1 for (_, end), p in zip(spans, units[i]) if p.rewarded]
    slots = used[row] + np.arange(n)
    reward_positions[row, slots] = ends
    reward_index[i, :n] = (first_row + row) * r + slots
    used[row] += n
    ranks[i, :n] = np.arange(n)
    margin[i] = groups[i].margin
    strength[i] = 1.0 if groups[i].strength is None else groups[i].strength
  return PackedPreferenceBatch(
    **rows.arrays(),
    reward_positions=reward_positions,
    reward_index=reward_index,
    ranks=ranks,
    margin=margin,
    example_mask=_example_mask(g, len(groups)),
    strength=strength,
  )


def _largest_groups(ids, n: int, k: int, attributes) -> list[PreferenceExample]:
  del attributes
  # Completions that differ from their first token share no prompt to write once.
  return [
    PreferenceExample(tuple(ids(j) for j in range(k)), tuple(range(k)), 0.0, "plan", {}) for _ in range(n)
  ]


PREFERENCE = ExampleType(
  key="preference",
  record=PreferenceRecord,
  example=PreferenceExample,
  name="preference pairs",
  fields="prompt, ranked completions",
  grouped=True,
  collate=_collate_preference,
  unit=_preference_unit,
  rewards=lambda group: len(group.input_ids),
  pack=_pack_preference,
  largest=_largest_groups,
)


# ------------------------------------------------------------------ stepwise sequences


def _collate_stepwise(
  examples: Sequence[StepwiseExample], n_real: int, k: None, length: int, pad_id: int
) -> StepwiseBatch:
  """The first ``n_real`` of ``examples`` are real, the rest fillers."""
  b = len(examples)
  input_ids, attention_mask = _one_row_each(examples, length, pad_id)
  labels = np.full((b, length), IGNORE_INDEX, np.int32)
  for i, e in enumerate(examples):
    labels[i, : len(e.labels)] = e.labels
  labels[n_real:] = IGNORE_INDEX
  return StepwiseBatch(
    input_ids=input_ids, attention_mask=attention_mask, labels=labels, example_mask=_example_mask(b, n_real)
  )


def _pack_stepwise(
  examples: Sequence[StepwiseExample], units, placed: Placed, rows, g: int, k, r, like, first_row: int
) -> PackedStepwiseBatch:
  """The packed stepwise batch of ``examples``; ``token_index`` counts from ``first_row``."""
  del units, k, r, like
  t = rows.row_length
  token_index = np.zeros((g, t), np.int32)
  labels = np.full((g, t), IGNORE_INDEX, np.int32)
  for i, row, [(start, end)] in placed:
    token_index[i, : end - start] = (first_row + row) * t + np.arange(start, end)
    labels[i, : end - start] = examples[i].labels
  return PackedStepwiseBatch(
    **rows.arrays(), token_index=token_index, labels=labels, example_mask=_example_mask(g, len(examples))
  )


def _largest_sequences(ids, n: int, k, attributes) -> list[StepwiseExample]:
  del k, attributes
  labels = np.full(len(ids(0)), IGNORE_INDEX, np.int32)
  labels[-1] = 1
  return [StepwiseExample(ids(0), labels, "plan", {}) for _ in range(n)]


STEPWISE = ExampleType(
  key="stepwise",
  record=StepwiseRecord,
  example=StepwiseExample,
  name="stepwise sequences",
  fields="prompt, steps labelled correct or not",
  grouped=False,
  collate=_collate_stepwise,
  # One sequence, its labels read at every step's end; shared_prompt does not apply.
  unit=lambda example, shared_prompt: [Piece(example.input_ids, 0, 0, 0, False)],
  rewards=lambda example: 0,
  pack=_pack_stepwise,
  largest=_largest_sequences,
)


# ------------------------------------------------------------------ items: one sequence, one output


def _item_unit(item, shared_prompt: bool) -> list[Piece]:
  of_example(item).check_packable(shared_prompt)
  return [Piece(item.input_ids, 0, 0, 0, True)]


def _item_placements(units, placed: Placed, rows, g: int, r: int, n: int, first_row: int) -> dict:
  """The row arrays and reward slots of ``n`` items (of ``g``) placed into ``rows``."""
  del units
  reward_positions = np.full((rows.num_rows, r), -1, np.int32)
  reward_index = np.zeros((g,), np.int32)
  used = np.zeros((rows.num_rows,), np.int32)
  for i, row, [(_, end)] in placed:
    if used[row] == r:
      raise ValueError(f"row {row} holds more than num_rewards={r} items; raise num_rewards")
    reward_positions[row, used[row]] = end - 1
    reward_index[i] = (first_row + row) * r + used[row]
    used[row] += 1
  return dict(
    **rows.arrays(),
    reward_positions=reward_positions,
    reward_index=reward_index,
    example_mask=_example_mask(g, n),
  )


def _collate_rated(
  examples: Sequence[RatedExample], n_real: int, k: None, length: int, pad_id: int
) -> RegressionBatch:
  """The first ``n_real`` of ``examples`` are real, the rest fillers (their ratings masked)."""
  b = len(examples)
  input_ids, attention_mask = _one_row_each(examples, length, pad_id)
  label_mask = np.stack([e.label_mask for e in examples])
  label_mask[n_real:] = 0.0
  return RegressionBatch(
    input_ids=input_ids,
    attention_mask=attention_mask,
    labels=np.stack([e.labels for e in examples]),
    label_mask=label_mask,
    group=np.array([e.group for e in examples], np.int32),
    example_mask=_example_mask(b, n_real),
  )


def _pack_rated(
  examples: Sequence[RatedExample], units, placed: Placed, rows, g: int, k, r: int, like, first_row: int
) -> PackedRegressionBatch:
  """The packed batch of rated ``examples``; ``like``, an item of the global batch, gives the
  number of attributes even where this host's ``examples`` are none (the last validation batch)."""
  del k
  placements = _item_placements(units, placed, rows, g, r, len(examples), first_row)
  labels, label_mask = (np.zeros((g, len(like.labels)), np.float32) for _ in range(2))
  group = np.zeros((g,), np.int32)
  for i, e in enumerate(examples):
    labels[i], label_mask[i], group[i] = e.labels, e.label_mask, e.group
  return PackedRegressionBatch(**placements, labels=labels, label_mask=label_mask, group=group)


def _largest_rated(ids, n: int, k, attributes) -> list[RatedExample]:
  del k
  a = len(attributes)
  return [
    RatedExample(ids(0), np.zeros(a, np.float32), np.ones(a, np.float32), i, "plan", {}) for i in range(n)
  ]


RATED = ExampleType(
  key="rated",
  record=RatedRecord,
  example=RatedExample,
  name="rated responses",
  fields="prompt, response, ratings",
  grouped=False,
  collate=_collate_rated,
  unit=_item_unit,
  rewards=lambda item: 1,
  pack=_pack_rated,
  largest=_largest_rated,
  shared_prompt_refused="rated responses (reward.type='regression')",
)


def _collate_labelled(
  examples: Sequence[LabelledExample], n_real: int, k: None, length: int, pad_id: int
) -> LabelledBatch:
  """The first ``n_real`` of ``examples`` are real, the rest fillers."""
  b = len(examples)
  input_ids, attention_mask = _one_row_each(examples, length, pad_id)
  labels = np.array([float(e.label) for e in examples], np.float32)
  return LabelledBatch(input_ids, attention_mask, labels, _example_mask(b, n_real))


def _pack_labelled(
  examples: Sequence[LabelledExample], units, placed: Placed, rows, g: int, k, r: int, like, first_row: int
) -> PackedLabelledBatch:
  """The packed batch of labelled ``examples``."""
  del k, like
  placements = _item_placements(units, placed, rows, g, r, len(examples), first_row)
  labels = np.zeros((g,), np.float32)
  labels[: len(examples)] = [float(e.label) for e in examples]
  return PackedLabelledBatch(**placements, labels=labels)


def _largest_labelled(ids, n: int, k, attributes) -> list[LabelledExample]:
  del k, attributes
  return [LabelledExample(ids(0), True, "plan", {}) for _ in range(n)]


LABELLED = ExampleType(
  key="labelled",
  record=LabelledRecord,
  example=LabelledExample,
  name="labelled items",
  fields="prompt, completion, label",
  grouped=False,
  collate=_collate_labelled,
  unit=_item_unit,
  rewards=lambda item: 1,
  pack=_pack_labelled,
  largest=_largest_labelled,
  shared_prompt_refused="labelled items (prompt, completion, label)",
)


TYPES = (PREFERENCE, STEPWISE, RATED, LABELLED)
_BY_CLASS = {t.example: t for t in TYPES}


def of_example(example) -> ExampleType:
  """The :class:`ExampleType` of a tokenized row; a TypeError for an object that is none."""
  for cls in type(example).__mro__:
    if cls in _BY_CLASS:
      return _BY_CLASS[cls]
  kinds = ", ".join(t.example.__name__ for t in TYPES)
  raise TypeError(f"{type(example).__name__} is not a tokenized row ({kinds})")
