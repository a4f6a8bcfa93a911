"""Evaluating a reward model: on preference, stepwise or rated data, or on a public benchmark.

* :mod:`~jaxrm.evaluation.core`: :func:`evaluate`, :func:`load_dataset`, :func:`run_benchmark`;
* :mod:`~jaxrm.evaluation.readings`: how each sort of data is read, and what it needs, scores and shows;
* :mod:`~jaxrm.evaluation.scores`: each reading's scores and metrics;
* :mod:`~jaxrm.evaluation.report`: the text report, the plot and the files written.

The command line is ``python -m jaxrm.evaluate`` (:mod:`jaxrm.evaluate`).
"""

from jaxrm.evaluation.core import dataset_source, evaluate, load_dataset, read_data, run_benchmark
from jaxrm.evaluation.report import (
  HISTOGRAM_FILE,
  REPORT_FILE,
  format_report,
  plot_scores,
  write_benchmark_outputs,
  write_outputs,
)
from jaxrm.evaluation.scores import NO_SUBSET

__all__ = [
  "HISTOGRAM_FILE",
  "NO_SUBSET",
  "REPORT_FILE",
  "dataset_source",
  "evaluate",
  "format_report",
  "load_dataset",
  "plot_scores",
  "read_data",
  "run_benchmark",
  "write_benchmark_outputs",
  "write_outputs",
]
