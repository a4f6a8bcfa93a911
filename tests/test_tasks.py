"""The reward tasks: what each reward type trains, and what each head serves."""

import types

import pytest

from jaxrm import kinds, tasks
from jaxrm.data import registry
from jaxrm.evaluation import data_kinds


def _head(head: str, num_labels: int):
  return types.SimpleNamespace(head=head, num_labels=num_labels)


def test_each_reward_type_trains_one_task():
  assert tasks.REWARD_TYPES == ("bradley_terry", "ranking", "stepwise", "regression")
  assert [tasks.of_reward_type(t).name for t in tasks.REWARD_TYPES] == [
    "preference",
    "preference",
    "process",
    "regression",
  ]


def test_an_unknown_reward_type_names_the_known_ones():
  with pytest.raises(
    ValueError,
    match=r"^reward.type must be one of bradley_terry, ranking, stepwise, regression; got 'pairs'$",
  ):
    tasks.of_reward_type("pairs")


def test_a_head_tells_its_task():
  assert tasks.of_head(_head("sequence", 1)) is tasks.PREFERENCE
  assert tasks.of_head(_head("token", 2)) is tasks.PROCESS
  # Attribute names make a sequence head one output per attribute, whatever its size.
  assert tasks.of_head(_head("sequence", 3), ("a", "b", "c")) is tasks.REGRESSION
  assert tasks.of_head(_head("sequence", 1), ("a",)) is tasks.REGRESSION
  assert tasks.of_head(_head("sequence", 2)) is None
  assert tasks.of_head(_head("token", 3)) is None
  assert kinds.model_kind(_head("sequence", 2)) == kinds.OTHER


def test_the_head_a_task_trains_is_told_as_that_task():
  for task in tasks.TASKS.values():
    attributes = ("a", "b") if task.per_attribute else None
    head = _head(task.head, len(attributes) if attributes else task.num_labels)
    assert tasks.of_head(head, attributes) is task
    assert kinds.model_kind(head, attributes) == task.name


def test_every_task_has_datasets_an_evaluation_and_unpacked_batches():
  assert {registry.task(n).name for n in registry.DATASET_NAMES} == set(tasks.TASKS)
  assert {registry.kind(n) for n in registry.DATASET_NAMES} == {t.data for t in tasks.TASKS.values()}
  assert len(data_kinds.KINDS) == len(tasks.TASKS)
  assert all(data_kinds.KINDS[t.evaluation].task is t for t in tasks.TASKS.values())
  assert all("none" in t.batches for t in tasks.TASKS.values())


def test_ranking_loss_counts_for_ranking_only():
  assert tasks.PREFERENCE.loss_key("ranking", "all_pairs") == ("ranking", "all_pairs")
  assert tasks.PREFERENCE.loss_key("bradley_terry", "all_pairs") == ("bradley_terry", None)
  assert tasks.PROCESS.loss_key("stepwise", "plackett_luce") == ("stepwise", None)
