"""Evaluating a pairwise judge: on preference pairs, each judged in both orders (accuracy in each
order and in both, consistency, position bias), equal to a hand computation from
``rm.compare``'s single orders; the benchmarks' judge paths, JudgeBench's rule for the two orders."""

import json

import numpy as np
import pytest
from helpers import REBATCHED, assistant, user

from jaxrm import RewardModel, benchmarks
from jaxrm.benchmarks import judgebench
from jaxrm.benchmarks.scoring import Scorer
from jaxrm.evaluation import evaluate, format_report, plot_scores, run_benchmark

PAIRS = [
  {"prompt": [user("What is 2 + 2?")], "chosen": [assistant("4")], "rejected": [assistant("5")]},
  {"prompt": [user("Capital of France?")], "chosen": [assistant("Paris")], "rejected": [assistant("Rome")]},
  {"prompt": [user("Say hi.")], "chosen": [assistant("Hi!")], "rejected": [assistant("No.")]},
  {"prompt": [user("3 * 3?")], "chosen": [assistant("9")], "rejected": [assistant("6, I think")]},
]


@pytest.fixture(scope="module")
def judge(causal_dir):
  return RewardModel.from_pretrained(causal_dir, judge=True)


def _sigmoid(x):
  return 1 / (1 + np.exp(-np.asarray(x, np.float64)))


def test_a_judges_pairs_are_scored_in_both_orders(judge, tmp_path):
  path = tmp_path / "pairs.jsonl"
  path.write_text("".join(json.dumps(row) + "\n" for row in PAIRS))
  result = evaluate(judge, str(path), max_length=128)
  prompts = [r["prompt"] for r in PAIRS]
  chosen, rejected = [r["chosen"] for r in PAIRS], [r["rejected"] for r in PAIRS]
  ab = judge.compare(prompts, chosen, rejected, orders="ab")  # the better shown as A
  ba = judge.compare(prompts, rejected, chosen, orders="ab")  # ... as B
  assert result["kind"] == "pairwise" and result["num_examples"] == len(PAIRS)
  np.testing.assert_allclose(result["scores"]["better_as_a"], ab, **REBATCHED)
  np.testing.assert_allclose(result["scores"]["better_as_b"], ba, **REBATCHED)
  m = result["metrics"]
  first, second = ab > 0, ba < 0
  assert m["accuracy_first"] == pytest.approx(first.mean())
  assert m["accuracy_second"] == pytest.approx(second.mean())
  assert m["accuracy"] == pytest.approx((first.mean() + second.mean()) / 2)
  assert m["consistency"] == pytest.approx((first == second).mean())
  assert m["position_bias"] == pytest.approx(((_sigmoid(ab) + _sigmoid(ba)) / 2).mean(), rel=1e-6)
  loss = -(np.log(_sigmoid(ab)) + np.log(_sigmoid(-ba))) / 2
  assert m["loss"] == pytest.approx(loss.mean(), rel=1e-5)
  report = format_report(result)
  assert "position bias" in report and "consistency" in report


def test_a_judges_plot_shows_its_log_odds_in_each_order():
  from matplotlib.figure import Figure

  scores = {
    "better_as_a": np.array([1.0, 2.0, -0.5], np.float32),
    "better_as_b": np.array([-1.0, 0.5], np.float32),
  }
  ax = Figure().add_subplot()
  plot_scores({"kind": "pairwise", "scores": scores}, ax)
  labels = [t.get_text() for t in ax.get_legend().get_texts()]
  assert labels == ["better response shown as A (n=3)", "better response shown as B (n=2)"]
  assert ax.get_xlabel() == "log p(A) - log p(B)" and ax.get_title().endswith("in each order")


# ------------------------------------------------------------------ benchmarks


class TableJudge:
  """A judge's log-odds s(A, B) read off a table by (A, B); it records the size of each call."""

  def __init__(self, table):
    self.table, self.calls = table, []

  def __call__(self, prompts, responses_a, responses_b):
    self.calls.append(len(prompts))
    return [self.table[a, b] for a, b in zip(responses_a, responses_b)]


def _judgebench_row(i, source, label):
  return {
    "pair_id": f"p{i}",
    "source": source,
    "question": f"Q{i}",
    "response_A": f"a{i}",
    "response_B": f"b{i}",
    "label": label,
  }


# JudgeBench's rule (utils/metrics.py): the swapped order's verdict flipped back, +1 each verdict
# right, -1 each wrong, 0 for none; a pair is right when the sum is above 0.
JUDGEBENCH = [
  (_judgebench_row(0, "mmlu-pro-law", "A>B"), 1.0, -1.0),  # right both ways: right
  (_judgebench_row(1, "mmlu-pro-math", "A>B"), 1.0, 1.0),  # the orders disagree (+1 - 1): not right
  (_judgebench_row(2, "livebench-math", "B>A"), 1.0, 0.0),  # wrong, then no verdict: not right
  (_judgebench_row(3, "livebench-math", "B>A"), -2.0, 0.0),  # right, then no verdict: right
]


def test_judgebench_counts_a_pair_right_as_its_own_rule_does(tmp_path):
  path = tmp_path / "judgebench.jsonl"
  path.write_text("".join(json.dumps(row) + "\n" for row, _, _ in JUDGEBENCH))
  table = {}
  for row, s_ab, s_ba in JUDGEBENCH:
    table[row["response_A"], row["response_B"]] = s_ab
    table[row["response_B"], row["response_A"]] = s_ba
  judge = TableJudge(table)
  report = benchmarks.run("judgebench", Scorer(judge_fn=judge), str(path))
  assert judge.calls == [8]  # every pair in both orders, in one call
  assert report["results"] == {"Overall": 0.5, "Knowledge": 0.5, "Math": 0.5}
  assert report["per_source"] == {"livebench-math": 0.5, "mmlu-pro-law": 1.0, "mmlu-pro-math": 0.0}
  assert report["consistency"] == {"both_right": 1, "both_wrong": 1, "orders_disagree": 3}
  # the better response shown as A: log-odds 1, 1, 0, 0 (right twice); as B: -1, 1, 1, -2 (twice)
  assert report["judge"]["accuracy_first"] == 0.5 and report["judge"]["accuracy_second"] == 0.5
  assert report["judge"]["consistency"] == 0.5  # pairs 0 (right both ways) and 2 (wrong both ways)
  assert "the two orders disagree on 3" in benchmarks.format_report(report)


def test_rewardbench_asks_a_judge_both_orders(tmp_path):
  rows = [
    {"prompt": "Q0", "chosen": "c0", "rejected": "r0", "subset": "alpacaeval-easy", "id": 0},
    {"prompt": "Q1", "chosen": "c1", "rejected": "r1", "subset": "alpacaeval-easy", "id": 1},
  ]
  path = tmp_path / "rewardbench.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  # pair 0: 2 as given, 1 swapped -> mean (2 - 1) / 2 > 0, right; pair 1: 1 and 3 -> wrong
  judge = TableJudge({("c0", "r0"): 2.0, ("r0", "c0"): 1.0, ("c1", "r1"): 1.0, ("r1", "c1"): 3.0})
  report = benchmarks.run("rewardbench", Scorer(judge_fn=judge), str(path))
  assert judge.calls == [4] and report["results"]["alpacaeval-easy"] == 0.5
  assert report["judge"]["consistency"] == 0.0 and "length_bias" not in report


def test_rmbench_asks_a_judge_each_style_pair_in_both_orders(tmp_path):
  chosen, rejected = ["c0", "c1", "c2"], ["r0", "r1", "r2"]
  path = tmp_path / "rmbench.jsonl"
  path.write_text(
    json.dumps({"id": 0, "prompt": "Q", "domain": "chat", "chosen": chosen, "rejected": rejected})
  )
  # the chosen shown as A: 2; shown as B: 3 against a plainer rejected style (the mean loses), else 1
  table = {(c, r): 2.0 for c in chosen for r in rejected}
  table |= {(r, c): 3.0 if i < j else 1.0 for i, c in enumerate(chosen) for j, r in enumerate(rejected)}
  judge = TableJudge(table)
  report = benchmarks.run("rmbench", Scorer(judge_fn=judge), str(path))
  assert judge.calls == [18] and "length_bias" not in report
  assert (report["results"]["hard_acc"], report["results"]["normal_acc"], report["results"]["easy_acc"]) == (
    0,
    1,
    1,
  )
  figures = report["judge"]
  assert (figures["accuracy_first"], figures["accuracy_second"], figures["consistency"]) == (1, 0, 0)
  assert "a pairwise judge, each pair asked in both orders (their mean" in benchmarks.format_report(report)


def test_judgebench_with_a_judge_model_reads_its_log_odds(judge, tmp_path):
  rows = [row for row, _, _ in JUDGEBENCH]
  path = tmp_path / "judgebench.jsonl"
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  report = run_benchmark("judgebench", judge, str(path))
  prompts, a, b = ([r[k] for r in rows] for k in ("question", "response_A", "response_B"))
  s_ab = judge.compare(prompts, a, b, orders="ab")
  s_ba = judge.compare(prompts, b, a, orders="ab")
  verdicts = [
    judgebench.outcome(r["label"], judgebench.decision(x), judgebench.decision(y)) > 0
    for r, x, y in zip(rows, s_ab, s_ba)
  ]
  assert report["results"]["Overall"] == np.mean(verdicts)


def test_rewardbench2_ranks_a_judges_groups_by_their_round_robin(tmp_path):
  rows = [
    {
      "prompt": "Q0",
      "chosen": ["c0"],
      "rejected": ["x", "y", "z"],
      "num_correct": 1,
      "subset": "Math",
      "id": 0,
    },
    {
      "prompt": "Q1",
      "chosen": ["c1"],
      "rejected": ["u", "v", "w"],
      "num_correct": 1,
      "subset": "Math",
      "id": 1,
    },
  ]
  path = tmp_path / "rewardbench2.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  strengths = {"Q0": [1.0, 0.0, -0.5, -0.5], "Q1": [0.0, 1.0, -0.5, -0.5]}  # the chosen first
  asked = []

  def groups(prompts, groups_):
    asked.append([len(g) for g in groups_])
    return [strengths[p] for p in prompts]

  report = benchmarks.run("rewardbench2", Scorer(judge_fn=lambda *a: [], groups_fn=groups), str(path))
  assert asked == [[4, 4]] and report["results"]["Math"] == 0.5
  assert "a pairwise judge's path" in benchmarks.format_report(report)
