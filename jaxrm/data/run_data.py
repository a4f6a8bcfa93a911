"""A training run's examples: its train and validation sets read, tokenized (or taken from the
cache) and checked against the run's reward type, with the rows each set dropped.

``check_data(config)`` is what the trainer checks before a model loads, ``load_run_data(config,
tokenizer)`` what it reads before it batches anything.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxrm import sharding, tasks
from jaxrm.data import cache, packing, pipeline, registry
from jaxrm.data.drops import DropReport
from jaxrm.data.example_types import of_example
from jaxrm.data.packing import PackSpec
from jaxrm.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
  from jaxrm.config import RewardSpec, RunConfig

log = logging.getLogger(__name__)

FIRST_ROWS = 64  # records of each set that check_data parses before a model loads


@dataclasses.dataclass
class RunData:
  """The tokenized examples of a run and the rows dropped from each set."""

  train: Sequence  # a list, or the cache's memory-mapped examples
  validation: dict[str, Sequence]
  drops: dict[str, DropReport]  # "train", "validation-<name>"
  num_completions: int | None  # K of preference batches; None for stepwise and rated data

  def mean_train_tokens(self, shared_prompt: bool = False) -> float:
    """Real tokens of a training group on average: its sequences' lengths, or with
    ``shared_prompt`` its packed row's, the prompt written once."""
    return sum(packing.packed_length(e, shared_prompt) for e in self.train) / len(self.train)


@dataclasses.dataclass(frozen=True)
class Batching:
  """How a run's groups become each host's batches: the sizes the trainer builds its input with,
  and the fit check (:mod:`jaxrm.planning.fit_check`) its worst-case batch."""

  per_host: int  # training groups per host per step
  eval_per_host: int  # validation groups per host per batch
  grad_accum: int  # micro-batches per update
  pack: PackSpec | None  # None: one sequence per row
  buckets: tuple[int, ...]  # the unpacked rows' lengths
  process_count: int

  @property
  def micro_batched(self) -> bool:
    """A training batch is a tuple of micro-batches, each padded to its own bucket."""
    return self.pack is None and self.grad_accum > 1


def batching(config: RunConfig, mesh, num_completions: int | None, process_count: int) -> Batching:
  """The :class:`Batching` of ``config`` on ``mesh`` over ``process_count`` hosts, for groups of
  ``num_completions`` (K of preference data; None for stepwise and rated data).

  Raises:
    ConfigError: the batch sizes do not divide over the devices and hosts.
  """
  data_parallel = sharding.data_parallel_size(mesh)
  gbs, mbs = config.train.global_batch_size, config.train.micro_batch_size
  if gbs % (mbs * data_parallel):
    raise ConfigError(
      f"train.global_batch_size={gbs} must be a multiple of micro_batch_size x data-parallel "
      f"devices = {mbs} x {data_parallel}"
    )
  if gbs % process_count:
    raise ConfigError(f"train.global_batch_size={gbs} must be divisible by the {process_count} processes")
  # Packed row counts: equal rows on every data-parallel device, in steps of a quarter micro-batch
  # per device (few compiled shapes).
  rows_multiple = data_parallel // math.gcd(data_parallel, process_count) * max(mbs // 4, 1)
  eval_groups = max(config.eval.batch_size // data_parallel, 1) * data_parallel
  return Batching(
    per_host=gbs // process_count,
    eval_per_host=eval_groups // process_count,
    grad_accum=gbs // (mbs * data_parallel),
    pack=_pack_spec(config, num_completions, rows_multiple),
    buckets=tuple(pipeline.length_buckets(config.data.max_length, config.data.bucket_multiple)),
    process_count=process_count,
  )


def _pack_spec(config: RunConfig, num_completions: int | None, rows_multiple: int) -> PackSpec | None:
  """The ``PackSpec`` that ``data.packing`` and ``data.packed_row_length`` ask for; None: unpacked.

  Args:
    config: the run's config.
    num_completions: K of preference data; None for stepwise data.
    rows_multiple: each host's row count is rounded up to a multiple of this.
  """
  spec = config.data
  if spec.packing == "none":
    return None
  # Automatic rows fit a group of K completions of max_length tokens, and are as long as each
  # batch's longest group, in steps of bucket_multiple (few compiled shapes).
  return PackSpec(
    row_length=spec.packed_row_length or spec.max_length * (num_completions or 1),
    length_multiple=0 if spec.packed_row_length else spec.bucket_multiple,
    shared_prompt=spec.packing == "shared_prompt",
    rows_multiple=rows_multiple,
    fit_multiple=spec.packed_fit_multiple,
  )


def load_run_data(config: RunConfig, tokenizer) -> RunData:
  """The train and validation sets ``config.data`` names, tokenized by ``tokenizer``.

  Raises:
    ConfigError: the data does not fit ``config.reward`` (its kind, or strengths to scale by), or
      a validation set has no usable rows.
  """
  spec = config.data
  task = _checked_task(config)
  options = _read_options(config.reward, spec.dataset_name)

  def load(path: str, split: str, limit: int, limit_name: str, drops: DropReport) -> Sequence:
    path = path or None
    source = None
    if spec.cache_directory is not None:
      source = registry.source_key(spec.dataset_name, path, split=split, **options)
    if source is not None:
      source["max_records"] = limit
    read = lambda d: registry.iter_records(
      spec.dataset_name, path, split=split, drops=d, max_records=limit, limit_name=limit_name, **options
    )
    return cache.load_tokenized(
      read,
      tokenizer=tokenizer,
      options=config.tokenize_options,
      drops=drops,
      source=source,
      cache_dir=spec.cache_directory,
      num_proc=spec.tokenizer_processes,
    )

  drops = {"train": DropReport()}
  train = load(spec.train_data_path, "train", spec.max_train_rows, "data.max_train_rows", drops["train"])
  validation = {}
  for name, path in spec.val_data_paths.items():
    drops[f"validation-{name}"] = report = DropReport()
    validation[name] = load(path, "validation", spec.max_val_rows, "data.max_val_rows", report)
    if not validation[name]:
      raise ConfigError(f"validation set {name!r} has no usable rows\n{report.summary(name)}")
  sets = {"data.train_data_path": train, **{f"validation set {n!r}": v for n, v in validation.items()}}
  for where, examples in sets.items():
    _check_kind_of_items(where, examples, task, config.reward.type)
  if config.reward.preference_strength_scaling and all(e.strength is None for e in train):
    raise ConfigError(
      f"reward.preference_strength_scaling weighs each pair by its preference strength, but no "
      f"training row of {spec.dataset_name} has one: give rows a 'strength' (HelpSteer3 has "
      "overall_preference), or set reward.preference_strength_scaling=False"
    )
  counts = [of_example(e[0]).num_completions(e) for e in sets.values() if e]
  num_completions = max((k for k in counts if k is not None), default=None)
  return RunData(train, validation, drops, num_completions)


def _check_kind_of_items(where: str, examples: Sequence, task: tasks.Task, reward_type: str) -> None:
  """Labelled items (prompt, completion, label) train a task that takes them, and a set holds
  one kind of row (the cache has checked a cached set)."""
  if not examples:
    return
  first = examples[0]
  kind = of_example(first)
  if kind not in task.example_types:
    takes = [r for t in tasks.TASKS.values() if kind in t.example_types for r in t.reward_types]
    raise ConfigError(
      f"{where} holds {kind.name} ({kind.fields}; {first.source}), which train "
      f"reward.type={' or '.join(takes)} only, not {reward_type!r}: give "
      f"{task.example_types[0].name}, or set reward.type={takes[0]!r}"
    )
  if isinstance(examples, list):
    odd = next((e for e in examples if type(e) is not type(first)), None)
    if odd is not None:
      raise ConfigError(
        f"{where} mixes {kind.name} ({first.source}) with {of_example(odd).name} ({odd.source}); "
        "give one kind of row per file"
      )


def check_data(config: RunConfig, first_rows: int = FIRST_ROWS) -> None:
  """Checks the data without a model, so that a run that cannot work stops before one loads: the
  dataset's name and rows against ``reward.type``, that each of ``reward.attributes`` is rated in
  the training set, and each set's path and first ``first_rows`` records (``config.data`` has
  checked the validation set names; :func:`jaxrm.config.check_run_settings` checks the rest).

  Raises:
    ConfigError: the data does not fit ``config.reward``, an attribute no training row rates.
    DataError: an unknown dataset, a missing path, an unknown file type, a bad row among the first.
  """
  spec = config.data
  _checked_task(config)
  options = _read_options(config.reward, spec.dataset_name)
  if "attributes" in options:  # before rows are read: with none rated, every row is dropped
    _check_attributes_rated(config)
  sets = [(spec.train_data_path, "train"), *((path, "validation") for path in spec.val_data_paths.values())]
  for path, split in sets:
    records = registry.iter_records(
      spec.dataset_name, path or None, split=split, drops=DropReport(), **options
    )
    try:
      for _ in itertools.islice(records, first_rows):
        pass
    finally:
      records.close()


def _check_attributes_rated(config: RunConfig) -> None:
  """Each of ``reward.attributes`` is rated by some row of the training set: a misspelled one
  would train its output on nothing."""
  spec, names = config.data, config.reward.attribute_names
  unrated, where, columns = registry.unrated_attributes(
    spec.dataset_name, spec.train_data_path or None, names
  )
  if unrated:
    raise ConfigError(
      f"reward.attributes={config.reward.attributes!r}: no row of {where} rates "
      f"{', '.join(map(repr, unrated))}{did_you_mean(unrated, columns)}; its rows have the columns "
      f"{', '.join(columns)}"
    )


def _checked_task(config: RunConfig) -> tasks.Task:
  """The task ``reward.type`` trains, if ``data.dataset_name``'s records are its data."""
  name, task = config.data.dataset_name, config.reward.task
  data_task = registry.task(name)
  if data_task.data != task.data:
    raise ConfigError(
      f"reward.type={config.reward.type!r} does not fit data.dataset_name={name!r}, "
      f"which holds {data_task.data} data (for reward.type {' or '.join(_reward_types(data_task.data))})"
    )
  return task


def _reward_types(data: str) -> list[str]:
  """The reward types whose tasks train on ``data`` (a :attr:`jaxrm.tasks.Task.data`)."""
  return [r for t in tasks.TASKS.values() if t.data == data for r in t.reward_types]


def _read_options(reward: RewardSpec, dataset_name: str) -> dict:
  """What a rated dataset is read for: the attributes, in the head's order, and their range."""
  if not reward.task.per_attribute:
    return {}
  options = {"attributes": reward.attribute_names}
  if registry.takes_option(dataset_name, "value_range"):
    options["value_range"] = reward.value_range
  elif reward.value_range is not None:
    log.warning(
      "reward.attribute_range=%r is not used: %s checks its own range", reward.attribute_range, dataset_name
    )
  return options
