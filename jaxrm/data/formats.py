"""Row formats users bring, checked and turned into canonical records.

Preference rows come in two layouts, told apart by their keys:

* NeMo RL: ``{"context": ..., "completions": [{"rank": int, "completion": ...}, ...]}``, lower
  rank preferred. Two or more completions; their order and ranks are kept as given. Ranks are
  distinct integers (not necessarily 0..K-1): a tie is an error, because a ranked list with a tie
  has no single ordering to train on (remove the tied completions, or the row).
* TRL: ``prompt`` / ``chosen`` / ``rejected``, each a string (standard) or a message list
  (conversational). Without ``prompt`` the prompt is implicit: for conversations it is the leading
  messages that ``chosen`` and ``rejected`` share; for strings it is empty, the whole text being
  scored. An optional number ``margin`` is kept.

Explicit judgments: ``prompt`` / ``response_a`` / ``response_b`` / ``label``, the label naming the
better response, ``"A"`` or ``"B"`` (any case; JudgeBench's ``"A>B"`` and ``"B>A"`` too). They are
read as a preference with the better response ranked first, so every preference task trains on
them (a pairwise judge in both orders). A tie (``"tie"``, ``"A=B"``) is dropped and counted. A
number is refused: 0/1 read as an index (0 is A) and as a yes/no (1: A is better) disagree.

A preference file may hold labelled items instead (TRL's unpaired preference rows): ``prompt`` /
``completion`` / ``label`` (true: a good completion, false: a bad one), which only a generative
verifier trains on (:class:`~jaxrm.data.records.LabelledRecord`).

Both may carry ``strength``, a positive number: how strongly the preference was annotated
(scaled Bradley-Terry weighs the pair by it).

Stepwise rows (TRL stepwise supervision): ``{"prompt": ..., "completions": [step strings],
"labels": [bool or 0/1]}``.

Rated rows (regression): ``{"prompt" | "context": ..., "response" | "completion": ...,
"<attribute>": number, ...}``, read for the attributes the run names; an attribute the row leaves
out (or gives as null) is not rated, and a row that rates none of them is dropped and counted.

Texts are a string or a list of ``{"role", "content"}`` messages. When a row mixes the two, the
strings become messages (a prompt a ``user`` turn, a completion an ``assistant`` turn) so that the
whole row goes through the chat template. Completions that are identical are dropped and counted;
every other problem raises :class:`DataError` naming the row and the field.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from jaxrm.data.drops import DropReport, row_error
from jaxrm.data.records import LabelledRecord, Message, PreferenceRecord, RatedRecord, StepwiseRecord, Text
from jaxrm.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
DROP_IDENTICAL = "identical completions (chosen == rejected)"
DROP_UNRATED = "no rating for any of the attributes"
DROP_TIE = "judged a tie (label 'tie' or 'A=B')"
_BETTER = {"a": 0, "a>b": 0, "b": 1, "b>a": 1}
_TIES = ("tie", "a=b", "b=a")

_JSON_TYPES = {
  bool: "a boolean",
  int: "an integer",
  float: "a number",
  str: "a string",
  list: "a list",
  dict: "an object",
  type(None): "null",
}


def json_type(value: Any) -> str:
  """Names a value's type the way a JSON user would, for error messages."""
  return _JSON_TYPES.get(type(value), type(value).__name__)


LONE_SURROGATE = "holds a lone surrogate (a JSON escape in \\ud800-\\udfff alone), which is not text"


def not_text(value: Any, whole: str = "the row") -> str | None:
  """Where ``value`` (a parsed JSON row or body) holds a string or key with a lone surrogate, which
  JSON's ``\\u`` escapes allow and no tokenizer reads: ``"field 'a[0].b'"`` or ``"a key of
  field 'a'"`` (of ``whole`` at the top); None where there is none."""
  todo = [("", value)]
  while todo:
    path, x = todo.pop()
    if isinstance(x, str):
      if not _is_text(x):
        return f"field '{path}'"
    elif isinstance(x, dict):
      for k, v in reversed(x.items()):
        if isinstance(k, str) and not _is_text(k):
          return f"a key of {f'field {path!r}' if path else whole}"
        todo.append((f"{path}.{k}" if path else str(k), v))
    elif isinstance(x, list):
      todo.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(x))))
  return None


def _is_text(s: str) -> bool:
  if s.isascii():
    return True
  try:
    s.encode("utf-8")
  except UnicodeEncodeError:
    return False
  return True


def required(obj: dict, key: str, source: str, prefix: str = "") -> Any:
  """``obj[key]``; a missing or null value is an error naming ``prefix.key``."""
  value = obj.get(key)
  if value is None:
    where = f"{prefix}.{key}" if prefix else key
    raise row_error(source, where, f"is missing; have {sorted(obj)}")
  return value


def is_int(value: Any) -> bool:
  """True for integers, excluding booleans (``True`` is not a rank or a rating)."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def number(value: Any, source: str, field: str) -> float:
  """A finite int or float (not a boolean) as a float."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
    raise row_error(source, field, f"expected a finite number, got {value!r} ({json_type(value)})")
  return float(value)


def validate_messages(messages: Any, source: str, field: str) -> list[Message]:
  """Checks a message list and returns it as ``[{"role", "content"}]`` (other keys are left out).

  Roles are ``system``, ``user``, ``assistant`` and ``tool``; ``content`` is a string.
  """
  if not isinstance(messages, list):
    raise row_error(source, field, f"expected a list of messages, got {json_type(messages)}")
  return [_message(m, source, f"{field}[{i}]") for i, m in enumerate(messages)]


def _message(message: Any, source: str, field: str) -> Message:
  if not isinstance(message, dict):
    raise row_error(
      source, field, f"expected a message object with 'role' and 'content', got {json_type(message)}"
    )
  for key in ("role", "content"):
    if message.get(key) is None:
      raise row_error(source, field, f"message has no '{key}'; each message needs 'role' and 'content'")
  role, content = message["role"], message["content"]
  if role not in ROLES:
    raise row_error(source, f"{field}.role", f"unknown role {role!r}; use one of {', '.join(ROLES)}")
  if not isinstance(content, str):
    raise row_error(source, f"{field}.content", f"expected a string, got {json_type(content)}")
  return {"role": role, "content": content}


def parse_text(value: Any, source: str, field: str) -> Text:
  """A string, or a validated message list."""
  if isinstance(value, str):
    return value
  if isinstance(value, list):
    return validate_messages(value, source, field)
  raise row_error(source, field, f"expected a string or a list of messages, got {json_type(value)}")


def parse_texts(values: Any, name: str, call: str) -> list[Text]:
  """``values``, the argument ``name`` of ``rm.<call>``, checked as a list of texts or conversations
  (each a list of messages)."""
  one = (
    "one string"
    if isinstance(values, str)
    else "one message"
    if isinstance(values, dict)
    else "one conversation (a list of messages)"
    if isinstance(values, list) and values and all(isinstance(v, dict) for v in values)
    else None
  )
  if one:
    raise DataError(
      f"{call}: {name} is {one}, where a list of texts or conversations belongs: for one, "
      f"wrap it in a list (rm.{call}([...])); a conversation is a list of {{'role', 'content'}} "
      "messages"
    )
  if not isinstance(values, (list, tuple)):
    raise DataError(f"{call}: {name} is {json_type(values)}; expected a list of texts or conversations")
  return [parse_text(v, call, f"{name}[{i}]") for i, v in enumerate(values)]


def parse_completion(value: Any, source: str, field: str) -> Text:
  """Like :func:`parse_text`, and the text must not be empty."""
  return check_completion(parse_text(value, source, field), source, field)


def check_completion(text: Text, source: str, field: str) -> Text:
  """Refuses a completion with no message or only blank text."""
  if isinstance(text, list) and not text:
    raise row_error(source, field, "has no messages; a completion needs at least one")
  content = text if isinstance(text, str) else "".join(m["content"] for m in text)
  if not content.strip():
    raise row_error(source, field, "completion text is empty")
  return text


def as_chat(text: Text, role: str) -> list[Message]:
  """A message list: a string becomes one ``role`` message (an empty string, no message)."""
  if isinstance(text, list):
    return text
  return [{"role": role, "content": text}] if text else []


def row_meta(row: dict, subset_field: str | None) -> dict[str, Any]:
  """``{"subset": row[subset_field]}`` when the row has that column (RewardBench style)."""
  if subset_field and row.get(subset_field) is not None:
    return {"subset": str(row[subset_field])}
  return {}


def preference_record(
  context: Text,
  completions: Sequence[Text],
  ranks: Sequence[int],
  source: str,
  drops: DropReport,
  *,
  margin: float | None = None,
  meta: dict | None = None,
  strength: float | None = None,
) -> PreferenceRecord | None:
  """Builds the record, or drops a row whose completions are not all different."""
  if all(isinstance(t, str) for t in (context, *completions)):
    texts = tuple(completions)
  else:
    context = as_chat(context, "user")
    texts = tuple(as_chat(c, "assistant") for c in completions)
  if len({_key(t) for t in texts}) < len(texts):
    drops.drop(DROP_IDENTICAL, source)
    return None
  return PreferenceRecord(
    context=context,
    completions=texts,
    ranks=tuple(ranks),
    source=source,
    margin=margin,
    meta=meta or {},
    strength=strength,
  )


def _key(text: Text):
  return text if isinstance(text, str) else tuple((m["role"], m["content"]) for m in text)


def split_shared_prompt(chosen: Text, rejected: Text) -> tuple[Text, Text, Text]:
  """Implicit prompt: ``(shared leading messages, chosen rest, rejected rest)``.

  Strings have no prompt to find (``""``); identical conversations are returned whole, so that
  they are dropped as identical rather than refused as empty.
  """
  if isinstance(chosen, str) or isinstance(rejected, str) or chosen == rejected:
    return ("" if isinstance(chosen, str) and isinstance(rejected, str) else []), chosen, rejected
  n = 0
  while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
    n += 1
  return chosen[:n], chosen[n:], rejected[n:]


def parse_preference(
  row: dict, source: str, drops: DropReport, *, subset_field: str | None = "subset"
) -> PreferenceRecord | LabelledRecord | None:
  """A NeMo RL or TRL preference row, or a labelled item (see the module docstring), as a
  record, or None if dropped."""
  if "completions" in row or "context" in row:
    return _nemo_preference(row, source, drops, subset_field)
  if "chosen" in row or "rejected" in row:
    return _trl_preference(row, source, drops, subset_field)
  if "response_a" in row or "response_b" in row:
    return _judgment(row, source, drops, subset_field)
  if "label" in row and "completion" in row:
    return _trl_labelled(row, source, subset_field)
  raise row_error(
    source,
    None,
    f"not a preference row: expected NeMo RL keys ('context', 'completions'), TRL keys ('prompt', "
    f"'chosen', 'rejected'), a judgment's ('prompt', 'response_a', 'response_b', 'label') or a "
    f"labelled item's ('prompt', 'completion', 'label'); got {sorted(row)}",
  )


def _judgment(row, source, drops, subset_field):
  """A judgment of two responses as a preference, the better one ranked first."""
  context = parse_text(required(row, "prompt", source), source, "prompt")
  responses = [parse_completion(required(row, f, source), source, f) for f in ("response_a", "response_b")]
  better = _better(required(row, "label", source), source, drops)
  if better is None:
    return None
  return preference_record(
    context,
    responses,
    (better, 1 - better),
    source,
    drops,
    margin=_margin(row, source),
    meta=row_meta(row, subset_field),
    strength=_strength(row, source),
  )


def _better(label: Any, source: str, drops: DropReport) -> int | None:
  """0 (response A is better) or 1 (B is); None for a tie, dropped and counted."""
  key = label.strip().lower() if isinstance(label, str) else None
  if key in _BETTER:
    return _BETTER[key]
  if key in _TIES:
    drops.drop(DROP_TIE, source)
    return None
  raise row_error(
    source,
    "label",
    f"expected 'A' or 'B' (the better response), got {label!r} ({json_type(label)})"
    + (
      "; a number is ambiguous (an index, 0 for A, or a yes/no, 1 for A?): write the letter"
      if isinstance(label, (int, float))
      else ""
    ),
  )


def _trl_labelled(row: dict, source: str, subset_field: str | None) -> LabelledRecord:
  context = parse_text(required(row, "prompt", source), source, "prompt")
  completion = parse_completion(row["completion"], source, "completion")
  label = _label(row["label"], source, "label")
  if isinstance(context, list) or isinstance(completion, list):
    context, completion = as_chat(context, "user"), as_chat(completion, "assistant")
  return LabelledRecord(context, completion, label, source, row_meta(row, subset_field))


def _nemo_preference(row, source, drops, subset_field):
  context = parse_text(required(row, "context", source), source, "context")
  entries = required(row, "completions", source)
  if not isinstance(entries, list):
    raise row_error(
      source, "completions", f"expected a list of {{'rank', 'completion'}} objects, got {json_type(entries)}"
    )
  if len(entries) < 2:
    raise row_error(
      source,
      "completions",
      f"has {len(entries)} entr{'y' if entries else 'ies'}; a preference needs at least 2 ranked completions",
    )
  completions, ranks = [], []
  for i, entry in enumerate(entries):
    field = f"completions[{i}]"
    if not isinstance(entry, dict):
      raise row_error(
        source, field, f"expected an object with 'rank' and 'completion', got {json_type(entry)}"
      )
    ranks.append(_rank(required(entry, "rank", source, field), ranks, source, f"{field}.rank"))
    completion = required(entry, "completion", source, field)
    completions.append(parse_completion(completion, source, f"{field}.completion"))
  return preference_record(
    context,
    completions,
    ranks,
    source,
    drops,
    margin=_margin(row, source),
    meta=row_meta(row, subset_field),
    strength=_strength(row, source),
  )


def _rank(rank: Any, previous: list[int], source: str, field: str) -> int:
  if not is_int(rank):
    raise row_error(source, field, f"expected an integer rank, got {rank!r} ({json_type(rank)})")
  if rank in previous:
    raise row_error(
      source,
      field,
      f"rank {rank} is also the rank of "
      f"completions[{previous.index(rank)}]; ranks must be distinct (remove the "
      "tied completions, or the row)",
    )
  return int(rank)


def _margin(row: dict, source: str) -> float | None:
  return None if row.get("margin") is None else number(row["margin"], source, "margin")


def _strength(row: dict, source: str) -> float | None:
  if row.get("strength") is None:
    return None
  strength = number(row["strength"], source, "strength")
  if strength <= 0:
    raise row_error(
      source,
      "strength",
      f"{strength:g} is not a preference strength; give a positive "
      "number (how strongly the first-ranked completion is preferred)",
    )
  return strength


def _trl_preference(row, source, drops, subset_field):
  chosen = parse_completion(required(row, "chosen", source), source, "chosen")
  rejected = parse_completion(required(row, "rejected", source), source, "rejected")
  if row.get("prompt") is not None:
    context = parse_text(row["prompt"], source, "prompt")
  else:
    context, chosen, rejected = split_shared_prompt(chosen, rejected)
    for text, field, other in ((chosen, "chosen", "rejected"), (rejected, "rejected", "chosen")):
      if not text:
        raise row_error(
          source,
          field,
          f"has no message after the prompt it shares with "
          f"'{other}'; give a 'prompt' or a final differing turn",
        )
      check_completion(text, source, field)
  return preference_record(
    context,
    (chosen, rejected),
    (0, 1),
    source,
    drops,
    margin=_margin(row, source),
    meta=row_meta(row, subset_field),
    strength=_strength(row, source),
  )


def parse_rated(
  row: dict,
  source: str,
  drops: DropReport,
  *,
  attributes: Sequence[str],
  value_range: tuple[float, float] | None = None,
  subset_field: str | None = "subset",
) -> RatedRecord | None:
  """A rated row (see the module docstring) as a record, or None when it rates no attribute.

  ``value_range`` (low, high): a rating outside it is an error.
  """
  context = parse_text(_either(row, ("prompt", "context"), source), source, "prompt")
  response = parse_completion(_either(row, ("response", "completion"), source), source, "response")
  ratings = tuple(rating(row.get(a), source, a, value_range) for a in attributes)
  return rated_record(context, response, ratings, source, drops, meta=row_meta(row, subset_field))


def rating(value: Any, source: str, field: str, value_range: tuple[float, float] | None) -> float | None:
  """A rating: a finite number within ``value_range``, or None for a missing (null) one."""
  if value is None:
    return None
  value = number(value, source, field)
  if value_range is not None and not value_range[0] <= value <= value_range[1]:
    raise row_error(
      source,
      field,
      f"rating {value:g} is outside {value_range[0]:g}..{value_range[1]:g} (reward.attribute_range)",
    )
  return value


def rated_record(
  context: Text,
  response: Text,
  ratings: Sequence[float | None],
  source: str,
  drops: DropReport,
  *,
  meta: dict | None = None,
) -> RatedRecord | None:
  """Builds the record (a chat when either text is one), or drops a row with no rating."""
  if all(r is None for r in ratings):
    drops.drop(DROP_UNRATED, source)
    return None
  if isinstance(context, list) or isinstance(response, list):
    context, response = as_chat(context, "user"), as_chat(response, "assistant")
  return RatedRecord(
    context=context, completion=response, ratings=tuple(ratings), source=source, meta=meta or {}
  )


def _either(row: dict, keys: tuple[str, str], source: str) -> Any:
  """The value of the first of ``keys`` the row has; an error naming both when it has neither."""
  for key in keys:
    if row.get(key) is not None:
      return row[key]
  raise row_error(source, keys[0], f"is missing (nor is there '{keys[1]}'); have {sorted(row)}")


def parse_stepwise(
  row: dict, source: str, drops: DropReport, *, subset_field: str | None = "subset"
) -> StepwiseRecord:
  """A TRL stepwise-supervision row as a record.

  No stepwise row is dropped here (``drops`` is taken for the signature all parsers share): every
  problem is an error.
  """
  del drops
  prompt = parse_text(required(row, "prompt", source), source, "prompt")
  steps = _steps(required(row, "completions", source), source)
  labels = required(row, "labels", source)
  if not isinstance(labels, list):
    raise row_error(source, "labels", f"expected a list of booleans, got {json_type(labels)}")
  if len(labels) != len(steps):
    raise row_error(
      source,
      "labels",
      f"has {len(labels)} labels for {len(steps)} steps in 'completions'; give one label per step",
    )
  labels = tuple(_label(x, source, f"labels[{i}]") for i, x in enumerate(labels))
  return StepwiseRecord(
    prompt=prompt, steps=steps, labels=labels, source=source, meta=row_meta(row, subset_field)
  )


def _steps(steps: Any, source: str) -> tuple[str, ...]:
  if not isinstance(steps, list):
    raise row_error(source, "completions", f"expected a list of step strings, got {json_type(steps)}")
  if not steps:
    raise row_error(source, "completions", "has no steps; a stepwise row needs at least one")
  for i, step in enumerate(steps):
    if not isinstance(step, str):
      raise row_error(source, f"completions[{i}]", f"expected a step string, got {json_type(step)}")
    if not step.strip():
      raise row_error(source, f"completions[{i}]", "step text is empty")
  return tuple(steps)


def _label(label: Any, source: str, field: str) -> bool:
  if isinstance(label, bool):
    return label
  if is_int(label) and label in (0, 1):
    return bool(label)
  raise row_error(source, field, f"expected true/false or 0/1, got {label!r} ({json_type(label)})")
