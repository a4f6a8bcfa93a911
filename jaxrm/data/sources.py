"""Where rows come from: local files, a ``save_to_disk`` directory, a URL or a hub dataset.

Every row is yielded with a ``source`` string that later errors quote: ``"train.jsonl:17"`` (line
number, from 1) for JSON Lines, ``"data.parquet[row 3]"`` (row index, from 0) for everything else.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator

from jaxrm.data.drops import row_error
from jaxrm.errors import DataError
from jaxrm.data.formats import kind

_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
# "name" or "org/name": anything else that does not exist on disk is a missing local path.
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def read_rows(path_or_name: str, *, split: str = "train",
              config: str | None = None) -> Iterator[tuple[str, dict]]:
  """Yields ``(source, row)`` for each row of a file, directory, URL or hub dataset.

  Args:
    path_or_name: a local ``.jsonl``, ``.json`` (a list of objects, or ``{"data": [...]}``) or
      ``.parquet`` file; a ``datasets`` ``save_to_disk`` directory; an http(s) URL of such a
      file; or a hub dataset name, read with ``datasets.load_dataset``.
    split: the split of a saved ``DatasetDict`` or of a hub dataset.
    config: the hub dataset's configuration name, if it has several.

  Raises:
    DataError: a missing or empty file, a line that is not valid UTF-8 or JSON, a row that is not
      an object, an unknown split.
  """
  path = os.path.expanduser(path_or_name)
  if os.path.isdir(path):
    return _objects(path_or_name, _saved_rows(path_or_name, path, split))
  if os.path.isfile(path):
    return _objects(path_or_name, _file_rows(path_or_name, path))
  if "://" in path_or_name:
    return _objects(path_or_name, _url_rows(path_or_name))
  if path_or_name.endswith(_FILE_SUFFIXES) or not _HUB_NAME.fullmatch(path_or_name):
    raise DataError(f"{path_or_name}: no such file or directory")
  return _objects(path_or_name, _hub_rows(path_or_name, split, config))


def _objects(name: str, rows: Iterable[tuple[str, object]]) -> Iterator[tuple[str, dict]]:
  """Passes rows through, refusing one that is not an object, and a source with no rows."""
  empty = True
  for source, row in rows:
    if not isinstance(row, dict):
      raise row_error(source, None, f"a row must be a JSON object, got {kind(row)}")
    empty = False
    yield source, row
  if empty:
    raise DataError(f"{name}: has no rows")


def _file_rows(name: str, path: str) -> Iterable[tuple[str, object]]:
  if os.path.getsize(path) == 0:
    raise DataError(f"{name}: the file is empty")
  if path.endswith(".jsonl"):
    return _jsonl_rows(name, path)
  if path.endswith(".json"):
    return _json_rows(name, path)
  if path.endswith(".parquet"):
    return _parquet_rows(name, path)
  raise DataError(f"{name}: unknown file type; use .jsonl, .json, .parquet or a directory written "
                  "by datasets' save_to_disk")


def _jsonl_rows(name: str, path: str) -> Iterator[tuple[str, object]]:
  with open(path, "rb") as f:
    for number, raw in enumerate(f, start=1):
      source = f"{name}:{number}"
      try:
        line = raw.decode("utf-8-sig")  # -sig: a byte-order mark some editors write is skipped
      except UnicodeDecodeError as e:
        raise row_error(source, None, f"not valid UTF-8 (byte {e.start + 1} of the line)") from None
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise row_error(source, None, f"not valid JSON: {e.msg} at column {e.colno}") from None
      yield source, row


def _json_rows(name: str, path: str) -> Iterator[tuple[str, object]]:
  with open(path, "rb") as f:
    raw = f.read()
  try:
    text = raw.decode("utf-8-sig")
  except UnicodeDecodeError as e:
    line = raw.count(b"\n", 0, e.start) + 1
    raise DataError(f"{name}:{line}: not valid UTF-8") from None
  try:
    data = json.loads(text)
  except json.JSONDecodeError as e:
    raise DataError(f"{name}:{e.lineno}: not valid JSON: {e.msg} at column {e.colno}") from None
  rows = data.get("data") if isinstance(data, dict) else data
  if not isinstance(rows, list):
    raise DataError(f"{name}: expected a JSON list of rows, or an object with a 'data' list")
  return ((f"{name}[row {i}]", row) for i, row in enumerate(rows))


def _parquet_rows(name: str, path: str) -> Iterator[tuple[str, object]]:
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  index = 0
  for batch in pq.ParquetFile(path).iter_batches():
    for row in batch.to_pylist():
      yield f"{name}[row {index}]", row
      index += 1


def _dataset_rows(where: str, dataset) -> Iterator[tuple[str, object]]:
  return ((f"{where}[row {i}]", row) for i, row in enumerate(dataset))


def _saved_rows(name: str, path: str, split: str) -> Iterator[tuple[str, object]]:
  import datasets  # pylint: disable=g-import-not-at-top

  if os.path.exists(os.path.join(path, "dataset_dict.json")):
    saved = datasets.load_from_disk(path)
    if split not in saved:
      raise DataError(f"{name}: has no split {split!r}; it has {sorted(saved)}")
    return _dataset_rows(f"{name}:{split}", saved[split])
  if os.path.exists(os.path.join(path, "state.json")):
    return _dataset_rows(name, datasets.load_from_disk(path))
  raise DataError(f"{name}: a directory, but not one written by datasets' save_to_disk (no "
                  "dataset_dict.json or state.json)")


def _url_rows(url: str) -> Iterator[tuple[str, object]]:
  builder = "parquet" if url.endswith(".parquet") else "json"
  return _dataset_rows(url, _load(url, "a URL", builder, data_files=url, split="train"))


def _hub_rows(name: str, split: str, config: str | None) -> Iterator[tuple[str, object]]:
  what = f"a hub dataset (split {split!r}, config {config!r})"
  return _dataset_rows(f"{name}:{split}", _load(name, what, name, config, split=split))


def _load(name: str, what: str, *args, **kwargs):
  import datasets  # pylint: disable=g-import-not-at-top

  try:
    return datasets.load_dataset(*args, **kwargs)
  except Exception as e:  # the hub raises many types; all mean "cannot read this dataset"
    raise DataError(f"{name}: not a local path, and reading it as {what} failed: {e}") from e
