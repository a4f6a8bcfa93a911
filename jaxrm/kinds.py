"""What a reward model is for, told once from its head: the one owner of "does this model fit?".

Every scoring path (``RewardModel.score`` and ``score_steps``, the reward functions, the server,
``jaxrm.evaluate`` and the benchmarks) asks :func:`check_kind`, so a model of the wrong kind gets
the same message everywhere: what the use needs, what the model is, and what to do.

* ``preference``: a sequence head with one output, one reward per row (Bradley-Terry, ranking);
* ``regression``: a sequence head with one output per named attribute (``reward.type=regression``);
* ``process``: a token head with 2 labels, a probability per step (``reward.type=stepwise``);
* ``other``: any other head (e.g. a sequence head with several unnamed outputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxrm.errors import UserError

PREFERENCE, REGRESSION, PROCESS, OTHER = "preference", "regression", "process", "other"

_NEEDS = {
  PREFERENCE: "a sequence-head reward model with one output (a preference reward model)",
  REGRESSION: "a regression model (one output per attribute, trained with reward.type=regression)",
  PROCESS: "a token-head (process reward) model with 2 labels (step in error, step correct)",
}
_TRAIN = {  # how to get a model of the key's kind
  PREFERENCE: "train one with reward.type=bradley_terry or ranking",
  REGRESSION: "train one with reward.type=regression",
  PROCESS: "train one with reward.type=stepwise",
}
_USE_INSTEAD = {  # what a model of the key's kind is scored on instead
  PROCESS: "a process reward model scores steps: rm.score_steps, or stepwise data "
  "(--dataset_name=StepwiseDataset or demo_arithmetic_steps)",
  REGRESSION: "a regression model is evaluated on rated data (--dataset_name=RatedDataset, HelpSteer2 "
  "or demo_attributes)",
}


class ModelKindError(UserError):
  """The model's head does not fit what it is used for."""


def model_kind(config: Any, attributes: Sequence[str] | None = None) -> str:
  """``preference`` | ``regression`` | ``process`` | ``other`` of a model config and its attribute names."""
  if config.head == "token":
    return PROCESS if config.num_labels == 2 else OTHER
  if attributes is not None:
    return REGRESSION
  return PREFERENCE if config.num_labels == 1 else OTHER


def describe(config: Any, attributes: Sequence[str] | None = None) -> str:
  """``a sequence head with 2 outputs (quality, polish)``: the head as messages name it."""
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
  """Returns ``rm``'s kind when it is one of ``kinds``, else raises ``error`` saying what to do.

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
  kind = model_kind(rm.config, attributes)
  if kind in kinds and not (one_reward and kind == REGRESSION and combine is None):
    return kind
  wanted = " or ".join(_NEEDS[k] for k in kinds if not (one_reward and k == REGRESSION))
  message = f"{use} needs {wanted}; this model has {describe(rm.config, attributes)}"
  if one_reward and kind == REGRESSION:
    message += (
      f": it scores one output per attribute, and {use} takes one reward per row: pass "
      f"{combine_hint} (an attribute's name, or 'name=weight,...')"
    )
  elif kind in _USE_INSTEAD:
    message += f"; {_USE_INSTEAD[kind]}"
  else:
    message += f"; {_TRAIN[kinds[0]]}"
  raise error(message)
