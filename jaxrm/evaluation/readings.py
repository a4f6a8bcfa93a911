"""How :func:`jaxrm.evaluation.evaluate` reads and scores evaluation data (preference, stepwise,
rated, a judge's pairs, labelled items) and :data:`READINGS`, the one table of what each reading is:
its records and examples, the model it needs, how it is scored (:mod:`jaxrm.evaluation.scores`) and
what its report shows (headline lines, the columns of the subset table, the plot). Evaluation,
report and plot look a reading up here instead of testing the data.

The tasks declare the readings (:attr:`jaxrm.tasks.Task.evaluations`: a task's ``evaluation`` for
its data, ``"regression"`` for rated rows, and a verifier's ``"labelled"`` items): :data:`READINGS`
is built from them, each with the rows and the task (the model it needs) of the first task that
declares it, and how it is scored here, or by the task itself where it says so
(:attr:`jaxrm.tasks.Task.evaluation_scoring`: a judge's pairs in both orders). A reading a task
declares and nothing scores, or the reverse, stops the import with both lists.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrm import tasks
from jaxrm.data.example_types import ExampleType
from jaxrm.errors import EvaluationError
from jaxrm.evaluation import scores
from jaxrm.tasks.base import ReadingScoring


@dataclasses.dataclass(frozen=True)
class Reading:
  """One way of reading and scoring evaluation data. ``result`` below is what :func:`jaxrm.evaluation.evaluate` returns."""

  task: tasks.Task  # the task whose models it evaluates: the first to declare it (Task.evaluations)
  rows: ExampleType  # its tokenized rows and their records, as the task declares them
  name: str  # its key in READINGS (a result's "kind")
  use: str  # what needs the model, as the wrong-model message names it
  # (rm, examples, combine) -> the result's extra keys; raises when the data does not fit the model
  prepare: Callable[[Any, list, str | None], dict[str, Any]]
  # (rm, batches, examples, extra keys) -> (arrays for `metrics`, scores for the result)
  score: Callable[[Any, list, list, dict[str, Any]], tuple[Any, scores.Scores]]
  metrics: Callable[[Any, np.ndarray], dict[str, float]]  # (arrays, example mask [N]) -> metrics
  lines: Callable[[dict[str, Any]], list[str]]  # result -> the report's headline lines
  columns: Callable[[dict[str, Any]], tuple[str, ...]]  # result -> the subset table's metrics
  plot: Callable[[dict[str, Any], Any], None]  # (result, matplotlib axes): the scores' plot

  @property
  def key(self) -> str:
    return self.name

  @property
  def kinds(self) -> tuple[str, ...]:
    """The tasks whose models it evaluates: every task that declares it (labelled items: a
    verifier's and a pointwise model's), its owner first."""
    return tuple(t.name for t in tasks.TASKS.values() if self.name in t.evaluations)

  @property
  def record(self) -> type:
    """Its records' class."""
    return self.rows.record

  @property
  def example(self) -> type:
    """Its tokenized examples' class."""
    return self.rows.example

  def sequences(self, example) -> Sequence[np.ndarray]:
    """The token sequences of ``example``."""
    return self.rows.sequences(example)


def reading_of(example: Any, task: tasks.Task | None = None) -> str:
  """The name in :data:`READINGS` of how a tokenized example is read: for a model of ``task``, its
  own evaluation where the example is of its layout (a judge's pairs in both orders are preference
  examples), else the first reading of the example's type."""
  own = READINGS.get(task.evaluation) if task is not None else None
  if own is not None and isinstance(example, own.example):
    return own.key
  return next(name for name, r in READINGS.items() if isinstance(example, r.example))


def _takes_no_combine(name: str) -> Callable[[Any, list, str | None], dict[str, Any]]:
  def prepare(rm, examples, combine):
    del rm, examples
    if combine is not None:
      raise EvaluationError(
        f"combine={combine!r} ranks the attributes of rated rows; this data is {name} data"
      )
    return {}

  return prepare


def _histograms(ax, series, xlabel: str, title: str) -> None:
  values = np.concatenate([v for _, v in series])
  bins = np.histogram_bin_edges(values, bins=min(40, max(10, len(values) // 10)))
  for label, v in series:
    ax.hist(v, bins=bins, alpha=0.6, label=f"{label} (n={len(v)})")
  ax.set_xlabel(xlabel)
  ax.set_ylabel("count")
  ax.set_title(title)
  ax.legend()


# --------------------------------------------------------------------------------------- preferences


def _preference_score(rm, batches, examples, extra):
  del extra
  arrays, out = scores.preference_arrays(rm, batches, len(examples))
  out["length"] = scores.length_comparisons(examples, arrays.rewards)
  return arrays, out


def _preference_lines(result: dict[str, Any]) -> list[str]:
  m = result["metrics"]
  return [
    f"accuracy           {m['accuracy']:.4f}  (best completion scored above the worst; "
    f"ties {m['tie_rate']:.4f})",
    f"pairwise accuracy  {m['pairwise_accuracy']:.4f}  (every ordered pair of completions)",
    f"loss               {m['loss']:.4f}",
    f"chosen reward      {m['chosen_reward']:.4f} ± {m['chosen_reward_std']:.4f}",
    f"rejected reward    {m['rejected_reward']:.4f} ± {m['rejected_reward_std']:.4f}",
    f"margin             {m['margin']:.4f} ± {m['margin_std']:.4f}",
    f"all rewards        {m['reward_mean']:.4f} ± {m['reward_std']:.4f}",
  ]


def _preference_plot(result: dict[str, Any], ax) -> None:
  s = result["scores"]
  _histograms(
    ax,
    (("chosen", s["chosen"]), ("rejected", s["rejected"])),
    "reward",
    "Rewards of the best (chosen) and worst (rejected) completions",
  )


# ------------------------------------------------------------------------------------------ stepwise


def _stepwise_score(rm, batches, examples, extra):
  del extra
  return scores.stepwise_arrays(rm, batches, len(examples))


def _stepwise_lines(result: dict[str, Any]) -> list[str]:
  m = result["metrics"]
  return [
    f"step accuracy      {m['step_accuracy']:.4f}  (baseline calling every step correct: "
    f"{m['positive_rate']:.4f})",
    f"recall             correct {m['recall_correct']:.4f}, error {m['recall_error']:.4f}",
    f"F1 (error class)   {m['f1_error']:.4f}  (baseline: 0)",
    f"first error found  {m['first_error_found']:.4f}  (of solutions with an error)",
    f"loss               {m['loss']:.4f}",
  ]


def _stepwise_plot(result: dict[str, Any], ax) -> None:
  s = result["scores"]
  _histograms(
    ax,
    (("steps labelled correct", s["correct"]), ("steps labelled in error", s["error"])),
    "P(step correct)",
    "Predicted probability that a step is correct",
  )


# ------------------------------------------------------------------------------------ labelled items


def _labelled_score(rm, batches, examples, extra):
  del extra
  return scores.labelled_arrays(rm, batches, len(examples))


def _labelled_lines(result: dict[str, Any]) -> list[str]:
  m = result["metrics"]
  return [
    f"accuracy           {m['accuracy']:.4f}  (baseline calling every item good: {m['positive_rate']:.4f})",
    f"AUROC              {m['auroc']:.4f}  (a good item's log-odds above a bad one's)",
    f"ECE                {m['ece']:.4f}  (expected calibration error of P(good), 10 bins)",
    f"loss               {m['loss']:.4f}",
    f"log-odds           {m['reward_mean']:.4f} ± {m['reward_std']:.4f}",
  ]


def _labelled_plot(result: dict[str, Any], ax) -> None:
  s = result["scores"]
  _histograms(
    ax,
    (("labelled good", s["good"]), ("labelled bad", s["bad"])),
    "log-odds (log p(good) - log p(bad))",
    "log-odds that the item is good",
  )


# ---------------------------------------------------------------------------------------- regression


def _regression_prepare(rm, examples, combine):
  """Rated rows hold their ratings in the order of ``rm.attributes``, one per attribute."""
  ratings = examples[0].labels.shape[0]
  if ratings != len(rm.attributes):
    raise EvaluationError(
      f"the rated rows hold {ratings} ratings each and the model has {len(rm.attributes)} "
      f"outputs ({', '.join(rm.attributes)}); read the rows for the model's attributes"
    )
  scores.combination(rm.attributes, combine)  # a bad combine fails before the model runs
  return {"attributes": list(rm.attributes), "combine": combine or rm.attributes[0]}


def _regression_score(rm, batches, examples, extra):
  return scores.regression_arrays(rm, batches, len(examples), extra["attributes"], extra["combine"])


def _regression_lines(result: dict[str, Any]) -> list[str]:
  m, attributes = result["metrics"], result["attributes"]
  width = max(len("attribute"), *(len(a) for a in attributes))
  lines = [
    f"mse                {m['mse']:.4f}  (every rating)",
    f"pairwise accuracy  {m['pairwise_accuracy']:.4f}  (same-prompt responses whose ratings differ, "
    f"ranked by {result['combine']})",
    f"loss               {m['loss']:.4f}",
    "",
    f"{'attribute':<{width}}  {'mse':>8}  {'mae':>8}  {'pearson':>8}  {'spearman':>8}",
  ]
  columns = ("mse", "mae", "pearson", "spearman")
  return lines + [f"{a:<{width}}" + "".join(f"  {m[f'{k}_{a}']:>8.4f}" for k in columns) for a in attributes]


def _regression_columns(result: dict[str, Any]) -> tuple[str, ...]:
  first = result["attributes"][0]
  return "mse", "pairwise_accuracy", f"pearson_{first}", f"spearman_{first}"


def _regression_plot(result: dict[str, Any], ax) -> None:
  """One scatter of predictions against ratings per attribute, each with its y = x line; the
  panels share ``ax``'s place in its figure. Attributes rate on their own scales, so each panel
  has its own axes."""
  spec = ax.get_subplotspec()
  if spec is None:
    raise ValueError(
      "plot_scores of a regression result draws one panel per attribute in the place of ax: "
      "give an axes of a grid (fig.add_subplot() or plt.subplots())"
    )
  fig, names, s = ax.figure, result["attributes"], result["scores"]
  grid = spec.subgridspec(1, len(names))
  ax.remove()
  for a, name in enumerate(names):
    panel = fig.add_subplot(grid[0, a])
    rated = s["rated"][:, a]
    ratings, predictions = s["ratings"][rated, a], s["predictions"][rated, a]
    panel.scatter(ratings, predictions, s=8, alpha=0.5)
    if rated.any():
      lo = float(min(ratings.min(), predictions.min()))
      hi = float(max(ratings.max(), predictions.max()))
      panel.plot([lo, hi], [lo, hi], color="gray", linestyle="--", linewidth=1)
    panel.set_title(f"{name} (n={int(rated.sum())})")
    panel.set_xlabel("rating")
    panel.set_ylabel("prediction" if a == 0 else "")
  fig.suptitle("Predictions against ratings (dashed: prediction = rating)")


# How each reading of evaluation data is scored and reported, by its name in READINGS, but for the
# readings the tasks score their own way (Task.evaluation_scoring: _task_scoring).
_SCORING = {
  "preference": dict(
    use="preference data",
    score=_preference_score,
    metrics=scores.preference_metrics,
    lines=_preference_lines,
    columns=lambda result: ("accuracy", "margin", "chosen_reward", "rejected_reward"),
    plot=_preference_plot,
  ),
  "stepwise": dict(
    use="stepwise data",
    score=_stepwise_score,
    metrics=scores.stepwise_metrics,
    lines=_stepwise_lines,
    columns=lambda result: ("step_accuracy", "f1_error", "first_error_found", "positive_rate"),
    plot=_stepwise_plot,
  ),
  "regression": dict(
    use="rated data",
    prepare=_regression_prepare,
    score=_regression_score,
    metrics=scores.regression_metrics,
    lines=_regression_lines,
    columns=_regression_columns,
    plot=_regression_plot,
  ),
  "labelled": dict(
    use="labelled items",
    score=_labelled_score,
    metrics=scores.labelled_metrics,
    lines=_labelled_lines,
    columns=lambda result: ("accuracy", "auroc", "ece", "positive_rate"),
    plot=_labelled_plot,
  ),
}


def _task_scoring(how: ReadingScoring) -> dict[str, Any]:
  """A task's own scoring of its reading (:attr:`jaxrm.tasks.Task.evaluation_scoring`) as an entry of
  :data:`_SCORING`: given the model's outputs of the eval rows, and its histograms drawn here."""
  return dict(
    use=how.use,
    score=lambda rm, batches, examples, extra: how.score(
      functools.partial(scores.row_outputs, rm, batches), examples
    ),
    metrics=how.metrics,
    lines=how.lines,
    columns=how.columns,
    plot=lambda result, ax: _histograms(ax, *how.histograms(result)),
  )


def _readings() -> dict[str, Reading]:
  """Every reading of evaluation data the tasks declare (:attr:`jaxrm.tasks.Task.evaluations`), each
  owned by the first task that declares it, with how :data:`_SCORING` scores it, or its task
  (:attr:`jaxrm.tasks.Task.evaluation_scoring`). Each task's own reading comes first, in the tasks'
  order, then the readings of the other rows they train on."""
  owners = {}
  for task in tasks.TASKS.values():
    for name, rows in task.evaluations.items():
      owners.setdefault(name, (task, rows))
  scoring = {
    **_SCORING,
    **{
      t.evaluation: _task_scoring(t.evaluation_scoring) for t in tasks.TASKS.values() if t.evaluation_scoring
    },
  }
  if set(owners) != set(scoring):
    raise LookupError(
      f"the tasks declare the evaluation readings {sorted(owners)} and jaxrm.evaluation.readings "
      f"scores {sorted(scoring)}: give each reading a task and a scoring"
    )
  # reading_of takes the first reading of an example's type: a preference example is preference
  # data before it is a judge's pairs
  order = dict.fromkeys([t.evaluation for t in tasks.TASKS.values()] + list(owners))
  # a reading whose scoring prepares nothing refuses combine, naming its rows
  return {
    name: Reading(
      task=task, rows=rows, name=name, **{"prepare": _takes_no_combine(rows.key), **scoring[name]}
    )
    for name in order
    for task, rows in [owners[name]]
  }


# An evaluation result's "kind" (the name of its reading; the key keeps result files as they were)
# -> its Reading
READINGS: dict[str, Reading] = _readings()
