"""Where rows come from: local files, a ``save_to_disk`` directory, a URL or a hub dataset.

Every row is yielded with a ``source`` string that later errors quote: ``"train.jsonl:17"`` (line
number, from 1) for JSON Lines, ``"data.parquet[row 3]"`` (row index, from 0) for everything else
(a CSV file's row 0 is the line after its header).
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Iterable, Iterator

from jaxrm.data.drops import row_error
from jaxrm.data.formats import LONE_SURROGATE, json_type, not_text
from jaxrm.errors import DataError

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
_PARQUET_BATCH = 65_536  # pyarrow's default batch size
# "name" or "org/name": anything else that does not exist on disk is a missing local path.
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
# A \u escape of a surrogate code point: the only way a lone surrogate gets into a row.
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def read_rows(
  path_or_name: str, *, split: str = "train", config: str | None = None, max_rows: int = 0
) -> Iterator[tuple[str, dict]]:
  """Yields ``(source, row)`` for each row of a file, directory, URL or hub dataset.

  Rows are read as they are asked for: JSON Lines line by line, Parquet and CSV a batch at a time,
  a ``save_to_disk`` directory memory-mapped; a ``.json`` file and a hub dataset are read whole.

  Args:
    path_or_name: a local ``.jsonl``, ``.json`` (a list of objects, or ``{"data": [...]}``),
      ``.parquet`` or ``.csv`` file (a header line naming the columns; types as pyarrow infers
      them); a ``datasets`` ``save_to_disk`` directory; an http(s) URL of such a file; or a hub
      dataset name, read with ``datasets.load_dataset``.
    split: the split of a saved ``DatasetDict`` or of a hub dataset.
    config: the hub dataset's configuration name, if it has several.
    max_rows: stop after this many rows (blank JSON Lines lines are not rows); 0: all. Parquet
      then decodes no more than that, and a hub or URL dataset is read as ``split[:max_rows]``.

  Raises:
    DataError: a missing or empty file, a line that is not valid UTF-8 or JSON, a row that is not
      an object, an unknown split.
  """
  if max_rows < 0:
    raise DataError(f"{path_or_name}: max_rows={max_rows}; use a number of rows, or 0 for all")
  path = os.path.expanduser(path_or_name)
  if os.path.isdir(path):
    rows = _saved_rows(path_or_name, path, split)
  elif os.path.isfile(path):
    rows = _file_rows(path_or_name, path, max_rows)
  elif "://" in path_or_name:
    rows = _url_rows(path_or_name, max_rows)
  elif path_or_name.endswith(FILE_SUFFIXES) or not _HUB_NAME.fullmatch(path_or_name):
    raise DataError(f"{path_or_name}: no such file or directory")
  else:
    rows = _hub_rows(path_or_name, split, config, max_rows)
  return _objects(path_or_name, itertools.islice(rows, max_rows or None))


def fingerprint(path_or_name: str, *, split: str = "train", config: str | None = None) -> dict:
  """What identifies the rows :func:`read_rows` would yield, for a cache key.

  A local file is known by the name as given (the rows' sources quote it), its size and an
  xxh3-128 hash of its content (a touched file with the same bytes is the same data); a
  directory by the same for each of its files; a URL or hub dataset by the fingerprint ``datasets`` gives what it loaded (its files'
  hashes or ETags; it is loaded, from its cache, to know it).

  Raises:
    DataError: as :func:`read_rows`, for a path that does not exist.
  """
  path = os.path.expanduser(path_or_name)
  if os.path.isfile(path):
    return {"file": path_or_name, **file_fingerprint(path)}
  if os.path.isdir(path):
    files = sorted(os.path.relpath(os.path.join(d, n), path) for d, _, names in os.walk(path) for n in names)
    return {
      "directory": path_or_name,
      "split": split,
      "files": {f: file_fingerprint(os.path.join(path, f)) for f in files},
    }
  if "://" in path_or_name:
    loaded = _load(path_or_name, "a URL", _url_builder(path_or_name), data_files=path_or_name, split="train")
    return {"url": path_or_name, "datasets_fingerprint": loaded._fingerprint}  # pylint: disable=protected-access
  if path_or_name.endswith(FILE_SUFFIXES) or not _HUB_NAME.fullmatch(path_or_name):
    raise DataError(f"{path_or_name}: no such file or directory")
  loaded = _load(
    path_or_name, f"a hub dataset (split {split!r}, config {config!r})", path_or_name, config, split=split
  )
  return {"hub": path_or_name, "split": split, "config": config, "datasets_fingerprint": loaded._fingerprint}  # pylint: disable=protected-access


def file_fingerprint(path: str) -> dict:
  """``{"size": bytes, "xxh3_128": hex digest}`` of a file's content."""
  import xxhash  # pylint: disable=g-import-not-at-top  (a dependency of datasets)

  h = xxhash.xxh3_128()
  with open(path, "rb") as f:
    while block := f.read(1 << 24):
      h.update(block)
  return {"size": os.path.getsize(path), "xxh3_128": h.hexdigest()}


def _objects(name: str, rows: Iterable[tuple[str, object]]) -> Iterator[tuple[str, dict]]:
  """Passes rows through, refusing one that is not an object, and a source with no rows."""
  empty = True
  for source, row in rows:
    if not isinstance(row, dict):
      raise row_error(source, None, f"a row must be a JSON object, got {json_type(row)}")
    empty = False
    yield source, row
  if empty:
    raise DataError(f"{name}: has no rows")


def _file_rows(name: str, path: str, max_rows: int) -> Iterable[tuple[str, object]]:
  if os.path.getsize(path) == 0:
    raise DataError(f"{name}: the file is empty")
  if path.endswith(".jsonl"):
    return _jsonl_rows(name, path)
  if path.endswith(".json"):
    return _json_rows(name, path)
  if path.endswith(".parquet"):
    return _parquet_rows(name, path, max_rows)
  if path.endswith(".csv"):
    return _csv_rows(name, path)
  raise DataError(
    f"{name}: unknown file type; use .jsonl, .json, .parquet, .csv or a directory written "
    "by datasets' save_to_disk"
  )


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
      if _ESCAPED_SURROGATE.search(line):
        _check_text(source, row)
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
  check = _ESCAPED_SURROGATE.search(text) is not None
  for i, row in enumerate(rows):
    if check:
      _check_text(f"{name}[row {i}]", row)
    yield f"{name}[row {i}]", row


def _check_text(source: str, row: object) -> None:
  """Refuses a row holding a lone surrogate (only JSON's escapes can: Arrow's strings are UTF-8)."""
  if (where := not_text(row)) is not None:
    raise row_error(source, None, f"{where} {LONE_SURROGATE}; write the character itself, or a valid pair")


def _parquet_rows(name: str, path: str, max_rows: int) -> Iterator[tuple[str, object]]:
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  index = 0
  # Batches of at most max_rows: a limit decodes no more than it keeps.
  for batch in pq.ParquetFile(path).iter_batches(batch_size=min(max_rows or _PARQUET_BATCH, _PARQUET_BATCH)):
    for row in batch.to_pylist():
      yield f"{name}[row {index}]", row
      index += 1


def _csv_rows(name: str, path: str) -> Iterator[tuple[str, object]]:
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.csv as pa_csv  # pylint: disable=g-import-not-at-top

  index = 0
  try:
    # Streamed a block at a time; column types are inferred from the first block.
    for batch in pa_csv.open_csv(path):
      for row in batch.to_pylist():
        yield f"{name}[row {index}]", row
        index += 1
  except pa.ArrowInvalid as e:
    raise DataError(f"{name}: not a CSV file pyarrow can read after row {index}: {e}") from None


def _url_builder(url: str) -> str:
  """The ``datasets`` builder that reads a file at ``url``."""
  return next((b for b in ("parquet", "csv") if url.endswith(f".{b}")), "json")


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
  raise DataError(
    f"{name}: a directory, but not one written by datasets' save_to_disk (no dataset_dict.json or state.json)"
  )


def _url_rows(url: str, max_rows: int) -> Iterator[tuple[str, object]]:
  return _dataset_rows(
    url, _load(url, "a URL", _url_builder(url), data_files=url, split=_sliced("train", max_rows))
  )


def _hub_rows(name: str, split: str, config: str | None, max_rows: int) -> Iterator[tuple[str, object]]:
  what = f"a hub dataset (split {split!r}, config {config!r})"
  return _dataset_rows(f"{name}:{split}", _load(name, what, name, config, split=_sliced(split, max_rows)))


def _sliced(split: str, max_rows: int) -> str:
  """``datasets``' split syntax for the first ``max_rows`` rows."""
  return f"{split}[:{max_rows}]" if max_rows else split


def _load(name: str, what: str, *args, **kwargs):
  import datasets  # pylint: disable=g-import-not-at-top

  try:
    return datasets.load_dataset(*args, **kwargs)
  except Exception as e:  # the hub raises many types; all mean "cannot read this dataset"
    raise DataError(f"{name}: not a local path, and reading it as {what} failed: {e}") from e
