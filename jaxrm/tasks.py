"""What a reward model is for, told once: one :class:`Task` per kind of reward model in jaxrm.

* ``preference``: one reward per response, trained on ranked completions of a prompt
  (``reward.type=bradley_terry``, or ``ranking`` with ``reward.ranking_loss``);
* ``process``: a probability per step that the step is correct (``reward.type=stepwise``);
* ``regression``: one prediction per rated attribute (``reward.type=regression``);
* ``verifier``: a causal LM's log-odds of answering yes to a question about the response
  (``reward.type=verifier``, :mod:`jaxrm.verifier`), trained on preferences as a preference model
  is, and used wherever one reward per response is.

Each task says which reward types train it, what data it reads, how its batches are laid out, the
head it needs, its losses, and what to say when a model of another kind is used for it. The config,
the data checks, the trainer, the losses, scoring, the server and evaluation ask a task (found from
a reward type with :func:`of_reward_type`, of a model with :func:`of_model`: the task its files
record, told from its head by :func:`of_head` only where they record none) instead of comparing
names; :mod:`jaxrm.kinds` says whether a model fits a use, in these tasks' words.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxrm import losses
from jaxrm.batches import (
  LabelledBatch,
  PackedLabelledBatch,
  PackedPreferenceBatch,
  PackedRegressionBatch,
  PackedStepwiseBatch,
  PreferenceBatch,
  RegressionBatch,
  StepwiseBatch,
)


@dataclasses.dataclass(frozen=True, eq=False)  # one object per task, compared by identity
class Task:
  """One kind of reward model: how it is trained, and what its head is."""

  name: str  # the model kind: RewardModel.kind, and what jaxrm.kinds.check_kind is asked for
  reward_types: tuple[str, ...]  # the reward.type values that train it
  data: str  # the kind of the datasets it trains on (jaxrm.data.registry.kind)
  evaluation: str  # its key in jaxrm.evaluation.data_kinds.KINDS (an evaluation result's "kind")
  # data.packing -> the batch class its rows are collated into; a mode left out is refused
  batches: Mapping[str, type]
  packing_refused: str  # why a data.packing left out of `batches` is refused ({packing}: the mode)
  # "sequence" (one output vector per row) | "token" (one per token) | "lm" (a verifier's: one
  # log-odds per row, from the LM head)
  head: str
  num_labels: int | None  # the head's outputs; None: one per rated attribute (reward.attributes)
  # RewardSpec.loss_key -> fn(spec, outputs, batch) -> (loss, metrics)
  losses: Mapping[tuple[str, str | None], losses.SpecLoss]
  # validation's metrics that need the whole set: fn(spec, outputs, batch) -> {"samples": ...}
  samples: losses.SpecMetrics | None
  # fn(spec) -> (outputs, batch) of one tiny unpacked batch: what the loss's metrics are named
  example: Callable[[Any], tuple[np.ndarray, Any]]
  # The wrong-model message (jaxrm.kinds.check_kind): what a use of this task needs, how to train
  # a model of it, and what a model of it is used for instead (None: the message says how to train
  # the model the use wants).
  needs: str
  train: str
  use_instead: str | None = None
  # The RewardSpec key that picks one of several losses (its value is the second part of the
  # loss key), or None.
  loss_choice: str | None = None
  # The other tasks' uses (their names) that a model of this task serves too: a verifier's one
  # reward per row serves wherever a preference model's does.
  serves: tuple[str, ...] = ()
  # Also trains on labelled items (prompt, completion, good or bad: a LabelledBatch), which a
  # preference file may hold instead of pairs.
  labelled: bool = False

  @property
  def per_attribute(self) -> bool:
    """Whether the head has one output per rated attribute (``reward.attributes``)."""
    return self.num_labels is None

  def loss_key(self, reward_type: str, choice: str) -> tuple[str, str | None]:
    """The key in :attr:`losses` of a reward spec: ``choice`` (the value of its
    :attr:`loss_choice` key) counts where it names one."""
    return (reward_type, choice) if (reward_type, choice) in self.losses else (reward_type, None)


def _mask(n: int) -> np.ndarray:
  return np.ones(n, np.float32)


def _preference_example(spec) -> tuple[np.ndarray, PreferenceBatch]:
  """Rewards [1, 2] of one group of two ranked completions."""
  del spec
  ids = np.zeros((2, 1), np.int32)
  ranks = np.array([[0, 1]], np.int32)
  batch = PreferenceBatch(ids, ids, ranks, np.zeros(1, np.float32), _mask(1), strength=_mask(1))
  return np.zeros((1, 2), np.float32), batch


def _process_example(spec) -> tuple[np.ndarray, StepwiseBatch]:
  """Logits [1, 1, 2] of one sequence of one labelled step."""
  del spec
  ids = np.zeros((1, 1), np.int32)
  return np.zeros((1, 1, 2), np.float32), StepwiseBatch(ids, ids, np.ones((1, 1), np.int32), _mask(1))


def _regression_example(spec) -> tuple[np.ndarray, RegressionBatch]:
  """Predictions [1, A] of one response rated on every attribute."""
  ids, rated = np.zeros((1, 1), np.int32), np.ones((1, len(spec.attribute_names)), np.float32)
  batch = RegressionBatch(ids, ids, rated, rated, np.zeros(1, np.int32), _mask(1))
  return np.zeros_like(rated), batch


PREFERENCE = Task(
  name="preference",
  reward_types=("bradley_terry", "ranking"),
  data="preference",
  evaluation="preference",
  batches={"none": PreferenceBatch, "packed": PackedPreferenceBatch, "shared_prompt": PackedPreferenceBatch},
  packing_refused="",
  head="sequence",
  num_labels=1,
  losses={
    ("bradley_terry", None): losses.bradley_terry,
    ("ranking", "plackett_luce"): losses.plackett_luce,
    ("ranking", "all_pairs"): losses.all_pairs,
  },
  samples=None,
  example=_preference_example,
  needs="a sequence-head reward model with one output (a preference reward model)",
  train="train one with reward.type=bradley_terry or ranking",
  loss_choice="ranking_loss",
)

PROCESS = Task(
  name="process",
  reward_types=("stepwise",),
  data="stepwise",
  evaluation="stepwise",
  batches={"none": StepwiseBatch, "packed": PackedStepwiseBatch},
  packing_refused="data.packing={packing!r} writes a preference group's prompt once; stepwise "
  "sequences have no group to share it: use data.packing='packed'",
  head="token",
  num_labels=2,  # step in error, step correct
  losses={("stepwise", None): losses.stepwise},
  samples=None,
  example=_process_example,
  needs="a token-head (process reward) model with 2 labels (step in error, step correct)",
  train="train one with reward.type=stepwise",
  use_instead="a process reward model scores steps: rm.score_steps, or stepwise data "
  "(--dataset_name=StepwiseDataset or demo_arithmetic_steps)",
)

REGRESSION = Task(
  name="regression",
  reward_types=("regression",),
  data="rated",
  evaluation="regression",
  batches={"none": RegressionBatch, "packed": PackedRegressionBatch},
  packing_refused="data.packing={packing!r} writes a preference group's prompt once; rated responses "
  "are one sequence each, with no group to share it: use data.packing='packed'",
  head="sequence",
  num_labels=None,
  losses={("regression", None): losses.regression},
  samples=losses.regression_pair_samples,
  example=_regression_example,
  needs="a regression model (one output per attribute, trained with reward.type=regression)",
  train="train one with reward.type=regression",
  use_instead="a regression model is evaluated on rated data (--dataset_name=RatedDataset, HelpSteer2 "
  "or demo_attributes)",
)


def _or_labelled(pairwise: losses.SpecLoss) -> losses.SpecLoss:
  """A verifier's loss: ``pairwise`` on preference batches, the cross-entropy over its two answers
  on labelled items."""

  def loss(spec, outputs, batch):
    if isinstance(batch, LABELLED_BATCHES):
      return losses.labelled(spec, outputs, batch)
    return pairwise(spec, outputs, batch)

  return loss


# A verifier's batches of labelled items, unpacked or packed: their outputs are alike, log-odds [G].
LABELLED_BATCHES = (LabelledBatch, PackedLabelledBatch)


def _labelled_scores(spec, outputs, batch):
  """Validation's scores of labelled items (their AUROC); none of preference batches."""
  return losses.labelled_scores(spec, outputs, batch) if isinstance(batch, LABELLED_BATCHES) else {}


VERIFIER = Task(
  name="verifier",
  reward_types=("verifier",),
  data="preference",
  evaluation="preference",
  # Labelled items become LABELLED_BATCHES instead; data.packing='shared_prompt' is refused for
  # them once their rows are read (jaxrm.data.packing.check_packable).
  batches=PREFERENCE.batches,
  packing_refused="",
  head="lm",
  num_labels=1,
  losses={
    ("verifier", None): _or_labelled(losses.bradley_terry),
    ("verifier", "plackett_luce"): _or_labelled(losses.plackett_luce),
    ("verifier", "all_pairs"): _or_labelled(losses.all_pairs),
  },
  samples=_labelled_scores,
  example=_preference_example,
  needs="a verifier (a causal LM scoring the log-odds of its answers to a question)",
  train="train one with reward.type=verifier, or load a causal LM with "
  "RewardModel.from_pretrained(path, verifier=True)",
  use_instead="a verifier scores conversations: rm.score, or preference data",
  loss_choice="verifier_loss",
  serves=(PREFERENCE.name,),
  labelled=True,
)

TASKS = {t.name: t for t in (PREFERENCE, PROCESS, REGRESSION, VERIFIER)}
REWARD_TYPES = tuple(r for t in TASKS.values() for r in t.reward_types)


def of_reward_type(reward_type: str) -> Task:
  """The task ``reward.type`` trains; a ValueError naming the reward types for an unknown one."""
  for task in TASKS.values():
    if reward_type in task.reward_types:
      return task
  raise ValueError(f"reward.type must be one of {', '.join(REWARD_TYPES)}; got {reward_type!r}")


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

  ``spec`` is read by its attributes (:class:`jaxrm.losses.LossSpec`), so the run's ``reward``
  section serves without this module importing the config. ``outputs`` is what
  ``batch.outputs(model)`` returns; packed and unpacked batches alike. With ``samples``
  (validation), metrics also hold the :class:`~jaxrm.metrics.Samples` the task ranks by, if any;
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
