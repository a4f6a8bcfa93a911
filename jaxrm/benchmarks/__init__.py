"""The public reward-model benchmarks, each scored by its official rules.

One module per benchmark (``rewardbench``, ``rewardbench2``, ``rmbench``, ``processbench``,
``judgebench``) reads rows of its public schema (``parse``), scores them through a
:class:`~jaxrm.benchmarks.scoring.Scorer` (``evaluate``) and lays the figures out as its leaderboard
does (``format_table``). It also names the kind of model it scores (``MODEL_KIND``, see
:mod:`jaxrm.scoring.kinds`), whether a pairwise judge has a path through it (``JUDGED``: its pairs asked
in both orders, or its groups ranked by round robin), and the longest row in tokens its official
harness scores by default (``MAX_LENGTH``; None: the model's context; a judge's texts hold two
responses, and default to the model's context).
:func:`load` reads and checks a benchmark's rows; :func:`score` scores them and adds the
length-bias report; :func:`run` does both.
"""

from __future__ import annotations

import json
import os
from typing import Any

from jaxrm.benchmarks import judgebench, length_bias, processbench, rewardbench, rewardbench2, rmbench
from jaxrm.benchmarks.scoring import Scorer
from jaxrm.data.drops import DropReport
from jaxrm.data.sources import read_rows
from jaxrm.errors import EvaluationError

BENCHMARKS = {m.NAME: m for m in (rewardbench, rewardbench2, rmbench, processbench, judgebench)}
# Keys of a result that hold per-row data: kept for the plot and the caller, not for eval.json.
ROW_KEYS = ("comparisons", "predictions", "drop_report")


def module(name: str):
  """The module of benchmark ``name``."""
  if name not in BENCHMARKS:
    raise EvaluationError(f"unknown benchmark {name!r}; use one of {', '.join(BENCHMARKS)}")
  return BENCHMARKS[name]


def plain_evaluation_note(subsets: set[str]) -> str | None:
  """Why plain evaluation of rows of these subsets gives other figures than the benchmark they
  are from (see its ``PLAIN_EVALUATION_DIFFERS``), or None when they are from none."""
  for bench in BENCHMARKS.values():
    if hasattr(bench, "holds") and bench.holds(subsets):
      return bench.PLAIN_EVALUATION_DIFFERS
  return None


def load(
  name: str, data: str | None = None, *, split: str | None = None, max_rows: int = 0
) -> dict[str, Any]:
  """Reads and checks benchmark ``name``'s rows from ``data`` (a file, ``save_to_disk``
  directory or hub name; default the benchmark's hub dataset).

  Returns:
    ``{"benchmark", "data", "split", "splits": {split: [parsed row]}}``, for :func:`score`.
  """
  bench = module(name)
  data = data or bench.HUB_NAME
  split = split or bench.DEFAULT_SPLIT
  splits = _read(bench, data, split, max_rows)
  parsed = {s: [bench.parse(source, row) for source, row in rows_] for s, rows_ in splits.items()}
  return {"benchmark": name, "data": data, "split": ",".join(parsed), "splits": parsed}


def score(loaded: dict[str, Any], scorer: Scorer, *, threshold: float = 0.5) -> dict[str, Any]:
  """Scores the rows :func:`load` read and returns the benchmark's report.

  Returns:
    ``{"benchmark", "data", "split", "num_examples", "results"`` (the official figures, by their
    official names), ``"counts"``, the benchmark's own details, ``"length_bias"`` (preference
    benchmarks), ``"throughput"`` ({"items", "seconds", "items_per_second"}), ``"dropped"``,
    and, not for eval.json, the :class:`DropReport` (``"drop_report"``) and per-row
    ``"comparisons"`` / ``"predictions"``.
  """
  bench = module(loaded["benchmark"])
  drops = DropReport()
  splits = loaded["splits"]
  if bench is processbench:
    result = processbench.evaluate(splits, scorer, threshold=threshold, drops=drops)
  else:
    (rows_,) = splits.values()
    result = bench.evaluate(rows_, scorer)
  report = {k: loaded[k] for k in ("benchmark", "data", "split")} | result
  if "comparisons" in result:
    report["length_bias"] = length_bias.report(result["comparisons"])
    if "length_categories" in result:
      report["length_bias"]["length_categories"] = report.pop("length_categories")
  report["throughput"] = scorer.throughput()
  report["dropped"] = drops.as_dict()
  report["drop_report"] = drops
  return report


def run(
  name: str,
  scorer: Scorer,
  data: str | None = None,
  *,
  split: str | None = None,
  max_rows: int = 0,
  threshold: float = 0.5,
) -> dict[str, Any]:
  """:func:`load` then :func:`score`."""
  return score(load(name, data, split=split, max_rows=max_rows), scorer, threshold=threshold)


def _read(bench, data: str, split: str, max_rows: int) -> dict[str, list[tuple[str, dict]]]:
  """``{split: [(source, row)]}``: one split, or for ProcessBench each of its splits."""
  names = [s.strip() for s in split.split(",") if s.strip()] if bench is processbench else [split]
  path = os.path.expanduser(data)
  if bench is processbench and os.path.isfile(path):
    # A file is one split: the one named by `split`, else the file's name.
    names = names if len(names) == 1 else [os.path.splitext(os.path.basename(path))[0]]
    return {names[0]: _rows(data, names[0], max_rows)}
  if bench is processbench and split == processbench.DEFAULT_SPLIT and os.path.isdir(path):
    names = _saved_splits(path) or names
  return {s: _rows(data, s, max_rows) for s in names}


def _rows(data: str, split: str, max_rows: int) -> list[tuple[str, dict]]:
  rows_ = []
  for source, row in read_rows(data, split=split):
    rows_.append((source, row))
    if max_rows and len(rows_) == max_rows:
      break
  return rows_


def _saved_splits(path: str) -> list[str]:
  """The ProcessBench splits a ``save_to_disk`` DatasetDict holds, in the official order."""
  index = os.path.join(path, "dataset_dict.json")
  if not os.path.exists(index):
    return []
  with open(index) as f:
    saved = json.load(f).get("splits", [])
  return [s for s in processbench.SPLITS if s in saved] + [s for s in saved if s not in processbench.SPLITS]


def format_report(report: dict[str, Any]) -> str:
  """The benchmark's leaderboard table, the length-bias lines and the throughput."""
  lines = [
    f"{report['benchmark']} on {report['data']} ({report['split']}): {report['num_examples']} examples",
    "",
    module(report["benchmark"]).format_table(report),
  ]
  if "length_bias" in report:
    lines += ["", length_bias.format_report(report["length_bias"])]
  t = report["throughput"]
  lines += ["", f"scored {t['items']} items in {t['seconds']:.1f} s ({t['items_per_second']:.1f} items/s)"]
  if t["truncated"]:
    lines.append(
      f"{t['truncated']} of them were longer than max_length and lost their oldest tokens, as the "
      "official harness truncates; raise --max_length to score them whole"
    )
  return "\n".join(lines)
