"""Reward-model losses: Bradley-Terry, Plackett-Luce ranking, stepwise cross-entropy and
regression on rated attributes.

Each loss is a pure function of one batch's arrays that returns ``(loss, metrics)``;
:data:`LOSSES` says which one each reward type trains with, and :func:`batch_loss` gives it as a
function of the model's outputs and the batch.

The metrics hold sums and counts, not means, so that batches combine exactly: :func:`accumulate`
adds two of them (micro-batches of one step, or every batch of a validation set) and
:func:`finalize_metrics` divides once at the end. A validation loss is therefore the mean over the
whole set, not a mean of batch means, and filler groups that pad the last batch change nothing.
Rank correlations and same-prompt pairs need every example of a set at once: :class:`Samples`
keeps them whole (validation only; ``batch_loss(spec, samples=True)``), and :func:`accumulate`
concatenates them.

``metrics["loss"].total`` is differentiable. To average over a global batch split into
micro-batches with different numbers of real pairs, differentiate ``metrics["loss"].total`` divided
by the global count instead of averaging the per-micro-batch ``loss``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import re
from collections.abc import Mapping, Sequence
from typing import Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrm.batches import IGNORE_INDEX, Batch

REWARD_TYPES = ("bradley_terry", "ranking", "stepwise", "regression")
RANKING_LOSSES = ("plackett_luce", "all_pairs")
# Attribute names stand in metric names such as ``validation-default_mse_helpfulness``.
_ATTRIBUTE_NAME = re.compile(r"[A-Za-z0-9_.-]+")

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


class Correlation(NamedTuple):
  """Sums of two paired quantities x and y over ``count`` pairs; finalizes to Pearson's r."""

  count: jax.Array  # [] float32
  sum_x: jax.Array
  sum_y: jax.Array
  sum_xx: jax.Array
  sum_yy: jax.Array
  sum_xy: jax.Array


@struct.dataclass
class Samples:
  """Every example's predictions and ratings, kept whole: :func:`accumulate` concatenates them.

  Finalizes to ``spearman_<attribute>`` (ranks over the whole set, ties sharing their mean rank)
  and ``pairwise_accuracy``: over every two responses to one prompt (same ``group``) whose
  ``combination`` of ratings differs, the share whose combined predictions order them alike (a
  tie in prediction counts as wrong; NaN when the set has no such pair).
  """

  predictions: jax.Array  # [N, A] float32
  labels: jax.Array  # [N, A] float32
  rated: jax.Array  # [N, A] bool: a real example's rated attribute
  group: jax.Array  # [N] int32: examples with one prompt share it
  attributes: tuple[str, ...] = struct.field(pytree_node=False, default=())
  combination: tuple[float, ...] = struct.field(pytree_node=False, default=())


Metrics = dict[str, Union[Ratio, Moments, Correlation, Samples]]


def accumulate(a: Metrics, b: Metrics) -> Metrics:
  """Combines the metrics of two batches (device arrays or host numpy alike)."""
  return {name: _concatenate(a[name], b[name]) if isinstance(a[name], Samples)
          else jax.tree.map(operator.add, a[name], b[name]) for name in a}


def _concatenate(a: Samples, b: Samples) -> Samples:
  xp = np if isinstance(a.group, np.ndarray) else jnp
  return jax.tree.map(lambda x, y: xp.concatenate([x, y]), a, b)


def finalize_metrics(metrics: Metrics) -> dict[str, float]:
  """Turns accumulated sums into values; a metric with nothing counted is NaN.

  ``reward_std`` is the population standard deviation over every real completion seen.
  """
  out = {}
  for name, acc in jax.device_get(metrics).items():
    if isinstance(acc, Samples):
      out.update(_ranked_metrics(acc))
    elif isinstance(acc, Correlation):
      out[name] = _pearson(*(np.asarray(x, np.float64) for x in acc))
    elif isinstance(acc, Moments):
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


def _pearson(n, sx, sy, sxx, syy, sxy) -> float:
  """Pearson's r from sums; NaN for fewer than two pairs or a constant quantity."""
  if n < 2:
    return math.nan
  cov, var_x, var_y = sxy - sx * sy / n, sxx - sx * sx / n, syy - sy * sy / n
  # A constant quantity's variance comes out of float32 sums as rounding error, a few 1e-7 of
  # the sum of squares per thousand terms; below 1e-5 of it r would be noise.
  if var_x <= 1e-5 * sxx or var_y <= 1e-5 * syy or var_x <= 0 or var_y <= 0:
    return math.nan
  return float(np.clip(cov / math.sqrt(var_x * var_y), -1.0, 1.0))


def _ranks(x: np.ndarray) -> np.ndarray:
  """Ranks 0..n-1 of ``x``; tied values share their mean rank."""
  order = np.argsort(x, kind="stable")
  ranks = np.empty(len(x), np.float64)
  ranks[order] = np.arange(len(x))
  _, tie, counts = np.unique(x, return_inverse=True, return_counts=True)
  return (np.bincount(tie, ranks) / counts)[tie]


def _correlation_of(x: np.ndarray, y: np.ndarray) -> float:
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  return _pearson(len(x), x.sum(), y.sum(), (x * x).sum(), (y * y).sum(), (x * y).sum())


def _ranked_metrics(s: Samples) -> dict[str, float]:
  predictions, labels, rated = (np.asarray(x) for x in (s.predictions, s.labels, s.rated))
  out = {}
  for a, name in enumerate(s.attributes):
    keep = rated[:, a]
    out[f"spearman_{name}"] = _correlation_of(_ranks(predictions[keep, a]), _ranks(labels[keep, a]))
  out["pairwise_accuracy"] = _pair_accuracy(predictions, labels, rated, np.asarray(s.group),
                                            np.asarray(s.combination, np.float64))
  return out


def _pair_accuracy(predictions, labels, rated, group, combination) -> float:
  """Accuracy of combined predictions over same-group pairs whose combined ratings differ."""
  used = combination != 0
  keep = rated[:, used].all(axis=1)
  score = predictions[keep].astype(np.float64) @ combination
  target = labels[keep].astype(np.float64) @ combination
  group = group[keep]
  right = total = 0
  for g in np.unique(group):
    members = group == g
    ds = score[members][:, None] - score[members][None, :]  # [n, n]
    dt = target[members][:, None] - target[members][None, :]
    pairs = dt > 0  # each differing pair once, better response first
    right += int(np.sum(pairs & (ds > 0)))
    total += int(np.sum(pairs))
  return right / total if total else math.nan


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
    weight: jax.Array | None = None,  # [B] float32
) -> tuple[jax.Array, Metrics]:
  """Mean over groups of ``-log sigmoid(r_best - r_worst - margin)``: one pair per group with two
  or more real completions, its best against its worst.

  ``center_rewards_coefficient`` adds ``coef * mean((r_best + r_worst) ** 2)``, which keeps
  rewards near 0. ``weight`` multiplies each group's ``-log sigmoid`` term (HelpSteer2-Preference's
  scaled Bradley-Terry: the annotated preference strength); the mean stays over groups.
  ``pairwise_accuracy`` is over every ordered pair of real completions.
  """
  return _pairwise_loss(rewards, ranks, example_mask, margin, center_rewards_coefficient, all_pairs=False,
                        weight=weight)


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
                   all_pairs: bool, weight=None) -> tuple[jax.Array, Metrics]:
  rewards, real = _real_completions(rewards, ranks, example_mask)
  best_worst, ordered = _best_worst_pairs(ranks, real), _ordered_pairs(ranks, real)
  loss = _pair_loss(rewards, margin, ordered if all_pairs else best_worst, center_rewards_coefficient,
                    weight)
  return _value(loss), {"loss": loss, **_preference_metrics(rewards, real, best_worst, ordered)}


def _pair_loss(rewards, margin, pairs, center_rewards_coefficient: float, weight=None) -> Ratio:
  """Sum and count of ``-weight * log sigmoid(r_i - r_j - margin) + coef * (r_i + r_j) ** 2``
  over ``pairs[b, i, j]`` (``[B, K, K]``: completion i preferred to j)."""
  margin = jnp.zeros(rewards.shape[:1]) if margin is None else margin.astype(jnp.float32)
  weight = jnp.ones(rewards.shape[:1]) if weight is None else weight.astype(jnp.float32)
  chosen = rewards[:, :, None]  # [B, K, 1]
  rejected = rewards[:, None, :]  # [B, 1, K]
  per_pair = (-weight[:, None, None] * jax.nn.log_sigmoid(chosen - rejected - margin[:, None, None])
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
  if predictions.shape != labels.shape or label_mask.shape != labels.shape or (
      example_mask.shape != labels.shape[:1] or labels.shape[1] != len(attributes)):
    raise ValueError(
        f"regression batch shapes disagree: predictions {predictions.shape}, labels {labels.shape} and"
        f" label_mask {label_mask.shape} must all be [B, A] with A = {len(attributes)} attributes,"
        f" example_mask {example_mask.shape} [B]")
  rated = (label_mask > 0) & (example_mask[:, None] > 0)  # [B, A]
  # Zeroing keeps a NaN computed for a filler row out of every sum below.
  p = jnp.where(rated, predictions.astype(jnp.float32), 0.0)
  y = jnp.where(rated, labels.astype(jnp.float32), 0.0)
  sq = (p - y) ** 2
  w = jnp.broadcast_to(jnp.asarray(weights if weights is not None else [1.0] * len(attributes),
                                   jnp.float32), rated.shape)
  loss = Ratio(_masked_sum(w * sq, rated), _masked_sum(w, rated))
  metrics: Metrics = {"loss": loss, "mse": _mean(sq, rated)}
  for a, name in enumerate(attributes):
    r = rated[:, a]
    metrics[f"mse_{name}"] = _mean(sq[:, a], r)
    metrics[f"mae_{name}"] = _mean(jnp.abs(p[:, a] - y[:, a]), r)
    metrics[f"pearson_{name}"] = Correlation(_count(r), *(_masked_sum(v, r) for v in (
        p[:, a], y[:, a], p[:, a] ** 2, y[:, a] ** 2, p[:, a] * y[:, a])))
  return _value(loss), metrics


def regression_samples(predictions, labels, label_mask, example_mask, group, *,
                       attributes: Sequence[str], combination: Sequence[float]) -> Samples:
  """The :class:`Samples` of one regression batch (arrays as :func:`regression_loss` takes)."""
  rated = (label_mask > 0) & (example_mask[:, None] > 0)
  return Samples(predictions=jnp.where(rated, predictions.astype(jnp.float32), 0.0),
                 labels=jnp.where(rated, labels.astype(jnp.float32), 0.0), rated=rated,
                 group=group.astype(jnp.int32), attributes=tuple(attributes),
                 combination=tuple(float(c) for c in combination))


def combination_weights(combine: str | Mapping[str, float] | Sequence[float],
                        attributes: Sequence[str], where: str = "combine") -> tuple[float, ...]:
  """One weight per attribute of a combination of them.

  ``combine`` is an attribute's name (``"helpfulness"``), ``"name=weight,..."`` (attributes left
  out weigh 0), a mapping of names to weights, or one weight per attribute.
  """
  if isinstance(combine, str):
    entries = [e.strip() for e in combine.split(",") if e.strip()]
    if not entries:
      raise ValueError(f"{where} is empty; name an attribute (one of {', '.join(attributes)}) or give "
                       "name=weight pairs")
    combine = dict(_weight_entry(e, where) for e in entries)
  if isinstance(combine, Mapping):
    unknown = sorted(set(combine) - set(attributes))
    if unknown:
      raise ValueError(f"{where} names {', '.join(map(repr, unknown))}, not among the model's attributes "
                       f"{', '.join(attributes)}")
    weights = tuple(float(combine.get(a, 0.0)) for a in attributes)
  else:
    weights = tuple(float(w) for w in combine)
    if len(weights) != len(attributes):
      raise ValueError(f"{where} has {len(weights)} weights for {len(attributes)} attributes "
                       f"({', '.join(attributes)}); give one per attribute")
  if not all(math.isfinite(w) for w in weights) or not any(weights):
    raise ValueError(f"{where}={combine!r}: weights must be finite and not all 0")
  return weights


def _weight_entry(entry: str, where: str) -> tuple[str, float]:
  name, _, weight = entry.partition("=")
  try:
    return name.strip(), float(weight) if weight else 1.0
  except ValueError:
    raise ValueError(f"{where}: {entry!r} is not 'name' or 'name=weight' (weight a number)") from None


# ---------------------------------------------------------------------------------------------
# Which loss a reward type trains with


@dataclasses.dataclass(frozen=True)
class RewardSpec:
  """Which loss trains the model."""

  type: str = "bradley_terry"  # bradley_terry | ranking | stepwise | regression
  ranking_loss: str = "plackett_luce"  # for type=ranking: plackett_luce | all_pairs
  center_rewards_coefficient: float = 0.0
  # bradley_terry: weight each pair's loss by its annotated preference strength (scaled BT)
  preference_strength_scaling: bool = False
  # regression: the rated attributes, comma-separated, in the order of the head's outputs
  attributes: str = ""
  # regression: each attribute's weight in the loss, comma-separated ("": all 1)
  attribute_weights: str = ""
  # regression: "low,high"; a rating outside is refused ("": any finite number)
  attribute_range: str = ""
  # regression: what validation's pairwise_accuracy ranks by: an attribute, or
  # "name=weight,..." ("": the first attribute)
  combine: str = ""

  def __post_init__(self):
    if self.type not in REWARD_TYPES:
      raise ValueError(f"reward.type must be one of {', '.join(REWARD_TYPES)}; got {self.type!r}")
    if self.ranking_loss not in RANKING_LOSSES:
      raise ValueError(f"reward.ranking_loss must be one of {', '.join(RANKING_LOSSES)}; got {self.ranking_loss!r}")
    if self.preference_strength_scaling and self.type != "bradley_terry":
      raise ValueError(f"reward.preference_strength_scaling applies to reward.type='bradley_terry', not "
                       f"{self.type!r}")
    if self.type == "regression":
      # Each property refuses a bad value of its key (attributes through all three).
      _ = self.weights, self.value_range, self.combination

  @property
  def attribute_names(self) -> tuple[str, ...]:
    """``attributes`` as a tuple; refused when empty, repeated or unfit for metric names."""
    names = tuple(a.strip() for a in self.attributes.split(",") if a.strip())
    if not names:
      raise ValueError("reward.attributes is empty: reward.type='regression' needs the rated attributes, "
                       "e.g. reward.attributes='helpfulness,correctness,coherence,complexity,verbosity'")
    for name in names:
      if not _ATTRIBUTE_NAME.fullmatch(name):
        raise ValueError(f"reward.attributes: {name!r} cannot stand in metric names; use letters, digits, "
                         "'_', '-' and '.'")
    if len(set(names)) < len(names):
      raise ValueError(f"reward.attributes={self.attributes!r} names an attribute twice")
    return names

  @property
  def weights(self) -> tuple[float, ...]:
    """One loss weight per attribute."""
    names = self.attribute_names
    if not self.attribute_weights.strip():
      return (1.0,) * len(names)
    try:
      weights = tuple(float(w) for w in self.attribute_weights.split(","))
    except ValueError:
      raise ValueError(f"reward.attribute_weights={self.attribute_weights!r}: give comma-separated numbers, "
                       f"one per attribute ({', '.join(names)})") from None
    if len(weights) != len(names):
      raise ValueError(f"reward.attribute_weights has {len(weights)} weights for the {len(names)} attributes "
                       f"({', '.join(names)}); give one per attribute")
    if not all(math.isfinite(w) and w >= 0 for w in weights) or not any(weights):
      raise ValueError(f"reward.attribute_weights={self.attribute_weights!r}: weights must be >= 0, not all 0")
    return weights

  @property
  def value_range(self) -> tuple[float, float] | None:
    """``attribute_range`` as (low, high), or None."""
    if not self.attribute_range.strip():
      return None
    try:
      low, high = (float(x) for x in self.attribute_range.split(","))
    except ValueError:
      raise ValueError(f"reward.attribute_range={self.attribute_range!r}: give 'low,high', e.g. '0,4'") from None
    if not low < high:
      raise ValueError(f"reward.attribute_range={self.attribute_range!r}: low must be below high")
    return low, high

  @property
  def combination(self) -> tuple[float, ...]:
    """One weight per attribute: how validation's pairwise accuracy combines them."""
    names = self.attribute_names
    return combination_weights(self.combine or names[0], names, where="reward.combine")

  @property
  def loss_key(self) -> tuple[str, str | None]:
    """This spec's key in :data:`LOSSES`: ``ranking_loss`` matters to type ``ranking`` only."""
    return self.type, self.ranking_loss if self.type == "ranking" else None


# outputs (rewards [G, K] or logits [G, T, C]) and their batch -> (loss, metrics)
BatchLoss = Callable[[jax.Array, Batch], tuple[jax.Array, Metrics]]


def _bradley_terry(spec: RewardSpec, rewards, batch) -> tuple[jax.Array, Metrics]:
  weight = None
  if spec.preference_strength_scaling:
    if batch.strength is None:
      raise ValueError("reward.preference_strength_scaling needs the batch's per-group strength; this "
                       "batch has none")
    weight = batch.strength
  return bradley_terry_loss(rewards, batch.ranks, batch.example_mask, batch.margin, weight=weight,
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


def _regression(spec: RewardSpec, predictions, batch) -> tuple[jax.Array, Metrics]:
  return regression_loss(predictions, batch.labels, batch.label_mask, batch.example_mask,
                         attributes=spec.attribute_names, weights=spec.weights)


# RewardSpec.loss_key -> fn(spec, outputs, batch) -> (loss, metrics)
LOSSES: dict[tuple[str, str | None], Callable[..., tuple[jax.Array, Metrics]]] = {
    ("bradley_terry", None): _bradley_terry,
    ("ranking", "plackett_luce"): _plackett_luce,
    ("ranking", "all_pairs"): _all_pairs,
    ("stepwise", None): _stepwise,
    ("regression", None): _regression,
}


def _regression_samples(spec: RewardSpec, predictions, batch) -> Metrics:
  return {"samples": regression_samples(predictions, batch.labels, batch.label_mask, batch.example_mask,
                                        batch.group, attributes=spec.attribute_names,
                                        combination=spec.combination)}


# RewardSpec.loss_key -> fn(spec, outputs, batch) -> metrics that need the whole set (Samples)
SAMPLES: dict[tuple[str, str | None], Callable[..., Metrics]] = {
    ("regression", None): _regression_samples,
}


def batch_loss(spec: RewardSpec, *, samples: bool = False) -> BatchLoss:
  """``loss(outputs, batch) -> (loss, metrics)`` of the loss ``spec`` trains with.

  ``outputs`` is what ``batch.outputs(model)`` returns; packed and unpacked batches alike. With
  ``samples`` (validation), metrics also hold the :class:`Samples` the reward type ranks by, if
  any; they are concatenated, not summed, so they stay out of the train step.
  """
  loss = functools.partial(LOSSES[spec.loss_key], spec)
  extra = SAMPLES.get(spec.loss_key) if samples else None
  if extra is None:
    return loss

  def with_samples(outputs, batch):
    value, metrics = loss(outputs, batch)
    return value, {**metrics, **extra(spec, outputs, batch)}

  return with_samples
