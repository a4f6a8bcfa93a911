"""The report of rows dropped on purpose, and the error that names a bad row.

Bad input either raises :class:`~jaxrm.errors.DataError` (naming file, line/row and field) or is
dropped and counted in a :class:`DropReport` that training prints at start and writes into the
run directory.
"""

from __future__ import annotations

import collections

from jaxrm.errors import DataError


def row_error(source: str, field: str | None, message: str) -> DataError:
  """``DataError("train.jsonl:17: field 'completions': has 1 entry; ...")``."""
  where = f"{source}: field '{field}'" if field else source
  return DataError(f"{where}: {message}")


class DropReport:
  """Counts dropped rows per reason, keeping a few example sources for each."""

  max_examples = 5

  def __init__(self):
    self.counts: collections.Counter[str] = collections.Counter()
    self.examples: dict[str, list[str]] = collections.defaultdict(list)

  def drop(self, reason: str, source: str, count: int = 1) -> None:
    """Counts ``count`` rows dropped for ``reason``; ``source`` names the row, or all of them when
    they went together (``"the last 3 of train"``)."""
    self.counts[reason] += count
    if len(self.examples[reason]) < self.max_examples:
      self.examples[reason].append(source)

  def merge(self, other: "DropReport") -> None:
    for reason, n in other.counts.items():
      self.counts[reason] += n
      room = self.max_examples - len(self.examples[reason])
      self.examples[reason].extend(other.examples[reason][:max(room, 0)])

  @property
  def total(self) -> int:
    return sum(self.counts.values())

  def as_dict(self) -> dict:
    return {
        "total": self.total,
        "reasons": {
            r: {"count": n, "examples": self.examples[r]} for r, n in self.counts.most_common()
        },
    }

  def summary(self, name: str = "data") -> str:
    if not self.total:
      return f"{name}: no rows dropped"
    lines = [f"{name}: {self.total} rows dropped"]
    for r, n in self.counts.most_common():
      lines.append(f"  {n:>7}  {r}  (e.g. {', '.join(self.examples[r][:3])})")
    return "\n".join(lines)
