"""Reward-model losses: Bradley-Terry, Plackett-Luce ranking, stepwise cross-entropy, regression
on rated attributes, and a verifier's cross-entropy on labelled items.

Each loss is a pure function of one batch's arrays that returns ``(loss, metrics)``;
:mod:`jaxrm.tasks` says which one each reward type trains with, and :func:`jaxrm.tasks.batch_loss`
gives it as a function of the model's outputs and the batch.

The metrics hold sums and counts, not means (:mod:`jaxrm.run.metrics` adds and finalizes them), so
batches combine exactly. Rank correlations and same-prompt pairs need every example of a set at
once: validation asks for them with ``tasks.batch_loss(spec, samples=True)``.

``metrics["loss"].total`` is differentiable. To average over a global batch split into
micro-batches with different numbers of real pairs, differentiate ``metrics["loss"].total`` divided
by the global count instead of averaging the per-micro-batch ``loss``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp

from jaxrm.data.batches import IGNORE_INDEX, Batch
from jaxrm.run.metrics import Calibration, Correlation, Metrics, Moments, Ratio, Samples, Scores

# Stands in for -inf in masked logsumexp terms: exp() of it is exactly 0, yet, unlike -inf, it
# never makes a NaN in gradients of rows where every entry is masked.
_MASKED_LOGIT = -1e9


def _masked_sum(values: jax.Array, mask: jax.Array) -> jax.Array:
  return jnp.sum(jnp.where(mask, values, 0.0))


def _count(mask: jax.Array) -> jax.Array:
  return jnp.sum(mask, dtype=jnp.float32)


def _moments(values: jax.Array, mask: jax.Array) -> Moments:
  """The masked values' moments and extremes: validation records the reward range a policy is
  later watched against (jaxrm.scoring.reward_health)."""
  low, high = jnp.min(jnp.where(mask, values, jnp.inf)), jnp.max(jnp.where(mask, values, -jnp.inf))
  return Moments(_masked_sum(values, mask), _masked_sum(values * values, mask), _count(mask), low, high)


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
      f" both be [B, K], example_mask {example_mask.shape} must be [B]"
    )
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
  return (
    has_pair[:, None, None]
    & (slots[None, :, None] == best[:, None, None])
    & (slots[None, None, :] == worst[:, None, None])
  )


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
    "reward": _moments(rewards, real),
  }


def bradley_terry_loss(
  rewards: jax.Array,  # [B, K] float
  ranks: jax.Array,  # [B, K] int32, distinct per group, lower preferred, -1 absent
  example_mask: jax.Array,  # [B] float32, 0 for filler groups
  margin: jax.Array | None = None,  # [B] float32
  *,
  center_rewards_coefficient: float = 0.0,
  weight: jax.Array | None = None,  # [B] float32
) -> tuple[jax.Array, Metrics]:
  """Mean over groups of ``-log sigmoid(r_best - r_worst - margin)``: one pair per group with two
  or more real completions, its best against its worst.

  ``center_rewards_coefficient`` adds ``coef * mean((r_best + r_worst) ** 2)``, which keeps
  rewards near 0. ``weight`` multiplies each group's ``-log sigmoid`` term (HelpSteer2-Preference's
  scaled Bradley-Terry: the annotated preference strength); the mean stays over groups.
  ``pairwise_accuracy`` is over every ordered pair of real completions.
  """
  return _pairwise_loss(
    rewards, ranks, example_mask, margin, center_rewards_coefficient, all_pairs=False, weight=weight
  )


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


def _pairwise_loss(
  rewards, ranks, example_mask, margin, center_rewards_coefficient: float, *, all_pairs: bool, weight=None
) -> tuple[jax.Array, Metrics]:
  rewards, real = _real_completions(rewards, ranks, example_mask)
  best_worst, ordered = _best_worst_pairs(ranks, real), _ordered_pairs(ranks, real)
  loss = _pair_loss(rewards, margin, ordered if all_pairs else best_worst, center_rewards_coefficient, weight)
  return _value(loss), {"loss": loss, **_preference_metrics(rewards, real, best_worst, ordered)}


def _pair_loss(rewards, margin, pairs, center_rewards_coefficient: float, weight=None) -> Ratio:
  """Sum and count of ``-weight * log sigmoid(r_i - r_j - margin) + coef * (r_i + r_j) ** 2``
  over ``pairs[b, i, j]`` (``[B, K, K]``: completion i preferred to j)."""
  margin = jnp.zeros(rewards.shape[:1]) if margin is None else margin.astype(jnp.float32)
  weight = jnp.ones(rewards.shape[:1]) if weight is None else weight.astype(jnp.float32)
  chosen = rewards[:, :, None]  # [B, K, 1]
  rejected = rewards[:, None, :]  # [B, 1, K]
  per_pair = (
    -weight[:, None, None] * jax.nn.log_sigmoid(chosen - rejected - margin[:, None, None])
    + center_rewards_coefficient * (chosen + rejected) ** 2
  )  # [B, K, K]
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
    jnp.where(remaining, rewards[:, None, :], _MASKED_LOGIT), axis=-1
  )  # [B, K]
  # The last completion is chosen with probability 1; it is not a choice.
  is_choice = real & (jnp.sum(remaining, axis=-1) >= 2)  # [B, K]
  loss = _mean(log_normalizer - rewards, is_choice)
  metrics = {
    "loss": loss,
    **_preference_metrics(rewards, real, _best_worst_pairs(ranks, real), _ordered_pairs(ranks, real)),
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
      f" {labels.shape} [B, T] and example_mask {example_mask.shape} [B]"
    )
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
# Regression on rated attributes


def regression_loss(
  predictions: jax.Array,  # [B, A] float: one output per attribute
  labels: jax.Array,  # [B, A] float32 ratings
  label_mask: jax.Array,  # [B, A] float32: 1 where the attribute is rated, 0 where it is missing
  example_mask: jax.Array,  # [B] float32, 0 for filler rows
  *,
  attributes: Sequence[str],
  weights: Sequence[float] | None = None,
) -> tuple[jax.Array, Metrics]:
  """Weighted mean squared error over the rated attributes: ``sum(w_a * (p - y) ** 2) / sum(w_a)``
  over every rated (row, attribute); a missing rating adds nothing to either sum.

  Metrics: ``mse`` (unweighted, over every rating), and per attribute ``mse_<a>``, ``mae_<a>``,
  ``pearson_<a>``.
  """
  if (
    predictions.shape != labels.shape
    or label_mask.shape != labels.shape
    or (example_mask.shape != labels.shape[:1] or labels.shape[1] != len(attributes))
  ):
    raise ValueError(
      f"regression batch shapes disagree: predictions {predictions.shape}, labels {labels.shape} and"
      f" label_mask {label_mask.shape} must all be [B, A] with A = {len(attributes)} attributes,"
      f" example_mask {example_mask.shape} [B]"
    )
  rated = (label_mask > 0) & (example_mask[:, None] > 0)  # [B, A]
  # Zeroing keeps a NaN computed for a filler row out of every sum below.
  p = jnp.where(rated, predictions.astype(jnp.float32), 0.0)
  y = jnp.where(rated, labels.astype(jnp.float32), 0.0)
  sq = (p - y) ** 2
  w = jnp.broadcast_to(
    jnp.asarray(weights if weights is not None else [1.0] * len(attributes), jnp.float32), rated.shape
  )
  loss = Ratio(_masked_sum(w * sq, rated), _masked_sum(w, rated))
  metrics: Metrics = {"loss": loss, "mse": _mean(sq, rated)}
  for a, name in enumerate(attributes):
    r = rated[:, a]
    metrics[f"mse_{name}"] = _mean(sq[:, a], r)
    metrics[f"mae_{name}"] = _mean(jnp.abs(p[:, a] - y[:, a]), r)
    metrics[f"pearson_{name}"] = Correlation(
      _count(r),
      *(_masked_sum(v, r) for v in (p[:, a], y[:, a], p[:, a] ** 2, y[:, a] ** 2, p[:, a] * y[:, a])),
    )
  return _value(loss), metrics


def regression_samples(
  predictions,
  labels,
  label_mask,
  example_mask,
  group,
  *,
  attributes: Sequence[str],
  combination: Sequence[float],
) -> Samples:
  """The :class:`Samples` of one regression batch (arrays as :func:`regression_loss` takes)."""
  rated = (label_mask > 0) & (example_mask[:, None] > 0)
  return Samples(
    predictions=jnp.where(rated, predictions.astype(jnp.float32), 0.0),
    labels=jnp.where(rated, labels.astype(jnp.float32), 0.0),
    rated=rated,
    group=group.astype(jnp.int32),
    attributes=tuple(attributes),
    combination=tuple(float(c) for c in combination),
  )


# ---------------------------------------------------------------------------------------------
# Labelled items (a verifier's unpaired data)

CALIBRATION_BINS = 10  # equal-width bins of P(good) (a verifier's P(yes)) for the expected calibration error


def labelled_loss(
  log_odds: jax.Array,  # [G] float: log p(yes) - log p(no)
  labels: jax.Array,  # [G] float32: 1 = good (the answer is yes), 0 = bad
  example_mask: jax.Array,  # [G] float32, 0 for filler rows
) -> tuple[jax.Array, Metrics]:
  """Cross-entropy over the two answers, ``-log sigmoid(+-log_odds)``, averaged over items.

  Metrics: ``accuracy`` (log-odds > 0 for good items, < 0 for bad; 0 counts as wrong),
  ``positive_rate`` (the share of good items: the accuracy of always answering yes), ``ece`` (the
  expected calibration error of P(yes) over :data:`CALIBRATION_BINS` equal-width bins) and the
  log-odds' mean and std (``reward``).
  """
  if log_odds.shape != labels.shape or example_mask.shape != labels.shape:
    raise ValueError(
      f"labelled batch shapes disagree: log_odds {log_odds.shape}, labels {labels.shape} and "
      f"example_mask {example_mask.shape} must all be [G]"
    )
  real = example_mask > 0
  s = jnp.where(real, log_odds.astype(jnp.float32), 0.0)
  y = jnp.where(real, labels.astype(jnp.float32), 0.0)
  nll = -(y * jax.nn.log_sigmoid(s) + (1.0 - y) * jax.nn.log_sigmoid(-s))
  loss = _mean(nll, real)
  good = y > 0.5
  right = real & jnp.where(good, s > 0, s < 0)
  p = jax.nn.sigmoid(s)
  bins = jnp.clip(jnp.floor(p * CALIBRATION_BINS), 0, CALIBRATION_BINS - 1).astype(jnp.int32)
  in_bin = real[:, None] & (bins[:, None] == jnp.arange(CALIBRATION_BINS)[None, :])  # [G, bins]
  metrics = {
    "loss": loss,
    "accuracy": Ratio(_count(right), _count(real)),
    "positive_rate": Ratio(_count(real & good), _count(real)),
    "ece": Calibration(
      jnp.sum(in_bin, axis=0, dtype=jnp.float32),
      jnp.sum(jnp.where(in_bin, p[:, None], 0.0), axis=0),
      jnp.sum(jnp.where(in_bin, y[:, None], 0.0), axis=0),
    ),
    "reward": _moments(s, real),
  }
  return _value(loss), metrics


# ---------------------------------------------------------------------------------------------
# The losses of a reward spec


class LossSpec(Protocol):
  """What the losses below read of a reward spec; :class:`jaxrm.config.RewardSpec` has it all.

  A shape, not an import: the config sits above the losses, and layers point one way.
  """

  loss_key: tuple[str, str | None]  # the spec's key in its task's losses (jaxrm.tasks)
  center_rewards_coefficient: float  # bradley_terry and ranking/all_pairs
  preference_strength_scaling: bool  # bradley_terry
  attribute_names: tuple[str, ...]  # regression, as are weights and combination
  weights: tuple[float, ...]
  combination: tuple[float, ...]


# outputs (rewards [G, K] or logits [G, T, C]) and their batch -> (loss, metrics)
BatchLoss = Callable[[jax.Array, Batch], tuple[jax.Array, Metrics]]
# What each task's table (jaxrm.tasks) holds: the losses of a reward spec, as functions of
# (spec, outputs, batch) -> (loss, metrics), and the metrics validation adds that need a whole set,
# (spec, outputs, batch) -> {"samples": Samples}.
SpecLoss = Callable[..., tuple[jax.Array, Metrics]]
SpecMetrics = Callable[..., Metrics]


def bradley_terry(spec: LossSpec, rewards, batch) -> tuple[jax.Array, Metrics]:
  weight = None
  if spec.preference_strength_scaling:
    if batch.strength is None:
      raise ValueError(
        "reward.preference_strength_scaling needs the batch's per-group strength; this batch has none"
      )
    weight = batch.strength
  return bradley_terry_loss(
    rewards,
    batch.ranks,
    batch.example_mask,
    batch.margin,
    weight=weight,
    center_rewards_coefficient=spec.center_rewards_coefficient,
  )


def all_pairs(spec: LossSpec, rewards, batch) -> tuple[jax.Array, Metrics]:
  return all_pairs_bradley_terry_loss(
    rewards,
    batch.ranks,
    batch.example_mask,
    batch.margin,
    center_rewards_coefficient=spec.center_rewards_coefficient,
  )


def plackett_luce(spec: LossSpec, rewards, batch) -> tuple[jax.Array, Metrics]:
  del spec  # Plackett-Luce has no margin and no centering
  return plackett_luce_loss(rewards, batch.ranks, batch.example_mask)


def stepwise(spec: LossSpec, logits, batch) -> tuple[jax.Array, Metrics]:
  del spec
  return stepwise_loss(logits, batch.labels, batch.example_mask)


def regression(spec: LossSpec, predictions, batch) -> tuple[jax.Array, Metrics]:
  return regression_loss(
    predictions,
    batch.labels,
    batch.label_mask,
    batch.example_mask,
    attributes=spec.attribute_names,
    weights=spec.weights,
  )


def labelled(spec: LossSpec, log_odds, batch) -> tuple[jax.Array, Metrics]:
  del spec  # the labels say it all
  return labelled_loss(log_odds, batch.labels, batch.example_mask)


def labelled_scores(spec: LossSpec, log_odds, batch) -> Metrics:
  """Validation's :class:`~jaxrm.run.metrics.Scores` of a labelled batch (``auroc``)."""
  del spec
  real = batch.example_mask > 0
  return {"samples": Scores(jnp.where(real, log_odds.astype(jnp.float32), 0.0), batch.labels, real)}


def regression_pair_samples(spec: LossSpec, predictions, batch) -> Metrics:
  return {
    "samples": regression_samples(
      predictions,
      batch.labels,
      batch.label_mask,
      batch.example_mask,
      batch.group,
      attributes=spec.attribute_names,
      combination=spec.combination,
    )
  }
