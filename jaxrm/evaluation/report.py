"""What an evaluation shows: the text report, the plot of its scores, and the files it writes
(``eval.json``, ``rewards.png``, ``length_bias.png``), for data and for benchmarks alike."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from jaxrm import benchmarks
from jaxrm.benchmarks import length_bias
from jaxrm.evaluation.readings import READINGS

REPORT_FILE = "eval.json"
HISTOGRAM_FILE = "rewards.png"


def format_report(result: dict[str, Any]) -> str:
  """The overall and per-subset metrics of :func:`jaxrm.evaluation.evaluate`'s result, as the CLI
  prints them."""
  reading = READINGS[result["kind"]]
  lines = [f"{result['num_examples']} examples", *reading.lines(result)]
  if result["subsets"]:
    lines += ["", *_subset_table(result["subsets"], reading.columns(result))]
  if "length_bias" in result:
    lines += ["", length_bias.format_report(result["length_bias"])]
  if "note" in result:
    lines += ["", f"note: {result['note']}"]
  return "\n".join(lines)


# What a metric with nothing counted (NaN) means, in the subset table's cell.
UNDEFINED = {
  "f1_error": "no errors",  # no step in error, and none called one
  "first_error_found": "no errors",  # no solution with a step in error
  "recall_error": "no errors",
  "recall_correct": "none correct",
  "accuracy": "no pairs",
}


def _subset_table(subsets: dict[str, dict[str, float]], columns: tuple[str, ...]) -> list[str]:
  width = max(len("subset"), *(len(s) for s in subsets))
  lines = [f"{'subset':<{width}}  {'n':>6}" + "".join(f"  {c:>17}" for c in columns)]
  for name, m in subsets.items():
    lines.append(
      f"{name:<{width}}  {m['num_examples']:>6}" + "".join(f"  {_cell(m[c], c):>17}" for c in columns)
    )
  return lines


def _cell(value: float, metric: str) -> str:
  """``value`` to 4 decimals, or what its NaN means (:data:`UNDEFINED`; else "undefined")."""
  return f"{value:.4f}" if math.isfinite(value) else UNDEFINED.get(metric, "undefined")


def plot_scores(result: dict[str, Any], ax) -> None:
  """Draws the histogram of chosen vs rejected rewards (step probabilities for PRMs) on ``ax``;
  for a regression model, one panel per attribute of its predictions against its ratings, in
  the place of ``ax`` (an axes of a grid: ``fig.add_subplot()``, ``plt.subplots()``)."""
  READINGS[result["kind"]].plot(result, ax)


def _figure_size(result: dict[str, Any]) -> tuple[float, float]:
  """Inches (width, height) of ``rewards.png``: wider for a regression model's panels."""
  panels = len(result["attributes"]) if READINGS[result["kind"]].task.per_attribute else 1
  return max(7.0, 3.2 * panels), 4.0


def write_outputs(result: dict[str, Any], output_dir: str, info: dict[str, Any]) -> list[str]:
  """Writes ``eval.json`` (``info`` merged in; no per-row scores), ``rewards.png`` and, for
  preferences, ``length_bias.png``; returns their paths."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  os.makedirs(output_dir, exist_ok=True)
  files = [_write_json({**info, **{k: v for k, v in result.items() if k != "scores"}}, output_dir)]
  fig = Figure(figsize=_figure_size(result))
  FigureCanvasAgg(fig)
  plot_scores(result, fig.add_subplot())
  fig.tight_layout()
  files.append(os.path.join(output_dir, HISTOGRAM_FILE))
  fig.savefig(files[-1], dpi=100)
  if "length" in result["scores"]:
    files.append(os.path.join(output_dir, length_bias.PLOT_FILE))
    length_bias.plot(result["scores"]["length"], files[-1], "Reward against completion length", unit="tokens")
  return files


def write_benchmark_outputs(report: dict[str, Any], output_dir: str, info: dict[str, Any]) -> list[str]:
  """Writes ``eval.json`` (no per-row data) and, for preference benchmarks, ``length_bias.png``."""
  os.makedirs(output_dir, exist_ok=True)
  files = [
    _write_json({**info, **{k: v for k, v in report.items() if k not in benchmarks.ROW_KEYS}}, output_dir)
  ]
  if "comparisons" in report:
    files.append(os.path.join(output_dir, length_bias.PLOT_FILE))
    length_bias.plot(
      report["comparisons"], files[-1], f"{report['benchmark']}: reward against response length"
    )
  return files


def _write_json(report: dict[str, Any], output_dir: str) -> str:
  path = os.path.join(output_dir, REPORT_FILE)
  with open(path, "w") as f:
    json.dump(_json_safe(report), f, indent=2)
  return path


def _json_safe(value):
  """NaN (a metric with nothing counted) becomes null, which JSON can hold."""
  if isinstance(value, dict):
    return {k: _json_safe(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_json_safe(v) for v in value]
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value
