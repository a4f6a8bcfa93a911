"""The report of rows dropped on purpose, and the error that names a bad row.

Bad input either raises :class:`~jaxrm.errors.DataError` (naming file, line/row and field) or is
dropped and counted in a :class:`DropReport` that training prints at start and writes into the
run directory. Rows left out by a limit (``data.max_val_rows``, a last partial batch...) are
counted there too, as not used rather than dropped.
"""

from __future__ import annotations

import collections

from jaxrm.errors import DataError

# The start of a reason for rows left out by a limit: good rows, not dropped for what they hold.
UNUSED = "not used: "


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
    self.cut = 0  # rows kept with their oldest context cut to fit (truncation="left"): not dropped

  def drop(self, reason: str, source: str, count: int = 1) -> None:
    """Counts ``count`` rows dropped for ``reason``; ``source`` names the row, or all of them when
    they went together (``"the last 3 of train"``)."""
    self.counts[reason] += count
    if len(self.examples[reason]) < self.max_examples:
      self.examples[reason].append(source)

  def leave_out(self, reason: str, source: str, count: int = 1) -> None:
    """Counts ``count`` good rows a limit left out (``reason`` names it), apart from the dropped ones."""
    self.drop(UNUSED + reason, source, count)

  def merge(self, other: DropReport) -> None:
    self.cut += other.cut
    for reason, n in other.counts.items():
      self.counts[reason] += n
      room = self.max_examples - len(self.examples[reason])
      self.examples[reason].extend(other.examples[reason][: max(room, 0)])

  @property
  def total(self) -> int:
    """Rows dropped (not counting those :meth:`leave_out` counted)."""
    return sum(n for r, n in self.counts.items() if not r.startswith(UNUSED))

  @property
  def unused(self) -> int:
    """Good rows left out by a limit."""
    return sum(n for r, n in self.counts.items() if r.startswith(UNUSED))

  def as_dict(self) -> dict:
    return {
      "total": self.total,
      "unused": self.unused,
      "reasons": {r: {"count": n, "examples": self.examples[r]} for r, n in self.counts.most_common()},
    }

  def summary(self, name: str = "data") -> str:
    """``train: 3 rows dropped, 40 not used (limits)`` and a line per reason."""
    head = f"{name}: {self.total} rows dropped" if self.total else f"{name}: no rows dropped"
    if self.unused:
      head += f", {self.unused} not used (limits)"
    lines = [head]
    for r, n in self.counts.most_common():
      lines.append(f"  {n:>7}  {r}  (e.g. {', '.join(self.examples[r][:3])})")
    return "\n".join(lines)
