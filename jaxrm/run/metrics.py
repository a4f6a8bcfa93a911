"""Metrics kept as sums and counts and finalised once, so aggregation over micro-batches, devices
and hosts is exact.

A loss returns its metrics as a :data:`Metrics` dict of :class:`Ratio`, :class:`Moments`,
:class:`Correlation`, :class:`Calibration`, :class:`Samples` and :class:`Scores`. :func:`accumulate` adds two of them (micro-batches of
one step, or every batch of a validation set) and :func:`finalize_metrics` divides once at the
end. A validation loss is therefore the mean over the whole set, not a mean of batch means, and
filler groups that pad the last batch change nothing. Rank correlations and same-prompt pairs need
every example of a set at once: :class:`Samples` (and :class:`Scores`, for AUROC) keeps them
whole and :func:`accumulate` concatenates them.
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


class Ratio(NamedTuple):
  """A metric kept as ``total / count`` until :func:`finalize_metrics`."""

  total: jax.Array  # [] float32
  count: jax.Array  # [] float32


class Moments(NamedTuple):
  """A quantity's sum, sum of squares and count; finalizes to ``<name>_mean`` and ``<name>_std``,
  and with its smallest and largest values (``low``, ``high``: +inf and -inf for none counted,
  reduced by min and max) to ``<name>_min`` and ``<name>_max`` too."""

  total: jax.Array  # [] float32
  total_sq: jax.Array  # [] float32
  count: jax.Array  # [] float32
  low: jax.Array | None = None  # [] float32
  high: jax.Array | None = None  # [] float32


class Correlation(NamedTuple):
  """Sums of two paired quantities x and y over ``count`` pairs; finalizes to Pearson's r."""

  count: jax.Array  # [] float32
  sum_x: jax.Array
  sum_y: jax.Array
  sum_xx: jax.Array
  sum_yy: jax.Array
  sum_xy: jax.Array


class Calibration(NamedTuple):
  """Per-bin counts and sums of a predicted probability and of its 0/1 label, over equal-width
  bins of the probability; finalizes to the expected calibration error,
  ``sum_b |sum_y - sum_p| / count`` (each bin's gap weighted by its share)."""

  count: jax.Array  # [bins] float32
  sum_p: jax.Array  # [bins] float32
  sum_y: jax.Array  # [bins] float32


@struct.dataclass
class Scores:
  """Every example's score and 0/1 label, kept whole (:func:`accumulate` concatenates them);
  finalizes to ``auroc``: the chance that a positive scores above a negative (ties count half;
  NaN without both)."""

  scores: jax.Array  # [N] float32
  labels: jax.Array  # [N] float32
  real: jax.Array  # [N] bool


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


Metrics = dict[str, Ratio | Moments | Correlation | Calibration | Samples | Scores]
_WHOLE = (Samples, Scores)  # kept whole: concatenated, not added


def accumulate(a: Metrics, b: Metrics) -> Metrics:
  """Combines the metrics of two batches (device arrays or host numpy alike)."""
  return {name: _combined(a[name], b[name]) for name in a}


def empty(shapes: Metrics) -> Metrics:
  """Metrics of nothing, shaped as ``shapes`` (``jax.eval_shape`` of a loss's): what
  :func:`accumulate` starts from -- zero sums, and extremes that any value replaces."""

  def of(shape):
    if isinstance(shape, Moments) and shape.low is not None:
      zeros = [jnp.zeros(s.shape, s.dtype) for s in shape[:3]]
      return Moments(*zeros, jnp.full(shape.low.shape, jnp.inf), jnp.full(shape.high.shape, -jnp.inf))
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape)

  return {name: of(shape) for name, shape in shapes.items()}


def _combined(a, b):
  if isinstance(a, _WHOLE):
    return _concatenate(a, b)
  if isinstance(a, Moments) and a.low is not None:
    xp = np if isinstance(a.low, np.ndarray | np.generic) else jnp
    sums = jax.tree.map(operator.add, a[:3], b[:3])
    return Moments(*sums, xp.minimum(a.low, b.low), xp.maximum(a.high, b.high))
  return jax.tree.map(operator.add, a, b)


def _concatenate(a: Samples | Scores, b: Samples | Scores) -> Samples | Scores:
  xp = np if isinstance(jax.tree.leaves(a)[0], np.ndarray) else jnp
  return jax.tree.map(lambda x, y: xp.concatenate([x, y]), a, b)


def finalize_metrics(metrics: Metrics) -> dict[str, float]:
  """Turns accumulated sums into values; a metric with nothing counted is NaN.

  ``reward_std`` is the population standard deviation over every real completion seen.
  """
  out = {}
  for name, acc in jax.device_get(metrics).items():
    if isinstance(acc, Samples):
      out.update(_ranked_metrics(acc))
    elif isinstance(acc, Scores):
      out["auroc"] = _auroc(np.asarray(acc.scores), np.asarray(acc.labels), np.asarray(acc.real, bool))
    elif isinstance(acc, Calibration):
      count = float(np.sum(acc.count, dtype=np.float64))
      gaps = np.abs(np.asarray(acc.sum_y, np.float64) - np.asarray(acc.sum_p, np.float64))
      out[name] = float(gaps.sum() / count) if count > 0 else math.nan
    elif isinstance(acc, Correlation):
      out[name] = _pearson(*(np.asarray(x, np.float64) for x in acc))
    elif isinstance(acc, Moments):
      mean = _divide(acc.total, acc.count)
      variance = _divide(acc.total_sq, acc.count) - mean * mean
      out[f"{name}_mean"] = mean
      # The float32 sums can make a zero variance come out slightly negative; NaN stays NaN.
      out[f"{name}_std"] = math.sqrt(max(variance, 0.0))
      if acc.low is not None:
        counted = float(acc.count) > 0
        out[f"{name}_min"] = float(acc.low) if counted else math.nan
        out[f"{name}_max"] = float(acc.high) if counted else math.nan
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
  out["pairwise_accuracy"] = _pair_accuracy(
    predictions, labels, rated, np.asarray(s.group), np.asarray(s.combination, np.float64)
  )
  return out


def _auroc(scores: np.ndarray, labels: np.ndarray, real: np.ndarray) -> float:
  """Mann-Whitney's U over the real examples, from ranks (tied scores share their mean rank)."""
  scores, positive = scores[real], labels[real] > 0.5
  n_pos, n_neg = int(positive.sum()), int((~positive).sum())
  if not n_pos or not n_neg:
    return math.nan
  ranks = _ranks(scores)  # 0-based
  return float((ranks[positive].sum() - n_pos * (n_pos - 1) / 2) / (n_pos * n_neg))


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


# NeMo RL writes a checkpoint metric as "val:<name>"; these prefixes are accepted and dropped.
METRIC_PREFIXES = ("val:", "val/", "validation/")


def normalize_metric_name(name: str | None) -> str | None:
  """Accepts NeMo RL's ``val:validation-default_loss`` form as well as ``validation-default_loss``."""
  if not name:
    return None
  for prefix in METRIC_PREFIXES:
    if name.startswith(prefix):
      name = name[len(prefix) :]
  return name
