"""Sequence packing: several sequences per row, with the outputs mapped back to the group layout.

A packed preference batch (:class:`~jaxrm.data.batches.PackedPreferenceBatch`) holds G groups of up to
K completions in B rows of T tokens, every completion of a group in the same row: each as a
sequence of its own (plain packing), or with the prompt they share written once and each
completion's own tokens branching off it (shared-prompt packing). A packed stepwise batch
(:class:`~jaxrm.data.batches.PackedStepwiseBatch`) holds G sequences, a packed regression or labelled
batch (:class:`~jaxrm.data.batches.PackedRegressionBatch`, :class:`~jaxrm.data.batches.PackedLabelledBatch`)
G items of one sequence each, every one read at its last token. The layouts, and how the model's
outputs are gathered back into the unpacked ``[G, K]`` / ``[G, T, C]`` / ``[G, A]`` / ``[G]``
layout, are documented in :mod:`jaxrm.data.batches`.

Rows are filled first-fit in order of decreasing length. With ``PackSpec.fit_multiple``, each
batch's row length and row count are chosen together, as the pair that holds the batch in the
fewest token slots (:func:`fitted_shape`). Padding lies at the end of each row (and in whole empty
rows), after every real token: causal attention never reads it, so the flash kernel skips its
blocks for every real query. A row that holds no sequence is all padding; attention masks every
key of it with a finite logit, so it stays NaN-free. :func:`fill` is the share of the fed token
slots that hold a real token, as the packer plans them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import jax
import numpy as np

from jaxrm.data import example_types
from jaxrm.data.batches import (
  PackedLabelledBatch,
  PackedPreferenceBatch,
  PackedRegressionBatch,
  PackedStepwiseBatch,
)

# Re-exported: whoever packs rows reads the model's outputs back with these.
from jaxrm.data.batches import group_logits as group_logits
from jaxrm.data.batches import group_rewards as group_rewards
from jaxrm.data.example_types import ExampleType, Piece, of_example
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
    fit_multiple: when > 0, each batch's shape is fitted (:func:`fitted_shape`): its rows'
      length T (a multiple of this up to ``row_length``, or the length it would have unfitted)
      and their count B (a multiple of ``rows_multiple``) are the pair with the fewest token
      slots B x T that holds every group: never more than unfitted rows take. A batch then takes
      one of at most ``row_length / fit_multiple`` (+ the unfitted lengths) row lengths times
      ``groups / rows_multiple`` row counts.
      The row count a caller fixes (``num_rows``) keeps rows unfitted. 0: rows are ``row_length``
      long (or as ``length_multiple`` says), as many as first-fit needs.
  """

  row_length: int
  length_multiple: int = 0
  shared_prompt: bool = False
  pad_id: int = 0
  rows_multiple: int = 1
  rewards_multiple: int = 8
  fit_multiple: int = 0

  def __post_init__(self):
    if (
      self.row_length < 1
      or min(self.length_multiple, self.fit_multiple) < 0
      or self.rows_multiple < 1
      or self.rewards_multiple < 1
    ):
      raise ValueError(
        f"PackSpec needs positive sizes, got row_length={self.row_length}, "
        f"rows_multiple={self.rows_multiple}, rewards_multiple={self.rewards_multiple} (and "
        f"length_multiple={self.length_multiple}, fit_multiple={self.fit_multiple} of 0 or more)"
      )


Example = PreferenceExample | StepwiseExample | RatedExample | LabelledExample  # a tokenized row
Item = RatedExample | LabelledExample  # one sequence, one output read at its last token


def check_packable(example: Example, shared_prompt: bool) -> None:
  """Raises a ValueError that says what to use instead where examples of ``example``'s kind cannot
  be packed with ``shared_prompt``: a rated or labelled item is one sequence, with no group whose
  prompt a row could write once."""
  of_example(example).check_packable(shared_prompt)


def _unit(example: Example, shared_prompt: bool) -> list[Piece]:
  """The pieces ``example`` is written as in a row."""
  return of_example(example).unit(example, shared_prompt)


def _length(unit: list[Piece]) -> int:
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


# Placements a search for fewer rows than first-fit found may try, per batch part and row length:
# the work per batch stays bounded (and the result deterministic) whatever the groups' lengths.
SEARCH_STEPS = 2_000


def fit_rows(lengths: Sequence[int], row_length: int, num_rows: int) -> list[list[int]] | None:
  """Unit indices per row placing every one of ``lengths`` in ``num_rows`` rows of
  ``row_length`` tokens, each row's units in placement order (longest first); None where a
  depth-first search of at most :data:`SEARCH_STEPS` placements finds none."""
  order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
  free = [row_length] * num_rows
  choice = [-1] * len(order)  # the row of each unit placed so far, in ``order``
  i = steps = 0
  while 0 <= i < len(order):
    n = lengths[order[i]]
    if choice[i] >= 0:  # back here: take the unit out of its row, to try the next
      free[choice[i]] += n
    # Rows with equal room are alike to the units left: try the first of each.
    row = next((r for r in range(choice[i] + 1, num_rows) if free[r] >= n and free[r] not in free[:r]), None)
    steps += 1
    if steps > SEARCH_STEPS:
      return None
    if row is None:
      choice[i], i = -1, i - 1
      continue
    free[row] -= n
    choice[i], i = row, i + 1
  if i < 0:
    return None
  rows = [[] for _ in range(num_rows)]
  for k, r in enumerate(choice):
    rows[r].append(order[k])
  return [r for r in rows if r]


def fitted_shape(
  parts: Sequence[Sequence[int]], spec: PackSpec, sources: Sequence[Sequence[str]] | None = None
) -> tuple[int, int, list[list[list[int]]]]:
  """The rows of one batch packed as ``spec`` says: (row length T, rows per part B, each part's
  unit indices per row).

  ``parts`` are the lengths of the units of every part of the batch (every host's micro-batches,
  each packed into rows of its own, all of one shape). With ``spec.fit_multiple``, T (a multiple
  of it up to ``spec.row_length``, or the length unfitted rows would have) and B (a multiple of
  ``spec.rows_multiple``) are the pair with the fewest token slots B x T that holds every part
  (never more than unfitted rows take); among equals, the row length with the most factors of
  two (fewer distinct shapes), then the shorter. Each part's rows are filled first-fit
  decreasing, or where that needs more rows than the slots allow, by :func:`fit_rows`. Without, T is as ``spec.row_length`` and ``spec.length_multiple``
  say and B as many rows as first-fit needs.
  """
  sources = sources or [[f"unit {i}" for i in range(len(p))] for p in parts]
  longest = max((n for p in parts for n in p), default=1)
  if not spec.fit_multiple:
    t = spec.row_length
    if spec.length_multiple:
      t = min(spec.row_length, _round_up(longest, spec.length_multiple))
    plans = [plan_rows(p, t, s) for p, s in zip(parts, sources)]
    return t, _round_up(max(map(len, plans), default=0), spec.rows_multiple), plans
  if longest > spec.row_length:
    plan_rows([longest], spec.row_length, [_longest_source(parts, sources)])  # raises, naming it
  best = None
  for slots, t, b in _candidate_shapes(parts, spec, longest):
    if best is not None and slots > best[1] * best[0]:
      break  # no shape left can beat the best one found
    plans = [plan_rows(p, t, s) for p, s in zip(parts, sources)]
    if _round_up(max(map(len, plans)), spec.rows_multiple) > b:
      searched = [fit_rows(p, t, b) if len(plan) > b else plan for p, plan in zip(parts, plans)]
      plans = searched if all(plan is not None for plan in searched) else plans
    rows = _round_up(max(map(len, plans)), spec.rows_multiple)
    if best is None or _preferred(rows, t) < _preferred(best[1], best[0]):
      best = (t, rows, plans)
  return best


def _preferred(rows: int, row_length: int) -> tuple[int, int, int]:
  """Orders shapes: the fewest slots, then among equals the row length with the most factors of
  two (batches then meet on fewer shapes: a third fewer on the GPU benchmark's rows), then the
  shorter."""
  return rows * row_length, -(row_length & -row_length), row_length


def _candidate_shapes(
  parts: Sequence[Sequence[int]], spec: PackSpec, longest: int
) -> list[tuple[int, int, int]]:
  """(the fewest slots, row length, rows) of every row length a fitted batch may take (the
  multiples of ``spec.fit_multiple`` that hold its longest unit, and the length its rows would
  have unfitted), the fewest slots first: each part's tokens over the row length, rounded up to
  ``spec.rows_multiple``."""
  m = spec.fit_multiple
  # And the unfitted rows' length: fitted rows never take more slots than unfitted ones would.
  unfitted = min(spec.row_length, _round_up(longest, spec.length_multiple or spec.row_length))
  lengths = sorted(set(range(_round_up(longest, m), spec.row_length + 1, m)) | {unfitted})
  shapes = []
  for t in lengths:
    b = _round_up(max((-(-sum(p) // t) for p in parts), default=1), spec.rows_multiple)
    shapes.append((b * t, t, b))
  return sorted(shapes)


def _longest_source(parts: Sequence[Sequence[int]], sources: Sequence[Sequence[str]]) -> str:
  return max((n, s) for p, ss in zip(parts, sources) for n, s in zip(p, ss))[1]


def _row_length(units: list[list[Piece]], spec: PackSpec) -> int:
  """The length of this batch's rows without fitting: see ``PackSpec.length_multiple``."""
  if not spec.length_multiple:
    return spec.row_length
  longest = max((_length(u) for u in units), default=1)
  return min(spec.row_length, _round_up(longest, spec.length_multiple))


def _round_up(n: int, multiple: int) -> int:
  return -(-max(n, 1) // multiple) * multiple


def _rows_needed(plan: list[list[int]], row_length: int, num_rows: int) -> int:
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

  def place(self, unit: list[Piece], row: int, cursor: int, first_segment: int) -> list[tuple[int, int]]:
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


def _fill(units: list[list[Piece]], plan: list[list[int]], rows: _Rows):
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
  return of_example(example).rewards(example)


def pack_preference(
  groups: Sequence[PreferenceExample],
  spec: PackSpec,
  *,
  num_groups: int | None = None,
  num_completions: int | None = None,
  num_rows: int | None = None,
  num_rewards: int | None = None,
) -> PackedPreferenceBatch:
  """Packs preference groups into rows (the layout is :class:`~jaxrm.data.batches.PackedPreferenceBatch`).

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
  return _filled(groups, units, plan, rows, g, k, r, example_types.PREFERENCE)


def _laid_out(
  examples: Sequence[Example], spec: PackSpec, num_rows: int | None, num_rewards: int | None
) -> tuple[list[list[Piece]], list[list[int]], _Rows, int]:
  """What one batch's ``pack_*`` fills: each example's pieces, the rows' plan, the empty rows
  (``num_rows``, or as many as the plan needs) and the reward slots per row (``num_rewards``, or
  the most any row reads, rounded up to ``spec.rewards_multiple``)."""
  units = [_unit(e, spec.shared_prompt) for e in examples]
  lengths, sources = [_length(u) for u in units], [e.source for e in examples]
  if num_rows is None:
    t, b, [plan] = fitted_shape([lengths], spec, [sources])
  else:
    t = _row_length(units, spec)
    plan = plan_rows(lengths, t, sources)
    b = _rows_needed(plan, t, num_rows)
  rows = _Rows(b, t, spec.pad_id)
  return units, plan, rows, num_rewards or _round_up(rewards_per_row(examples, plan), spec.rewards_multiple)


def _filled(
  examples: Sequence[Example],
  units: list[list[Piece]],
  plan: list[list[int]],
  rows: _Rows,
  g: int,
  k: int | None,
  r: int,
  kind: ExampleType,
  like: Example | None = None,
  first_row: int = 0,
):
  """The packed batch of ``examples`` (of ``kind``), placed as ``plan`` says into ``rows``.

  ``like``: an example of the global batch, whose shape (a rated item's attributes) the batch
  takes even where this host's ``examples`` are none (the last validation batch).
  ``first_row``: the global index of ``rows``' first row, where the batch's indices start counting.
  """
  placed = list(_fill(units, plan, rows))
  return kind.pack(examples, units, placed, rows, g, k, r, like, first_row)


def pack_stepwise(
  examples: Sequence[StepwiseExample],
  spec: PackSpec,
  *,
  num_examples: int | None = None,
  num_rows: int | None = None,
) -> PackedStepwiseBatch:
  """Packs stepwise sequences into rows (the layout is :class:`~jaxrm.data.batches.PackedStepwiseBatch`).

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
  return _filled(examples, units, plan, rows, g, None, 0, example_types.STEPWISE)


def pack_items(
  examples: Sequence[Item],
  spec: PackSpec,
  *,
  num_examples: int | None = None,
  num_rows: int | None = None,
  num_rewards: int | None = None,
) -> PackedRegressionBatch | PackedLabelledBatch:
  """Packs rated responses or labelled items into rows, each a sequence of its own (the layouts are
  :class:`~jaxrm.data.batches.PackedRegressionBatch` and :class:`~jaxrm.data.batches.PackedLabelledBatch`).

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
  return _filled(examples, units, plan, rows, g, None, r, of_example(examples[0]), examples[0])


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
    parts, units, row_length, num_rows, plans = self._layout(groups)
    num_rewards = _round_up(
      max(rewards_per_row(part, plan) for part, plan in zip(parts, plans)), self.spec.rewards_multiple
    )
    micro = []
    first_row = self.process_index * num_rows  # this host's rows follow the lower hosts'
    g = self.batch_size // n
    kind = of_example(groups[0])
    k = (self.num_completions or kind.num_completions(groups)) if kind.grouped else None
    for m in range(n):
      part = self.process_index * n + m
      rows = _Rows(num_rows, row_length, self.spec.pad_id)
      placed = (parts[part], units[part], plans[part], rows, g)
      micro.append(_filled(*placed, k, num_rewards, kind, groups[0], first_row))
    if n == 1:
      return micro[0]
    return jax.tree.map(lambda *arrays: np.stack(arrays), *micro)

  def fill(self, groups: Sequence[Example]) -> tuple[int, int]:
    """(tokens written, token slots fed) of the global batch ``groups`` over every host and
    micro-batch, as :meth:`__call__` packs it (a shared prompt written once), without building
    its arrays."""
    parts, units, row_length, num_rows, _ = self._layout(groups)
    written = sum(_length(u) for part in units for u in part)
    return written, len(parts) * num_rows * row_length

  def _layout(self, groups: Sequence[Example]):
    """Every part's examples (host p's micro-batch m at ``p * micro_batches + m``), their units,
    the row length and count all parts share, and each part's plan."""
    n = self.micro_batches
    # Micro-batch m of a host takes every n-th of its groups from the m-th on.
    parts = [
      list(groups[p * self.batch_size : (p + 1) * self.batch_size])[m::n]
      for p in range(self.process_count)
      for m in range(n)
    ]
    units = [[_unit(e, self.spec.shared_prompt) for e in part] for part in parts]
    lengths = [[_length(u) for u in part] for part in units]
    row_length, num_rows, plans = fitted_shape(lengths, self.spec, [[e.source for e in p] for p in parts])
    return parts, units, row_length, num_rows, plans


def fill(batches: Iterable[Sequence[Example]], collate: PackedCollator) -> float:
  """The share of the fed token slots that hold a real token (a shared prompt counted once, as
  written) over the global batches ``batches``, as ``collate`` packs them on every host, planned
  without building them: what ``train/packing_efficiency`` reads for those batches on one host
  (on several, each reads its own rows')."""
  written = fed = 0
  for groups in batches:
    w, f = collate.fill(groups)
    written, fed = written + w, fed + f
  return written / fed if fed else 0.0
