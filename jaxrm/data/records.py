"""Canonical rows that every data format and adapter is turned into.

A message list is a list of ``{"role": str, "content": str}`` dicts; a plain string is raw text
(tokenized without a chat template). ``source`` names where the row came from
(``"train.jsonl:17"`` or ``"HelpSteer3[row 17]"``) so later stages can point at it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

Message = dict[str, str]
Text = Union[str, list[Message]]  # plain text, or a conversation


@dataclasses.dataclass(frozen=True)
class PreferenceRecord:
  """A prompt with two or more completions ranked by preference (lower rank preferred).

  ``completions[i]`` has rank ``ranks[i]``; ranks are distinct integers. A pair is the special
  case of two completions. ``margin`` is an optional per-row Bradley-Terry margin.
  """

  context: Text
  completions: tuple[Text, ...]
  ranks: tuple[int, ...]
  source: str
  margin: float | None = None
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. {"subset": "math"}


@dataclasses.dataclass(frozen=True)
class StepwiseRecord:
  """A prompt and a solution split into steps, each labelled correct (True) or not (False)."""

  prompt: Text
  steps: tuple[str, ...]
  labels: tuple[bool, ...]
  source: str
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)
