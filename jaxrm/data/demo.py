"""Procedural demo datasets: offline, deterministic, and small enough to train on in minutes.

They produce ordinary rows (NeMo RL preference rows, TRL stepwise rows, rated rows) that go through
the same parsing as user data. A question belongs to ``train`` or ``validation`` by a hash of its text,
whatever the seed, so the two splits never share a question.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable

import numpy as np

from jaxrm.errors import DataError

SPLITS = ("train", "validation")
DEFAULT_ROWS = {"train": 4000, "validation": 500}
DEFAULT_STEP_ROWS = {"train": 3000, "validation": 300}
DEFAULT_RATED_ROWS = {"train": 2000, "validation": 400}
# About one question in five is held out for validation.
_VALIDATION_BUCKETS = 5

# (family, question, correct answer, plausible wrong answers)
Item = tuple[str, str, str, tuple[str, ...]]


def split_of(question: str) -> str:
  """The split a question belongs to, fixed by its text."""
  held_out = zlib.crc32(question.encode("utf-8")) % _VALIDATION_BUCKETS == 0
  return "validation" if held_out else "train"


def _rng(split: str, seed: int) -> np.random.Generator:
  return np.random.default_rng([seed, SPLITS.index(split)])


def _check_split(split: str) -> None:
  if split not in SPLITS:
    raise DataError(f"demo split {split!r}: use one of {', '.join(SPLITS)}")


# --- Wrong answers --------------------------------------------------------------------------------

_OPS: dict[str, Callable[[int, int], int]] = {
  "+": lambda a, b: a + b,
  "-": lambda a, b: a - b,
  "×": lambda a, b: a * b,
}


def _swap_last_digits(n: int) -> int | None:
  s = str(n)
  if len(s) < 2 or (len(s) == 2 and s[1] == "0"):
    return None
  return int(s[:-2] + s[-1] + s[-2])


def wrong_results(a: int, op: str, b: int) -> list[int]:
  """Plausible wrong values of ``a op b``: off by ten, last digits swapped, another operation.

  Off-by-one answers were tried and left out: the embedded 135M model's likelihood prefers the
  right answer to one off by one only 73% of the time in subtraction, and a reward model trained
  on a thousand pairs scored held-out off-by-one pairs at chance (40-49% for + and -), while it
  learned the other mistakes.
  """
  right = _OPS[op](a, b)
  candidates = [right - 10, right + 10, _swap_last_digits(right)]
  candidates += [f(a, b) for other, f in _OPS.items() if other != op]
  return sorted({c for c in candidates if c is not None and c >= 0 and c != right})


# A short system turn: without one, chat templates such as SmolLM2's insert a long default.
SYSTEM = {"role": "system", "content": "Answer briefly."}

# --- Preference questions -------------------------------------------------------------------------

# Countries whose capitals the embedded 135M model knows: given a country's capital and another
# country's, its own likelihood prefers the right one every time. Cities that are not the capital
# of their country (Sydney, Istanbul, Zurich...) were tried as wrong answers; the model prefers
# them as often as not, so no reward model built on it can learn them from other countries. The
# same holds for "which day/month/letter comes after X" with a neighbour as the wrong answer
# (65% preferred right), which is why there are no such questions.
CAPITALS = (
  ("France", "Paris"),
  ("Germany", "Berlin"),
  ("Italy", "Rome"),
  ("Spain", "Madrid"),
  ("Japan", "Tokyo"),
  ("China", "Beijing"),
  ("Russia", "Moscow"),
  ("the United Kingdom", "London"),
  ("Egypt", "Cairo"),
  ("Greece", "Athens"),
  ("Portugal", "Lisbon"),
  ("Ireland", "Dublin"),
  ("Austria", "Vienna"),
  ("Norway", "Oslo"),
  ("Sweden", "Stockholm"),
  ("Denmark", "Copenhagen"),
  ("Finland", "Helsinki"),
  ("Poland", "Warsaw"),
  ("Hungary", "Budapest"),
  ("the Netherlands", "Amsterdam"),
  ("Belgium", "Brussels"),
  ("Mexico", "Mexico City"),
  ("Argentina", "Buenos Aires"),
  ("Peru", "Lima"),
  ("Chile", "Santiago"),
  ("Cuba", "Havana"),
  ("Thailand", "Bangkok"),
  ("South Korea", "Seoul"),
  ("Indonesia", "Jakarta"),
  ("Iran", "Tehran"),
  ("Iraq", "Baghdad"),
  ("Kenya", "Nairobi"),
  ("Canada", "Ottawa"),
  ("Australia", "Canberra"),
  ("India", "New Delhi"),
  ("the Czech Republic", "Prague"),
  ("Ukraine", "Kyiv"),
  ("Turkey", "Ankara"),
  ("the Philippines", "Manila"),
  ("Vietnam", "Hanoi"),
)


def _arithmetic_items() -> list[Item]:
  # Small integers: a 135M model learns to check most of them from about a thousand pairs.
  pairs = [("+", a, b) for a in range(13) for b in range(13)]
  pairs += [("-", a, b) for a in range(19) for b in range(a + 1)]
  pairs += [("×", a, b) for a in range(2, 10) for b in range(2, 10)]
  return [
    (
      "arithmetic",
      f"What is {a} {op} {b}?",
      f"{a} {op} {b} = {_OPS[op](a, b)}.",
      tuple(f"{a} {op} {b} = {w}." for w in wrong_results(a, op, b)),
    )
    for op, a, b in pairs
  ]


def _capital_items() -> list[Item]:
  capitals = [capital for _, capital in CAPITALS]
  return [
    (
      "capitals",
      f"What is the capital of {country}?",
      f"The capital of {country} is {capital}.",
      tuple(f"The capital of {country} is {other}." for other in capitals if other != capital),
    )
    for country, capital in CAPITALS
  ]


# Each kind of question and the share of rows drawn from it. Within arithmetic every question is as
# likely as any other, so multiplications (64 of 423 questions) are rarer; giving each operation a
# third of the arithmetic rows was tried and lowered held-out accuracy (90.4% vs 93.0% after
# 120 x 8 pairs), as checking exact products is the hardest part for the embedded model.
_FAMILIES = ((_arithmetic_items, 0.75), (_capital_items, 0.25))


@functools.cache
def _pools(split: str) -> tuple[tuple[tuple[Item, ...], float], ...]:
  """The questions of ``split`` in each family, with the family's share of rows."""
  return tuple(
    (tuple(item for item in make() if split_of(item[1]) == split), share) for make, share in _FAMILIES
  )


def _preference_row(item: Item, rng: np.random.Generator) -> dict:
  family, question, right, wrongs = item
  completions = [
    {"rank": 0, "completion": [{"role": "assistant", "content": right}]},
    {"rank": 1, "completion": [{"role": "assistant", "content": wrongs[rng.integers(len(wrongs))]}]},
  ]
  if rng.random() < 0.5:  # the preferred completion is not always listed first
    completions.reverse()
  return {
    "context": [SYSTEM, {"role": "user", "content": question}],
    "completions": completions,
    "subset": family,
  }


def demo_arithmetic(split: str, num_rows: int | None = None, seed: int = 0) -> list[dict]:
  """NeMo RL preference rows (chat form): small-integer arithmetic and simple facts.

  The chosen completion gives the correct answer, the rejected one a plausible wrong one (off by
  ten, digits swapped, the wrong operation; another country's capital). Three rows in four are
  arithmetic, one in four capitals. ``row["subset"]`` names the family of question (``arithmetic``
  or ``capitals``). Questions repeat within a split.
  """
  _check_split(split)
  rng = _rng(split, seed)
  pools = _pools(split)
  shares = np.array([share for _, share in pools])
  rows = []
  for _ in range(DEFAULT_ROWS[split] if num_rows is None else num_rows):
    items = pools[rng.choice(len(pools), p=shares / shares.sum())][0]
    rows.append(_preference_row(items[rng.integers(len(items))], rng))
  return rows


# --- Stepwise solutions ---------------------------------------------------------------------------

# Share of solutions without a mistake; the rest have one, at a uniform step. With 2 to 4
# operations about half of all step labels are True, so always answering True is no good.
_CLEAN_SHARE = 1 / 3
_PHRASES = {"+": "add {}", "-": "subtract {}", "×": "multiply by {}"}


def _problem(rng: np.random.Generator) -> tuple[int, list[tuple[str, int]]]:
  start = value = int(rng.integers(2, 21))
  ops = []
  for _ in range(int(rng.integers(2, 5))):
    op = ("+", "-", "×")[rng.integers(3)]
    operand = int(rng.integers(2, 6 if op == "×" else 21))
    if op == "-" and operand > value:
      op = "+"
    ops.append((op, operand))
    value = _OPS[op](value, operand)
  return start, ops


def _chain(value: int, ops: list[tuple[str, int]]) -> int:
  """The lowest value met applying ``ops`` to ``value``."""
  lowest = value
  for op, x in ops:
    value = _OPS[op](value, x)
    lowest = min(lowest, value)
  return lowest


def _question(start: int, ops: list[tuple[str, int]]) -> str:
  phrases = [_PHRASES[op].format(x) for op, x in ops]
  return f"Start with {start}, {', '.join(phrases[:-1])}, then {phrases[-1]}. What is the result?"


def _solution(
  start: int, ops: list[tuple[str, int]], mistake: int | None, rng: np.random.Generator
) -> list[str]:
  """One step per operation, then the answer; step ``mistake`` (if any) states a wrong value."""
  steps, value = [], start
  for i, (op, x) in enumerate(ops):
    result = _OPS[op](value, x)
    if i == mistake:
      # The rest of the chain must stay non-negative; the right value plus ten always does, as
      # every operation grows with its input.
      wrongs = [w for w in wrong_results(value, op, x) if _chain(w, ops[i + 1 :]) >= 0]
      result = wrongs[rng.integers(len(wrongs))]
    steps.append(f"{value} {op} {x} = {result}")
    value = result  # later steps build on the value written, right or wrong
  return steps + [f"The answer is {value}."]


def demo_arithmetic_steps(split: str, num_rows: int | None = None, seed: int = 0) -> list[dict]:
  """TRL stepwise rows: chains of 2 to 4 operations solved one step per line, then the answer.

  A third of the solutions are right; the others get one wrong step, after which the solution
  carries on correctly from the wrong value. Labels are True up to the first mistake and False
  from it on, the answer included (the PRM800K convention). ``row["subset"]`` is ``"clean"`` or
  ``"mistake"``.
  """
  _check_split(split)
  rng = _rng(split, seed)
  rows = []
  while len(rows) < (DEFAULT_STEP_ROWS[split] if num_rows is None else num_rows):
    start, ops = _problem(rng)
    question = _question(start, ops)
    if split_of(question) != split:
      continue
    mistake = None if rng.random() < _CLEAN_SHARE else int(rng.integers(len(ops)))
    steps = _solution(start, ops, mistake, rng)
    first_false = len(steps) if mistake is None else mistake
    rows.append(
      {
        "prompt": question,
        "completions": steps,
        "labels": [i < first_false for i in range(len(steps))],
        "subset": "clean" if mistake is None else "mistake",
      }
    )
  return rows


# --- Rated responses ------------------------------------------------------------------------------

ATTRIBUTES = ("helpfulness", "correctness", "verbosity")
RATING_RANGE = (0, 4)
# Sentences that add nothing to an answer; a response's verbosity is how many it carries.
_FILLERS = (
  "I hope this helps.",
  "Let me know if you need more.",
  "This is a common question.",
  "Thanks for asking.",
  "Questions like this come up often.",
)
# About one response in ten leaves verbosity unrated, as real raters skip attributes.
_UNRATED_SHARE = 0.1


def _rated_response(item: Item, right: bool, rng: np.random.Generator) -> tuple[str, dict[str, float]]:
  _, _, answer, wrongs = item
  text = answer if right else wrongs[rng.integers(len(wrongs))]
  verbosity = int(rng.integers(len(_FILLERS)))
  fillers = [_FILLERS[i] for i in rng.permutation(len(_FILLERS))[:verbosity]]
  correctness = 4 if right else 0
  ratings = {
    "helpfulness": max(correctness - max(verbosity - 2, 0), 0),
    "correctness": correctness,
    "verbosity": verbosity,
  }
  return " ".join([text, *fillers]), ratings


def demo_attributes(split: str, num_rows: int | None = None, seed: int = 0) -> list[dict]:
  """Rated rows (``prompt``, ``response``, one column per attribute of :data:`ATTRIBUTES`, 0..4):
  the questions of :func:`demo_arithmetic`, each answered twice.

  The hidden rules: ``correctness`` is 4 for the right answer, 0 for a wrong one (each is drawn
  with probability 1/2); ``verbosity`` counts the filler sentences after the answer (0 to 4);
  ``helpfulness`` is correctness less one point per filler sentence beyond two, at least 0. The two
  answers to a question follow each other and share its prompt, so validation has same-prompt
  pairs; about one response in ten has verbosity unrated (null). ``row["subset"]`` is the family.
  """
  _check_split(split)
  rng = _rng(split, seed)
  pools = _pools(split)
  shares = np.array([share for _, share in pools])
  rows = []
  total = DEFAULT_RATED_ROWS[split] if num_rows is None else num_rows
  while len(rows) < total:
    items = pools[rng.choice(len(pools), p=shares / shares.sum())][0]
    item = items[rng.integers(len(items))]
    for _ in range(min(2, total - len(rows))):
      response, ratings = _rated_response(item, bool(rng.random() < 0.5), rng)
      if rng.random() < _UNRATED_SHARE:
        ratings["verbosity"] = None
      rows.append(
        {
          "prompt": [SYSTEM, {"role": "user", "content": item[1]}],
          "response": response,
          **ratings,
          "subset": item[0],
        }
      )
  return rows
