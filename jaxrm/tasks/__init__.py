"""What a reward model is for, told once: one :class:`Task` per reward task in jaxrm, each in its own
file of this package.

* ``preference``: one reward per response, trained on ranked completions of a prompt
  (``reward.type=bradley_terry``, or ``ranking`` with ``reward.ranking_loss``);
* ``process``: a probability per step that the step is correct (``reward.type=stepwise``);
* ``regression``: one prediction per rated attribute (``reward.type=regression``);
* ``verifier``: a causal LM's log-odds of answering yes to a question about the response
  (``reward.type=verifier``, :mod:`jaxrm.tasks.verifier`), trained on preferences as a preference model
  is, and used wherever one reward per response is;
* ``pairwise``: a causal LM judging which of two responses is better (``reward.type=pairwise``,
  :mod:`jaxrm.tasks.pairwise`), trained on both orders of every pair, and turned into one reward
  per response of a group by its comparisons;
* ``pointwise``: one reward per response, the log-odds that it is good (``reward.type=pointwise``,
  :mod:`jaxrm.tasks.pointwise`), trained with the logistic loss on labelled items (prompt,
  completion, good or bad), and used wherever one reward per response is.

Each task says which reward types train it, what data it reads, how its batches are laid out, the
head it needs, its losses, what a loaded model of it does beyond scoring (its verbs, :func:`verb`),
and what to say when a model of another kind is used for it. The config,
the data checks, the trainer, the losses, scoring, the server and evaluation ask a task (found from
a reward type with :func:`of_reward_type`, of a model with :func:`of_model`: the task its files
record, told from its head by :func:`of_head` only where they record none) instead of comparing
names; :mod:`jaxrm.scoring.kinds` says whether a model fits a use, in these tasks' words.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from jaxrm.data.example_types import ExampleType
from jaxrm.tasks import losses
from jaxrm.tasks.base import SCORES, Task
from jaxrm.tasks.pairwise import PAIRWISE
from jaxrm.tasks.pointwise import POINTWISE
from jaxrm.tasks.preference import PREFERENCE
from jaxrm.tasks.process import PROCESS
from jaxrm.tasks.regression import REGRESSION
from jaxrm.tasks.verifier import LABELLED_BATCHES, VERIFIER

__all__ = [
  "first_asker",
  "LABELLED_BATCHES",
  "PAIRWISE",
  "POINTWISE",
  "PREFERENCE",
  "PROCESS",
  "REGRESSION",
  "REWARD_TYPES",
  "TASKS",
  "VERIFIER",
  "Task",
  "batch_loss",
  "grouping",
  "named",
  "of_head",
  "of_model",
  "of_reward_type",
  "reading",
  "scores_of",
  "scoring",
  "verb",
]

TASKS = {t.name: t for t in (PREFERENCE, PROCESS, REGRESSION, VERIFIER, PAIRWISE, POINTWISE)}
REWARD_TYPES = tuple(r for t in TASKS.values() for r in t.reward_types)


def of_reward_type(reward_type: str) -> Task:
  """The task ``reward.type`` trains; a ValueError naming the reward types for an unknown one."""
  for task in TASKS.values():
    if reward_type in task.reward_types:
      return task
  raise ValueError(f"reward.type must be one of {', '.join(REWARD_TYPES)}; got {reward_type!r}")


def scoring(*what: str) -> tuple[str, ...]:
  """The names of the tasks whose models score ``what`` (values of :attr:`Task.scores`), in the order
  of ``what``: the kinds a use that takes those scores asks :func:`jaxrm.scoring.kinds.check_kind` for. A
  task that serves another's uses (a verifier) is left out: it fits through the task it serves."""
  unknown = [w for w in what if w not in SCORES]
  if unknown:
    raise ValueError(f"a task scores one of {', '.join(SCORES)}; got {', '.join(map(repr, unknown))}")
  return tuple(t.name for w in what for t in TASKS.values() if t.scores == w and not t.serves)


def scores_of(kind: str | None) -> str | None:
  """What a model of ``kind`` (a task's name) scores (its :attr:`Task.scores`); None for a kind that
  is no task's (``other``, None)."""
  task = TASKS.get(kind) if isinstance(kind, str) else None
  return None if task is None else task.scores


def grouping(*options: str) -> Any:
  """The group rewards (:attr:`Task.group_rewards`) of the task whose RL reward functions take the
  keyword ``options`` (a judge's ``strategy``, ``aggregate``); a ValueError where no task's do."""
  for task in TASKS.values():
    if task.group_rewards is not None and set(options) <= set(task.group_rewards.OPTIONS):
      return task.group_rewards
  raise ValueError(f"no task's reward functions take {', '.join(f'{o}=' for o in options)}")


def verb(name: str, kind: str | None = None) -> Callable[..., Any] | property | None:
  """The verb ``name`` (:attr:`Task.verbs`) of the task called ``kind`` (a model's kind), else of the
  first task that has one: called on a model of another task, a verb refuses it in its own words.
  None where no task has it."""
  own = TASKS[kind].verbs if kind in TASKS else {}
  return own.get(name) or next((t.verbs[name] for t in TASKS.values() if name in t.verbs), None)


def first_asker() -> Task:
  """The first task with an asker (the verifier): the asker of an LM head loaded without one, of
  files that record an asker but no task (written before judges), and ``from_pretrained``'s
  ``verifier=``."""
  return next(t for t in TASKS.values() if t.asker is not None)


def reading(rows: ExampleType) -> Task:
  """The task a dataset of ``rows`` trains: the first whose own data they are."""
  return next(t for t in TASKS.values() if t.example_types[0] is rows)


def named(name: str, where: str = "the model's files") -> Task:
  """The task called ``name`` (a :attr:`Task.name`); a ValueError for a name no task has."""
  if name not in TASKS:
    raise ValueError(
      f"{where} record the task {name!r}, which this version of jaxrm does not know ({', '.join(TASKS)})"
    )
  return TASKS[name]


def of_model(
  config: Any, attributes: Sequence[str] | None = None, recorded: str | None = None
) -> Task | None:
  """The task of a model: the one its files record by name (``recorded``), checked against its head;
  for a model saved before they recorded one (``recorded`` None), the one its head serves
  (:func:`of_head`, the only place a task is told from a head).

  Raises:
    ValueError: the recorded task is unknown, or needs another head than the model has.
  """
  if recorded is None:
    return of_head(config, attributes)
  task = named(recorded)
  sized = task.num_labels in (None, config.num_labels)
  if task.head != config.head or not sized or task.per_attribute != (attributes is not None):
    raise ValueError(
      f"the model's files record it as a {task.name} model, which needs {task.needs}; the model "
      f"has a {config.head} head with {config.num_labels} outputs"
      + ("" if attributes is None else f" named {', '.join(attributes)}")
    )
  return task


def of_head(config: Any, attributes: Sequence[str] | None = None) -> Task | None:
  """The task a model serves, told from its head (``config.head``, ``config.num_labels``) and its
  attribute names; None for a head that serves none (e.g. several unnamed outputs). Only a model
  whose files record no task is told this way (:func:`of_model`).

  A head with attribute names is one per attribute whatever its size, so those tasks come first.
  """
  for task in sorted(TASKS.values(), key=lambda t: not t.per_attribute):
    if task.head != config.head:
      continue
    if attributes is not None if task.per_attribute else config.num_labels == task.num_labels:
      return task
  return None


def batch_loss(spec: losses.LossSpec, *, samples: bool = False) -> losses.BatchLoss:
  """``loss(outputs, batch) -> (loss, metrics)`` of the loss ``spec`` trains with.

  ``spec`` is read by its attributes (:class:`jaxrm.tasks.losses.LossSpec`), so the run's ``reward``
  section serves without this module importing the config. ``outputs`` is what
  ``batch.outputs(model)`` returns; packed and unpacked batches alike. With ``samples``
  (validation), metrics also hold the :class:`~jaxrm.run.metrics.Samples` the task ranks by, if any;
  they are concatenated, not summed, so they stay out of the train step.
  """
  task = of_reward_type(spec.loss_key[0])
  loss = functools.partial(task.losses[spec.loss_key], spec)
  if not (samples and task.samples):
    return loss
  extra = functools.partial(task.samples, spec)

  def with_samples(outputs, batch):
    value, metrics = loss(outputs, batch)
    return value, {**metrics, **extra(outputs, batch)}

  return with_samples
