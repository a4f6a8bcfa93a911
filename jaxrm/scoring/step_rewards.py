"""A process reward model's step probabilities as one reward per solution.

A process (token-head) model gives each step of a solution the probability that it is correct
(:meth:`jaxrm.RewardModel.score_steps`). An RL trainer wants one reward per completion; the PRM
literature takes one of:

* ``min``: the weakest step (the common default: a solution is as good as its worst step);
* ``last``: the last step's probability (the model has read the whole solution by then);
* ``product``: every step correct, the steps taken as independent;
* ``mean``: the average step.

A completion is cut into steps the way a stepwise training row is laid out
(:func:`jaxrm.data.tokenize.tokenize_stepwise`): every step is followed by the run's step
separator, so the text between two separators is one step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jaxrm.data.formats import json_type

AGGREGATIONS = ("min", "last", "product", "mean")
DEFAULT_AGGREGATION = "min"


def check_aggregation(how: str, flag: str = "step_aggregation") -> str:
  """``how`` if it names one of :data:`AGGREGATIONS`, else a ValueError naming ``flag``."""
  if how not in AGGREGATIONS:
    raise ValueError(
      f"{flag}={how!r} is not an aggregation of step probabilities; "
      f"choose one of {', '.join(AGGREGATIONS)} (default {DEFAULT_AGGREGATION})"
    )
  return how


def split_steps(completion: str, separator: str) -> list[str]:
  """The steps of ``completion``: the texts between occurrences of ``separator``, in order.

  Each step was followed by ``separator`` in training; a last step without one is still a step,
  and a completion without any separator is one step. Steps that are empty or only whitespace
  (two separators in a row, a trailing separator) are dropped: there is no step there to judge.
  """
  if not isinstance(completion, str):
    raise TypeError(f"a completion to split into steps must be a string, got {type(completion).__name__}")
  if not isinstance(separator, str) or not separator:
    raise ValueError(f"the step separator must be a non-empty string, got {separator!r}")
  return [step for step in completion.split(separator) if step.strip()]


def check_steps(steps: Any, field: str, one_string: str) -> list[str]:
  """``steps`` as a list of step texts (an empty list is a solution with no steps), else a
  ValueError naming ``field``. One string is refused, not cut: where its steps end is the step
  separator's to say, which ``one_string`` tells the caller how to apply."""
  if isinstance(steps, str):
    raise ValueError(f"{field} is one string; pass a list of steps ({one_string})")
  if not isinstance(steps, (list, tuple)):
    raise ValueError(f"{field} is {json_type(steps)}; expected a list of step texts (strings)")
  for x in steps:
    if not isinstance(x, str):
      raise ValueError(f"{field} holds {json_type(x)}; expected a list of step texts (strings)")
  return list(steps)


def solution_reward(probabilities: Sequence[float], how: str = DEFAULT_AGGREGATION) -> float | None:
  """:func:`aggregate`, or None for a solution with no steps: no reward, as TRL reads None (the
  reward functions and the server's ``/score_steps`` alike)."""
  return aggregate(probabilities, how) if len(probabilities) else None


def aggregate(probabilities: Sequence[float], how: str = DEFAULT_AGGREGATION) -> float:
  """One reward from a solution's step probabilities (each in [0, 1]), by ``how``.

  A solution with no steps raises ValueError: no reward is neutral for it (0.0 would be the worst
  a probability can be), so the caller decides what such a solution is worth.
  """
  check_aggregation(how, flag="aggregation")
  p = [float(x) for x in probabilities]
  if not p:
    raise ValueError("a solution with no steps has no step probabilities to aggregate")
  bad = [x for x in p if not 0.0 <= x <= 1.0]  # also catches NaN
  if bad:
    raise ValueError(f"step probabilities must lie in [0, 1]; got {bad[0]!r}")
  if how == "min":
    return min(p)
  if how == "last":
    return p[-1]
  if how == "product":
    return math.prod(p)
  return math.fsum(p) / len(p)
