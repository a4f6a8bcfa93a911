"""Canonical rows that every data format and adapter is turned into.

A message list is a list of ``{"role": str, "content": str}`` dicts; a plain string is raw text
(tokenized without a chat template). ``source`` names where the row came from
(``"train.jsonl:17"`` or ``"HelpSteer3[row 17]"``) so later stages can point at it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

Message = dict[str, str]
Text = str | list[Message]  # plain text, or a conversation


@dataclasses.dataclass(frozen=True)
class PreferenceRecord:
  """A prompt with two or more completions ranked by preference (lower rank preferred).

  ``completions[i]`` has rank ``ranks[i]``; ranks are distinct integers. A pair is the special
  case of two completions. ``margin`` is an optional per-row Bradley-Terry margin, ``strength``
  the annotated strength of the preference (scaled Bradley-Terry weighs the pair by it).
  """

  context: Text
  completions: tuple[Text, ...]
  ranks: tuple[int, ...]
  source: str
  margin: float | None = None
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. {"subset": "math"}
  strength: float | None = None


@dataclasses.dataclass(frozen=True)
class RatedRecord:
  """A prompt and one response rated on named attributes (a regression target per attribute).

  ``ratings[i]`` is the rating of the i-th attribute the row was read for, None where the row
  does not rate it; at least one is rated.
  """

  context: Text
  completion: Text
  ratings: tuple[float | None, ...]
  source: str
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class LabelledRecord:
  """A prompt and one completion labelled good (True) or bad (False): TRL's unpaired preference
  rows, which a generative verifier trains on (:mod:`jaxrm.tasks.verifier`)."""

  context: Text
  completion: Text
  label: bool
  source: str
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepwiseRecord:
  """A prompt and a solution split into steps, each labelled correct (True) or not (False)."""

  prompt: Text
  steps: tuple[str, ...]
  labels: tuple[bool, ...]
  source: str
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)
