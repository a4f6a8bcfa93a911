"""Reward-model losses: Bradley-Terry, Plackett-Luce ranking and stepwise cross-entropy.

Each loss is a pure function of one batch's arrays that returns ``(loss, metrics)``;
:data:`LOSSES` says which one each reward type trains with, and :func:`batch_loss` gives it as a
function of the model's outputs and the batch.

The metrics hold sums and counts, not means, so that batches combine exactly: :func:`accumulate`
adds two of them (micro-batches of one step, or every batch of a validation set) and
:func:`finalize_metrics` divides once at the end. A validation loss is therefore the mean over the
whole set, not a mean of batch means, and filler groups that pad the last batch change nothing.

``metrics["loss"].total`` is differentiable. To average over a global batch split into
micro-batches with different numbers of real pairs, differentiate ``metrics["loss"].total`` divided
by the global count instead of averaging the per-micro-batch ``loss``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from typing import Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxrm.batches import IGNORE_INDEX, Batch

REWARD_TYPES = ("bradley_terry", "ranking", "stepwise")
RANKING_LOSSES = ("plackett_luce", "all_pairs")

# Stands in for -inf in masked logsumexp terms: exp() of it is exactly 0, yet, unlike -inf, it
# never makes a NaN in gradients of rows where every entry is masked.
_MASKED_LOGIT = -1e9


class Ratio(NamedTuple):
  """A metric kept as ``total / count`` until :func:`finalize_metrics`."""

  total: jax.Array  # [] float32
  count: jax.Array  # [] float32


class Moments(NamedTuple):
  """A quantity's sum, sum of squares and count; finalizes to ``<name>_mean`` and ``<name>_std``."""

  total: jax.Array  # [] float32
  total_sq: jax.Array  # [] float32
  count: jax.Array  # [] float32


Metrics = dict[str, Union[Ratio, Moments]]


def accumulate(a: Metrics, b: Metrics) -> Metrics:
  """Combines the metrics of two batches (device arrays or host numpy alike)."""
  return jax.tree.map(operator.add, a, b)


def finalize_metrics(metrics: Metrics) -> dict[str, float]:
  """Turns accumulated sums into values; a metric with nothing counted is NaN.

  ``reward_std`` is the population standard deviation over every real completion seen.
  """
  out = {}
  for name, acc in jax.device_get(metrics).items():
    if isinstance(acc, Moments):
      mean = _divide(acc.total, acc.count)
      variance = _divide(acc.total_sq, acc.count) - mean * mean
      out[f"{name}_mean"] = mean
      # The float32 sums can make a zero variance come out slightly negative; NaN stays NaN.
      out[f"{name}_std"] = math.sqrt(max(variance, 0.0))
    else:
      out[name] = _divide(acc.total, acc.count)
  return out


def _divide(total, count) -> float:
  count = float(np.asarray(count, np.float64))
  return float(np.asarray(total, np.float64)) / count if count > 0 else math.nan


def _masked_sum(values: jax.Array, mask: jax.Array) -> jax.Array:
  return jnp.sum(jnp.where(mask, values, 0.0))


def _count(mask: jax.Array) -> jax.Array:
  return jnp.sum(mask, dtype=jnp.float32)


def _mean(values: jax.Array, mask: jax.Array) -> Ratio:
  return Ratio(_masked_sum(values, mask), _count(mask))


def _value(loss: Ratio) -> jax.Array:
  """The mean a loss function returns; 0 when nothing is counted (an all-filler batch)."""
  return loss.total / jnp.maximum(loss.count, 1.0)


# ---------------------------------------------------------------------------------------------
# Preferences


def _real_completions(rewards, ranks, example_mask):
  """Float32 rewards with absent slots zeroed, and the mask of real completions ``[B, K]``."""
  if rewards.shape != ranks.shape or example_mask.shape != rewards.shape[:1]:
    raise ValueError(
        f"preference batch shapes disagree: rewards {rewards.shape} and ranks {ranks.shape} must"
        f" both be [B, K], example_mask {example_mask.shape} must be [B]")
  real = (ranks >= 0) & (example_mask[:, None] > 0)
  # Zeroing keeps a NaN or inf computed for a filler slot out of every sum below.
  return jnp.where(real, rewards.astype(jnp.float32), 0.0), real


def _ordered_pairs(ranks, real):
  """``[B, K, K]``: completion i is preferred to completion j, both real."""
  return real[:, :, None] & real[:, None, :] & (ranks[:, :, None] < ranks[:, None, :])


def _best_worst_pairs(ranks, real):
  """``[B, K, K]``: one pair per group with two or more real completions, best vs worst."""
  num_slots = ranks.shape[1]
  best = jnp.argmin(jnp.where(real, ranks, jnp.iinfo(jnp.int32).max), axis=1)  # [B]
  worst = jnp.argmax(jnp.where(real, ranks, -1), axis=1)  # [B]
  has_pair = jnp.sum(real, axis=1) >= 2  # [B]
  slots = jnp.arange(num_slots)
  return (has_pair[:, None, None]
          & (slots[None, :, None] == best[:, None, None])
          & (slots[None, None, :] == worst[:, None, None]))


def _preference_metrics(rewards, real, best_worst, ordered) -> Metrics:
  """Metrics shared by every preference loss; ``loss`` is added by the caller."""
  chosen = rewards[:, :, None]  # [B, K, 1]
  rejected = rewards[:, None, :]  # [B, 1, K]
  diff = chosen - rejected  # [B, K, K]
  num_best_worst = _count(best_worst)
  return {
      "accuracy": Ratio(_count(best_worst & (diff > 0)), num_best_worst),
      "tie_rate": Ratio(_count(best_worst & (diff == 0)), num_best_worst),
      "pairwise_accuracy": Ratio(_count(ordered & (diff > 0)), _count(ordered)),
      "chosen_reward": _mean(jnp.broadcast_to(chosen, diff.shape), best_worst),
      "rejected_reward": _mean(jnp.broadcast_to(rejected, diff.shape), best_worst),
      "margin": _mean(diff, best_worst),
      "reward": Moments(_masked_sum(rewards, real), _masked_sum(rewards * rewards, real),
                        _count(real)),
  }


def bradley_terry_loss(
    rewards: jax.Array,  # [B, K] float
    ranks: jax.Array,  # [B, K] int32, distinct per group, lower preferred, -1 absent
    example_mask: jax.Array,  # [B] float32, 0 for filler groups
    margin: jax.Array | None = None,  # [B] float32
    *,
    center_rewards_coefficient: float = 0.0,
) -> tuple[jax.Array, Metrics]:
  """Mean over groups of ``-log sigmoid(r_best - r_worst - margin)``: one pair per group with two
  or more real completions, its best against its worst.

  ``center_rewards_coefficient`` adds ``coef * mean((r_best + r_worst) ** 2)``, which keeps
  rewards near 0. ``pairwise_accuracy`` is over every ordered pair of real completions.
  """
  return _pairwise_loss(rewards, ranks, example_mask, margin, center_rewards_coefficient, all_pairs=False)


def all_pairs_bradley_terry_loss(
    rewards: jax.Array,  # [B, K] float
    ranks: jax.Array,  # [B, K] int32, distinct per group, lower preferred, -1 absent
    example_mask: jax.Array,  # [B] float32, 0 for filler groups
    margin: jax.Array | None = None,  # [B] float32
    *,
    center_rewards_coefficient: float = 0.0,
) -> tuple[jax.Array, Metrics]:
  """:func:`bradley_terry_loss` over every ordered pair of real completions, averaged over pairs
  (not over groups).

  Accuracy and reward means stay over best-vs-worst pairs, as :func:`bradley_terry_loss` reports
  them.
  """
  return _pairwise_loss(rewards, ranks, example_mask, margin, center_rewards_coefficient, all_pairs=True)


def _pairwise_loss(rewards, ranks, example_mask, margin, center_rewards_coefficient: float, *,
                   all_pairs: bool) -> tuple[jax.Array, Metrics]:
  rewards, real = _real_completions(rewards, ranks, example_mask)
  best_worst, ordered = _best_worst_pairs(ranks, real), _ordered_pairs(ranks, real)
  loss = _pair_loss(rewards, margin, ordered if all_pairs else best_worst, center_rewards_coefficient)
  return _value(loss), {"loss": loss, **_preference_metrics(rewards, real, best_worst, ordered)}


def _pair_loss(rewards, margin, pairs, center_rewards_coefficient: float) -> Ratio:
  """Sum and count of ``-log sigmoid(r_i - r_j - margin) + coef * (r_i + r_j) ** 2`` over
  ``pairs[b, i, j]`` (``[B, K, K]``: completion i preferred to j)."""
  margin = jnp.zeros(rewards.shape[:1]) if margin is None else margin.astype(jnp.float32)
  chosen = rewards[:, :, None]  # [B, K, 1]
  rejected = rewards[:, None, :]  # [B, 1, K]
  per_pair = (-jax.nn.log_sigmoid(chosen - rejected - margin[:, None, None])
              + center_rewards_coefficient * (chosen + rejected) ** 2)  # [B, K, K]
  return _mean(per_pair, pairs)


def plackett_luce_loss(
    rewards: jax.Array,  # [B, K] float
    ranks: jax.Array,  # [B, K] int32, distinct per group, lower preferred, -1 absent
    example_mask: jax.Array,  # [B] float32, 0 for filler groups
) -> tuple[jax.Array, Metrics]:
  """Listwise ranking loss: minus the log-probability of the ranking under Plackett-Luce.

  A ranking of n completions is n - 1 choices, each of the next-best completion among those not
  yet chosen: ``log softmax`` over the rewards of the remaining ones. The loss is the mean over
  all choices in the batch, so with two completions per group it equals
  :func:`bradley_terry_loss` (without margin).
  """
  rewards, real = _real_completions(rewards, ranks, example_mask)
  # remaining[b, i, j]: completion j is still unchosen when completion i is chosen.
  remaining = real[:, None, :] & (ranks[:, None, :] >= ranks[:, :, None])  # [B, K, K]
  log_normalizer = jax.nn.logsumexp(
      jnp.where(remaining, rewards[:, None, :], _MASKED_LOGIT), axis=-1)  # [B, K]
  # The last completion is chosen with probability 1; it is not a choice.
  is_choice = real & (jnp.sum(remaining, axis=-1) >= 2)  # [B, K]
  loss = _mean(log_normalizer - rewards, is_choice)
  metrics = {
      "loss": loss,
      **_preference_metrics(rewards, real, _best_worst_pairs(ranks, real),
                            _ordered_pairs(ranks, real)),
  }
  return _value(loss), metrics


# ---------------------------------------------------------------------------------------------
# Stepwise


def stepwise_loss(
    logits: jax.Array,  # [B, T, C] float; class 1 = step correct, class 0 = step in error
    labels: jax.Array,  # [B, T] int32, IGNORE_INDEX where the token is not a step
    example_mask: jax.Array,  # [B] float32, 0 for filler sequences
) -> tuple[jax.Array, Metrics]:
  """Token cross-entropy over labelled steps, averaged over steps (not over sequences).

  Metrics treat the error class (label 0) as the one to find: ``recall_error`` and ``f1_error``
  are 0 for a model that calls every step correct, whatever its ``step_accuracy``;
  ``positive_rate`` is that model's accuracy. ``first_error_found`` is the share of sequences with
  an error step whose first predicted error is exactly their first labelled error.
  """
  if logits.shape[:2] != labels.shape or example_mask.shape != labels.shape[:1]:
    raise ValueError(
        f"stepwise batch shapes disagree: logits {logits.shape} must be [B, T, C] with labels"
        f" {labels.shape} [B, T] and example_mask {example_mask.shape} [B]")
  labelled = (labels != IGNORE_INDEX) & (example_mask[:, None] > 0)  # [B, T]
  logits = jnp.where(labelled[..., None], logits.astype(jnp.float32), 0.0)
  targets = jnp.where(labelled, labels, 0)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]  # [B, T]
  loss = _mean(nll, labelled)

  predicted = jnp.argmax(logits, axis=-1)  # [B, T]
  is_error, is_correct = labelled & (labels == 0), labelled & (labels == 1)
  said_error, said_correct = labelled & (predicted == 0), labelled & (predicted == 1)
  errors_found = _count(is_error & said_error)
  metrics = {
      "loss": loss,
      "step_accuracy": Ratio(_count(labelled & (predicted == labels)), _count(labelled)),
      "recall_correct": Ratio(_count(is_correct & said_correct), _count(is_correct)),
      "recall_error": Ratio(errors_found, _count(is_error)),
      # F1 = 2TP / (2TP + FP + FN) is a ratio of sums, so it aggregates exactly.
      "f1_error": Ratio(2 * errors_found, _count(is_error) + _count(said_error)),
      "first_error_found": _first_error_found(is_error, said_error),
      "positive_rate": Ratio(_count(is_correct), _count(labelled)),
  }
  return _value(loss), metrics


def _first_error_found(is_error, said_error) -> Ratio:
  length = is_error.shape[1]
  positions = jnp.arange(length)
  first_error = jnp.min(jnp.where(is_error, positions, length), axis=1)  # [B]
  first_said = jnp.min(jnp.where(said_error, positions, length), axis=1)  # [B]
  has_error = first_error < length
  return Ratio(_count(has_error & (first_said == first_error)), _count(has_error))


# ---------------------------------------------------------------------------------------------
# Which loss a reward type trains with


@dataclasses.dataclass(frozen=True)
class RewardSpec:
  """Which loss trains the model."""

  type: str = "bradley_terry"  # bradley_terry | ranking | stepwise
  ranking_loss: str = "plackett_luce"  # for type=ranking: plackett_luce | all_pairs
  center_rewards_coefficient: float = 0.0

  def __post_init__(self):
    if self.type not in REWARD_TYPES:
      raise ValueError(f"reward.type must be one of {', '.join(REWARD_TYPES)}; got {self.type!r}")
    if self.ranking_loss not in RANKING_LOSSES:
      raise ValueError(f"reward.ranking_loss must be one of {', '.join(RANKING_LOSSES)}; got {self.ranking_loss!r}")

  @property
  def loss_key(self) -> tuple[str, str | None]:
    """This spec's key in :data:`LOSSES`: ``ranking_loss`` matters to type ``ranking`` only."""
    return self.type, self.ranking_loss if self.type == "ranking" else None


# outputs (rewards [G, K] or logits [G, T, C]) and their batch -> (loss, metrics)
BatchLoss = Callable[[jax.Array, Batch], tuple[jax.Array, Metrics]]


def _bradley_terry(spec: RewardSpec, rewards, batch) -> tuple[jax.Array, Metrics]:
  return bradley_terry_loss(rewards, batch.ranks, batch.example_mask, batch.margin,
                            center_rewards_coefficient=spec.center_rewards_coefficient)


def _all_pairs(spec: RewardSpec, rewards, batch) -> tuple[jax.Array, Metrics]:
  return all_pairs_bradley_terry_loss(rewards, batch.ranks, batch.example_mask, batch.margin,
                                      center_rewards_coefficient=spec.center_rewards_coefficient)


def _plackett_luce(spec: RewardSpec, rewards, batch) -> tuple[jax.Array, Metrics]:
  del spec  # Plackett-Luce has no margin and no centering
  return plackett_luce_loss(rewards, batch.ranks, batch.example_mask)


def _stepwise(spec: RewardSpec, logits, batch) -> tuple[jax.Array, Metrics]:
  del spec
  return stepwise_loss(logits, batch.labels, batch.example_mask)


# RewardSpec.loss_key -> fn(spec, outputs, batch) -> (loss, metrics)
LOSSES: dict[tuple[str, str | None], Callable[..., tuple[jax.Array, Metrics]]] = {
    ("bradley_terry", None): _bradley_terry,
    ("ranking", "plackett_luce"): _plackett_luce,
    ("ranking", "all_pairs"): _all_pairs,
    ("stepwise", None): _stepwise,
}


def batch_loss(spec: RewardSpec) -> BatchLoss:
  """``loss(outputs, batch) -> (loss, metrics)`` of the loss ``spec`` trains with.

  ``outputs`` is what ``batch.outputs(model)`` returns; packed and unpacked batches alike.
  """
  return functools.partial(LOSSES[spec.loss_key], spec)
