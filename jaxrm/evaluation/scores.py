"""What each reading of evaluation data is scored into, and its metrics over any subset of the rows.

Per reading, ``<reading>_arrays(rm, batches, n, ...)`` runs the model over the eval batches and returns
the per-example arrays the metrics take (with the ``scores`` an evaluation result keeps), and
``<reading>_metrics(arrays, mask)`` computes the metrics of the examples where ``mask`` [N] is 1 from
the training loss's own metric sums, so that evaluation and validation report the same figures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxrm.benchmarks import length_bias
from jaxrm.config import combination_weights
from jaxrm.data.batches import IGNORE_INDEX, LabelledBatch, PreferenceBatch, RegressionBatch, StepwiseBatch
from jaxrm.data.tokenize import PreferenceExample
from jaxrm.errors import EvaluationError
from jaxrm.models.heads import correct_probability
from jaxrm.run.metrics import Scores as ScoreSamples
from jaxrm.run.metrics import finalize_metrics
from jaxrm.tasks import losses

NO_SUBSET = "(none)"  # the subset of rows that have no subset column

Scores = dict[str, Any]  # float32 arrays kept in the result, by name


def per_subset(
  subsets: Sequence[Any], metrics_of: Callable[[np.ndarray], dict[str, float]]
) -> dict[str, dict[str, float]]:
  """``metrics_of(example_mask [N])`` for each subset (None: no subset); {} when no example has one."""
  if all(s is None for s in subsets):
    return {}
  names = np.array([NO_SUBSET if s is None else str(s) for s in subsets])
  return {
    name: {"num_examples": int(np.sum(names == name)), **metrics_of((names == name).astype(np.float32))}
    for name in sorted(set(names))
  }


# --------------------------------------------------------------------------------------- preferences


class PreferenceArrays(NamedTuple):
  rewards: np.ndarray  # [N, K] float32, best completion first
  ranks: np.ndarray  # [N, K] int32: position in preference order, -1 = no completion
  margin: np.ndarray  # [N] float32


def batch_outputs(rm, batch) -> list[np.ndarray | None]:
  """The model's output for each row of an eval ``batch`` (its reward(s), or a token head's logits
  [T_i, C] over its real tokens), None for a row with none. The rows' real tokens are scored by
  ``rm.outputs_of_ids``, so rows sharing a prefix (a prompt's completions) share it
  (:mod:`jaxrm.scoring.shared_prefix`), in passes of as many rows as the batch has."""
  ids, mask = np.asarray(batch.input_ids), np.asarray(batch.attention_mask) > 0
  real = [j for j in range(len(ids)) if mask[j].any()]
  outputs = rm.outputs_of_ids([ids[j][mask[j]].tolist() for j in real], batch_size=len(ids))
  out: list[np.ndarray | None] = [None] * len(ids)
  for j, o in zip(real, outputs):
    out[j] = o
  return out


def row_outputs(rm, batches, width: int) -> np.ndarray:
  """float32 [rows of all batches, width]: each row's reward(s), 0 for rows without tokens. A task's
  own reading (:attr:`jaxrm.tasks.Task.evaluation_scoring`) is given it to score its rows."""
  rows = [
    np.zeros(width, np.float32) if o is None else np.asarray(o, np.float32).reshape(width)
    for b in batches
    for o in batch_outputs(rm, b)
  ]
  return np.stack(rows)


def preference_arrays(rm, batches: list[PreferenceBatch], n: int) -> tuple[PreferenceArrays, Scores]:
  """The rewards of every completion; scores ``chosen``/``rejected`` [N]: the best and the worst."""
  k = batches[0].ranks.shape[1]
  rewards = row_outputs(rm, batches, 1).reshape(-1, k)[:n]
  ranks = np.concatenate([b.ranks for b in batches])[:n]
  margin = np.concatenate([b.margin for b in batches])[:n]
  worst = np.max(ranks, axis=1)  # completions are in preference order: the worst is the last real one
  scores = {"chosen": rewards[:, 0], "rejected": rewards[np.arange(n), worst]}
  return PreferenceArrays(rewards, ranks, margin), scores


def length_comparisons(examples: list[PreferenceExample], rewards: np.ndarray) -> length_bias.Comparisons:
  """The best vs the worst completion of each example; lengths in tokens after the shared prompt."""
  pairs, responses = [], []
  for e, r in zip(examples, rewards):
    shared = _shared_prefix(e.input_ids)
    lengths = [len(ids) - shared for ids in e.input_ids]  # best first, the worst last
    pairs.append((r[0], lengths[0], r[len(lengths) - 1], lengths[-1]))
    responses += [(r[j], n, j == 0) for j, n in enumerate(lengths)]
  return length_bias.comparisons(pairs, responses)


def _shared_prefix(sequences: Sequence[np.ndarray]) -> int:
  n = min(len(x) for x in sequences)
  same = np.all([x[:n] == sequences[0][:n] for x in sequences], axis=0)
  return int(np.argmin(same)) if not same.all() else n


# Jitted: one compile per evaluation instead of one per operation, whatever the number of subsets.
_bradley_terry_sums = jax.jit(lambda *args: losses.bradley_terry_loss(*args)[1])
_stepwise_sums = jax.jit(lambda *args: losses.stepwise_loss(*args)[1])


def preference_metrics(a: PreferenceArrays, mask: np.ndarray) -> dict[str, float]:
  """The Bradley-Terry validation metrics, with the std of chosen/rejected rewards and margins."""
  metrics = finalize_metrics(_bradley_terry_sums(a.rewards, a.ranks, mask, a.margin))
  rows = mask > 0
  chosen = a.rewards[rows, 0]
  rejected = a.rewards[rows, np.max(a.ranks[rows], axis=1)]
  for name, values in (
    ("chosen_reward", chosen),
    ("rejected_reward", rejected),
    ("margin", chosen - rejected),
  ):
    metrics[f"{name}_std"] = float(np.std(values)) if len(values) else math.nan
  return metrics


# ------------------------------------------------------------------------------------- labelled items


class LabelledArrays(NamedTuple):
  log_odds: np.ndarray  # [N] float32: a verifier's log p(yes) - log p(no)
  labels: np.ndarray  # [N] float32: 1 = good, 0 = bad


def labelled_arrays(rm, batches: list[LabelledBatch], n: int) -> tuple[LabelledArrays, Scores]:
  """The log-odds of every item; scores ``good``/``bad``: those of the items so labelled."""
  log_odds = row_outputs(rm, batches, 1).reshape(-1)[:n]
  labels = np.concatenate([b.labels for b in batches])[:n]
  return LabelledArrays(log_odds, labels), {"good": log_odds[labels > 0.5], "bad": log_odds[labels <= 0.5]}


_labelled_sums = jax.jit(lambda *args: losses.labelled_loss(*args)[1])


def labelled_metrics(a: LabelledArrays, mask: np.ndarray) -> dict[str, float]:
  """The labelled items' validation metrics: loss, accuracy, positive rate, ECE and AUROC."""
  metrics = finalize_metrics(_labelled_sums(a.log_odds, a.labels, mask))
  return {**metrics, **finalize_metrics({"auroc": ScoreSamples(a.log_odds, a.labels, mask > 0)})}


# ------------------------------------------------------------------------------------------ stepwise


class StepwiseArrays(NamedTuple):
  logits: np.ndarray  # [N, S, 2] float32 of each example's labelled steps, in order
  labels: np.ndarray  # [N, S] int32: 1 = step correct, 0 = in error, IGNORE_INDEX past the last step


def stepwise_arrays(rm, batches: list[StepwiseBatch], n: int) -> tuple[StepwiseArrays, Scores]:
  """The logits of every labelled step; scores ``correct``/``error``: P(step correct) of the steps
  labelled each way."""
  step_logits, step_labels = [], []
  for b in batches:
    mask = np.asarray(b.attention_mask) > 0
    for row_logits, row_labels, row_mask in zip(batch_outputs(rm, b), np.asarray(b.labels), mask):
      row_labels = row_labels[row_mask]  # over the row's real tokens, as its logits [T_i, 2]
      where = row_labels != IGNORE_INDEX
      step_logits.append(np.zeros((0, 2), np.float32) if row_logits is None else row_logits[where])
      step_labels.append(row_labels[where])
  step_logits, step_labels = step_logits[:n], step_labels[:n]
  num_steps = max(len(x) for x in step_labels)
  logits = np.zeros((n, num_steps, 2), np.float32)
  labels = np.full((n, num_steps), IGNORE_INDEX, np.int32)
  for i, (x, y) in enumerate(zip(step_logits, step_labels)):
    logits[i, : len(y)], labels[i, : len(y)] = x, y
  all_logits, all_labels = np.concatenate(step_logits), np.concatenate(step_labels)
  p_correct = correct_probability(all_logits)
  scores = {"correct": p_correct[all_labels == 1], "error": p_correct[all_labels == 0]}
  return StepwiseArrays(logits, labels), scores


def stepwise_metrics(a: StepwiseArrays, mask: np.ndarray) -> dict[str, float]:
  """The stepwise loss's validation metrics."""
  return finalize_metrics(_stepwise_sums(a.logits, a.labels, mask))


# ---------------------------------------------------------------------------------------- regression


class RegressionArrays(NamedTuple):
  predictions: np.ndarray  # [N, A] float32
  labels: np.ndarray  # [N, A] float32: the ratings, 0 where missing
  label_mask: np.ndarray  # [N, A] float32: 1 where rated
  group: np.ndarray  # [N] int32: the responses to one prompt share it
  attributes: tuple[str, ...]  # [A], the model's
  combination: tuple[float, ...]  # [A]: what pairwise_accuracy ranks same-prompt responses by


def combination(attributes: Sequence[str], combine: str | None) -> tuple[float, ...]:
  """The weights of ``combine`` (an attribute, or ``"name=weight,..."``; default the first attribute)."""
  try:
    return combination_weights(combine or attributes[0], attributes)
  except ValueError as e:
    raise EvaluationError(str(e)) from None


def regression_arrays(
  rm, batches: list[RegressionBatch], n: int, attributes: Sequence[str], combine: str | None
) -> tuple[RegressionArrays, Scores]:
  """Predictions against ratings; scores ``predictions``, ``ratings`` [N, A] and ``rated`` (bool)."""
  a = len(attributes)
  predictions = row_outputs(rm, batches, a)[:n]
  labels, label_mask, group = (
    np.concatenate([getattr(b, f) for b in batches])[:n] for f in ("labels", "label_mask", "group")
  )
  arrays = RegressionArrays(
    predictions, labels, label_mask, group, tuple(attributes), combination(attributes, combine)
  )
  return arrays, {"predictions": predictions, "ratings": labels, "rated": label_mask > 0}


def regression_metrics(a: RegressionArrays, mask: np.ndarray) -> dict[str, float]:
  """Validation's regression metrics: the loss's MSE, MAE and Pearson sums (every attribute weighing
  1), Spearman and pairwise accuracy from the whole set."""
  _, sums = losses.regression_loss(a.predictions, a.labels, a.label_mask, mask, attributes=a.attributes)
  sums["samples"] = losses.regression_samples(
    a.predictions, a.labels, a.label_mask, mask, a.group, attributes=a.attributes, combination=a.combination
  )
  return finalize_metrics(sums)
