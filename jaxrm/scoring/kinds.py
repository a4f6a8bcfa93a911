"""Whether a model fits its use, told once from its task: the one owner of "does this model fit?".

Every scoring path (``RewardModel.score`` and ``score_steps``, the reward functions, the server,
``jaxrm.evaluate`` and the benchmarks) asks :func:`check_kind`, so a model of the wrong kind gets
the same message everywhere: what the use needs, what the model is, and what to do. A model's kind
is the name of its :mod:`jaxrm.tasks` task, whose words the message uses: the one its files record
(:func:`task_of`), or for a model saved before they recorded one, the one its head serves:

* ``preference``: a sequence head with one output, one reward per row (Bradley-Terry, ranking);
* ``regression``: a sequence head with one output per named attribute (``reward.type=regression``);
* ``process``: a token head with 2 labels, a probability per step (``reward.type=stepwise``);
* ``verifier``: a causal LM's log-odds of two answers, one reward per row (``reward.type=verifier``,
  or a causal LM loaded with ``verifier=True``); it serves every use a preference model serves;
* ``pairwise``: a causal LM judging which of two responses is better (``reward.type=pairwise``, or
  a causal LM loaded with ``judge=True``); it compares, and serves no use of one reward per row;
* ``other``: any other head (e.g. a sequence head with several unnamed outputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxrm import tasks
from jaxrm.errors import UserError

OTHER = "other"


class ModelKindError(UserError):
  """The model's head does not fit what it is used for."""


def model_kind(config: Any, attributes: Sequence[str] | None = None) -> str:
  """``preference`` | ``regression`` | ``process`` | ``verifier`` | ``other`` of a model config and
  its attribute names, for a model whose files record no task (else :func:`kind_of`)."""
  task = tasks.of_model(config, attributes)
  return OTHER if task is None else task.name


def task_of(rm: Any) -> tasks.Task | None:
  """The task of ``rm`` (anything with ``config`` and ``attributes``): the one its files record
  (``rm.info.task``, a :class:`jaxrm.scoring.loading.ScoringInfo`'s), else the one its head serves."""
  recorded = getattr(getattr(rm, "info", None), "task", None)
  return tasks.of_model(rm.config, getattr(rm, "attributes", None), recorded)


def kind_of(rm: Any) -> str:
  """The kind of ``rm`` (:func:`task_of`'s name, or ``other``)."""
  task = task_of(rm)
  return OTHER if task is None else task.name


def describe(config: Any, attributes: Sequence[str] | None = None, task: tasks.Task | None = None) -> str:
  """``a sequence head with 2 outputs (quality, polish)``: the head as messages name it; an LM
  head by the model's ``task`` (a verifier's, a pairwise judge's: the first words of what its
  task's uses need); an LM head of no known task by the first task of an LM head's."""
  if config.head == "lm":
    task = task or next(t for t in tasks.TASKS.values() if t.head == "lm")
    what = task.needs
    return f"an LM head ({what.split(' (')[0]}: the log-odds of two answer tokens)"
  n = config.num_labels
  noun = ("label" if config.head == "token" else "output") + ("" if n == 1 else "s")
  names = f" ({', '.join(attributes)})" if attributes else ""
  return f"a {config.head} head with {n} {noun}{names}"


def check_kind(
  rm: Any,
  *kinds: str,
  use: str,
  one_reward: bool = False,
  combine: Any = None,
  combine_hint: str = "combine=",
  error: type[UserError] = ModelKindError,
) -> str:
  """Returns ``rm``'s kind when it is one of ``kinds`` (or its task serves one of them: a verifier
  serves a preference model's uses), else raises ``error`` saying what to do.

  Args:
    rm: anything with ``config`` (``head``, ``num_labels``) and ``attributes`` (a RewardModel).
    kinds: the kinds ``use`` takes.
    use: what needs the model, as the message starts: ``"score()"``, ``"stepwise data"``...
    one_reward: ``use`` takes one reward per row: a regression model only with ``combine``.
    combine: how a regression model's outputs become one reward (with ``one_reward``).
    combine_hint: how the caller passes ``combine`` (``"--combine"`` on a command line).
    error: the exception type raised (a subclass of UserError).
  """
  attributes = getattr(rm, "attributes", None)
  task = task_of(rm)
  kind = OTHER if task is None else task.name
  # `use` takes one reward per row: a model of one output per attribute needs `combine`
  combines = one_reward and task is not None and task.per_attribute
  fits = kind in kinds or (task is not None and any(k in kinds for k in task.serves))
  if fits and not (combines and combine is None):
    return kind
  serving = [t.name for t in tasks.TASKS.values() if t.name not in kinds and set(t.serves) & set(kinds)]
  wanted = " or ".join(
    t.needs for t in map(tasks.TASKS.get, (*kinds, *serving)) if not (one_reward and t.per_attribute)
  )
  message = f"{use} needs {wanted}; this model has {describe(rm.config, attributes, task)}"
  if combines:
    message += (
      f": it scores one output per attribute, and {use} takes one reward per row: pass "
      f"{combine_hint} (an attribute's name, or 'name=weight,...')"
    )
  elif task is not None and task.use_instead:
    message += f"; {task.use_instead}"
  else:
    message += f"; {tasks.TASKS[kinds[0]].train}"
  raise error(message)
