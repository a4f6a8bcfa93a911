"""Regression on rated attributes and scaled Bradley-Terry: the losses and metrics against hand
computations, the rated formats and the HelpSteer2 adapter on rows in their published schema, and
preference strength from rows to batches."""

import copy
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assistant, softplus, user

from jaxrm import tasks
from jaxrm.config import RewardSpec
from jaxrm.data import adapters, formats, pipeline, registry
from jaxrm.data.batches import PreferenceBatch, RegressionBatch
from jaxrm.data.drops import DropReport
from jaxrm.data.records import RatedRecord
from jaxrm.data.tokenize import RatedExample, TokenizeOptions, prompt_group, tokenize_all
from jaxrm.errors import DataError
from jaxrm.run.metrics import accumulate, finalize_metrics
from jaxrm.tasks import losses

# Float32 losses against float64 hand computations: a few float32 roundings (~6e-8 relative each)
# on O(1) values, while a wrong mask or weight moves them by far more than 1e-6.
RTOL = 1e-6
# Pearson's r from float32 sums of ~100 O(1) terms against float64 numpy: the sums' rounding
# (~1e-7 relative per addition) enters r through differences of sums ~10x larger than the
# variances, so r is good to ~1e-5.
PEARSON_ATOL = 1e-5
SRC = "raw.jsonl:3"
regression_loss = jax.jit(losses.regression_loss, static_argnames=("attributes", "weights"))


def error_of(fn, *args, **kwargs) -> str:
  with pytest.raises(DataError) as e:
    fn(*args, **kwargs)
  return str(e.value)


# ---------------------------------------------------------------------------------------------
# The loss


def test_regression_loss_masks_missing_ratings_by_hand():
  predictions = jnp.array([[1.0, 2.0], [3.0, 0.0], [np.nan, 5.0]])
  labels = jnp.array([[0.0, 0.0], [3.0, 1.0], [9.0, 9.0]])
  label_mask = jnp.array([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])  # row 0 leaves attribute b unrated
  example_mask = jnp.array([1.0, 1.0, 0.0])  # row 2 is a filler, NaN prediction and all
  loss, metrics = regression_loss(
    predictions, labels, label_mask, example_mask, attributes=("a", "b"), weights=(1.0, 2.0)
  )
  # Rated: (0, a) error 1, (1, a) error 0, (1, b) error -1, weighing 1, 1, 2. Taking the missing
  # rating as 0 would add (2 - 0)^2 to the sums.
  np.testing.assert_allclose(loss, (1 * 1 + 1 * 0 + 2 * 1) / (1 + 1 + 2), rtol=RTOL)
  out = finalize_metrics(metrics)
  assert out.pop("pearson_a") == pytest.approx(1.0)  # (1, 3) against (0, 3)
  assert math.isnan(out.pop("pearson_b"))  # one rated value: no correlation
  assert out == pytest.approx(
    {"loss": 0.75, "mse": 2 / 3, "mse_a": 0.5, "mse_b": 1.0, "mae_a": 0.5, "mae_b": 1.0}, rel=RTOL
  )


def test_regression_metrics_aggregate_exactly_over_batches():
  rng = np.random.default_rng(0)
  y = rng.integers(0, 5, (96, 2)).astype(np.float32)
  p = (y + rng.normal(0, 1.0, y.shape)).astype(np.float32)
  rated = rng.random(y.shape) < 0.8
  args = lambda s: (
    jnp.asarray(p[s]),
    jnp.asarray(y[s]),
    jnp.asarray(rated[s], jnp.float32),
    jnp.ones(len(y[s])),
  )
  kw = dict(attributes=("a", "b"), weights=None)
  acc = None
  for s in (slice(0, 40), slice(40, 72), slice(72, 96)):  # unequal batches
    m = jax.device_get(regression_loss(*args(s), **kw)[1])
    acc = m if acc is None else accumulate(acc, m)
  out = finalize_metrics(acc)
  for a, name in enumerate("ab"):
    r = rated[:, a]
    err = p[r, a].astype(np.float64) - y[r, a]
    assert out[f"mse_{name}"] == pytest.approx(np.mean(err**2), rel=RTOL)
    assert out[f"mae_{name}"] == pytest.approx(np.mean(np.abs(err)), rel=RTOL)
    np.testing.assert_allclose(out[f"pearson_{name}"], np.corrcoef(p[r, a], y[r, a])[0, 1], atol=PEARSON_ATOL)
  assert out["mse"] == pytest.approx(np.mean((p[rated].astype(np.float64) - y[rated]) ** 2), rel=RTOL)


def samples_of(p, y, rated, group, combination):
  return losses.regression_samples(
    jnp.asarray(p, jnp.float32),
    jnp.asarray(y, jnp.float32),
    jnp.asarray(rated, jnp.float32),
    jnp.ones(len(y)),
    jnp.asarray(group),
    attributes=("a", "b"),
    combination=combination,
  )


def test_spearman_ranks_over_the_whole_set_across_batches():
  scipy_stats = pytest.importorskip("scipy.stats")
  rng = np.random.default_rng(1)
  y = rng.integers(0, 5, (50, 2)).astype(np.float32)  # many ties, as 0..4 ratings have
  p = np.round(y + rng.normal(0, 1.5, y.shape), 1).astype(np.float32)  # ties in predictions too
  rated = rng.random(y.shape) < 0.9
  group = np.arange(50) // 2
  parts = [
    jax.device_get(samples_of(p[s], y[s], rated[s], group[s], (1.0, 0.0)))
    for s in (slice(0, 7), slice(7, 31), slice(31, 50))
  ]
  acc = parts[0]
  for part in parts[1:]:
    acc = accumulate({"samples": acc}, {"samples": part})["samples"]
  out = finalize_metrics({"samples": acc})
  for a, name in enumerate("ab"):
    r = rated[:, a]
    expected = scipy_stats.spearmanr(p[r, a], y[r, a]).statistic
    np.testing.assert_allclose(out[f"spearman_{name}"], expected, rtol=0, atol=1e-12)
  # Ranked per batch and averaged, Spearman would differ.
  per_batch = [scipy_stats.spearmanr(p[s, 0], y[s, 0]).statistic for s in (slice(0, 7), slice(7, 31))]
  assert all(abs(out["spearman_a"] - v) > 1e-3 for v in per_batch)


def test_pairwise_accuracy_of_a_combination_by_hand():
  # Prompt 0: three responses; prompt 1: two with equal combined ratings (no pair); prompt 2:
  # one response rated on a only, left out as the combination needs b.
  y = [[4, 0], [2, 2], [0, 0], [3, 1], [1, 3], [4, 4]]
  p = [[1, 0], [0.5, 0], [0.6, 0], [9, 9], [0, 0], [5, 5]]
  rated = [[1, 1]] * 5 + [[1, 0]]
  group = [0, 0, 0, 1, 1, 2]
  out = finalize_metrics({"samples": samples_of(p, y, rated, group, (1.0, 1.0))})
  # Combined ratings 4, 4, 0 (prompt 0): pairs (0 > 2) and (1 > 2); combined predictions 1, 0.5,
  # 0.6: 1 > 0.6 right, 0.5 > 0.6 wrong.
  assert out["pairwise_accuracy"] == 0.5
  out = finalize_metrics({"samples": samples_of(p, y, rated, group, (1.0, 0.0))})
  # On a alone: 4 > 2 > 0 and 3 > 1: pairs (0,1) right, (0,2) right, (1,2) wrong, (3,4) right.
  assert out["pairwise_accuracy"] == 0.75
  no_pairs = finalize_metrics({"samples": samples_of(p[:1], y[:1], rated[:1], group[:1], (1.0, 0.0))})
  assert math.isnan(no_pairs["pairwise_accuracy"])


def test_regression_spec_trains_with_the_loss_and_validates_with_samples():
  spec = RewardSpec("regression", attributes="a, b", attribute_weights="1,3", combine="a=1,b=-0.5")
  assert (spec.attribute_names, spec.weights, spec.combination) == (("a", "b"), (1.0, 3.0), (1.0, -0.5))
  batch = RegressionBatch(
    input_ids=None,
    attention_mask=None,
    labels=jnp.array([[1.0, 2.0], [0.0, 4.0]]),
    label_mask=jnp.ones((2, 2)),
    group=jnp.array([5, 5], jnp.int32),
    example_mask=jnp.ones(2),
  )
  predictions = jnp.array([[0.0, 2.0], [0.0, 2.0]])
  loss, metrics = tasks.batch_loss(spec)(predictions, batch)
  np.testing.assert_allclose(loss, (1 * 1 + 3 * 0 + 1 * 0 + 3 * 4) / 8, rtol=RTOL)
  assert "samples" not in metrics  # the train step sums metrics; Samples are validation's
  _, metrics = tasks.batch_loss(spec, samples=True)(predictions, batch)
  # Combined ratings 1 - 1 = 0 and 0 - 2 = -2; predictions tie at -1: a tie counts as wrong.
  assert finalize_metrics(metrics)["pairwise_accuracy"] == 0.0


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(attributes=""), "reward.attributes is empty"),
    (dict(attributes="a,a"), "reward.attributes='a,a' names an attribute twice"),
    (dict(attributes="a b"), "reward.attributes: 'a b' cannot stand in metric names"),
    (
      dict(attributes="a,b", attribute_weights="1"),
      "reward.attribute_weights has 1 weights for the 2 attributes",
    ),
    (dict(attributes="a", attribute_weights="-1"), "weights must be >= 0, not all 0"),
    (dict(attributes="a", attribute_range="4,0"), "reward.attribute_range='4,0': low must be below high"),
    (dict(attributes="a", combine="z"), "reward.combine names 'z', not among the model's attributes a"),
  ],
)
def test_regression_spec_refuses_bad_keys(changes, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    RewardSpec("regression", **changes)


# ---------------------------------------------------------------------------------------------
# Scaled Bradley-Terry


def test_scaled_bradley_terry_weighs_each_pair_by_its_strength():
  rewards = jnp.array([[2.0, 1.0], [0.0, 1.0], [5.0, 0.0]])
  ranks = jnp.array([[0, 1], [0, 1], [0, 1]], jnp.int32)
  batch = PreferenceBatch(
    input_ids=None,
    attention_mask=None,
    ranks=ranks,
    margin=jnp.zeros(3),
    example_mask=jnp.array([1.0, 1.0, 0.0]),
    strength=jnp.array([3.0, 1.0, 2.0]),
  )
  loss, _ = tasks.batch_loss(RewardSpec(preference_strength_scaling=True))(rewards, batch)
  # Mean over the two real pairs of strength * -log sigmoid(chosen - rejected).
  np.testing.assert_allclose(loss, (3 * softplus(-1.0) + 1 * softplus(1.0)) / 2, rtol=RTOL)
  plain, _ = tasks.batch_loss(RewardSpec())(rewards, batch)
  np.testing.assert_allclose(plain, (softplus(-1.0) + softplus(1.0)) / 2, rtol=RTOL)
  with pytest.raises(ValueError, match="applies to reward.type='bradley_terry'"):
    RewardSpec("ranking", preference_strength_scaling=True)


def test_preference_strength_reaches_the_batch(smollm2_tokenizer):
  hs3 = {
    "domain": "general",
    "context": [user("Name a prime.")],
    "response1": "9.",
    "response2": "11.",
    "overall_preference": 2,
  }
  trl = {"prompt": "Q:", "chosen": " yes", "rejected": " no", "strength": 0.5}
  records = [
    adapters.helpsteer3(hs3, SRC, DropReport()),
    formats.parse_preference(trl, SRC, DropReport()),
    formats.parse_preference({**trl, "strength": None}, SRC, DropReport()),
  ]
  assert [r.strength for r in records] == [2.0, 0.5, None]
  examples = tokenize_all(records, smollm2_tokenizer, TokenizeOptions(max_length=64), DropReport())
  batch = pipeline.make_eval_batches(examples, batch_size=4, buckets=(64,))[0]
  np.testing.assert_array_equal(batch.strength, [2.0, 0.5, 1.0, 1.0])  # none given: 1; the filler: 1
  assert error_of(formats.parse_preference, {**trl, "strength": 0}, SRC, DropReport()) == (
    f"{SRC}: field 'strength': 0 is not a preference strength; give a positive number (how strongly the "
    "first-ranked completion is preferred)"
  )


# ---------------------------------------------------------------------------------------------
# Rated rows


def test_generic_rated_rows_take_either_key_and_leave_unrated_attributes_missing():
  attributes = ("helpfulness", "verbosity")
  record = formats.parse_rated(
    {"context": [user("Hi")], "completion": "Hello!", "helpfulness": 3.5},
    SRC,
    DropReport(),
    attributes=attributes,
    value_range=(0, 4),
  )
  assert record == RatedRecord(
    context=[user("Hi")], completion=[assistant("Hello!")], ratings=(3.5, None), source=SRC
  )
  record = formats.parse_rated(
    {"prompt": "Q:", "response": " A", "verbosity": 1, "helpfulness": None},
    SRC,
    DropReport(),
    attributes=attributes,
  )
  assert (record.context, record.completion, record.ratings) == ("Q:", " A", (None, 1.0))


def test_generic_rated_rows_with_no_rating_are_dropped_and_counted():
  drops = DropReport()
  assert (
    formats.parse_rated(
      {"prompt": "Q:", "response": " A", "other": 2}, SRC, drops, attributes=("helpfulness",)
    )
    is None
  )
  assert drops.counts == {formats.DROP_UNRATED: 1} and drops.examples[formats.DROP_UNRATED] == [SRC]


@pytest.mark.parametrize(
  "changes, message",
  [
    ({"helpfulness": 5}, "field 'helpfulness': rating 5 is outside 0..4 (reward.attribute_range)"),
    ({"helpfulness": "3"}, "field 'helpfulness': expected a finite number, got '3' (a string)"),
    ({"helpfulness": True}, "field 'helpfulness': expected a finite number, got True (a boolean)"),
    ({"helpfulness": float("nan")}, "field 'helpfulness': expected a finite number, got nan (a number)"),
    (
      {"response": None},
      "field 'response': is missing (nor is there 'completion'); have ['helpfulness', 'prompt', 'response']",
    ),
    ({"response": " "}, "field 'response': completion text is empty"),
  ],
)
def test_bad_rated_rows_name_the_field(changes, message):
  row = {"prompt": "Q:", "response": " A", "helpfulness": 2, **changes}
  assert (
    error_of(formats.parse_rated, row, SRC, DropReport(), attributes=("helpfulness",), value_range=(0, 4))
    == f"{SRC}: {message}"
  )


def test_rated_file_errors_name_the_file_and_line(tmp_path):
  path = tmp_path / "rated.jsonl"
  path.write_text(
    '{"prompt": "Q:", "response": " A", "helpfulness": 1}\n'
    '{"prompt": "Q:", "response": " B", "helpfulness": -1}\n'
  )
  message = error_of(
    registry.load_records,
    "RatedDataset",
    str(path),
    drops=DropReport(),
    attributes=("helpfulness",),
    value_range=(0, 4),
  )
  assert message == f"{path}:2: field 'helpfulness': rating -1 is outside 0..4 (reward.attribute_range)"


def test_rated_examples_collate_with_masks_and_prompt_groups(smollm2_tokenizer):
  records = [
    RatedRecord("Q1:", " a", (1.0, None), "r:1"),
    RatedRecord("Q1:", " b", (None, 3.0), "r:2"),
    RatedRecord("Q2:", " c", (2.0, 4.0), "r:3"),
  ]
  examples = tokenize_all(records, smollm2_tokenizer, TokenizeOptions(max_length=16), DropReport())
  assert all(isinstance(e, RatedExample) for e in examples)
  np.testing.assert_array_equal(examples[0].input_ids, smollm2_tokenizer("Q1: a")["input_ids"])
  batch = pipeline.make_eval_batches(examples, batch_size=4, buckets=(16,))[0]
  assert isinstance(batch, RegressionBatch)
  np.testing.assert_array_equal(batch.labels[:3], [[1, 0], [0, 3], [2, 4]])
  np.testing.assert_array_equal(batch.label_mask, [[1, 0], [0, 1], [1, 1], [0, 0]])  # the filler: unrated
  np.testing.assert_array_equal(batch.example_mask, [1, 1, 1, 0])
  assert batch.group[0] == batch.group[1] == prompt_group("Q1:") != batch.group[2]


# ---------------------------------------------------------------------------------------------
# HelpSteer2

HELPSTEER2 = {
  "prompt": "Name a prime.<extra_id_1>Assistant\n7.<extra_id_1>User\nAnother one?",
  "response": "11 is prime.",
  "helpfulness": 3,
  "correctness": 4,
  "coherence": 4,
  "complexity": 1,
  "verbosity": 0,
}


def helpsteer2(**changes):
  return {**copy.deepcopy(HELPSTEER2), **changes}


def test_helpsteer2_turn_markers_become_messages():
  record = adapters.helpsteer2(HELPSTEER2, SRC, DropReport())
  assert record == RatedRecord(
    context=[user("Name a prime."), assistant("7."), user("Another one?")],
    completion=[assistant("11 is prime.")],
    ratings=(3.0, 4.0, 4.0, 1.0, 0.0),
    source=SRC,
  )


def test_helpsteer2_reads_the_attributes_asked_for_in_their_order():
  record = adapters.helpsteer2(
    helpsteer2(prompt="What is 2 + 2?"), SRC, DropReport(), attributes=("verbosity", "helpfulness")
  )
  assert (record.context, record.ratings) == ([user("What is 2 + 2?")], (0.0, 3.0))
  assert error_of(adapters.helpsteer2, HELPSTEER2, SRC, DropReport(), attributes=("safety",)) == (
    "HelpSteer2 rates helpfulness, correctness, coherence, complexity, verbosity; it has no safety "
    "(reward.attributes)"
  )


def test_helpsteer2_unrated_attributes_are_missing_and_unrated_rows_dropped():
  record = adapters.helpsteer2(helpsteer2(verbosity=None), SRC, DropReport())
  assert record.ratings == (3.0, 4.0, 4.0, 1.0, None)
  drops = DropReport()
  row = {"prompt": "Q?", "response": "A.", "correctness": 2}
  assert adapters.helpsteer2(row, SRC, drops, attributes=("helpfulness", "verbosity")) is None
  assert drops.counts == {formats.DROP_UNRATED: 1}


@pytest.mark.parametrize(
  "changes, message",
  [
    ({"helpfulness": 5}, "field 'helpfulness': expected an integer in 0..4, got 5 (an integer)"),
    ({"correctness": 2.5}, "field 'correctness': expected an integer in 0..4, got 2.5 (a number)"),
    ({"verbosity": "0"}, "field 'verbosity': expected an integer in 0..4, got '0' (a string)"),
    (
      {"prompt": "Hi<extra_id_1>Bot\nHello"},
      "field 'prompt': turn 2 (after marker 1 '<extra_id_1>') does "
      "not start with 'Assistant' or 'User' and a line break: 'Bot\\nHello'",
    ),
    (
      {"prompt": "Hi<extra_id_1>Assistant\nHello"},
      "field 'prompt': ends with an assistant turn; the response answers a user turn",
    ),
    ({"response": ""}, "field 'response': completion text is empty"),
  ],
)
def test_helpsteer2_bad_rows(changes, message):
  assert error_of(adapters.helpsteer2, helpsteer2(**changes), SRC, DropReport()) == f"{SRC}: {message}"


def test_registry_knows_the_rated_datasets():
  assert [registry.rows_of(n) for n in ("HelpSteer2", "RatedDataset", "demo_attributes", "HelpSteer3")] == [
    "rated",
    "rated",
    "rated",
    "preference",
  ]
  records = registry.load_records(
    "demo_attributes",
    None,
    split="validation",
    drops=DropReport(),
    attributes=("helpfulness", "correctness", "verbosity"),
    value_range=(0, 4),
  )
  assert len(records) == 400 and all(isinstance(r, RatedRecord) for r in records)
  # The hidden rules of the demo: helpfulness is correctness less the verbosity beyond 2.
  for r in records:
    helpfulness, correctness, verbosity = r.ratings
    assert correctness in (0, 4)
    if verbosity is not None:
      assert helpfulness == max(correctness - max(verbosity - 2, 0), 0)
  assert 0.05 < np.mean([r.ratings[2] is None for r in records]) < 0.15  # verbosity sometimes unrated
  assert records[0].context == records[1].context  # answers come in same-prompt pairs
