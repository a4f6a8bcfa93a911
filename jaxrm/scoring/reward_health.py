"""The reward's health during RL: one definition of each signal, shared by every place that reports it.

A reward model being gamed by its policy shows it in its rewards before it shows it anywhere else:
they drift up and bunch together, they grow with the completion's length, they leave the range the
model gave on its validation set. :func:`batch_health` measures that on one batch of rewards;
TRL's ``log_metric`` (:mod:`jaxrm.scoring.reward_funcs`), OpenRLHF's ``extra_logs`` and the server's
``/metrics`` (:mod:`jaxrm.server`) all report its values, under these names:

* ``reward_mean``, ``reward_std``: the batch's mean and (population) standard deviation. A mean that
  keeps rising while the policy's real quality does not is the classic sign of reward hacking; a
  std shrinking towards 0 means the rewards no longer tell completions apart (GRPO's advantages
  vanish).
* ``reward_length_corr``: Pearson's r between reward and completion length (tokens where the
  loop gives them, else characters). A model that learned "longer is better" drives the policy to
  pad its answers: a correlation climbing towards 1 during training is length hacking. Left out
  for a batch with fewer than two lengths or rewards that do not vary.
* ``reward_out_of_range``: the share of rewards outside [min, max] of the model's rewards at its
  last validation (recorded in the run, ``reward_stats``). A policy finding inputs the model never
  saw pushes rewards out of that range; more than a few percent means the rewards are extrapolated.
  Left out when the model has no recorded range.
* ``truncated``: the share of inputs cut to fit before scoring (on the server: as their requests
  asked; an over-long input is otherwise refused). A cut input is scored without its start; a
  rising share means completions are outgrowing the length the loop allows them.
* A regression model's mean of each attribute: ``reward_mean`` of each attribute's reward
  function (:func:`jaxrm.scoring.reward_funcs.as_reward_funcs`), before the loop weighs them into one
  reward: which attribute the policy is pushing.

None and NaN rewards (a process reward model's completion with no steps) are left out of every
value.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from jaxrm import tasks

MEAN, STD, LENGTH_CORR = "reward_mean", "reward_std", "reward_length_corr"
OUT_OF_RANGE, TRUNCATED = "reward_out_of_range", "truncated"
NAMES = (MEAN, STD, LENGTH_CORR, OUT_OF_RANGE, TRUNCATED)

Range = tuple[float, float]


def out_of_range(rewards: Sequence[float], reward_range: Range) -> np.ndarray:
  """Whether each reward lies outside ``reward_range`` (low, high), bool [N]."""
  r = np.asarray(rewards, np.float64)
  low, high = reward_range
  return (r < low) | (r > high)


def batch_health(
  rewards: Sequence[float | None],
  lengths: Sequence[int] | None = None,
  *,
  reward_range: Range | None = None,
  truncated: Sequence[bool] | None = None,
) -> dict[str, float]:
  """The health signals of one batch (see the module docstring); empty for a batch of no reward.

  Args:
    rewards: one per completion; None or NaN for no reward.
    lengths: each completion's length, in the same order.
    reward_range: (min, max) of the rewards at validation.
    truncated: whether each input was cut to fit max_length.
  """
  r = np.array([math.nan if x is None else x for x in rewards], np.float64)
  real = np.isfinite(r)
  if not real.any():
    return {}
  out = {MEAN: float(r[real].mean()), STD: float(r[real].std())}
  if lengths is not None:
    corr = _pearson(np.asarray(lengths, np.float64)[real], r[real])
    if corr is not None:
      out[LENGTH_CORR] = corr
  if reward_range is not None:
    out[OUT_OF_RANGE] = float(out_of_range(r[real], reward_range).mean())
  if truncated is not None:
    out[TRUNCATED] = float(np.mean(np.asarray(truncated, bool)))
  return out


def _pearson(x: np.ndarray, y: np.ndarray) -> float | None:
  """Pearson's r, or None where it is undefined (under two pairs, or x or y constant)."""
  if len(x) < 2:
    return None
  dx, dy = x - x.mean(), y - y.mean()
  scale = math.sqrt(float((dx * dx).sum() * (dy * dy).sum()))
  return float((dx * dy).sum() / scale) if scale > 0 else None


def validation_range(rm, *, normalize: bool = False) -> Range | None:
  """(min, max) of ``rm``'s rewards at its last validation, normalized as the served rewards are
  if ``normalize``; None where the run recorded none, or for a regression model (whose served
  reward combines several outputs)."""
  stats = getattr(rm, "reward_stats", None) or {}
  if "min" not in stats or "max" not in stats or tasks.scores_of(getattr(rm, "kind", None)) == "attributes":
    return None
  low, high = float(stats["min"]), float(stats["max"])
  if normalize:
    mean, std = float(stats["mean"]), float(stats["std"])
    low, high = (low - mean) / std, (high - mean) / std
  return low, high


class Window:
  """The last ``size`` rewards scored, with their lengths: the batch of a server, whose clients send
  one completion per request (OpenRLHF, slime, verl) or a few."""

  def __init__(self, size: int = 256, reward_range: Range | None = None):
    self.reward_range = reward_range
    self._items: deque[tuple[float, int, bool]] = deque(maxlen=size)

  def add(self, rewards: Sequence[float], lengths: Sequence[int], truncated: int = 0) -> dict[str, float]:
    """Adds one request's rewards, ``truncated`` of its inputs cut to fit; the window's health
    after it."""
    cut = [i < truncated for i in range(len(rewards))]  # which ones were cut does not matter here
    self._items.extend(zip(rewards, lengths, cut))
    if not self._items:
      return {}
    rewards, lengths, cut = zip(*self._items)
    return batch_health(rewards, lengths, reward_range=self.reward_range, truncated=cut)
