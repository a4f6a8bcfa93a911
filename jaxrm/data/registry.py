"""The datasets ``data.dataset_name`` can name, and how each is read into records.

``PreferenceDataset``, ``StepwiseDataset`` and ``RatedDataset`` read user files in the formats of
:mod:`jaxrm.data.formats`; the public datasets go through :mod:`jaxrm.data.adapters` and, given no
path, are read from their usual place; the demo sets are made on the spot.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from jaxrm import tasks
from jaxrm.data import adapters, demo, example_types, formats, sources
from jaxrm.data.drops import DropReport
from jaxrm.data.records import PreferenceRecord, RatedRecord, StepwiseRecord
from jaxrm.errors import DataError

_PRM800K_URL = "https://github.com/openai/prm800k/raw/refs/heads/main/prm800k/data/phase2_{split}.jsonl"


@dataclasses.dataclass(frozen=True)
class _Spec:
  """How one dataset name is read."""

  parse: Callable  # (row, source, drops, *, subset_field, **options) -> record | None
  rows: example_types.ExampleType  # its records' layout (the task they train: `task`)
  default: str | None = None  # read when no path is given: a hub name or a URL ({split})
  config: str | None = None  # the hub configuration
  splits: Mapping[str, str] = dataclasses.field(default_factory=dict)  # ours -> the hub's
  subset_field: str = "subset"  # the column copied into record.meta["subset"]
  options: tuple[str, ...] = ()  # options passed to `parse`
  make: Callable[..., list[dict]] | None = None  # a demo set's row maker
  attribute_columns: bool = False  # rated rows hold each attribute in a column of its name
  # the task its records train: the one whose own data they are (its `data` the rows they are)
  task: tasks.Task = dataclasses.field(init=False)

  def __post_init__(self):
    object.__setattr__(self, "task", tasks.reading(self.rows))


_RATED_OPTIONS = ("attributes", "value_range")

_SPECS = {
  "PreferenceDataset": _Spec(formats.parse_preference, example_types.PREFERENCE),
  "HelpSteer3": _Spec(
    adapters.helpsteer3,
    example_types.PREFERENCE,
    default="nvidia/HelpSteer3",
    config="preference",
    subset_field="domain",
  ),
  "UltraFeedback": _Spec(
    adapters.ultrafeedback,
    example_types.PREFERENCE,
    default="HuggingFaceH4/ultrafeedback_binarized",
    splits={"train": "train_prefs", "validation": "test_prefs", "test": "test_prefs"},
  ),
  "PRM800K": _Spec(
    adapters.prm800k,
    example_types.STEPWISE,
    default=_PRM800K_URL,
    splits={"validation": "test"},
    options=("neutral",),
  ),
  "MathShepherd": _Spec(
    adapters.math_shepherd, example_types.STEPWISE, default="peiyi9979/Math-Shepherd", subset_field="task"
  ),
  "StepwiseDataset": _Spec(formats.parse_stepwise, example_types.STEPWISE),
  "RatedDataset": _Spec(
    formats.parse_rated, example_types.RATED, options=_RATED_OPTIONS, attribute_columns=True
  ),
  "HelpSteer2": _Spec(
    adapters.helpsteer2, example_types.RATED, default="nvidia/HelpSteer2", options=("attributes",)
  ),
  "demo_arithmetic": _Spec(formats.parse_preference, example_types.PREFERENCE, make=demo.demo_arithmetic),
  "demo_arithmetic_steps": _Spec(
    formats.parse_stepwise, example_types.STEPWISE, make=demo.demo_arithmetic_steps
  ),
  "demo_attributes": _Spec(
    formats.parse_rated,
    example_types.RATED,
    make=demo.demo_attributes,
    options=_RATED_OPTIONS,
    attribute_columns=True,
  ),
}
DATASET_NAMES = tuple(_SPECS)
# The dataset that reads a user's own files of each sort of rows, as the tasks that train on it name it.
FILE_FORMATS = {t.data: t.dataset for t in tasks.TASKS.values()}
# Values of a validation path that name a split of a dataset read by name, not a file.
SPLIT_NAMES = ("train", "validation", "test")


def _spec(dataset_name: str) -> _Spec:
  if dataset_name not in _SPECS:
    raise DataError(
      f"data.dataset_name {dataset_name!r} is not known; use one of "
      f"{', '.join(DATASET_NAMES)}{_path_hint(dataset_name)}"
    )
  return _SPECS[dataset_name]


def _path_hint(name: str) -> str:
  """Where a hub dataset or file given as ``data.dataset_name`` belongs (TRL's habit)."""
  if not isinstance(name, str) or not ("/" in name or name.endswith(sources.FILE_SUFFIXES)):
    return ""
  return (
    f". {name!r} looks like a hub dataset or a file: give it as data.train_data_path={name!r}, with "
    "data.dataset_name the format of its rows (PreferenceDataset, StepwiseDataset or RatedDataset)"
  )


def is_demo(dataset_name: str) -> bool:
  """Whether the dataset makes its own rows (a demo set) instead of reading them."""
  return _spec(dataset_name).make is not None


def reads_paths_only(dataset_name: str) -> bool:
  """Whether the dataset reads only the paths it is given (a file format, no usual place)."""
  spec = _spec(dataset_name)
  return spec.make is None and spec.default is None


def is_stepwise(dataset_name: str) -> bool:
  """Whether the dataset holds stepwise (process) labels rather than preferences."""
  return _spec(dataset_name).task.scores == "steps"


def rows_of(dataset_name: str) -> str:
  """The rows the dataset holds: "preference", "stepwise" or "rated" (its task's ``data``)."""
  return _spec(dataset_name).task.data


def task(dataset_name: str) -> tasks.Task:
  """The task the dataset's records train (:mod:`jaxrm.tasks`)."""
  return _spec(dataset_name).task


def takes_option(dataset_name: str, option: str) -> bool:
  """Whether :func:`load_records` passes ``option`` on to the dataset's parser."""
  return option in _spec(dataset_name).options


def load_records(
  dataset_name: str,
  path: str | None,
  *,
  split: str = "train",
  drops: DropReport,
  max_records: int = 0,
  **options,
) -> list[PreferenceRecord] | list[StepwiseRecord] | list[RatedRecord]:
  """Reads one dataset into records, counting dropped rows in ``drops``.

  Args:
    dataset_name: one of :data:`DATASET_NAMES`.
    path: a file, directory, URL or hub name (see :func:`jaxrm.data.sources.read_rows`). Public
      datasets given None are read from their usual place (``split`` mapped to theirs, e.g.
      UltraFeedback's ``train_prefs``), and so is a split name given as the path (``"validation"``:
      that split of their usual place). Demo sets take None, or ``"train"`` / ``"validation"`` as
      the split.
    split: the split to read.
    drops: where dropped rows are counted.
    max_records: keep the first this many records (0: all); the rows after them are read but
      not parsed, and counted in ``drops`` (see :func:`iter_records`).
    **options: ``subset_field`` (the column copied to ``record.meta["subset"]``; "subset" by
      default, HelpSteer3 "domain", MathShepherd "task"; None for none), ``config`` (hub
      configuration), ``neutral`` (PRM800K), ``attributes`` (rated sets: the attributes read, in
      order) and ``value_range`` (``RatedDataset``, ``demo_attributes``: (low, high) of a rating),
      ``num_rows`` and ``seed`` (demo sets).

  Raises:
    DataError: an unknown name or option, a bad row, or no row left.
  """
  return list(iter_records(dataset_name, path, split=split, drops=drops, max_records=max_records, **options))


def iter_records(
  dataset_name: str,
  path: str | None,
  *,
  split: str = "train",
  drops: DropReport,
  max_records: int = 0,
  limit_name: str = "max_records",
  **options,
) -> Iterator[PreferenceRecord | StepwiseRecord | RatedRecord]:
  """:func:`load_records`, one record at a time as the rows are read; ``drops`` is complete once
  the iterator is exhausted (or closed).

  Rows after the first ``max_records`` records are read but not parsed, and counted in ``drops``
  as left out by ``limit_name`` (the config key that set the limit).
  """
  spec = _spec(dataset_name)
  subset_field = options.pop("subset_field", spec.subset_field)
  parse_options = {k: options.pop(k) for k in spec.options if k in options}
  _check_read_options(spec, dataset_name, options)
  read = _demo_rows if spec.make else _read_rows
  rows, where = read(spec, dataset_name, path, split, options)
  local, count = DropReport(), 0
  try:
    for source, row in rows:
      record = spec.parse(row, source, local, subset_field=subset_field, **parse_options)
      if record is not None:
        yield record
        count += 1
        if count == max_records:
          _count_rest(rows, local, f"after the first {max_records} records ({limit_name}={max_records})")
          return
  finally:
    drops.merge(local)
  if not count:
    dropped = f"all {local.total} rows were dropped\n{local.summary(where)}"
    raise DataError(f"{where}: {dropped if local.total else 'has no rows'}")


def unrated_attributes(
  dataset_name: str, path: str | None, attributes: Sequence[str], *, split: str = "train"
) -> tuple[list[str], str, list[str]]:
  """Those of ``attributes`` that no row of a rated set holds a rating of (a column of the
  attribute's name, not null), where its rows come from, and the columns they hold.

  Rows are read until each attribute has been seen, so a set that rates them all is read no
  further than it must be. A dataset that reads its attributes otherwise (HelpSteer2 checks their
  names itself) has none unrated here.
  """
  spec = _spec(dataset_name)
  if not spec.attribute_columns:
    return [], dataset_name, []
  read = _demo_rows if spec.make else _read_rows
  rows, where = read(spec, dataset_name, path, split, {})
  unrated, columns = list(attributes), set()
  try:
    for _, row in rows:
      columns.update(k for k, v in row.items() if v is not None)
      unrated = [a for a in unrated if a not in columns]
      if not unrated:
        break
  finally:
    getattr(rows, "close", lambda: None)()
  return unrated, where, sorted(columns)


def _count_rest(rows: Iterable[tuple[str, dict]], drops: DropReport, reason: str) -> None:
  for source, _ in rows:
    drops.leave_out(reason, source)


def source_key(dataset_name: str, path: str | None, *, split: str = "train", **options) -> dict | None:
  """What identifies the records :func:`load_records` makes with these arguments, for the
  tokenized-example cache (:mod:`jaxrm.data.cache`); None for a demo set, made on the spot."""
  spec = _spec(dataset_name)
  if spec.make:
    return None
  path, read_split, read_options = _resolve(spec, dataset_name, path, split, {})
  return {
    "dataset_name": dataset_name,
    "split": split,
    "options": options,
    "source": sources.fingerprint(
      path, split=read_split, config=options.get("config", read_options.get("config"))
    ),
  }


def resolve(dataset_name: str, path: str | None, split: str = "train") -> tuple[str, str, dict]:
  """Where a dataset read from files or the hub is read: its path, split and read options."""
  return _resolve(_spec(dataset_name), dataset_name, path, split, {})


def _check_read_options(spec: _Spec, name: str, options: dict) -> None:
  allowed = ("num_rows", "seed") if spec.make else ("config",)
  unknown = sorted(set(options) - set(allowed))
  if unknown:
    known = sorted({"subset_field", *allowed, *spec.options})
    raise DataError(f"{name}: unknown option(s) {unknown}; it takes {known}")


_Rows = tuple[Iterable[tuple[str, dict]], str]  # (source, row) pairs, and where they come from


def _demo_rows(spec: _Spec, name: str, path: str | None, split: str, options: dict) -> _Rows:
  if path not in (None, *demo.SPLITS):
    raise DataError(
      f"{name} makes its own rows: give no path, or one of {demo.SPLITS} to choose the split (got {path!r})"
    )
  split = path or split
  where = f"{name}:{split}"
  return ((f"{where}[row {i}]", row) for i, row in enumerate(spec.make(split, **options))), where


def _read_rows(spec: _Spec, name: str, path: str | None, split: str, options: dict) -> _Rows:
  path, split, options = _resolve(spec, name, path, split, options)
  return sources.read_rows(path, split=split, **options), path


def _resolve(spec: _Spec, name: str, path: str | None, split: str, options: dict) -> tuple[str, str, dict]:
  """The path, split and read options a dataset is read with: its usual place when ``path`` is None
  or a split name (``"validation"``: that split, as a demo set takes it)."""
  if path in SPLIT_NAMES and spec.default is not None and not os.path.exists(path):
    path, split = None, path
  if path is None:
    if spec.default is None:
      raise DataError(
        f"{name} needs a path: set data.train_data_path (and data.val_data_paths) "
        "to a .jsonl, .json or .parquet file, a save_to_disk directory or a hub name"
      )
    split = spec.splits.get(split, split)
    path = spec.default.format(split=split)
    options = {"config": spec.config, **options}
  return path, split, options


_VAL_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def check_val_set_name(name: str) -> str:
  """Returns ``name`` if it can stand in metric names like ``validation-<name>_loss``."""
  if not isinstance(name, str) or not name:
    raise DataError(f"validation set name {name!r}: must be a non-empty string")
  if not _VAL_NAME.fullmatch(name):
    bad = sorted({c for c in name if not _VAL_NAME.fullmatch(c)})
    raise DataError(
      f"validation set name {name!r} cannot be used in metric names such as "
      f"'validation-{name}_loss': it contains {', '.join(map(repr, bad))}; use only "
      "letters, digits, '_', '-' and '.'"
    )
  return name
