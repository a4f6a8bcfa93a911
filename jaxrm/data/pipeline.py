"""Grain input pipeline: tokenized examples -> fixed-shape, per-host numpy batches.

Preference examples are collated into a :class:`~jaxrm.data.batches.PreferenceBatch`, stepwise ones
into a :class:`~jaxrm.data.batches.StepwiseBatch`, rated ones into a
:class:`~jaxrm.data.batches.RegressionBatch`, labelled items into a :class:`~jaxrm.data.batches.LabelledBatch`
(the layouts are in :mod:`jaxrm.data.batches`). T is the smallest length bucket that holds the longest
sequence of the *global* batch, so every host builds the same shapes. Length is bucketed per batch.
The training order is a seeded shuffle, or with ``group_by_length`` Hugging Face's length-grouped
order (:class:`~jaxrm.data.grouping.GroupedEpochs`).

With gradient accumulation, a global batch is split into micro-batches of similar lengths
(:func:`~jaxrm.data.grouping.micro_batch_groups`), each padded to its own bucket: a training batch
is then a tuple of micro-batches (:class:`MicroBatchCollator`).

With a :class:`~jaxrm.data.packing.PackSpec`, batches are packed instead (several sequences per
row: a :class:`~jaxrm.data.batches.PackedPreferenceBatch`, :class:`~jaxrm.data.batches.PackedStepwiseBatch`,
:class:`~jaxrm.data.batches.PackedRegressionBatch` or :class:`~jaxrm.data.batches.PackedLabelledBatch`),
with the same shuffling, per-host split and resume state. A packed training batch split into n
micro-batches carries a leading ``[n]`` axis on every array, its batch dimension second.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import grain
import jax
import numpy as np
from absl import flags

from jaxrm import sharding
from jaxrm.data import grouping, packing
from jaxrm.data.batches import Batch, PreferenceBatch, RegressionBatch, StepwiseBatch
from jaxrm.data.example_types import of_example
from jaxrm.data.example_types import right_padded as right_padded  # re-exported: scoring pads rows with it
from jaxrm.data.packing import Example, PackedCollator, PackSpec
from jaxrm.errors import DataError

log = logging.getLogger(__name__)


def length_buckets(max_length: int, multiple: int = 64) -> tuple[int, ...]:
  """Multiples of ``multiple`` below ``max_length``, then ``max_length`` itself."""
  return tuple(range(multiple, max_length, multiple)) + (max_length,)


def bucket_length(length: int, buckets: Sequence[int]) -> int:
  """The first of ``buckets`` that holds ``length`` tokens (``length`` itself past the last)."""
  return next((b for b in buckets if b >= length), length)


def scoring_rows(n: int, batch_size: int) -> int:
  """Rows of a scoring batch holding ``n`` rows: ``batch_size``, or the next power of two when
  fewer remain (few compiled shapes)."""
  return min(batch_size, 1 << (n - 1).bit_length())


def max_completions(examples: Sequence[Example]) -> int:
  """K for preference batches: the most completions in any example (2 for pairs; 0 if none)."""
  return max((len(e.input_ids) for e in examples), default=0)


@dataclasses.dataclass(frozen=True)
class Collator:
  """Builds this host's batch from the groups of one global batch.

  Attributes:
    batch_size: groups per host (B).
    process_index, process_count: this host's slice of the global batch of
      ``batch_size * process_count`` groups.
    buckets: allowed sequence lengths T, ascending.
    pad_id: token id written into padding.
    num_completions: K for preference batches; None for stepwise and rated ones.
  """

  batch_size: int
  buckets: tuple[int, ...]
  pad_id: int = 0
  num_completions: int | None = None
  process_index: int = 0
  process_count: int = 1

  def __call__(self, groups: Sequence[Example]) -> PreferenceBatch | StepwiseBatch | RegressionBatch:
    """Collates ``groups`` (at most one global batch); missing groups become fillers."""
    length = self._bucket(groups)
    start = self.process_index * self.batch_size
    local = list(groups[start : start + self.batch_size])
    n_real = len(local)
    # Fillers repeat a real example of the global batch; their mask entries then zero them out.
    local += [groups[0]] * (self.batch_size - n_real)
    return of_example(groups[0]).collate(local, n_real, self.num_completions, length, self.pad_id)

  def _bucket(self, groups: Sequence[Example]) -> int:
    longest, source = max((len(ids), e.source) for e in groups for ids in _sequences(e))
    for b in self.buckets:
      if b >= longest:
        return b
    raise ValueError(
      f"a sequence of {longest} tokens ({source}) exceeds the largest length "
      f"bucket {self.buckets[-1]}; tokenize with max_length <= "
      f"{self.buckets[-1]} or add a larger bucket"
    )


def group_length(example: Example) -> int:
  """The longest sequence of a group: what its rows are padded to."""
  return max(len(ids) for ids in _sequences(example))


@dataclasses.dataclass(frozen=True)
class MicroBatchCollator:
  """Splits one global batch into ``micro_batches`` micro-batches of similar lengths, each padded
  to its own bucket; returns this host's slice of each, as a tuple.

  The split and each micro-batch's bucket depend on the global batch alone, so every host builds
  the same shapes; host ``process_index`` takes its contiguous slice of every micro-batch.

  Attributes:
    collate: a :class:`Collator` whose ``batch_size`` is one micro-batch's groups per host.
    micro_batches: how many micro-batches a global batch is split into.
  """

  collate: Collator
  micro_batches: int

  def __call__(self, groups: Sequence[Example]) -> tuple[Batch, ...]:
    size = self.collate.batch_size * self.collate.process_count * self.micro_batches
    if len(groups) != size:
      raise ValueError(
        f"a global batch of {len(groups)} groups does not split into {self.micro_batches} "
        f"micro-batches of {self.collate.batch_size} groups per host"
      )
    split = grouping.micro_batch_groups([group_length(g) for g in groups], self.micro_batches)
    return tuple(self.collate([groups[i] for i in indices]) for indices in split)


def token_counts(batch: Batch | Sequence[Batch]) -> tuple[int, float]:
  """(real tokens, their share of the token slots fed) of a batch or a tuple of micro-batches."""
  if not isinstance(batch, tuple):
    return batch.token_counts()
  counts = [b.token_counts() for b in batch]
  real = sum(n for n, _ in counts)
  fed = sum(n / share for n, share in counts if share)
  return real, real / fed if fed else 0.0


FILL_BATCHES = 64  # packed runs: the first batches whose fill the packer plans at the start


@dataclasses.dataclass(frozen=True)
class TrainStream:
  """How a training iterator walks the data.

  An epoch is ``steps_per_epoch`` global batches; the examples left over after the last full
  global batch are skipped for that epoch (a different few each epoch, as the order is reshuffled).
  ``fill``: with packed rows, the share of the fed token slots that hold a real token over the
  first :data:`FILL_BATCHES` batches, as the packer plans them (``packing.fill``); None unpacked.
  """

  num_examples: int
  global_batch_size: int
  fill: float | None = None

  @property
  def steps_per_epoch(self) -> int:
    return self.num_examples // self.global_batch_size

  def epoch(self, step: int) -> int:
    """The epoch that batch number ``step`` (0-based) belongs to."""
    return step // self.steps_per_epoch


def make_train_iterator(
  examples: Sequence[Example],
  *,
  batch_size: int,
  seed: int,
  buckets: Sequence[int],
  pad_id: int = 0,
  num_completions: int | None = None,
  process_index: int = 0,
  process_count: int = 1,
  num_workers: int = 0,
  pack: PackSpec | None = None,
  micro_batches: int = 1,
  group_by_length: bool = False,
) -> tuple[grain.DatasetIterator, TrainStream]:
  """An endless iterator of this host's training batches, and its epoch arithmetic.

  Each epoch is a fresh seeded shuffle of ``examples`` (identical for identical seeds), cut into
  global batches of ``batch_size * process_count`` groups; host ``process_index`` gets its
  ``batch_size`` groups of each. The iterator's ``get_state()``/``set_state()`` resume it exactly;
  Grain's Orbax checkpoint handler saves it.

  Args:
    examples: tokenized examples, all of one kind (preference, stepwise, rated or labelled).
    batch_size: groups per host per step.
    seed: shuffle seed (a non-negative integer).
    buckets: allowed sequence lengths, ascending (see :func:`length_buckets`).
    pad_id: token id for padding (the tokenizer's pad id, or 0).
    num_completions: K for preference batches; defaults to :func:`max_completions`.
    process_index, process_count: this host and the number of hosts.
    num_workers: Grain worker processes (0: batches are built in this process).
    pack: pack each batch's sequences into rows this way (``buckets`` then do not apply; the
      spec's pad_id is replaced by ``pad_id``); None: one sequence per row.
    micro_batches: the micro-batches of gradient accumulation. With ``pack``, packed apart and
      stacked along a leading axis (see :class:`~jaxrm.data.packing.PackedCollator`); without,
      a batch is a tuple of micro-batches each padded to its own bucket
      (:class:`MicroBatchCollator`).
    group_by_length: each epoch in Hugging Face's ``group_by_length`` order instead of a plain
      shuffle (:class:`~jaxrm.data.grouping.GroupedEpochs`); unpacked batches only.
  """
  stream = TrainStream(len(examples), batch_size * process_count)
  if stream.steps_per_epoch == 0:
    raise DataError(
      f"the training set has {len(examples)} examples after dropped rows; one "
      f"global batch needs {stream.global_batch_size} (batch_size {batch_size} x "
      f"{process_count} hosts): lower the batch size or add data"
    )
  if group_by_length and pack is not None:
    raise ValueError(
      "data.group_by_length applies to unpacked batches: packed rows have no padding to save; "
      "set data.packing='none' or data.group_by_length=False"
    )
  collate = train_collator(
    examples, batch_size, buckets, pad_id, num_completions, process_index, process_count, pack, micro_batches
  )
  if isinstance(collate, PackedCollator):
    first = first_batches(examples, stream.global_batch_size, seed, FILL_BATCHES)
    stream = dataclasses.replace(stream, fill=packing.fill(first, collate))
    log.info(
      "packed rows: %.1f%% of the fed token slots hold a real token over the first %d batches (planned)",
      100 * stream.fill,
      len(first),
    )
  if group_by_length:
    # Epoch e's order is drawn from (seed, e) alone; batches never straddle two epochs, as each
    # epoch holds a whole number of global batches.
    lengths = [group_length(e) for e in examples]
    ds = grain.MapDataset.source(grouping.GroupedEpochs(examples, lengths, stream.global_batch_size, seed))
    ds = ds.batch(stream.global_batch_size, drop_remainder=True, batch_fn=list).map(collate)
  else:
    ds = grain.MapDataset.source(examples).shuffle(seed=_shuffle_seed(seed))
    # MapDataset.batch keeps epochs apart and drops each epoch's remainder; repeat() then reads
    # epoch e through the shuffle seeded for epoch e.
    ds = ds.batch(stream.global_batch_size, drop_remainder=True, batch_fn=list)
    ds = ds.map(collate).repeat()
  # Examples are already in memory: one reader thread and a short buffer are enough.
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4))
  if num_workers > 0:
    if not flags.FLAGS.is_parsed():
      # Grain's workers read absl flags, which are unparsed outside an absl app (e.g. a notebook).
      flags.FLAGS.mark_as_parsed()
    it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
  return iter(it), stream


def _shuffle_seed(seed: int) -> int:
  # Grain shuffles epoch e with seed + e; mixing the seed first keeps runs with seeds s and s + 1
  # from seeing the same orders one epoch apart.
  return int(np.random.SeedSequence(seed).generate_state(1)[0])


def first_batches(
  examples: Sequence[Example], global_batch_size: int, seed: int, num_batches: int
) -> list[list]:
  """The first ``num_batches`` global batches (of at most one epoch) that a training iterator of
  ``seed`` collates, in order, as lists of examples (the shuffled order without
  ``group_by_length``)."""
  order = grain.MapDataset.source(range(len(examples))).shuffle(seed=_shuffle_seed(seed))
  n = min(num_batches, len(examples) // global_batch_size)
  return [[examples[order[b * global_batch_size + i]] for i in range(global_batch_size)] for b in range(n)]


def make_eval_batches(
  examples: Sequence[Example],
  *,
  batch_size: int,
  buckets: Sequence[int],
  pad_id: int = 0,
  num_completions: int | None = None,
  process_index: int = 0,
  process_count: int = 1,
  pack: PackSpec | None = None,
) -> list[Batch]:
  """Every example once, in order, as this host's batches; the last is completed with fillers.

  Arguments are those of :func:`make_train_iterator`.
  """
  collate = _collator(
    examples, batch_size, buckets, pad_id, num_completions, process_index, process_count, pack
  )
  step = batch_size * process_count
  return [collate(examples[i : i + step]) for i in range(0, len(examples), step)]


def to_global_batch(local_batch: Batch, mesh: jax.sharding.Mesh, *, stacked: bool = False) -> Batch:
  """Assembles every host's local batch into one batch of global arrays on ``mesh``.

  Args:
    local_batch: this host's batch (its rows are a contiguous slice of the global batch).
    mesh: the device mesh; rows are split over its data-parallel axes
      (``sharding.batch_sharding``).
    stacked: the arrays are micro-batches stacked along a leading ``[n]`` axis, rows second.
  A tuple of micro-batches becomes a tuple of global batches.
  """
  if isinstance(local_batch, tuple):
    return tuple(to_global_batch(b, mesh) for b in local_batch)
  shardings = jax.tree.map(lambda x: sharding.batch_sharding(mesh, x.ndim, stacked=stacked), local_batch)
  return jax.make_array_from_process_local_data(shardings, local_batch)


def train_collator(
  examples: Sequence[Example],
  batch_size: int,
  buckets: Sequence[int],
  pad_id: int,
  num_completions: int | None,
  process_index: int,
  process_count: int,
  pack: PackSpec | None,
  micro_batches: int,
) -> Collator | PackedCollator | MicroBatchCollator:
  """What turns one global batch of groups into this host's training batch (arguments as
  :func:`make_train_iterator`'s)."""
  if pack is not None or micro_batches == 1:
    return _collator(
      examples,
      batch_size,
      buckets,
      pad_id,
      num_completions,
      process_index,
      process_count,
      pack,
      micro_batches,
    )
  if batch_size % micro_batches:
    raise ValueError(f"{batch_size} groups per host do not split into {micro_batches} equal micro-batches")
  collate = _collator(
    examples, batch_size // micro_batches, buckets, pad_id, num_completions, process_index, process_count
  )
  return MicroBatchCollator(collate, micro_batches)


def _collator(
  examples: Sequence[Example],
  batch_size: int,
  buckets: Sequence[int],
  pad_id: int,
  num_completions: int | None,
  process_index: int,
  process_count: int,
  pack: PackSpec | None = None,
  micro_batches: int = 1,
) -> Collator | PackedCollator:
  if not examples:
    raise DataError("no examples left to batch (every row was dropped, or the data is empty)")
  if num_completions is None:
    num_completions = of_example(examples[0]).num_completions(examples)
  if pack is not None:
    packing.check_packable(examples[0], pack.shared_prompt)
    return PackedCollator(
      batch_size=batch_size,
      spec=dataclasses.replace(pack, pad_id=pad_id),
      num_completions=num_completions,
      process_index=process_index,
      process_count=process_count,
      micro_batches=micro_batches,
    )
  return Collator(
    batch_size=batch_size,
    buckets=tuple(sorted(buckets)),
    pad_id=pad_id,
    num_completions=num_completions,
    process_index=process_index,
    process_count=process_count,
  )


def _sequences(example: Example) -> Sequence[np.ndarray]:
  return of_example(example).sequences(example)
