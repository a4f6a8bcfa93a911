"""The reward's health signals (jaxrm.scoring.reward_health), each against its definition in numpy."""

import math
import os

import numpy as np
import pytest

from jaxrm import RewardModel
from jaxrm.scoring import reward_health
from jaxrm.scoring.loading import ScoringInfo


def test_batch_health_by_its_definitions():
  rewards, lengths = [1.0, None, 3.0, math.nan, -2.0, 6.0], [10, 99, 30, 99, 5, 50]
  health = reward_health.batch_health(
    rewards, lengths, reward_range=(-1.0, 4.0), truncated=[False, False, True, False, False, True]
  )
  real = np.array([1.0, 3.0, -2.0, 6.0])  # None and NaN are no reward: left out
  assert health == {
    "reward_mean": pytest.approx(real.mean()),
    "reward_std": pytest.approx(real.std()),
    "reward_length_corr": pytest.approx(np.corrcoef(real, [10, 30, 5, 50])[0, 1]),
    "reward_out_of_range": 0.5,  # -2 and 6
    "truncated": pytest.approx(2 / 6),
  }


def test_what_cannot_be_measured_is_left_out():
  assert reward_health.batch_health([None, math.nan]) == {}
  # One reward, or lengths that do not vary: no correlation; no range, no share outside it.
  assert set(reward_health.batch_health([1.0], [3])) == {"reward_mean", "reward_std"}
  assert set(reward_health.batch_health([1.0, 2.0], [3, 3])) == {"reward_mean", "reward_std"}


def test_the_window_keeps_the_last_rewards():
  window = reward_health.Window(size=3, reward_range=(0.0, 1.0))
  window.add([5.0, 0.5], [1, 2], truncated=1)
  health = window.add([0.25, 0.75], [3, 4])  # 5.0 has left the window
  assert health["reward_mean"] == pytest.approx(0.5)
  assert health["reward_out_of_range"] == 0.0
  assert health["truncated"] == 0.0  # 5.0's request counted one cut; it has left too
  assert window.add([0.5], [5], truncated=1)["truncated"] == pytest.approx(1 / 3)
  assert health["reward_length_corr"] == pytest.approx(np.corrcoef([0.5, 0.25, 0.75], [2, 3, 4])[0, 1])


def test_validation_range_is_the_runs_normalized_as_served(tiny_rm):
  stats = {"mean": 1.0, "std": 2.0, "min": -3.0, "max": 5.0, "from": "validation-default"}
  rm = RewardModel(tiny_rm.model, tiny_rm.tokenizer, ScoringInfo(reward_stats=stats))
  assert reward_health.validation_range(rm) == (-3.0, 5.0)
  assert reward_health.validation_range(rm, normalize=True) == (-2.0, 2.0)
  # A run that recorded no range (before min and max were kept) has none.
  assert reward_health.validation_range(tiny_rm) is None


def test_extremes_accumulate_by_min_and_max():
  """The reward range that validation records: kept through micro-batches and batches (from
  metrics.empty, which any value replaces), NaN where nothing was counted."""
  import jax.numpy as jnp

  from jaxrm.run.metrics import Moments, accumulate, empty, finalize_metrics

  def batch(values, real):
    v, m = jnp.asarray(values), jnp.asarray(real)
    low, high = jnp.min(jnp.where(m, v, jnp.inf)), jnp.max(jnp.where(m, v, -jnp.inf))
    return {"reward": Moments(jnp.sum(v * m), jnp.sum(v * v * m), jnp.sum(m, dtype=jnp.float32), low, high)}

  a, b = batch([1.0, -9.0, 2.0], [True, False, True]), batch([0.5, 7.0], [True, True])
  total = accumulate(accumulate(empty(jax_shapes(a)), a), b)
  out = finalize_metrics(total)
  assert (out["reward_min"], out["reward_max"]) == (0.5, 7.0)
  none = finalize_metrics(empty(jax_shapes(a)))
  assert math.isnan(none["reward_min"]) and math.isnan(none["reward_max"])


def jax_shapes(metrics):
  import jax

  return jax.eval_shape(lambda: metrics)


def test_a_run_records_its_validation_range(baseline):
  rm = RewardModel.from_pretrained(baseline)
  stats = rm.reward_stats
  assert stats["min"] < stats["mean"] < stats["max"]
  assert reward_health.validation_range(rm) == (stats["min"], stats["max"])


def test_the_docs_page_names_every_signal_as_reported():
  from jaxrm.scoring import reward_funcs
  from jaxrm.server import formats

  with open(os.path.join(os.path.dirname(__file__), "..", "docs", "rl", "reward-health.md")) as f:
    page = f.read()
  for name in reward_health.NAMES:
    assert f"| `{name}` |" in page, name
  for prefix in (reward_funcs.HEALTH_PREFIX, formats.HEALTH_PREFIX, "jaxrm_"):
    assert f"`{prefix}" in page, prefix


def test_one_request_moves_the_servers_window_by_its_share_only():
  """A request of as many rows as the window holds adds HEALTH_SHARE of them, evenly spaced: the
  others' health is not replaced by one client's request."""
  from jaxrm.server.metrics import HEALTH_SHARE, HEALTH_WINDOW, Metrics

  metrics = Metrics()
  for _ in range(HEALTH_WINDOW):
    metrics.scored([0.0], [[1, 2]])
  health = metrics.scored([5.0] * HEALTH_WINDOW, [[1, 2]] * HEALTH_WINDOW, truncated=HEALTH_WINDOW)
  assert health["reward_mean"] == pytest.approx(5.0 * HEALTH_SHARE / HEALTH_WINDOW)
  assert health["truncated"] == pytest.approx(HEALTH_SHARE / HEALTH_WINDOW)
