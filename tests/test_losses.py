"""Losses and metrics against hand computations in numpy."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import preference_loss_args, softplus

from jaxrm import tasks
from jaxrm.config import RANKING_LOSSES, REWARD_TYPES, VERIFIER_LOSSES, RewardSpec
from jaxrm.data.batches import IGNORE_INDEX as X
from jaxrm.data.batches import PreferenceBatch, StepwiseBatch
from jaxrm.run.metrics import accumulate, finalize_metrics
from jaxrm.tasks import losses

# Jitted once here, as training uses them; it also keeps the tests fast (one compile per shape
# instead of one per operation and shape).
bradley_terry_loss = jax.jit(losses.bradley_terry_loss)
all_pairs_loss = jax.jit(losses.all_pairs_bradley_terry_loss)
plackett_luce_loss = jax.jit(losses.plackett_luce_loss)
stepwise_loss = jax.jit(losses.stepwise_loss)

# The losses run in float32, the hand computations here in float64: a loss or metric is a handful
# of float32 operations (exp, log1p, a mean of a few terms), each rounding by ~6e-8 relative, while
# a wrong pair, rank or mask changes it by far more than 1e-6. pytest.approx's default (rel 1e-6)
# is the same bound, for rates that are ratios of counts.
RTOL = 1e-6


def neg_log_sigmoid(x):
  return softplus(-np.asarray(x, np.float64))


def assert_metrics_close(actual, expected, rtol=RTOL, atol=1e-6):
  """``atol`` is for metrics at or near 0 (a margin, an error recall), where rtol alone would allow
  no rounding at all."""
  assert actual.keys() == expected.keys()
  for name in expected:
    np.testing.assert_allclose(actual[name], expected[name], rtol=rtol, atol=atol, err_msg=name)


# ---------------------------------------------------------------------------------------------
# Bradley-Terry


def test_bradley_terry_pairs_by_hand():
  loss, metrics = bradley_terry_loss(**preference_loss_args([[2, 1], [0, 3]], [[0, 1], [0, 1]]))
  np.testing.assert_allclose(loss, (neg_log_sigmoid(1) + neg_log_sigmoid(-3)) / 2, rtol=RTOL)
  assert_metrics_close(
    finalize_metrics(metrics),
    {
      "loss": float(loss),
      "accuracy": 0.5,
      "tie_rate": 0.0,
      "pairwise_accuracy": 0.5,
      "chosen_reward": 1.0,  # mean(2, 0)
      "rejected_reward": 2.0,  # mean(1, 3)
      "margin": -1.0,  # mean(1, -3)
      "reward_mean": 1.5,
      "reward_std": float(np.std([2, 1, 0, 3])),
      "reward_min": 0.0,
      "reward_max": 3.0,
    },
  )


def test_bradley_terry_margin_and_centering():
  batch = preference_loss_args([[2, 1], [0, 3]], [[0, 1], [1, 0]], margin=[0.5, 1.0])
  loss, metrics = bradley_terry_loss(**batch, center_rewards_coefficient=0.1)
  # Group 2 prefers the second completion: chosen 3, rejected 0.
  expected = (neg_log_sigmoid(2 - 1 - 0.5) + neg_log_sigmoid(3 - 0 - 1.0)) / 2
  expected += 0.1 * ((2 + 1) ** 2 + (3 + 0) ** 2) / 2
  np.testing.assert_allclose(loss, expected, rtol=RTOL)
  np.testing.assert_allclose(finalize_metrics(metrics)["loss"], expected, rtol=RTOL)
  # The margin shifts the loss only; the reported margin is the raw reward difference.
  assert finalize_metrics(metrics)["margin"] == pytest.approx(2.0)


def test_filler_groups_and_absent_slots_change_nothing():
  loss, metrics = bradley_terry_loss(**preference_loss_args([[2, 1], [0, 3]], [[0, 1], [0, 1]]))
  # Same two pairs with an absent middle slot in the first group, and a filler group whose
  # rewards are garbage (a model may give anything, even NaN, for an all-padding row).
  padded = preference_loss_args(
    [[2, 9, 1], [0, 3, 0], [np.nan, 7, 100]], [[0, -1, 1], [0, 1, -1], [0, 1, 2]], example_mask=[1, 1, 0]
  )
  padded_loss, padded_metrics = bradley_terry_loss(**padded)
  np.testing.assert_allclose(padded_loss, loss, rtol=RTOL)
  assert_metrics_close(finalize_metrics(padded_metrics), finalize_metrics(metrics))


def test_ranks_in_any_order_pick_best_and_worst():
  # Ranks 2, 0, 1: the best is slot 1 (reward 5), the worst slot 0 (reward 1).
  loss, metrics = bradley_terry_loss(**preference_loss_args([[1, 5, 4]], [[2, 0, 1]]))
  np.testing.assert_allclose(loss, neg_log_sigmoid(5 - 1), rtol=RTOL)
  finalized = finalize_metrics(metrics)
  assert (finalized["chosen_reward"], finalized["rejected_reward"]) == (5.0, 1.0)
  assert finalized["pairwise_accuracy"] == 1.0


def test_all_pairs_averages_over_pairs_not_groups():
  # Group 1 ranks three completions (three pairs), group 2 has one pair; 4 pairs in all.
  batch = preference_loss_args([[1.0, 0.5, 2.0], [3.0, 1.0, 0.0]], [[0, 1, 2], [0, 1, -1]])
  loss, metrics = all_pairs_loss(**batch)
  differences = [1.0 - 0.5, 1.0 - 2.0, 0.5 - 2.0, 3.0 - 1.0]
  np.testing.assert_allclose(loss, np.mean(neg_log_sigmoid(differences)), rtol=RTOL)
  finalized = finalize_metrics(metrics)
  assert finalized["pairwise_accuracy"] == pytest.approx(2 / 4)
  # Accuracy stays best vs worst: group 1 has 1 < 2 (wrong), group 2 has 3 > 1 (right).
  assert finalized["accuracy"] == 0.5
  assert finalized["margin"] == pytest.approx(((1 - 2) + (3 - 1)) / 2)

  best_worst_loss, _ = bradley_terry_loss(**batch)  # one pair per group
  np.testing.assert_allclose(best_worst_loss, np.mean(neg_log_sigmoid([1.0 - 2.0, 3.0 - 1.0])), rtol=RTOL)


def test_ties_count_as_wrong_and_are_reported():
  _, metrics = bradley_terry_loss(**preference_loss_args([[1, 1], [2, 0], [0, 0]], [[0, 1]] * 3))
  finalized = finalize_metrics(metrics)
  assert finalized["accuracy"] == pytest.approx(1 / 3)
  assert finalized["tie_rate"] == pytest.approx(2 / 3)


def test_all_filler_batch_has_zero_loss_and_nan_metrics():
  loss, metrics = bradley_terry_loss(**preference_loss_args([[1, 2]], [[0, 1]], example_mask=[0]))
  assert float(loss) == 0.0
  finalized = finalize_metrics(metrics)
  assert math.isnan(finalized["accuracy"]) and math.isnan(finalized["reward_std"])


def test_shape_mismatch_names_the_shapes():
  with pytest.raises(ValueError, match=r"rewards \(2, 2\) and ranks \(2, 3\)"):
    bradley_terry_loss(jnp.zeros((2, 2)), jnp.zeros((2, 3), jnp.int32), jnp.ones(2))


# ---------------------------------------------------------------------------------------------
# Plackett-Luce


def test_plackett_luce_with_two_completions_equals_bradley_terry():
  rng = np.random.default_rng(0)
  rewards = rng.normal(size=(5, 3)).astype(np.float32) * 3
  # Two real completions per group, in varying slots and orders; the last group is filler.
  ranks = [[0, 1, -1], [1, -1, 0], [-1, 0, 1], [3, 7, -1], [0, 1, -1]]
  batch = preference_loss_args(rewards, ranks, example_mask=[1, 1, 1, 1, 0])
  pl_loss, pl_metrics = plackett_luce_loss(**batch)
  bt_loss, bt_metrics = bradley_terry_loss(**batch)
  np.testing.assert_allclose(pl_loss, bt_loss, rtol=RTOL)
  assert_metrics_close(finalize_metrics(pl_metrics), finalize_metrics(bt_metrics))


def test_plackett_luce_by_hand():
  a, b, c = 0.3, 1.0, 2.0
  # Group 1 ranks c > a > b (ranks given out of order): two choices.
  # Group 2 has one absent slot: one choice, y over x.
  x, y = 0.5, 1.5
  batch = preference_loss_args([[a, b, c], [x, 42.0, y]], [[1, 2, 0], [1, -1, 0]])
  loss, metrics = plackett_luce_loss(**batch)
  first = np.log(np.exp(a) + np.exp(b) + np.exp(c)) - c
  second = np.log(np.exp(a) + np.exp(b)) - a
  third = np.log(np.exp(x) + np.exp(y)) - y
  np.testing.assert_allclose(loss, (first + second + third) / 3, rtol=RTOL)
  finalized = finalize_metrics(metrics)
  assert finalized["loss"] == pytest.approx((first + second + third) / 3, rel=RTOL)
  assert finalized["accuracy"] == 1.0  # best vs worst: c > b and y > x
  assert finalized["pairwise_accuracy"] == pytest.approx(3 / 4)  # only a > b is wrong


def test_gradients_finite_and_zero_on_masked_slots():
  rewards = jnp.array([[0.3, -1.2, 2.0], [0.5, 1e4, 1.5], [np.nan, 3.0, -2.0]])
  ranks = jnp.array([[1, 2, 0], [1, -1, 0], [0, 1, 2]], jnp.int32)
  example_mask = jnp.array([1.0, 1.0, 0.0])
  expected_zero = np.array([[0, 0, 0], [0, 1, 0], [1, 1, 1]], bool)
  for loss_fn in (losses.plackett_luce_loss, losses.all_pairs_bradley_terry_loss):
    grads = jax.jit(jax.grad(lambda r, loss_fn=loss_fn: loss_fn(r, ranks, example_mask)[0]))(rewards)
    assert np.isfinite(grads).all()
    assert (np.asarray(grads)[expected_zero] == 0).all()
    assert (np.asarray(grads)[~expected_zero] != 0).all()


# ---------------------------------------------------------------------------------------------
# Stepwise


def test_stepwise_cross_entropy_by_hand():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(3, 5, 2)).astype(np.float32)
  labels = np.array([[X, 1, X, 0, 1], [X, X, 1, X, X], [1, 0, 1, 0, 1]], np.int32)
  example_mask = np.array([1, 1, 0], np.float32)  # the third sequence is filler
  loss, metrics = stepwise_loss(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(example_mask))
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  steps = [(0, 1), (0, 3), (0, 4), (1, 2)]
  expected = -np.mean([log_probs[b, t, labels[b, t]] for b, t in steps])
  np.testing.assert_allclose(loss, expected, rtol=RTOL)
  np.testing.assert_allclose(finalize_metrics(metrics)["loss"], expected, rtol=RTOL)


def step_logits(predictions):
  """Logits whose argmax is the given 0/1 prediction per token."""
  predictions = np.asarray(predictions)
  return jnp.asarray(np.stack([1.0 - predictions, predictions], -1).astype(np.float32))


def test_always_true_model_shows_zero_error_recall_and_f1():
  labels = np.array([[1, 0, 1, X], [1, 1, 1, 1]], np.int32)
  _, metrics = stepwise_loss(step_logits(np.ones((2, 4))), jnp.asarray(labels), jnp.ones(2))
  finalized = finalize_metrics(metrics)
  assert finalized["recall_error"] == 0.0
  assert finalized["f1_error"] == 0.0
  assert finalized["recall_correct"] == 1.0
  assert finalized["step_accuracy"] == pytest.approx(6 / 7)
  assert finalized["positive_rate"] == pytest.approx(6 / 7)
  assert finalized["first_error_found"] == 0.0


def test_stepwise_metrics_by_hand():
  labels = np.array(
    [
      [X, 1, X, 0, X, 0],  # first error at 3; predicted first error at 3 -> found
      [1, 1, 0, X, X, X],  # first error at 2; predicted first error at 0 -> not found
      [X, 1, X, 1, X, X],  # no error: not counted
      [0, 1, 0, X, X, X],  # first error at 0; no error predicted -> not found
    ],
    np.int32,
  )
  predictions = np.array(
    [
      [0, 1, 0, 0, 0, 1],  # errors predicted on unlabelled tokens 0, 2, 4 do not count
      [0, 1, 0, 0, 0, 0],
      [0, 0, 0, 1, 0, 0],
      [1, 1, 1, 1, 1, 1],
    ]
  )
  _, metrics = stepwise_loss(step_logits(predictions), jnp.asarray(labels), jnp.ones(4))
  # Labelled steps (label, prediction): (1,1) (0,0) (0,1) | (1,0) (1,1) (0,0) | (1,0) (1,1)
  # | (0,1) (1,1) (0,1). Errors: 5, found 2; correct: 6, found 4; predicted errors: 4.
  assert_metrics_close(
    {k: v for k, v in finalize_metrics(metrics).items() if k != "loss"},
    {
      "step_accuracy": 6 / 11,
      "recall_correct": 4 / 6,
      "recall_error": 2 / 5,
      "f1_error": 2 * 2 / (2 * 2 + 2 + 3),  # 2TP / (2TP + FP + FN)
      "first_error_found": 1 / 3,
      "positive_rate": 6 / 11,
    },
  )


# ---------------------------------------------------------------------------------------------
# Aggregation


def test_two_batches_accumulate_to_the_concatenated_batch():
  rng = np.random.default_rng(2)
  rewards = rng.normal(size=(6, 3)).astype(np.float32)
  ranks = np.array([[0, 1, 2], [2, -1, 0], [1, 0, -1], [0, 2, 1], [0, 1, 2], [1, 0, 2]])
  mask = np.array([1, 1, 1, 1, 1, 0], np.float32)
  whole = preference_loss_args(rewards, ranks, mask)
  # The halves hold 3 and 2 real groups (5 and 6 ordered pairs), so averaging the two batch
  # means would not give the whole-batch mean. Equal shapes keep it to one more compile.
  first, second = (
    preference_loss_args(rewards[:3], ranks[:3], mask[:3]),
    preference_loss_args(rewards[3:], ranks[3:], mask[3:]),
  )
  for loss_fn in (bradley_terry_loss, plackett_luce_loss):
    _, expected = loss_fn(**whole)
    accumulated = accumulate(loss_fn(**first)[1], loss_fn(**second)[1])
    assert_metrics_close(finalize_metrics(accumulated), finalize_metrics(expected))

  logits = rng.normal(size=(4, 6, 2)).astype(np.float32)
  labels = np.where(rng.random((4, 6)) < 0.4, X, rng.integers(0, 2, (4, 6))).astype(np.int32)
  step_mask = np.array([1, 1, 1, 0], np.float32)
  _, expected = stepwise_loss(logits, labels, step_mask)
  accumulated = accumulate(
    stepwise_loss(logits[:2], labels[:2], step_mask[:2])[1],
    stepwise_loss(logits[2:], labels[2:], step_mask[2:])[1],
  )
  assert_metrics_close(finalize_metrics(accumulated), finalize_metrics(expected))


# ---------------------------------------------------------------------------------------------
# The loss of each reward type


def test_each_reward_type_trains_with_its_loss():
  # Three ranked completions and a margin: the three preference losses all differ here.
  rewards = jnp.array([[1.0, 0.5, 2.0], [3.0, 1.0, 0.0]])
  ranks = jnp.array([[0, 1, 2], [0, 1, -1]], jnp.int32)
  mask, margin = jnp.ones(2), jnp.array([0.5, 0.0])
  # The batch's token arrays are not read by the loss: the rewards stand in for the model's outputs.
  batch = PreferenceBatch(input_ids=None, attention_mask=None, ranks=ranks, margin=margin, example_mask=mask)
  expected = {
    RewardSpec("bradley_terry", center_rewards_coefficient=0.1): losses.bradley_terry_loss(
      rewards, ranks, mask, margin, center_rewards_coefficient=0.1
    ),
    RewardSpec("ranking", "plackett_luce"): losses.plackett_luce_loss(rewards, ranks, mask),
    RewardSpec("ranking", "all_pairs", center_rewards_coefficient=0.1): losses.all_pairs_bradley_terry_loss(
      rewards, ranks, mask, margin, center_rewards_coefficient=0.1
    ),
  }
  values = {spec: float(tasks.batch_loss(spec)(rewards, batch)[0]) for spec in expected}
  assert len(set(values.values())) == 3
  for spec, (loss, metrics) in expected.items():
    assert values[spec] == pytest.approx(float(loss), rel=RTOL), spec
    assert_metrics_close(
      finalize_metrics(tasks.batch_loss(spec)(rewards, batch)[1]), finalize_metrics(metrics)
    )
  # A spec without type=ranking ignores ranking_loss.
  assert RewardSpec("bradley_terry", "all_pairs").loss_key == ("bradley_terry", None)

  logits = jnp.asarray(np.random.default_rng(3).normal(size=(2, 4, 2)), jnp.float32)
  labels = jnp.array([[X, 1, X, 0], [0, X, X, 1]], jnp.int32)
  steps = StepwiseBatch(input_ids=None, attention_mask=None, labels=labels, example_mask=mask)
  loss, _ = tasks.batch_loss(RewardSpec("stepwise"))(logits, steps)
  assert float(loss) == pytest.approx(float(losses.stepwise_loss(logits, labels, mask)[0]), rel=RTOL)


def test_every_reward_spec_has_a_loss():
  specs = [
    RewardSpec(t, r, attributes="a" if t == "regression" else "", verifier_loss=v)
    for t in REWARD_TYPES
    for r in RANKING_LOSSES
    for v in VERIFIER_LOSSES
  ]
  assert {spec.loss_key for spec in specs} == {key for task in tasks.TASKS.values() for key in task.losses}


def test_bad_reward_spec_names_the_choices():
  with pytest.raises(
    ValueError,
    match=r"reward.type must be one of bradley_terry, ranking, "
    r"stepwise, regression, verifier, pairwise, pointwise; got 'pairs'",
  ):
    RewardSpec("pairs")
  with pytest.raises(
    ValueError,
    match=r"reward.ranking_loss must be one of plackett_luce, "
    r"all_pairs; got 'listnet'",
  ):
    RewardSpec("ranking", "listnet")
