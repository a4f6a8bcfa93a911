"""Adapters from public datasets' raw rows to canonical records.

Each adapter takes one row exactly as the dataset publishes it and returns a record, or None when
the row is dropped on purpose (a tie, for instance), counted in ``drops`` under a reason named
below. Rows that do not fit the schema raise :class:`DataError` naming the row and the field.
"""

from __future__ import annotations

import re
from typing import Any

from jaxrm.data import formats
from jaxrm.data.drops import DropReport, row_error
from jaxrm.data.formats import required, row_meta
from jaxrm.data.records import Message, PreferenceRecord, RatedRecord, StepwiseRecord
from jaxrm.errors import DataError

DROP_HELPSTEER3_TIE = "HelpSteer3 tie (overall_preference == 0)"
DROP_ULTRAFEEDBACK_TIE = "UltraFeedback tie (score_chosen == score_rejected)"
DROP_PRM800K_NO_STEP = "PRM800K row with no rated step"
DROP_PRM800K_NEUTRAL = "PRM800K row with a neutral step (neutral='drop')"
DROP_SHEPHERD_NO_FIRST_STEP = "Math-Shepherd input without 'Step 1:' before the first step tag"


def helpsteer3(
  row: dict, source: str, drops: DropReport, *, subset_field: str | None = "subset"
) -> PreferenceRecord | None:
  """A ``nvidia/HelpSteer3`` preference row.

  ``context`` (messages, or a string taken as one user turn), ``response1``, ``response2``,
  ``overall_preference`` in -3..3: negative prefers ``response1``, positive ``response2``; 0 is a
  tie, dropped and counted. The responses become assistant turns; ranks are chosen 0, rejected 1;
  ``|overall_preference|`` is the preference's strength (1 slightly better .. 3 much better).
  """
  preference = required(row, "overall_preference", source)
  if not formats.is_int(preference) or not -3 <= preference <= 3:
    raise row_error(
      source,
      "overall_preference",
      f"expected an integer in -3..3, got {preference!r} ({formats.json_type(preference)})",
    )
  context = formats.parse_text(required(row, "context", source), source, "context")
  first, second = (
    formats.parse_completion(required(row, f, source), source, f) for f in ("response1", "response2")
  )
  if preference == 0:
    drops.drop(DROP_HELPSTEER3_TIE, source)
    return None
  chosen, rejected = (first, second) if preference < 0 else (second, first)
  return formats.preference_record(
    formats.as_chat(context, "user"),
    (formats.as_chat(chosen, "assistant"), formats.as_chat(rejected, "assistant")),
    (0, 1),
    source,
    drops,
    meta=row_meta(row, subset_field),
    strength=float(abs(preference)),
  )


HELPSTEER2_ATTRIBUTES = ("helpfulness", "correctness", "coherence", "complexity", "verbosity")
HELPSTEER2_RANGE = (0, 4)
# HelpSteer2 writes a multi-turn prompt as one string: "turn 1<extra_id_1>Assistant\nturn 2
# <extra_id_1>User\nturn 3", the first turn the user's.
HELPSTEER2_TURN = "<extra_id_1>"
_HELPSTEER2_ROLE = re.compile(r"(Assistant|User)\s")


def helpsteer2(
  row: dict,
  source: str,
  drops: DropReport,
  *,
  attributes: tuple[str, ...] = HELPSTEER2_ATTRIBUTES,
  subset_field: str | None = "subset",
) -> RatedRecord | None:
  """A ``nvidia/HelpSteer2`` row: ``prompt``, ``response`` and the five attributes, integers 0..4.

  ``attributes`` are the ones read, in this order (a subset of the five); a null or absent one is
  not rated, and a row that rates none of them is dropped and counted. A multi-turn prompt's
  ``<extra_id_1>Assistant`` / ``<extra_id_1>User`` markers become messages; the response is the
  assistant's next turn.
  """
  unknown = [a for a in attributes if a not in HELPSTEER2_ATTRIBUTES]
  if unknown:
    raise DataError(
      f"HelpSteer2 rates {', '.join(HELPSTEER2_ATTRIBUTES)}; it has no {', '.join(unknown)} "
      "(reward.attributes)"
    )
  prompt = required(row, "prompt", source)
  if not isinstance(prompt, str):
    raise row_error(source, "prompt", f"expected a string, got {formats.json_type(prompt)}")
  response = formats.parse_completion(required(row, "response", source), source, "response")
  ratings = tuple(_helpsteer2_rating(row.get(a), source, a) for a in attributes)
  return formats.rated_record(
    _helpsteer2_turns(prompt, source),
    formats.as_chat(response, "assistant"),
    ratings,
    source,
    drops,
    meta=row_meta(row, subset_field),
  )


def _helpsteer2_rating(value: Any, source: str, field: str) -> float | None:
  low, high = HELPSTEER2_RANGE
  if value is None:
    return None
  if not formats.is_int(value) or not low <= value <= high:
    raise row_error(
      source, field, f"expected an integer in {low}..{high}, got {value!r} ({formats.json_type(value)})"
    )
  return float(value)


def _helpsteer2_turns(prompt: str, source: str) -> list[Message]:
  first, *rest = prompt.split(HELPSTEER2_TURN)
  messages = [{"role": "user", "content": first.strip()}]
  for i, turn in enumerate(rest):
    role = _HELPSTEER2_ROLE.match(turn)
    if role is None:
      raise row_error(
        source,
        "prompt",
        f"turn {i + 2} (after marker {i + 1} '{HELPSTEER2_TURN}') does not "
        f"start with 'Assistant' or 'User' and a line break: {turn[:40]!r}",
      )
    messages.append({"role": role.group(1).lower(), "content": turn[role.end() :].strip()})
  if messages[-1]["role"] != "user":
    raise row_error(source, "prompt", "ends with an assistant turn; the response answers a user turn")
  for i, m in enumerate(messages):
    if not m["content"]:
      raise row_error(source, "prompt", f"turn {i + 1} is empty")
  return messages


def ultrafeedback(
  row: dict, source: str, drops: DropReport, *, subset_field: str | None = "subset"
) -> PreferenceRecord | None:
  """A ``HuggingFaceH4/ultrafeedback_binarized`` row (``*_prefs`` splits).

  ``chosen`` and ``rejected`` are whole conversations that start with the prompt as a user turn;
  the prompt is their shared leading messages (the ``prompt`` column repeats it and is not used).
  Equal ``score_chosen`` and ``score_rejected`` is a tie, dropped and counted; a lower
  ``score_chosen`` means the columns are not what they claim, an error.
  """
  score_chosen, score_rejected = (
    formats.number(required(row, f, source), source, f) for f in ("score_chosen", "score_rejected")
  )
  chosen, rejected = (
    formats.validate_messages(required(row, f, source), source, f) for f in ("chosen", "rejected")
  )
  if score_chosen < score_rejected:
    raise row_error(
      source,
      "score_chosen",
      f"{score_chosen} is below score_rejected "
      f"{score_rejected}; expected the chosen response to score at least as high",
    )
  if score_chosen == score_rejected:
    drops.drop(DROP_ULTRAFEEDBACK_TIE, source)
    return None
  context, chosen, rejected = formats.split_shared_prompt(chosen, rejected)
  for text, field in ((chosen, "chosen"), (rejected, "rejected")):
    formats.check_completion(text, source, field)
  return formats.preference_record(
    context, (chosen, rejected), (0, 1), source, drops, meta=row_meta(row, subset_field)
  )


_NEUTRAL = {"correct": True, "incorrect": False, "drop": None}


def prm800k(
  row: dict, source: str, drops: DropReport, *, neutral: str = "correct", subset_field: str | None = "subset"
) -> StepwiseRecord | None:
  """An ``openai/prm800k`` row (phase 2; phase 1 rows are read the same way).

  The prompt is ``question.problem``. The steps are the solution the labeller followed: at each
  entry of ``label.steps``, ``completions[chosen_completion]``, or the ``human_completion``
  (phase 1; a step the labeller wrote, taken as correct) when no completion was chosen. The
  solution ends at its first step rated -1, as labelling did. An entry with neither a chosen nor a
  human completion ends it too: in phase 2 that is the step where the labeller found the error,
  whose first completion rated -1 (the pre-generated step) is kept as the last, incorrect step.
  Alternatives that were not chosen are not used: one row gives one record.

  Ratings become labels: +1 -> True, -1 -> False, and 0 (neutral: valid but no progress) as
  ``neutral`` says: ``"correct"`` (True), ``"incorrect"`` (False, as TRL's PRM800K conversion
  does) or ``"drop"`` (the whole row is dropped and counted). A row with no rated step is dropped
  and counted.
  """
  if neutral not in _NEUTRAL:
    raise DataError(f"PRM800K: neutral={neutral!r}; use one of {', '.join(map(repr, _NEUTRAL))}")
  problem = _field(row, "question.problem", str, source)
  solution = _prm800k_solution(_field(row, "label.steps", list, source), source)
  if not solution:
    drops.drop(DROP_PRM800K_NO_STEP, source)
    return None
  if neutral == "drop" and any(rating == 0 for _, rating in solution):
    drops.drop(DROP_PRM800K_NEUTRAL, source)
    return None
  labels = tuple(_NEUTRAL[neutral] if rating == 0 else rating == 1 for _, rating in solution)
  return StepwiseRecord(
    prompt=problem,
    steps=tuple(text for text, _ in solution),
    labels=labels,
    source=source,
    meta=row_meta(row, subset_field),
  )


def _field(row: dict, path: str, type_: type, source: str) -> Any:
  """``row["a"]["b"]`` for ``path`` ``"a.b"``, checked to be a ``type_``."""
  value, done = row, []
  for key in path.split("."):
    if not isinstance(value, dict):
      raise row_error(source, ".".join(done), f"expected an object, got {formats.json_type(value)}")
    value = required(value, key, source, ".".join(done))
    done.append(key)
  if not isinstance(value, type_):
    raise row_error(source, path, f"expected {formats.json_type(type_())}, got {formats.json_type(value)}")
  return value


def _prm800k_solution(steps: list, source: str) -> list[tuple[str, int]]:
  """``[(text, rating)]`` of the followed solution, up to and including its first -1."""
  solution = []
  for i, step in enumerate(steps):
    field = f"label.steps[{i}]"
    if not isinstance(step, dict):
      raise row_error(source, field, f"expected an object, got {formats.json_type(step)}")
    completions = step.get("completions") or []
    chosen = step.get("chosen_completion")
    if chosen is not None:
      if not formats.is_int(chosen) or not 0 <= chosen < len(completions):
        raise row_error(
          source,
          f"{field}.chosen_completion",
          f"{chosen!r} is not an index into its {len(completions)} completions",
        )
      solution.append(_prm800k_step(completions[chosen], source, f"{field}.completions[{chosen}]"))
    elif step.get("human_completion") is not None:
      solution.append((_prm800k_text(step["human_completion"], source, f"{field}.human_completion"), 1))
    else:
      errors = [(j, c) for j, c in enumerate(completions) if isinstance(c, dict) and c.get("rating") == -1]
      if errors:
        j, c = errors[0]
        solution.append(_prm800k_step(c, source, f"{field}.completions[{j}]"))
      break
    if solution[-1][1] == -1:
      break
  return solution


def _prm800k_step(completion: Any, source: str, field: str) -> tuple[str, int]:
  if not isinstance(completion, dict):
    raise row_error(source, field, f"expected an object, got {formats.json_type(completion)}")
  rating = required(completion, "rating", source, field)
  if not formats.is_int(rating) or rating not in (-1, 0, 1):
    raise row_error(source, f"{field}.rating", f"expected -1, 0 or 1, got {rating!r}")
  return _prm800k_text(completion, source, field), int(rating)


def _prm800k_text(completion: Any, source: str, field: str) -> str:
  text = completion.get("text") if isinstance(completion, dict) else completion
  if not isinstance(text, str) or not text.strip():
    raise row_error(source, f"{field}.text", f"expected a non-empty step string, got {text!r}")
  return text


STEP_TAG = "ки"
_FIRST_STEP = re.compile(r"[Ss]tep 1:")


def math_shepherd(
  row: dict, source: str, drops: DropReport, *, subset_field: str | None = "subset"
) -> StepwiseRecord | None:
  """A ``peiyi9979/Math-Shepherd`` row.

  ``input`` is the question followed by the solution, each step ending with the tag ``ки``;
  ``label`` is the same text with ``+`` (correct) or ``-`` (incorrect) in place of each tag. The
  prompt is the text before ``Step 1:``; the steps keep their ``Step k:`` prefix and lose
  surrounding whitespace. A row with no ``Step 1:`` before its first tag (a few rows carry a tag
  inside the question) is dropped and counted.
  """
  text, label = (required(row, f, source) for f in ("input", "label"))
  for value, field in ((text, "input"), (label, "label")):
    if not isinstance(value, str):
      raise row_error(source, field, f"expected a string, got {formats.json_type(value)}")
  pieces = text.split(STEP_TAG)
  if len(pieces) < 2:
    raise row_error(source, "input", f"has no '{STEP_TAG}' step tag")
  if pieces[-1].strip():
    raise row_error(source, "input", f"has text after its last '{STEP_TAG}' step tag")
  labels = _shepherd_labels(pieces, label, source)
  first = _FIRST_STEP.search(pieces[0])
  if first is None:
    drops.drop(DROP_SHEPHERD_NO_FIRST_STEP, source)
    return None
  steps = tuple(s.strip() for s in (pieces[0][first.start() :], *pieces[1:-1]))
  for k, step in enumerate(steps):
    if not step:
      raise row_error(source, "input", f"step {k + 1} is empty")
  return StepwiseRecord(
    prompt=pieces[0][: first.start()].strip(),
    steps=steps,
    labels=labels,
    source=source,
    meta=row_meta(row, subset_field),
  )


def _shepherd_labels(pieces: list[str], label: str, source: str) -> tuple[bool, ...]:
  """The ``+``/``-`` that stand where ``input`` has its tags; ``label`` must match otherwise."""
  marks, start = [], 0
  for k, piece in enumerate(pieces[:-1]):
    end = start + len(piece)
    if label[start:end] != piece or label[end : end + 1] not in ("+", "-"):
      raise _shepherd_mismatch(source, f"at step tag {k + 1}")
    marks.append(label[end] == "+")
    start = end + 1
  if label[start:] != pieces[-1]:
    raise _shepherd_mismatch(source, "after the last step tag")
  return tuple(marks)


def _shepherd_mismatch(source: str, where: str) -> DataError:
  return row_error(
    source,
    "label",
    f"differs from 'input' {where}; expected the same text with each '{STEP_TAG}' replaced by '+' or '-'",
  )
