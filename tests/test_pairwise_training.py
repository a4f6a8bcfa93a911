"""Training a pairwise judge (reward.type=pairwise): its rows, its runs, what it learns, what is
refused before a model loads; and the Bradley-Terry strengths and win rates its comparisons give."""

import math

import mpmath
import numpy as np
import pytest
import scipy.optimize

from jaxrm.tasks import pairwise

# ------------------------------------------------------------------ Bradley-Terry and win rates


def _soft_labels(d, compared):
  return np.where(compared, 1 / (1 + np.exp(-np.where(compared, d, 0.0))), 0.0)


def _nll(t, d, compared):
  """The negative log-likelihood of strengths ``t``, written from the definition: each ordered
  compared pair (i, j) adds ``-p_ij log sigmoid(t_i - t_j)``, so each unordered pair adds both of
  its soft labels' terms."""
  x = t[:, None] - t[None, :]
  return float(np.sum(_soft_labels(d, compared) * np.logaddexp(0.0, -x)))


def _nll_grad(t, d, compared):
  x = t[:, None] - t[None, :]
  return np.sum(np.where(compared, 1 / (1 + np.exp(-x)) - _soft_labels(d, compared), 0.0), 1)


def _scipy_strengths(d):
  d = np.asarray(d, np.float64)
  compared = ~np.isnan(d)
  np.fill_diagonal(compared, False)
  fit = scipy.optimize.minimize(
    _nll, np.zeros(len(d)), args=(d, compared), jac=_nll_grad, method="BFGS", options={"gtol": 1e-12}
  )
  return fit.x - fit.x.mean()


def _exact_newton_step(t, d):
  """The largest entry of a Newton step on the log-likelihood from ``t``, computed in 60-digit
  arithmetic: near 0 only at the maximum (the function is concave). Float64 cannot check this at
  log-odds of 30-40: there the gradient is ~1e-17, below the rounding of the terms it sums."""
  mpmath.mp.dps = 60
  n = len(t)
  sig = lambda x: 1 / (1 + mpmath.exp(-x))
  grad, hess = mpmath.zeros(n - 1, 1), mpmath.zeros(n - 1, n - 1)
  for i in range(n - 1):
    for j in range(n):
      if i == j or math.isnan(d[i][j]):
        continue
      x = mpmath.mpf(float(t[i])) - mpmath.mpf(float(t[j]))
      w = sig(x) * sig(-x)
      grad[i] += sig(mpmath.mpf(float(d[i][j]))) - sig(x)
      hess[i, i] += w
      if j < n - 1:
        hess[i, j] -= w
  return float(max(abs(s) for s in mpmath.lu_solve(hess, grad)))


def _antisymmetric(upper):
  d = np.triu(np.asarray(upper, np.float64), 1)
  return d - d.T


# Fixed matrices: moderate log-odds, some pairs near probability 0 or 1, and a circle (each
# response compared with the next only; NaN where not compared).
_RNG = np.random.default_rng(0)
_MODERATE = _antisymmetric(_RNG.normal(0, 3, (5, 5)))
_NEAR_0_AND_1 = _antisymmetric(np.where(_RNG.random((6, 6)) < 0.4, 35.0, _RNG.normal(0, 10, (6, 6))))
_NEAR_0_AND_1[0, 1], _NEAR_0_AND_1[1, 0] = -40.0, 40.0
_CIRCLE = np.full((5, 5), np.nan)
for _i, _x in enumerate(_RNG.normal(0, 2, 5)):
  _CIRCLE[_i, (_i + 1) % 5], _CIRCLE[(_i + 1) % 5, _i] = _x, -_x


@pytest.mark.parametrize("d", [_MODERATE, _NEAR_0_AND_1, _CIRCLE], ids=["moderate", "near_0_and_1", "circle"])
def test_bradley_terry_is_the_maximum_likelihood(d):
  t = pairwise.bradley_terry(d)
  assert abs(t.mean()) < 1e-12
  assert _exact_newton_step(t, d) < 1e-9
  if d is not _NEAR_0_AND_1:
    # scipy's BFGS stops at a gradient of ~1e-12, where the likelihood is flat to second order:
    # its strengths agree to ~1e-7. (At log-odds of 35-40 it stalls far from the maximum, its
    # float64 gradient lost in rounding; the exact Newton step above checks those.)
    np.testing.assert_allclose(t, _scipy_strengths(d), atol=1e-6, rtol=0)


@pytest.mark.parametrize("d01", [0.3, -5.0, 30.0, -40.0])
def test_bradley_terry_of_two_is_their_log_odds(d01):
  t = pairwise.bradley_terry(np.array([[0.0, d01], [-d01, 0.0]]))
  np.testing.assert_allclose(t, [d01 / 2, -d01 / 2], rtol=1e-12, atol=0)


def test_bradley_terry_of_consistent_log_odds_and_of_a_cycle():
  s = np.array([0.0, 30.0, -10.0, 2.5])  # differences up to 40: probabilities within 1e-17 of 0 or 1
  np.testing.assert_allclose(pairwise.bradley_terry(s[:, None] - s[None, :]), s - s.mean(), atol=1e-9, rtol=0)
  cycle = _antisymmetric([[0, 3.0, -3.0], [0, 0, 3.0], [0, 0, 0]])  # 0 > 1 > 2 > 0 alike: all equal
  np.testing.assert_allclose(pairwise.bradley_terry(cycle), np.zeros(3), atol=1e-12, rtol=0)


def test_bradley_terry_is_antisymmetric_and_follows_the_order():
  t = pairwise.bradley_terry(_NEAR_0_AND_1)
  np.testing.assert_allclose(pairwise.bradley_terry(-_NEAR_0_AND_1), -t, atol=1e-9, rtol=0)
  order = np.array([3, 0, 5, 1, 4, 2])
  np.testing.assert_allclose(
    pairwise.bradley_terry(_NEAR_0_AND_1[np.ix_(order, order)]), t[order], atol=1e-9, rtol=0
  )


@pytest.mark.parametrize(
  "d, message",
  [
    (np.array([[0, 1.0, np.nan], [-1, 0, np.nan], [np.nan, np.nan, 0]]), "never compared"),
    (
      np.array(
        [[0, 1.0, np.nan, np.nan], [-1, 0, np.nan, np.nan], [np.nan, np.nan, 0, 2], [np.nan, np.nan, -2, 0]]
      ),
      "never compared",
    ),
    (np.array([[0, np.inf], [-np.inf, 0]]), "infinite"),
    (np.array([[0, 1.0], [1.0, 0]]), "antisymmetric"),
    (np.array([[0, 1.0], [np.nan, 0]]), "antisymmetric"),  # a NaN on one side only
    (np.zeros((2, 3)), "square"),
  ],
)
def test_bradley_terry_refuses(d, message):
  with pytest.raises(ValueError, match=message):
    pairwise.bradley_terry(d)


def test_win_rates_against_the_definition():
  for d in (_MODERATE, _NEAR_0_AND_1, _CIRCLE):
    want = [
      np.mean([1 / (1 + math.exp(-d[i, j])) for j in range(len(d)) if j != i and not math.isnan(d[i, j])])
      for i in range(len(d))
    ]
    np.testing.assert_allclose(pairwise.win_rates(d), want, rtol=1e-12, atol=0)
  # Near 0 and 1 the rates keep their relative precision: sigmoid(-40) is 4.2e-18, not 0.
  np.testing.assert_allclose(
    pairwise.win_rates(np.array([[0, -40.0], [40.0, 0]])), [4.248354255291589e-18, 1.0], rtol=1e-12
  )
