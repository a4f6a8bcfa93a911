"""Evaluating a reward model from Python: on data (:func:`evaluate`; datasets read by name with
:func:`load_dataset`) or on a public benchmark by its official rules (:func:`run_benchmark`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrm import benchmarks, tasks
from jaxrm.benchmarks import length_bias
from jaxrm.benchmarks.scoring import Scorer, model_scorer
from jaxrm.data import pipeline, registry
from jaxrm.data.drops import DropReport
from jaxrm.data.tokenize import TokenizeOptions, pad_id, tokenize_all
from jaxrm.errors import EvaluationError
from jaxrm.evaluation import report
from jaxrm.evaluation.readings import READINGS, Reading, reading_of
from jaxrm.evaluation.scores import per_subset
from jaxrm.run.report import DEFAULT_FORMAT  # what a data path holds when no dataset_name says otherwise
from jaxrm.scoring import kinds

log = logging.getLogger(__name__)


def evaluate(
  rm,
  data: str | os.PathLike | Sequence[Any],
  *,
  dataset_name: str | None = None,
  split: str = "validation",
  subset_field: str | None = None,
  max_rows: int = 0,
  max_length: int | None = None,
  options: TokenizeOptions | None = None,
  batch_size: int = 8,
  bucket_multiple: int = 64,
  drops: DropReport | None = None,
  combine: str | None = None,
) -> dict[str, Any]:
  """Scores every example of ``data`` and returns its metrics.

  Args:
    rm: a :class:`jaxrm.RewardModel` of the kind the data needs: a preference reward model for
      preference data (or a verifier: records then end with its question), a process reward model
      (token head) for stepwise data, a regression model (one output per name of
      ``rm.attributes``) for rated rows.
    data: a dataset, read as ``python -m jaxrm.evaluate --data`` reads it: a name of
      :data:`jaxrm.data.registry.DATASET_NAMES` (``"demo_arithmetic"``, ``"HelpSteer3"``...)
      read from its usual place, or a file or directory in the format ``dataset_name`` names
      (default PreferenceDataset). Or preference, stepwise or rated records (tokenized here with
      ``options``), or tokenized examples. Rated rows hold their ratings in the order of
      ``rm.attributes`` (a rated dataset is read for them).
    dataset_name: the format of a data path, or the dataset it holds (see ``data``).
    split: the split of a dataset read by name, or of a saved DatasetDict.
    subset_field: the column holding each row's subset (default the dataset's, "subset" for files).
    max_rows: evaluate only the first N rows (0: all).
    max_length: the longest sequence in tokens (longer rows are dropped, or cut with
      ``options.truncation="left"``); default ``options.max_length``.
    options: how records are tokenized (default ``TokenizeOptions()``).
    batch_size: examples (groups of completions) per forward pass.
    bucket_multiple: sequence lengths are padded to a multiple of this, so that few shapes compile.
    drops: where dropped rows are counted (and already-dropped rows, if given).
    combine: rated rows: what ``pairwise_accuracy`` ranks same-prompt responses by, as
      ``reward.combine`` takes it (an attribute, or ``"name=weight,..."``; default: the first).

  Returns:
    ``{"kind": "preference" | "stepwise" | "regression" | ... (how the data was read:
    :data:`jaxrm.evaluation.readings.READINGS`), "num_examples", "timing", "metrics",
    "subsets", "dropped", "scores"}``; ``timing`` is ``{"seconds", "examples_per_second"}`` of the
    scoring (compiles included). ``metrics`` uses the names of the training loss's validation metrics;
    ``subsets`` maps each subset to ``{"num_examples", **metrics}`` (empty when no row has one);
    ``scores`` holds float32 arrays: ``chosen``/``rejected`` rewards [N] of each example's best and
    worst completion, for stepwise models ``correct``/``error``, the probability that a step is
    correct, for the steps labelled each way, and for regression models ``predictions`` and
    ``ratings`` [N, A] with ``rated`` (bool [N, A]: where a row rates an attribute). Preference
    results also have ``length_bias`` (see :mod:`jaxrm.benchmarks.length_bias`; lengths in tokens
    after the prompt), whose comparisons are ``scores["length"]``, and, for rows of a public
    benchmark, ``note``: why its ``run_benchmark`` figures differ; regression results have
    ``attributes`` and ``combine``.
  """
  drops = drops if drops is not None else DropReport()
  if isinstance(data, (str, os.PathLike)):
    _, data = read_data(
      os.fspath(data),
      lambda: rm,
      dataset_name=dataset_name,
      split=split,
      subset_field=subset_field,
      max_rows=max_rows,
      drops=drops,
    )
  elif max_rows:
    data = list(data)[:max_rows]
  options = options or TokenizeOptions()
  if max_length is not None:
    options = dataclasses.replace(options, max_length=max_length)
  verifier = getattr(rm, "verifier", None)
  if verifier is not None:  # records laid out as the verifier or judge reads them
    options = verifier.tokenize_options(options)
  rendering = getattr(rm, "rendering", None)
  if rendering is not None and options.rendering is None:  # rows rendered as training rendered its own
    options = dataclasses.replace(options, rendering=rendering)
  examples = _examples(rm, data, options, drops)
  name = reading_of(examples[0], kinds.task_of(rm))
  reading = READINGS[name]
  kinds.check_kind(rm, *reading.kinds, use=reading.use, error=EvaluationError)
  extra = reading.prepare(rm, examples, combine)
  batches = _batches(rm, examples, reading, batch_size, bucket_multiple)
  log.info("scoring %d %s examples in %d batches of %d", len(examples), name, len(batches), batch_size)
  t0 = time.perf_counter()
  arrays, scores = reading.score(rm, _Progress(batches, t0), examples, extra)
  seconds = max(time.perf_counter() - t0, 1e-9)
  log.info("scored %d examples in %.1f s (%.1f examples/s)", len(examples), seconds, len(examples) / seconds)
  result = {
    "kind": name,
    **extra,
    "num_examples": len(examples),
    # compiling each batch shape is counted in: the time a user waits
    "timing": {"seconds": seconds, "examples_per_second": len(examples) / seconds},
    "metrics": reading.metrics(arrays, np.ones(len(examples), np.float32)),
    "subsets": per_subset(
      [e.meta.get("subset") for e in examples], functools.partial(reading.metrics, arrays)
    ),
    "dropped": drops.as_dict(),
    "scores": scores,
  }
  if "length" in scores:
    result["length_bias"] = length_bias.report(scores["length"], unit="tokens")
  note = benchmarks.plain_evaluation_note(
    {str(s) for e in examples if (s := e.meta.get("subset")) is not None}
  )
  if note is not None and reading.task.name in tasks.scoring("reward"):
    result["note"] = note
  return result


def _examples(rm, data: Sequence[Any], options: TokenizeOptions, drops: DropReport) -> list:
  if not data:
    raise EvaluationError("there is nothing to evaluate: the data has no rows")
  if all(isinstance(x, tuple(r.example for r in READINGS.values())) for x in data):
    examples = list(data)
  elif all(isinstance(x, tuple(r.record for r in READINGS.values())) for x in data):
    if rm.tokenizer is None:
      raise EvaluationError(
        "the model has no tokenizer to tokenize records with; pass tokenizer= to "
        "RewardModel.from_pretrained, or pass tokenized examples"
      )
    examples = tokenize_all(data, rm.tokenizer, options, drops)
  else:
    records = " / ".join(r.record.__name__ for r in READINGS.values())
    raise EvaluationError(
      f"data must be all records ({records}) or all tokenized examples; got "
      f"{sorted({type(x).__name__ for x in data})}"
    )
  if not examples:
    raise EvaluationError(f"every row was dropped\n{drops.summary('data')}")
  if len({reading_of(e) for e in examples}) > 1:
    mixed = " and ".join(sorted({reading_of(e) for e in examples}))
    raise EvaluationError(f"data mixes {mixed} rows; evaluate them separately")
  return examples


def _batches(rm, examples: list, reading: Reading, batch_size: int, bucket_multiple: int) -> list:
  """The eval batches, padded to the multiples of ``bucket_multiple`` the longest sequence needs."""
  longest = max(len(ids) for e in examples for ids in reading.sequences(e))
  buckets = pipeline.length_buckets(-(-longest // bucket_multiple) * bucket_multiple, bucket_multiple)
  return pipeline.make_eval_batches(
    examples, batch_size=batch_size, buckets=buckets, pad_id=pad_id(rm.tokenizer, rm.config.pad_token_id)
  )


class _Progress(list):
  """Eval batches whose first walk -- the scoring, in every reading's ``score`` -- logs how far it has
  got, at each tenth of the batches; later walks (reading labels) log nothing."""

  def __init__(self, batches: list, t0: float):
    super().__init__(batches)
    self._t0, self._walked = t0, False

  def __iter__(self):
    if self._walked:
      yield from super().__iter__()
      return
    self._walked = True
    every = max(len(self) // 10, 1)
    for i, batch in enumerate(super().__iter__()):
      yield batch
      if (i + 1) % every == 0 and i + 1 < len(self):
        seconds = time.perf_counter() - self._t0
        log.info(
          "scored %d of %d batches (%.1f s, %.2f batches/s)", i + 1, len(self), seconds, (i + 1) / seconds
        )


# ------------------------------------------------------------------------------------------ data


def load_dataset(
  name: str,
  path: str | None = None,
  *,
  split: str = "train",
  max_rows: int = 0,
  drops: DropReport | None = None,
  **options,
) -> list:
  """The records of dataset ``name``, as training and ``python -m jaxrm.evaluate`` read them.

  Args:
    name: one of :data:`jaxrm.data.registry.DATASET_NAMES`: a public or demo dataset
      (``"demo_arithmetic"``, ``"HelpSteer3"``...) or a file format (``"PreferenceDataset"``).
    path: a file, directory, URL or hub name; None: the dataset's usual place (demo sets make
      their rows).
    split: the split to read.
    max_rows: keep only the first N records (0: all).
    drops: where rows dropped while reading are counted; None: a summary of them is printed, so
      that none goes unnoticed.
    **options: for :func:`jaxrm.data.registry.load_records`: ``subset_field``, ``attributes``
      (rated sets), ``num_rows`` and ``seed`` (demo sets), ``config`` (hub datasets)...
  """
  counted = drops if drops is not None else DropReport()
  records = registry.load_records(name, path, split=split, drops=counted, **options)
  if drops is None and counted.total:
    print(counted.summary(f"{name} ({split})"))
  return records[:max_rows] if max_rows else records


def dataset_source(
  data: str, dataset_name: str | None = None, task: tasks.Task | None = None
) -> tuple[str, str | None]:
  """(dataset name, path or None) of ``data``: a dataset's name, or a path in ``dataset_name``'s
  format, else in the format of the data ``task`` (the model's) trains on, else preference rows."""
  if data in registry.DATASET_NAMES:
    if dataset_name not in (None, data):
      raise EvaluationError(
        f"data={data} names a dataset, which dataset_name={dataset_name} contradicts; give one of them"
      )
    return data, None
  if dataset_name is None and task is not None:
    return registry.FILE_FORMATS[task.data], data
  return dataset_name or DEFAULT_FORMAT, data


def read_data(
  data: str,
  load_model: Callable[[], Any],
  *,
  dataset_name: str | None = None,
  split: str = "validation",
  subset_field: str | None = None,
  max_rows: int = 0,
  drops: DropReport | None = None,
) -> tuple[Any, list]:
  """(model, records) of a dataset named by ``data`` (see :func:`evaluate`), the model from ``load_model()``.

  Rated rows are read for the model's attributes, and a path given without ``dataset_name`` in
  the format of the model's task (rated rows for a regression model, stepwise rows for a process
  model...), so the model is then loaded first; other data is read first, so that a bad row
  fails before a model loads.
  """
  rm = None
  if dataset_name is None and data not in registry.DATASET_NAMES:
    rm = load_model()
    load_model = lambda: rm  # noqa: E731 -- loaded once
  name, path = dataset_source(data, dataset_name, None if rm is None else kinds.task_of(rm))
  options = {} if subset_field is None else {"subset_field": subset_field}
  read = functools.partial(load_dataset, name, path, split=split, max_rows=max_rows, drops=drops, **options)
  task = registry.task(name)
  if not task.per_attribute:
    records = read()
    return load_model(), records
  rm = load_model()
  kinds.check_kind(rm, task.name, use=f"{name} (rated rows)", error=EvaluationError)
  return rm, read(attributes=rm.attributes)


# ------------------------------------------------------------------------------------ benchmarks


def run_benchmark(
  name: str,
  model,
  data: str | dict | None = None,
  *,
  split: str | None = None,
  max_rows: int = 0,
  threshold: float = 0.5,
  batch_size: int = 32,
  max_length: int | None = None,
  output_dir: str | None = None,
  info: dict[str, Any] | None = None,
) -> dict[str, Any]:
  """Runs a public benchmark by its official rules (see :mod:`jaxrm.benchmarks`).

  Args:
    name: rewardbench, rewardbench2, rmbench, processbench or judgebench.
    model: a :class:`jaxrm.RewardModel` (a preference reward model or a pairwise judge for the
      preference benchmarks, a process reward model for processbench, a pairwise judge for
      judgebench), or a :class:`~jaxrm.benchmarks.scoring.Scorer` of reward / step / judge functions.
    data: a file or ``save_to_disk`` directory in the benchmark's schema, or a hub name (default
      the benchmark's hub dataset); or rows already read by :func:`jaxrm.benchmarks.load`.
    split: the split (processbench: comma-separated splits); default the benchmark's.
    max_rows: score only the first N rows of each split (0: all).
    threshold: processbench: a step is wrong when P(correct) is below this.
    batch_size: rows per forward pass.
    max_length: the longest row in tokens; default the benchmark's official length (``MAX_LENGTH``):
      2048 for the preference benchmarks (a longer row loses its oldest tokens), the model's
      context for processbench, whose official harness cuts nothing (a longer solution is dropped),
      and for a pairwise judge (a judge text that does not fit is an error naming it).
    output_dir: where to write ``eval.json`` and ``length_bias.png``; the paths go in ``"files"``.
    info: more keys for ``eval.json`` (the CLI gives the model).

  Returns:
    The report of :func:`jaxrm.benchmarks.score`, and ``"files"``: what was written.
  """
  bench = benchmarks.module(name)
  if isinstance(model, Scorer):
    scorer = model
  else:
    task = kinds.task_of(model)
    # a model that compares (a judge) has its own paths through the benchmarks that say so (JUDGED)
    compares = task is not None and task.benchmark_scoring is not None
    scorer = model_scorer(
      model,
      needs=(task.name,) if compares and bench.JUDGED else (bench.MODEL_KIND,),
      use=name,
      batch_size=batch_size,
      # its text holds both responses: the official length, for one, would cut most
      max_length=bench.MAX_LENGTH if max_length is None and not compares else max_length,
    )
  loaded = data if isinstance(data, dict) else benchmarks.load(name, data, split=split, max_rows=max_rows)
  result = benchmarks.score(loaded, scorer, threshold=threshold)
  result["files"] = report.write_benchmark_outputs(result, output_dir, info or {}) if output_dir else []
  return result
