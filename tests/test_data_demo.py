"""The procedural demo datasets: correct answers, disjoint splits, determinism, label balance."""

import re

import numpy as np
import pytest

from jaxrm.data import demo, formats
from jaxrm.data.drops import DropReport
from jaxrm.errors import DataError

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "×": lambda a, b: a * b}
EQUATION = re.compile(r"(\d+) ([-+×]) (\d+) = (-?\d+)\.?")


@pytest.fixture(scope="module")
def pairs():
  return {split: demo.demo_arithmetic(split) for split in demo.SPLITS}


@pytest.fixture(scope="module")
def solutions():
  return {split: demo.demo_arithmetic_steps(split) for split in demo.SPLITS}


def answers(row):
  """(chosen text, rejected text) of a demo preference row."""
  by_rank = sorted(row["completions"], key=lambda c: c["rank"])
  return tuple(c["completion"][0]["content"] for c in by_rank)


def question(row):
  return row["context"][-1]["content"]


def test_preference_rows_are_valid_and_sized(pairs):
  assert {s: len(rows) for s, rows in pairs.items()} == {"train": 4000, "validation": 500}
  drops = DropReport()
  for i, row in enumerate(pairs["validation"]):
    record = formats.parse_preference(row, f"demo[row {i}]", drops)
    assert record.ranks in ((0, 1), (1, 0)) and [m["role"] for m in record.context] == ["system", "user"]
  assert drops.total == 0
  assert len(demo.demo_arithmetic("train", num_rows=7, seed=3)) == 7


def test_chosen_is_right_and_rejected_plausibly_wrong(pairs):
  mistakes = set()
  for row in pairs["train"]:
    chosen, rejected = answers(row)
    if row["subset"] != "arithmetic":
      assert chosen != rejected
      continue
    a, op, b, right = EQUATION.fullmatch(chosen).groups()
    assert question(row) == f"What is {a} {op} {b}?" and int(right) == OPS[op](int(a), int(b))
    wrong = int(EQUATION.fullmatch(rejected).group(4))
    right = int(right)
    assert wrong != right and wrong >= 0
    if abs(wrong - right) == 10:
      mistakes.add("off by ten")
    elif sorted(str(wrong)) == sorted(str(right)):
      mistakes.add("swapped digits")
    else:
      assert wrong in [f(int(a), int(b)) for f in OPS.values()]
      mistakes.add("wrong operation")
  assert mistakes == {"off by ten", "swapped digits", "wrong operation"}


def test_facts():
  rows = demo.demo_arithmetic("train", num_rows=300)
  by_subset = {}
  for row in rows:
    by_subset.setdefault(row["subset"], []).append(row)
  assert set(by_subset) == {"arithmetic", "capitals"}
  capitals = dict(demo.CAPITALS)
  for row in by_subset["capitals"]:
    country = re.fullmatch(r"What is the capital of (.+)\?", question(row)).group(1)
    right, wrong = answers(row)
    assert right == f"The capital of {country} is {capitals[country]}."
    other = re.fullmatch(rf"The capital of {country} is (.+)\.", wrong).group(1)
    assert other in capitals.values() and other != capitals[country]


def test_preferred_completion_is_not_always_first(pairs):
  first_ranks = [row["completions"][0]["rank"] for row in pairs["train"]]
  assert 0.4 < np.mean(first_ranks) < 0.6


def test_splits_share_no_question(pairs, solutions):
  other_seed = demo.demo_arithmetic("validation", seed=1)
  train = {question(r) for r in pairs["train"]}
  assert not train & {question(r) for r in pairs["validation"] + other_seed}
  prompts = {split: {r["prompt"] for r in rows} for split, rows in solutions.items()}
  assert not prompts["train"] & prompts["validation"]
  for rows in pairs.values():
    assert {r["subset"] for r in rows} == {"arithmetic", "capitals"}


def test_deterministic_per_seed_without_global_rng():
  np.random.seed(123)
  state = np.random.get_state()[1].copy()
  first = demo.demo_arithmetic("train", num_rows=50, seed=5)
  steps = demo.demo_arithmetic_steps("train", num_rows=50, seed=5)
  assert (np.random.get_state()[1] == state).all()
  assert demo.demo_arithmetic("train", num_rows=50, seed=5) == first
  assert demo.demo_arithmetic_steps("train", num_rows=50, seed=5) == steps
  assert demo.demo_arithmetic("train", num_rows=50, seed=6) != first
  assert demo.demo_arithmetic_steps("train", num_rows=50, seed=6) != steps


def test_steps_labels_are_true_until_the_first_wrong_step(solutions):
  drops = DropReport()
  for i, row in enumerate(solutions["train"]):
    formats.parse_stepwise(row, f"demo[row {i}]", drops)
    value = int(re.match(r"Start with (\d+),", row["prompt"]).group(1))
    all_right = True
    for step, label in zip(row["completions"][:-1], row["labels"][:-1]):
      a, op, b, result = EQUATION.fullmatch(step).groups()
      assert int(a) == value  # each step starts from the value the previous one wrote
      all_right &= int(result) == OPS[op](int(a), int(b))
      assert label == all_right
      value = int(result)
    assert row["completions"][-1] == f"The answer is {value}."
    assert row["labels"][-1] == all_right
    assert row["subset"] == ("clean" if all_right else "mistake")
    assert 3 <= len(row["completions"]) <= 5


@pytest.mark.parametrize("seed", [0, 1])
def test_always_true_scores_at_most_60_percent(solutions, seed):
  for split in demo.SPLITS:
    rows = solutions[split] if seed == 0 else demo.demo_arithmetic_steps(split, seed=seed)
    labels = np.concatenate([r["labels"] for r in rows])
    assert 0.4 <= labels.mean() <= 0.6, (split, labels.mean())
    assert 0.25 < np.mean([all(r["labels"]) for r in rows]) < 0.42


def test_sizes_and_unknown_split(solutions):
  assert {s: len(rows) for s, rows in solutions.items()} == {"train": 3000, "validation": 300}
  with pytest.raises(DataError, match=r"demo split 'test': use one of train, validation"):
    demo.demo_arithmetic("test")
  with pytest.raises(DataError, match=r"demo split 'dev'"):
    demo.demo_arithmetic_steps("dev")


def test_wrong_results():
  assert demo.wrong_results(12, "+", 7) == [5, 9, 29, 84, 91]  # 12-7, off by ten, 12×7, 91
  assert demo.wrong_results(3, "-", 3) == [6, 9, 10]  # no negative, no swap of a single digit
  assert demo.wrong_results(5, "×", 2) == [0, 3, 7, 20]  # 10 has no swap (it would read 01)
