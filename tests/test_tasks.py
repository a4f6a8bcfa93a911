"""The reward tasks: what each reward type trains, and what each head serves."""

import dataclasses
import types

import pytest
import start_checks
import tiny_run

from jaxrm import RewardModel, tasks
from jaxrm.config import validation_metrics
from jaxrm.data import example_types, registry
from jaxrm.errors import ConfigError
from jaxrm.evaluation import readings
from jaxrm.scoring import kinds


def _head(head: str, num_labels: int):
  return types.SimpleNamespace(head=head, num_labels=num_labels)


def test_each_reward_type_trains_one_task():
  assert tasks.REWARD_TYPES == (
    "bradley_terry",
    "ranking",
    "stepwise",
    "regression",
    "verifier",
    "pairwise",
    "pointwise",
  )
  assert [tasks.of_reward_type(t).name for t in tasks.REWARD_TYPES] == [
    "preference",
    "preference",
    "process",
    "regression",
    "verifier",
    "pairwise",
    "pointwise",
  ]


def test_an_unknown_reward_type_names_the_known_ones():
  with pytest.raises(
    ValueError,
    match=r"^reward.type must be one of bradley_terry, ranking, stepwise, regression, verifier, pairwise, "
    r"pointwise; got 'pairs'$",
  ):
    tasks.of_reward_type("pairs")


def test_a_head_tells_its_task():
  assert tasks.of_head(_head("sequence", 1)) is tasks.PREFERENCE
  assert tasks.of_head(_head("token", 2)) is tasks.PROCESS
  assert tasks.of_head(_head("lm", 1)) is tasks.VERIFIER
  # Attribute names make a sequence head one output per attribute, whatever its size.
  assert tasks.of_head(_head("sequence", 3), ("a", "b", "c")) is tasks.REGRESSION
  assert tasks.of_head(_head("sequence", 1), ("a",)) is tasks.REGRESSION
  assert tasks.of_head(_head("sequence", 2)) is None
  assert tasks.of_head(_head("token", 3)) is None
  assert kinds.model_kind(_head("sequence", 2)) == kinds.OTHER


def test_the_head_a_task_trains_is_told_as_that_task():
  """Of the tasks that train one head, the first is told from it: the others (a pairwise judge's LM
  head is a verifier's, a pointwise model's sequence head with one output a preference model's)
  exist only since models record their task, so none is ever told so."""
  told = {}
  for task in tasks.TASKS.values():
    told.setdefault((task.head, task.num_labels), task)
  assert told[("lm", 1)] is tasks.VERIFIER and tasks.PAIRWISE not in told.values()
  assert told[("sequence", 1)] is tasks.PREFERENCE and tasks.POINTWISE not in told.values()
  for task in told.values():
    attributes = ("a", "b") if task.per_attribute else None
    head = _head(task.head, len(attributes) if attributes else task.num_labels)
    assert tasks.of_head(head, attributes) is task
    assert kinds.model_kind(head, attributes) == task.name


def test_a_recorded_task_is_read_and_checked_against_the_head():
  assert tasks.of_model(_head("sequence", 1), ("a",), "regression") is tasks.REGRESSION
  assert tasks.of_model(_head("sequence", 1), None, None) is tasks.PREFERENCE  # unrecorded: the head's
  with pytest.raises(
    ValueError, match=r"record it as a process model, which needs a token-head .* has a sequence head"
  ):
    tasks.of_model(_head("sequence", 1), None, "process")
  with pytest.raises(ValueError, match=r"record the task 'judge', which this version of jaxrm does not know"):
    tasks.of_model(_head("sequence", 1), None, "judge")


def test_a_use_asks_for_the_tasks_whose_models_score_what_it_takes():
  """tasks.scoring lists, in the order asked, the tasks giving each kind of score (a verifier and a
  pointwise model fit through the preference model they serve); tasks.scores_of says what a model of a kind gives."""
  assert tasks.scoring("reward", "attributes", "steps", "comparisons") == (
    "preference",
    "regression",
    "process",
    "pairwise",
  )
  assert tasks.scoring("steps", "reward") == ("process", "preference")
  assert [tasks.scores_of(name) for name in tasks.TASKS] == [
    "reward",
    "steps",
    "attributes",
    "reward",
    "comparisons",
    "reward",
  ]
  assert tasks.scores_of(kinds.OTHER) is None and tasks.scores_of(None) is None
  with pytest.raises(ValueError, match="one of reward, steps, attributes, comparisons; got 'rewards'"):
    tasks.scoring("rewards")


def test_every_task_has_datasets_an_evaluation_and_unpacked_batches():
  # A verifier and a pairwise judge train on a preference model's datasets: the first task of a
  # given sort of rows owns its datasets.
  owners = {}
  for t in tasks.TASKS.values():
    owners.setdefault(t.data, t.name)
  assert {registry.task(n).name for n in registry.DATASET_NAMES} == set(owners.values())
  assert {registry.rows_of(n) for n in registry.DATASET_NAMES} == {t.data for t in tasks.TASKS.values()}
  # A verifier's labelled items are the one reading of evaluation data besides the tasks' own.
  assert set(readings.READINGS) == {t.evaluation for t in tasks.TASKS.values()} | {"labelled"}
  assert all(t.name in readings.READINGS[t.evaluation].kinds for t in tasks.TASKS.values())
  assert all("none" in t.batches for t in tasks.TASKS.values())


def test_each_task_names_its_dataset_rows_and_evaluation_kinds_and_the_tables_follow():
  """The dataset table's file formats and the evaluation table are built from what the tasks
  declare: a task without a dataset of its rows, or an evaluation reading nothing scores, fails."""
  for t in tasks.TASKS.values():
    assert registry.task(t.dataset).data == t.data and registry.reads_paths_only(t.dataset), t.name
    assert registry.FILE_FORMATS[t.data] == t.dataset
    assert t.evaluations[t.evaluation] is t.example_types[0]
    for name, rows in t.evaluations.items():
      reading = readings.READINGS[name]
      assert reading.rows is rows and reading.example is rows.example and reading.record is rows.record
      assert t.name in reading.kinds, (t.name, name)  # evaluate takes its models on its own reading
  assert list(readings.READINGS) == ["preference", "stepwise", "regression", "pairwise", "labelled"]
  assert readings.READINGS["labelled"].task is tasks.VERIFIER
  # Every kind of tokenized row is trained by a task, and is one of the data path's.
  trained = {rows for t in tasks.TASKS.values() for rows in t.example_types}
  assert trained == set(example_types.TYPES)


def test_ranking_loss_counts_for_ranking_only():
  assert tasks.PREFERENCE.loss_key("ranking", "all_pairs") == ("ranking", "all_pairs")
  assert tasks.PREFERENCE.loss_key("bradley_terry", "all_pairs") == ("bradley_terry", None)
  assert tasks.PROCESS.loss_key("stepwise", "plackett_luce") == ("stepwise", None)
  assert tasks.VERIFIER.loss_key("verifier", "bradley_terry") == ("verifier", None)
  assert tasks.VERIFIER.loss_key("verifier", "all_pairs") == ("verifier", "all_pairs")


def test_validation_metrics_are_those_a_run_reports(baseline):
  from jaxrm.config import RewardSpec

  (row,) = [r for r in tiny_run.read_metrics(baseline) if r["step"] == 4 and "validation-default_loss" in r]
  reported = {k.removeprefix("validation-default_") for k in row if k.startswith("validation-default_")}
  assert set(validation_metrics(RewardSpec())) == reported


@pytest.mark.parametrize(
  "reward_type,metrics,absent",
  [
    ("stepwise", {"loss", "step_accuracy", "f1_error", "first_error_found", "recall_error"}, {"accuracy"}),
    ("regression", {"loss", "mse", "mse_q", "pearson_q", "spearman_q", "pairwise_accuracy"}, {"accuracy"}),
    # labelled items: no pair, so none of a preference model's pair metrics
    (
      "pointwise",
      {"loss", "accuracy", "positive_rate", "auroc", "ece", "reward_mean"},
      {"margin", "tie_rate"},
    ),
  ],
)
def test_validation_metrics_of_each_task(reward_type, metrics, absent):
  from jaxrm.config import RewardSpec

  spec = RewardSpec(type=reward_type, attributes="q" if reward_type == "regression" else "")
  names = validation_metrics(spec)
  assert metrics <= set(names) and not absent & set(names)


def test_a_misspelled_checkpoint_metric_is_refused_before_the_model_loads(model_dir, tmp_path, monkeypatch):
  c = tiny_run.config(
    model_dir, str(tmp_path / "run"), checkpointing__metric_name="val:validation-default_acuracy"
  )
  assert start_checks.refusal(c, monkeypatch) == (
    "checkpointing.metric_name='val:validation-default_acuracy' is not a validation metric; available: "
    "validation-default_loss, validation-default_accuracy, validation-default_margin, "
    "validation-default_chosen_reward, validation-default_pairwise_accuracy, "
    "validation-default_rejected_reward, validation-default_reward_max, validation-default_reward_mean, "
    "validation-default_reward_min, validation-default_reward_std, "
    "validation-default_tie_rate (did you mean 'validation-default_accuracy'?)"
  )
  # A set whose name holds '_' is told apart from the metric that follows it.
  c = tiny_run.config(
    model_dir, str(tmp_path / "run"), checkpointing__metric_name="validation-train_sample_los"
  )
  assert start_checks.refusal(c, monkeypatch).endswith(
    "validation-train_sample_tie_rate (did you mean 'validation-train_sample_loss'?)"
  )


def test_a_model_does_what_its_task_names(tiny_rm, monkeypatch):
  """A task's verbs (Task.verbs) are its models': each bound to the model, a property read as an
  attribute, and listed by dir(); a name no task has stays an AttributeError."""
  task = tasks.named(tiny_rm.kind)
  verbs = {"twice": lambda rm, x: (rm.kind, 2 * x), "head": property(lambda rm: rm.config.head)}
  monkeypatch.setitem(tasks.TASKS, task.name, dataclasses.replace(task, verbs=verbs))
  assert tiny_rm.twice(3) == (task.name, 6) and tiny_rm.head == "sequence"
  assert {"twice", "head"} <= set(dir(tiny_rm))
  with pytest.raises(AttributeError, match="^'RewardModel' object has no attribute 'thrice'$"):
    tiny_rm.thrice  # noqa: B018


@pytest.mark.parametrize("asker, noun", [("verifier", "a verifier"), ("judge", "a judge")])
def test_an_lm_head_task_is_named_by_its_asker_in_load_messages(model_dir, asker, noun):
  with pytest.raises(ConfigError, match=f"^num_labels=2: {noun} gives one score per row"):
    RewardModel.from_pretrained(model_dir, **{asker: True}, num_labels=2, load_weights=False)
