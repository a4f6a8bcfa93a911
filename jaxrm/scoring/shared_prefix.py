"""Scoring rows that share a token prefix together: the prefix once, each row's rest a branch.

GRPO scores every prompt with many completions; scored one row each, the prompt is recomputed for
every completion. Here rows are grouped by the token prefix they share (:func:`prefix_groups`) and
each group is written as one shared-prompt packed row, exactly as training writes a preference
group (:func:`jaxrm.data.packing.pack_preference` with ``shared_prompt``): the prefix once, then
each row's remaining tokens as a branch that sees the prefix and itself only, its positions
continuing the prefix's. The decoder's tree mask (segment and branch ids) makes each branch's
outputs those of its row scored alone: a sequence head's reward is read at the branch's last
token, a token head's logits of a row are the prefix's followed by its branch's.

The grouping rule: rows are sorted by their token ids, so that rows sharing a prefix are
neighbours, and split into runs of neighbours that minimise the estimated cost of scoring them
(:func:`row_cost`: tokens, plus attention that grows with the square of a row's length). A run
shares its longest common prefix, cut to leave every row at least one token of its own (where its
reward is read). A run is formed only when it shares at least ``Sharing.min_prefix`` tokens, holds
at most ``Sharing.max_rows`` rows and fits ``Sharing.row_length`` tokens; larger groups are split
into several runs, each with its own copy of the prefix. Rows in no run score alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from jaxrm.data import packing
from jaxrm.data.batches import PackedPreferenceBatch
from jaxrm.data.pipeline import bucket_length, scoring_rows
from jaxrm.data.tokenize import PreferenceExample
from jaxrm.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Sharing:
  """When rows are scored together (see the module's docstring).

  Attributes:
    min_prefix: rows share only a prefix of at least this many tokens. The default, 64 (one
      default length bucket), leaves alone rows that share only a chat template's opening or a
      short prompt: that saves less per row than right-padding already spends on it, and a
      small call would compile a packed program for it.
    max_rows: rows in one packed row, at most (a larger group is split).
    row_length: tokens of one packed row, at most (a longer group is split).
  """

  min_prefix: int = 64
  max_rows: int = 64
  row_length: int = 4096

  def __post_init__(self):
    if self.min_prefix < 1 or self.max_rows < 2 or self.row_length < 2:
      raise ValueError(
        f"Sharing needs min_prefix >= 1, max_rows >= 2 and row_length >= 2, got "
        f"min_prefix={self.min_prefix}, max_rows={self.max_rows}, row_length={self.row_length}"
      )


def as_sharing(share_prefix: bool | Sharing) -> Sharing | None:
  """The rule ``share_prefix`` asks for: True is :class:`Sharing`'s defaults, False none."""
  if isinstance(share_prefix, Sharing):
    return share_prefix
  if isinstance(share_prefix, bool):
    return Sharing() if share_prefix else None
  raise TypeError(
    f"share_prefix must be True, False or a jaxrm.scoring.shared_prefix.Sharing, got {share_prefix!r}"
  )


def break_even_length(cfg: ModelConfig) -> float:
  """The row length at which a token's attention costs as much as its projections and MLP.

  Per token and layer, the projections and the gated MLP take ``D * (2 * H * Dh + 2 * K * Dh) +
  3 * D * F`` multiply-adds; attention takes ``2 * H * Dh`` per key it sees. Embedding and head
  are per token and left out.
  """
  d, f = cfg.hidden_size, cfg.intermediate_size
  qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  return (d * (2 * qd + 2 * kvd) + 3 * d * f) / (2 * qd)


def row_cost(length: int, break_even: float) -> float:
  """The cost of one causal row of ``length`` tokens, in tokens' worth of projections: each token,
  plus the ``length**2 / 2`` query-key pairs of its attention."""
  return length * (1.0 + length / (2.0 * break_even))


def scoring_groups(
  rows: Sequence[Sequence[int]], sharing: Sharing | None, cfg: ModelConfig, max_tokens: int
) -> list[list[int]]:
  """The groups of ``rows`` that :class:`jaxrm.RewardModel` scores together for a model of ``cfg``:
  :func:`prefix_groups` with packed rows of at most ``max_tokens`` tokens (the token budget of one
  forward pass); every row alone without ``sharing``."""
  if sharing is None:
    return [[i] for i in range(len(rows))]
  sharing = dataclasses.replace(sharing, row_length=min(sharing.row_length, max_tokens))
  return prefix_groups(rows, sharing, break_even_length(cfg))


def packed_length(rows: Sequence[Sequence[int]], group: Sequence[int]) -> int:
  """Tokens the rows ``group`` of ``rows`` take in one packed row: the prefix they share once,
  then each one's own (a row alone: its length)."""
  return packing.packed_length(_example(rows, group), shared_prompt=True)


def prefix_groups(rows: Sequence[Sequence[int]], sharing: Sharing, break_even: float) -> list[list[int]]:
  """The indices of ``rows`` in groups scored together (the rule is in the module's docstring);
  a group of one scores alone. Every index appears once."""
  arrays = [np.asarray(r, np.int64) for r in rows]
  order = sorted(range(len(rows)), key=lambda i: arrays[i].tolist())
  lengths = [len(arrays[i]) for i in order]
  adjacent = [_common_prefix(arrays[a], arrays[b]) for a, b in zip(order, order[1:])]
  start = _best_runs(lengths, adjacent, sharing, break_even)
  groups, end = [], len(order)
  while end:
    groups.append(order[start[end] : end])
    end = start[end]
  return groups[::-1]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
  n = min(len(a), len(b))
  differs = np.flatnonzero(a[:n] != b[:n])
  return int(differs[0]) if differs.size else n


def _best_runs(lengths: list[int], adjacent: list[int], sharing: Sharing, break_even: float) -> list[int]:
  """start[j]: where the last run of the cheapest split of the first j sorted rows begins.

  Dynamic programming over split points. Growing a run backwards only shrinks its prefix and
  lengthens its packed row, so the search stops at the first run that breaks a limit.
  """
  cost, start = [0.0], [0]
  for j, length in enumerate(lengths):
    cost.append(cost[j] + row_cost(length, break_even))
    start.append(j)
    common, shortest, total = length, length, length
    for i in range(j - 1, max(-1, j - sharing.max_rows), -1):
      common, shortest, total = min(common, adjacent[i]), min(shortest, lengths[i]), total + lengths[i]
      prefix = min(common, shortest - 1)  # as packing.pack_preference cuts it
      packed = total - (j - i) * prefix
      if prefix < sharing.min_prefix or packed > sharing.row_length:
        break
      if cost[i] + row_cost(packed, break_even) < cost[j + 1]:
        cost[j + 1], start[j + 1] = cost[i] + row_cost(packed, break_even), i
  return start


@dataclasses.dataclass(frozen=True)
class SharedRows:
  """Groups of rows written as shared-prompt packed rows for one forward pass.

  Attributes:
    batch: the packed rows ([B, T] arrays); group g of ``groups`` is its group g, row k of it
      its completion k.
    groups: the caller's row indices of each group.
  """

  batch: PackedPreferenceBatch
  groups: tuple[tuple[int, ...], ...]

  @property
  def rows(self) -> list[int]:
    """The caller's row indices, in the order :meth:`rewards` and :meth:`logits` return them."""
    return [i for group in self.groups for i in group]

  def rewards(self, rewards_br: np.ndarray) -> np.ndarray:
    """Each row's reward(s), [N] or [N, C], from the model's rewards [B, R] or [B, R, C] at the
    batch's ``reward_positions``."""
    flat = rewards_br.reshape(rewards_br.shape[0] * rewards_br.shape[1], -1)
    index = np.concatenate([self.batch.reward_index[g, : len(group)] for g, group in enumerate(self.groups)])
    out = flat[index]
    return out[:, 0] if rewards_br.ndim == 2 else out

  def logits(self, logits_btc: np.ndarray) -> list[np.ndarray]:
    """Each row's logits [T_i, C] from the model's [B, T, C]: its prefix's, then its branch's."""
    return [logits_btc[row, tokens] for row, tokens in self._tokens()]

  def padded(self, num_rows: int, length: int, pad_id: int) -> SharedRows:
    """These rows in a pass of ``num_rows`` rows of ``length`` tokens, one reward slot per token
    (as :func:`shared_batches` with ``slot_per_token`` gives them): empty rows and right padding
    added, every row's outputs unchanged."""
    return dataclasses.replace(self, batch=self.batch.padded(num_rows, length, length, pad_id))

  def _tokens(self) -> Iterator[tuple[int, np.ndarray]]:
    """(packed row, indices in it) of each row's tokens: its group's prefix and its own branch."""
    b = self.batch
    r = b.reward_positions.shape[1]
    for g, group in enumerate(self.groups):
      for slot in b.reward_index[g, : len(group)]:
        row, end = slot // r, b.reward_positions[slot // r, slot % r]
        segment, branch = b.segment_ids[row], b.branch_ids[row]
        yield row, np.flatnonzero((segment == segment[end]) & ((branch == 0) | (branch == branch[end])))


def shared_batches(
  rows: Sequence[Sequence[int]],
  groups: Sequence[Sequence[int]],
  *,
  batch_size: int,
  buckets: Sequence[int],
  max_tokens: int,
  pad_id: int,
  slot_per_token: bool = False,
  shapes: Sequence[tuple[int, int]] | None = None,
) -> Iterator[SharedRows]:
  """``groups`` of ``rows`` as forward passes of packed rows, shortest first.

  A pass holds at most ``batch_size`` rows of T tokens, T the first of ``buckets`` that holds its
  longest group (:func:`jaxrm.data.pipeline.bucket_length`), and at most ``max_tokens`` tokens.
  Its row count is ``batch_size`` or, when fewer groups remain, the next power of two (as unpacked
  scoring batches; few programs compile); shorter groups may share a row. Reward slots per row:
  the power of two (at least 8) that holds them, or with ``slot_per_token`` one per token (T: a
  pass's shape is then its rows and T alone, so every shape can be compiled ahead).

  ``shapes``: the (rows, T) a pass may have (a server's compiled programs). A pass then takes,
  of those that hold its groups (first-fit, longest first), the one of fewest token slots, then
  the shortest: three groups of 1,450 to 1,900 tokens fill two rows of 3,072 (6,144 slots), not
  four of 2,048 (8,192).
  """
  examples = [_example(rows, g) for g in groups]
  lengths = [packed_length(rows, g) for g in groups]
  order = sorted(range(len(groups)), key=lengths.__getitem__)
  while order:
    n = 1
    while n < min(batch_size, len(order)) and (
      scoring_rows(n + 1, batch_size) * bucket_length(lengths[order[n]], buckets) <= max_tokens
    ):
      n += 1
    members, order = order[:n], order[n:]
    length = bucket_length(lengths[members[-1]], buckets)
    num_rows = None
    if shapes:
      num_rows, length = _fewest_slots([lengths[i] for i in members], shapes, (None, length))
    yield _pack(
      [examples[i] for i in members],
      tuple(tuple(groups[i]) for i in members),
      length,
      batch_size,
      pad_id,
      length if slot_per_token else None,
      num_rows,
    )


def fewest_slots(shapes: Sequence[tuple[int, int]], default: tuple) -> tuple:
  """The (rows, T) of ``shapes`` with the fewest token slots, then the shortest; ``default`` if
  there is none."""
  return min(shapes, key=lambda s: (s[0] * s[1], s[1]), default=default)


def _fewest_slots(lengths: list[int], shapes, default: tuple) -> tuple:
  """:func:`fewest_slots` of the ``shapes`` whose rows hold groups of ``lengths`` as
  :func:`jaxrm.data.packing.plan_rows` places them."""
  return fewest_slots(
    [
      (b, t)
      for b, t in shapes
      if t >= max(lengths) and len(packing.plan_rows(lengths, t, [""] * len(lengths))) <= b
    ],
    default,
  )


def _example(rows: Sequence[Sequence[int]], group: Sequence[int]) -> PreferenceExample:
  """A group of rows as the preference group whose completions they are (in order)."""
  ids = tuple(np.asarray(rows[i], np.int32) for i in group)
  return PreferenceExample(ids, tuple(range(len(ids))), 0.0, f"rows {', '.join(map(str, group))}", {})


def _pack(
  examples: list[PreferenceExample],
  groups: tuple[tuple[int, ...], ...],
  length: int,
  batch_size: int,
  pad_id: int,
  slots: int | None,
  num_rows: int | None = None,
) -> SharedRows:
  """``examples`` in rows of ``length`` tokens with ``slots`` reward slots per row (None: the
  power of two, at least 8, that holds them, so that few shapes compile), in ``num_rows`` rows
  (None: as :func:`jaxrm.data.pipeline.scoring_rows` gives for the rows they fill)."""
  spec = packing.PackSpec(row_length=length, shared_prompt=True, pad_id=pad_id)
  plan = packing.plan_rows(
    [packing.packed_length(e, shared_prompt=True) for e in examples], length, [e.source for e in examples]
  )
  if slots is None:
    slots = max(8, 1 << (packing.rewards_per_row(examples, plan) - 1).bit_length())
  batch = packing.pack_preference(
    examples, spec, num_rows=num_rows or scoring_rows(len(plan), batch_size), num_rewards=slots
  )
  return SharedRows(batch, groups)
