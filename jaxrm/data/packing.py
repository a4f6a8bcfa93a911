"""Sequence packing: several sequences per row, with the outputs mapped back to the group layout.

A packed preference batch (:class:`~jaxrm.batches.PackedPreferenceBatch`) holds G groups of up to
K completions in B rows of T tokens, every completion of a group in the same row: each as a
sequence of its own (plain packing), or with the prompt they share written once and each
completion's own tokens branching off it (shared-prompt packing). A packed stepwise batch
(:class:`~jaxrm.batches.PackedStepwiseBatch`) holds G sequences, a packed regression or labelled
batch (:class:`~jaxrm.batches.PackedRegressionBatch`, :class:`~jaxrm.batches.PackedLabelledBatch`)
G items of one sequence each, every one read at its last token. The layouts, and how the model's
outputs are gathered back into the unpacked ``[G, K]`` / ``[G, T, C]`` / ``[G, A]`` / ``[G]``
layout, are documented in :mod:`jaxrm.batches`.

Rows are filled first-fit in order of decreasing length. A row that holds no sequence is all
padding; attention masks every key of it with a finite logit, so it stays NaN-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from jaxrm.batches import (
  IGNORE_INDEX,
  PackedLabelledBatch,
  PackedPreferenceBatch,
  PackedRegressionBatch,
  PackedStepwiseBatch,
)

# Re-exported: whoever packs rows reads the model's outputs back with these.
from jaxrm.batches import group_logits as group_logits
from jaxrm.batches import group_rewards as group_rewards
from jaxrm.data.tokenize import LabelledExample, PreferenceExample, RatedExample, StepwiseExample


@dataclasses.dataclass(frozen=True)
class PackSpec:
  """How sequences are packed.

  Attributes:
    row_length: tokens per row (T), at most. A group must fit in one row: with plain packing, K
      completions of ``max_length`` tokens need ``row_length >= K * max_length``.
    length_multiple: when > 0, a batch's rows are only as long as the smallest multiple of this
      that holds its longest group (as unpacked batches use length buckets): short batches then
      pay for less attention. 0: rows are always ``row_length`` long.
    shared_prompt: write the tokens all completions of a group share once per row.
    pad_id: token id written into padding.
    rows_multiple: the row count B is rounded up to a multiple of this (fewer distinct shapes to
      compile).
    rewards_multiple: R, the reward slots per row, is rounded up to a multiple of this.
  """

  row_length: int
  length_multiple: int = 0
  shared_prompt: bool = False
  pad_id: int = 0
  rows_multiple: int = 1
  rewards_multiple: int = 8

  def __post_init__(self):
    if self.row_length < 1 or self.length_multiple < 0 or self.rows_multiple < 1 or self.rewards_multiple < 1:
      raise ValueError(
        f"PackSpec needs positive sizes, got row_length={self.row_length}, "
        f"rows_multiple={self.rows_multiple}, rewards_multiple={self.rewards_multiple}"
      )


@dataclasses.dataclass(frozen=True)
class _Piece:
  """Consecutive tokens of one unit: its own segment and branch, positions from ``start``."""

  ids: np.ndarray  # int32 [n]
  segment: int  # 0-based within the unit
  branch: int
  start: int
  rewarded: bool  # a reward is read at its last token


def _preference_unit(group: PreferenceExample, shared_prompt: bool) -> list[_Piece]:
  if not shared_prompt:
    return [_Piece(ids, j, 0, 0, True) for j, ids in enumerate(group.input_ids)]
  # Every completion keeps at least its last token, where its reward is read.
  shared = min(len(ids) for ids in group.input_ids) - 1
  first = group.input_ids[0]
  for ids in group.input_ids[1:]:
    differs = np.flatnonzero(ids[:shared] != first[:shared])
    shared = int(differs[0]) if differs.size else shared
  pieces = [_Piece(first[:shared], 0, 0, 0, False)] if shared else []
  return pieces + [_Piece(ids[shared:], 0, j + 1, shared, True) for j, ids in enumerate(group.input_ids)]


Example = PreferenceExample | StepwiseExample | RatedExample | LabelledExample  # a tokenized row
Item = RatedExample | LabelledExample  # one sequence, one output read at its last token


def check_packable(example: Example, shared_prompt: bool) -> None:
  """Raises a ValueError that says what to use instead where examples of ``example``'s kind cannot
  be packed with ``shared_prompt``: a rated or labelled item is one sequence, with no group whose
  prompt a row could write once."""
  if shared_prompt and isinstance(example, (RatedExample, LabelledExample)):
    what = (
      "labelled items (prompt, completion, label)"
      if isinstance(example, LabelledExample)
      else "rated responses (reward.type='regression')"
    )
    raise ValueError(
      f"data.packing='shared_prompt' writes a preference group's prompt once; {what} are one "
      "sequence each, with no group to share it: use data.packing='packed'"
    )


def _unit(example: Example, shared_prompt: bool) -> list[_Piece]:
  """The pieces ``example`` is written as in a row."""
  if isinstance(example, PreferenceExample):
    return _preference_unit(example, shared_prompt)
  if isinstance(example, StepwiseExample):
    return [_Piece(example.input_ids, 0, 0, 0, False)]
  check_packable(example, shared_prompt)
  return [_Piece(example.input_ids, 0, 0, 0, True)]


def _length(unit: list[_Piece]) -> int:
  return sum(len(p.ids) for p in unit)


def packed_length(example: Example, shared_prompt: bool = False) -> int:
  """Tokens ``example`` takes in a packed row: every completion's, or with ``shared_prompt`` the
  prompt's once and then each completion's own (one sequence of a stepwise, rated or labelled
  example, which is not packed with ``shared_prompt``: :func:`check_packable`)."""
  return _length(_unit(example, shared_prompt))


def plan_rows(lengths: Sequence[int], row_length: int, sources: Sequence[str]) -> list[list[int]]:
  """First-fit decreasing: unit indices per row, each row's units in placement order."""
  rows, free = [], []
  for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
    if lengths[i] > row_length:
      raise ValueError(
        f"{sources[i]} needs {lengths[i]} tokens in one row but rows hold "
        f"row_length={row_length}; raise row_length (plain packing needs "
        f"num_completions * max_length) or tokenize with a smaller max_length"
      )
    row = next((r for r, room in enumerate(free) if room >= lengths[i]), None)
    if row is None:
      rows.append([])
      free.append(row_length)
      row = len(rows) - 1
    rows[row].append(i)
    free[row] -= lengths[i]
  return rows


def _row_length(units: list[list[_Piece]], spec: PackSpec) -> int:
  """The length of this batch's rows: see ``PackSpec.length_multiple``."""
  if not spec.length_multiple:
    return spec.row_length
  longest = max((_length(u) for u in units), default=1)
  return min(spec.row_length, _round_up(longest, spec.length_multiple))


def _plan(units: list[list[_Piece]], spec: PackSpec, sources: Sequence[str]) -> tuple[int, list[list[int]]]:
  """The batch's row length, and which units go in each row."""
  row_length = _row_length(units, spec)
  return row_length, plan_rows([_length(u) for u in units], row_length, sources)


def _round_up(n: int, multiple: int) -> int:
  return -(-max(n, 1) // multiple) * multiple


def _rows_needed(plan: list[list[int]], row_length: int, spec: PackSpec, num_rows: int | None) -> int:
  if num_rows is None:
    return _round_up(len(plan), spec.rows_multiple)
  if len(plan) > num_rows:
    raise ValueError(
      f"packing needs {len(plan)} rows of {row_length} tokens but "
      f"num_rows={num_rows}; raise num_rows or row_length"
    )
  return num_rows


@dataclasses.dataclass
class _Rows:
  """The [B, T] arrays of a packed batch, filled one unit at a time."""

  num_rows: int
  row_length: int
  pad_id: int

  def __post_init__(self):
    shape = (self.num_rows, self.row_length)
    self.input_ids = np.full(shape, self.pad_id, np.int32)
    self.attention_mask = np.zeros(shape, np.int32)
    self.positions = np.zeros(shape, np.int32)
    self.segment_ids = np.zeros(shape, np.int32)
    self.branch_ids = np.zeros(shape, np.int32)

  def place(self, unit: list[_Piece], row: int, cursor: int, first_segment: int) -> list[tuple[int, int]]:
    """Writes ``unit`` at ``cursor``; returns (start, end) of each piece within the row."""
    spans = []
    for p in unit:
      sl = slice(cursor, cursor + len(p.ids))
      self.input_ids[row, sl] = p.ids
      self.attention_mask[row, sl] = 1
      self.positions[row, sl] = p.start + np.arange(len(p.ids))
      self.segment_ids[row, sl] = first_segment + p.segment
      self.branch_ids[row, sl] = p.branch
      spans.append((sl.start, sl.stop))
      cursor = sl.stop
    return spans

  def arrays(self) -> dict[str, np.ndarray]:
    """The row arrays, named as the batch classes name them."""
    return {
      "input_ids": self.input_ids,
      "attention_mask": self.attention_mask,
      "positions": self.positions,
      "segment_ids": self.segment_ids,
      "branch_ids": self.branch_ids,
    }


def _fill(units: list[list[_Piece]], plan: list[list[int]], rows: _Rows):
  """Places every unit as ``plan`` says; yields (unit index, row, per-piece (start, end))."""
  for r, members in enumerate(plan):
    cursor, segment = 0, 1
    for i in members:
      spans = rows.place(units[i], r, cursor, segment)
      yield i, r, spans
      cursor = spans[-1][1]
      segment += 1 + max(p.segment for p in units[i])


def rewards_per_row(groups: Sequence[Example], plan: list[list[int]]) -> int:
  """The most rewards any row of ``plan`` reads: completions of preference groups, one per
  rated or labelled item, none of stepwise sequences."""
  return max((sum(_rewards(groups[i]) for i in members) for members in plan), default=0)


def _rewards(example: Example) -> int:
  if isinstance(example, PreferenceExample):
    return len(example.input_ids)
  return 0 if isinstance(example, StepwiseExample) else 1


def pack_preference(
  groups: Sequence[PreferenceExample],
  spec: PackSpec,
  *,
  num_groups: int | None = None,
  num_completions: int | None = None,
  num_rows: int | None = None,
  num_rewards: int | None = None,
) -> PackedPreferenceBatch:
  """Packs preference groups into rows (the layout is :class:`~jaxrm.batches.PackedPreferenceBatch`).

  Args:
    groups: the groups of this batch, best completion first in each (as tokenized).
    spec: row length, shared-prompt mode, padding and rounding.
    num_groups: G; missing groups become fillers (default: ``len(groups)``).
    num_completions: K (default: the most completions of any group).
    num_rows: B (default: as many as needed, rounded up to ``spec.rows_multiple``).
    num_rewards: R (default: the most completions in a row, rounded up to
      ``spec.rewards_multiple``).
  """
  g = len(groups) if num_groups is None else num_groups
  k = num_completions or max((len(e.input_ids) for e in groups), default=0)
  if not k:
    raise ValueError("no groups to pack: pass num_completions to build an all-filler batch")
  if len(groups) > g:
    raise ValueError(f"{len(groups)} groups given for num_groups={g}")
  units, plan, rows, r = _laid_out(groups, spec, num_rows, num_rewards)
  return _fill_preference(groups, units, plan, rows, g, k, r)


def _laid_out(
  examples: Sequence[Example], spec: PackSpec, num_rows: int | None, num_rewards: int | None
) -> tuple[list[list[_Piece]], list[list[int]], _Rows, int]:
  """What one batch's ``pack_*`` fills: each example's pieces, the rows' plan, the empty rows
  (``num_rows``, or as many as the plan needs) and the reward slots per row (``num_rewards``, or
  the most any row reads, rounded up to ``spec.rewards_multiple``)."""
  units = [_unit(e, spec.shared_prompt) for e in examples]
  t, plan = _plan(units, spec, [e.source for e in examples])
  rows = _Rows(_rows_needed(plan, t, spec, num_rows), t, spec.pad_id)
  return units, plan, rows, num_rewards or _round_up(rewards_per_row(examples, plan), spec.rewards_multiple)


def _fill_preference(
  groups: Sequence[PreferenceExample],
  units: list[list[_Piece]],
  plan: list[list[int]],
  rows: _Rows,
  g: int,
  k: int,
  r: int,
  first_row: int = 0,
) -> PackedPreferenceBatch:
  """The packed preference batch of ``groups``, placed as ``plan`` says into ``rows``.

  ``first_row``: the global index of ``rows``' first row, where ``reward_index`` starts counting.
  """
  b = rows.num_rows
  reward_positions = np.full((b, r), -1, np.int32)
  reward_index = np.zeros((g, k), np.int32)
  ranks = np.full((g, k), -1, np.int32)
  margin = np.zeros((g,), np.float32)
  strength = np.ones((g,), np.float32)
  used = np.zeros((b,), np.int32)
  for i, row, spans in _fill(units, plan, rows):
    n = len(groups[i].input_ids)
    if n > k:
      raise ValueError(
        f"{groups[i].source} has {n} completions but batches hold "
        f"num_completions={k}; pass num_completions >= {n}"
      )
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
  example_mask = (np.arange(g) < len(groups)).astype(np.float32)
  return PackedPreferenceBatch(
    **rows.arrays(),
    reward_positions=reward_positions,
    reward_index=reward_index,
    ranks=ranks,
    margin=margin,
    example_mask=example_mask,
    strength=strength,
  )


def pack_stepwise(
  examples: Sequence[StepwiseExample],
  spec: PackSpec,
  *,
  num_examples: int | None = None,
  num_rows: int | None = None,
) -> PackedStepwiseBatch:
  """Packs stepwise sequences into rows (the layout is :class:`~jaxrm.batches.PackedStepwiseBatch`).

  Args:
    examples: the sequences of this batch.
    spec: row length, padding and rounding (``shared_prompt`` does not apply).
    num_examples: G; missing sequences become fillers (default: ``len(examples)``).
    num_rows: B (default: as many as needed, rounded up to ``spec.rows_multiple``).
  """
  g = len(examples) if num_examples is None else num_examples
  if len(examples) > g:
    raise ValueError(f"{len(examples)} examples given for num_examples={g}")
  units, plan, rows, _ = _laid_out(examples, spec, num_rows, None)  # one piece each, whatever shared_prompt
  return _fill_stepwise(examples, units, plan, rows, g)


def _fill_stepwise(
  examples: Sequence[StepwiseExample],
  units: list[list[_Piece]],
  plan: list[list[int]],
  rows: _Rows,
  g: int,
  first_row: int = 0,
) -> PackedStepwiseBatch:
  """The packed stepwise batch of ``examples``, placed as ``plan`` says into ``rows``.

  ``first_row``: the global index of ``rows``' first row, where ``token_index`` starts counting.
  """
  t = rows.row_length
  token_index = np.zeros((g, t), np.int32)
  labels = np.full((g, t), IGNORE_INDEX, np.int32)
  for i, row, [(start, end)] in _fill(units, plan, rows):
    token_index[i, : end - start] = (first_row + row) * t + np.arange(start, end)
    labels[i, : end - start] = examples[i].labels
  example_mask = (np.arange(g) < len(examples)).astype(np.float32)
  return PackedStepwiseBatch(
    **rows.arrays(), token_index=token_index, labels=labels, example_mask=example_mask
  )


def pack_items(
  examples: Sequence[Item],
  spec: PackSpec,
  *,
  num_examples: int | None = None,
  num_rows: int | None = None,
  num_rewards: int | None = None,
) -> PackedRegressionBatch | PackedLabelledBatch:
  """Packs rated responses or labelled items into rows, each a sequence of its own (the layouts are
  :class:`~jaxrm.batches.PackedRegressionBatch` and :class:`~jaxrm.batches.PackedLabelledBatch`).

  Args:
    examples: the items of this batch, all of one kind.
    spec: row length, padding and rounding (``shared_prompt`` is refused: :func:`check_packable`).
    num_examples: G; missing items become fillers (default: ``len(examples)``).
    num_rows: B (default: as many as needed, rounded up to ``spec.rows_multiple``).
    num_rewards: R (default: the most items in a row, rounded up to ``spec.rewards_multiple``).
  """
  g = len(examples) if num_examples is None else num_examples
  if not examples:
    raise ValueError("no items to pack: an all-filler batch needs an item of its kind")
  if len(examples) > g:
    raise ValueError(f"{len(examples)} items given for num_examples={g}")
  units, plan, rows, r = _laid_out(examples, spec, num_rows, num_rewards)
  return _fill_items(examples, units, plan, rows, g, r, examples[0])


def _fill_items(
  examples: Sequence[Item],
  units: list[list[_Piece]],
  plan: list[list[int]],
  rows: _Rows,
  g: int,
  r: int,
  like: Item,
  first_row: int = 0,
) -> PackedRegressionBatch | PackedLabelledBatch:
  """The packed batch of ``examples``, placed as ``plan`` says into ``rows``; item g is read at
  ``reward_index[g]``.

  ``like``: an item of the global batch, whose kind (and number of rated attributes) the batch
  takes even where this host's ``examples`` are none (the last validation batch).
  ``first_row``: the global index of ``rows``' first row, where ``reward_index`` starts counting.
  """
  reward_positions = np.full((rows.num_rows, r), -1, np.int32)
  reward_index = np.zeros((g,), np.int32)
  used = np.zeros((rows.num_rows,), np.int32)
  for i, row, [(_, end)] in _fill(units, plan, rows):
    if used[row] == r:
      raise ValueError(f"row {row} holds more than num_rewards={r} items; raise num_rewards")
    reward_positions[row, used[row]] = end - 1
    reward_index[i] = (first_row + row) * r + used[row]
    used[row] += 1
  n = len(examples)
  placed = dict(
    **rows.arrays(),
    reward_positions=reward_positions,
    reward_index=reward_index,
    example_mask=(np.arange(g) < n).astype(np.float32),
  )
  if isinstance(like, LabelledExample):
    labels = np.zeros((g,), np.float32)
    labels[:n] = [float(e.label) for e in examples]
    return PackedLabelledBatch(**placed, labels=labels)
  labels, label_mask = (np.zeros((g, len(like.labels)), np.float32) for _ in range(2))
  group = np.zeros((g,), np.int32)
  for i, e in enumerate(examples):
    labels[i], label_mask[i], group[i] = e.labels, e.label_mask, e.group
  return PackedRegressionBatch(**placed, labels=labels, label_mask=label_mask, group=group)


@dataclasses.dataclass(frozen=True)
class PackedCollator:
  """Packs this host's groups of one global batch, with the same shapes on every host.

  Drop-in for :class:`jaxrm.data.pipeline.Collator` when batches are packed: every host packs
  every host's slice (cheap) and takes the largest row and reward counts, so all hosts build
  arrays of one shape without talking to each other. ``reward_index`` and ``token_index`` point
  into the *global* batch that ``pipeline.to_global_batch`` assembles from the hosts' rows.

  With ``micro_batches`` n > 1 (gradient accumulation), micro-batch m takes every n-th group of
  the host's slice from the m-th on (as ``steps`` splits unpacked batches) and is packed apart;
  every array gets a leading ``[n]`` axis, all micro-batches padded to one shape, and the indices
  of micro-batch m point into micro-batch m of the global batch.

  Attributes:
    batch_size: groups (or stepwise sequences, rated or labelled items) per host, G; a multiple of
      ``micro_batches``.
    spec: how rows are packed.
    num_completions: K for preference batches; None for the others.
    process_index, process_count: this host's slice of the global batch.
    micro_batches: packed apart and stacked, n.
  """

  batch_size: int
  spec: PackSpec
  num_completions: int | None = None
  process_index: int = 0
  process_count: int = 1
  micro_batches: int = 1

  def __post_init__(self):
    if self.micro_batches < 1 or self.batch_size % self.micro_batches:
      raise ValueError(
        f"batch_size={self.batch_size} groups per host cannot be split into "
        f"micro_batches={self.micro_batches} equal micro-batches"
      )

  def __call__(
    self, groups: Sequence[Example]
  ) -> PackedPreferenceBatch | PackedStepwiseBatch | PackedRegressionBatch | PackedLabelledBatch:
    n = self.micro_batches
    # slices[p][m]: host p's micro-batch m.
    slices = [
      [list(groups[p * self.batch_size : (p + 1) * self.batch_size])[m::n] for m in range(n)]
      for p in range(self.process_count)
    ]
    parts = [part for host in slices for part in host]
    units = [[_unit(e, self.spec.shared_prompt) for e in part] for part in parts]
    # Every host's rows are as long as the longest any host needs.
    row_length = _row_length([u for part in units for u in part], self.spec)
    spec = dataclasses.replace(self.spec, row_length=row_length, length_multiple=0)
    plans = [_plan(u, spec, [e.source for e in part])[1] for u, part in zip(units, parts)]
    num_rows = _round_up(max(map(len, plans)), spec.rows_multiple)
    num_rewards = _round_up(
      max(rewards_per_row(part, plan) for part, plan in zip(parts, plans)), spec.rewards_multiple
    )
    micro = []
    first_row = self.process_index * num_rows  # this host's rows follow the lower hosts'
    g = self.batch_size // n
    for m, local in enumerate(slices[self.process_index]):
      part = self.process_index * n + m
      rows = _Rows(num_rows, row_length, spec.pad_id)
      placed = (local, units[part], plans[part], rows, g)
      if isinstance(groups[0], StepwiseExample):
        batch = _fill_stepwise(*placed, first_row)
      elif isinstance(groups[0], PreferenceExample):
        k = self.num_completions or max(len(e.input_ids) for e in groups)
        batch = _fill_preference(*placed, k, num_rewards, first_row)
      else:
        batch = _fill_items(*placed, num_rewards, groups[0], first_row)
      micro.append(batch)
    if n == 1:
      return micro[0]
    return jax.tree.map(lambda *arrays: np.stack(arrays), *micro)
