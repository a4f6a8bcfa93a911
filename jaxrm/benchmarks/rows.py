"""Checks of a benchmark row's fields: each bad value is an error naming the row and the field."""

from __future__ import annotations

from typing import Any

from jaxrm.data.drops import row_error
from jaxrm.data.formats import is_int, json_type, required


def text(row: dict, field: str, source: str) -> str:
  """``row[field]``, a string."""
  value = required(row, field, source)
  if not isinstance(value, str):
    raise row_error(source, field, f"expected a string, got {json_type(value)}")
  return value


def texts(row: dict, field: str, source: str, *, count: int | None = None) -> tuple[str, ...]:
  """``row[field]``, a non-empty list of strings (exactly ``count`` of them when given)."""
  value = required(row, field, source)
  if not isinstance(value, (list, tuple)):
    raise row_error(source, field, f"expected a list of strings, got {json_type(value)}")
  if not value:
    raise row_error(source, field, "is an empty list; give at least one response")
  if count is not None and len(value) != count:
    raise row_error(source, field, f"has {len(value)} entries; this benchmark has exactly {count}")
  for i, item in enumerate(value):
    if not isinstance(item, str):
      raise row_error(source, f"{field}[{i}]", f"expected a string, got {json_type(item)}")
  return tuple(value)


def integer(row: dict, field: str, source: str) -> int:
  """``row[field]``, an integer (not a boolean)."""
  value = required(row, field, source)
  if not is_int(value):
    raise row_error(source, field, f"expected an integer, got {value!r} ({json_type(value)})")
  return int(value)


def row_id(row: dict, source: str) -> Any:
  """The row's ``id`` when it has one (kept as given, for the report), else its source."""
  return row.get("id", source)
