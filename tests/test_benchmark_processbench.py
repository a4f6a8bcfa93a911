"""ProcessBench: the predicted first error, accuracies on erroneous and correct samples, F1."""

import re
import types

import pytest
from helpers import write_jsonl

from jaxrm.benchmarks import format_report, load, run
from jaxrm.benchmarks.scoring import Scorer
from jaxrm.errors import DataError, EvaluationError
from jaxrm.evaluation import run_benchmark

# The stub PRM's P(step correct) for each step text.
P_CORRECT = {"ok": 0.9, "bad": 0.2, "meh": 0.5}


def step_probabilities(problems, steps_lists):
  return [[P_CORRECT[s.split()[0]] for s in steps] for steps in steps_lists]


def sample(i, steps, label):
  return {
    "id": f"s-{i}",
    "generator": "m",
    "problem": f"problem {i}",
    "steps": [f"{s} step" for s in steps],
    "final_answer_correct": label == -1,
    "label": label,
  }


GSM8K = [
  sample(0, ["ok", "ok"], -1),  # predicted -1: right
  sample(1, ["ok", "bad"], -1),  # a correct solution called wrong at step 1
  sample(2, ["ok", "bad", "ok"], 1),  # right
  # The error is at step 0 (P = 0.5, not below the threshold): found one step late.
  sample(3, ["meh", "bad"], 0),
  sample(4, ["ok", "ok", "bad"], 2),  # right
]
MATH = [sample(10, ["ok"], -1), sample(11, ["bad", "ok"], 0)]


def test_official_figures_by_hand(tmp_path):
  report = run(
    "processbench", Scorer(steps_fn=step_probabilities), write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
  )
  g = report["results"]["gsm8k"]  # a file is one split, named after the file
  assert g["error_acc"] == pytest.approx(200 / 3)  # samples 2 and 4 of 2, 3, 4
  assert g["correct_acc"] == pytest.approx(50.0)  # sample 0 of 0, 1
  assert g["f1"] == pytest.approx(2 * (200 / 3) * 50 / (200 / 3 + 50))
  assert report["results"]["average_f1"] == pytest.approx(g["f1"])
  assert [p["prediction"] for p in report["predictions"]["gsm8k"]] == [-1, 1, 1, 1, 2]
  assert report["counts"]["gsm8k"] == {"error": 3, "correct": 2}
  assert "length_bias" not in report
  # A higher threshold calls P = 0.5 wrong: sample 3's error is found at step 0.
  strict = run(
    "processbench",
    Scorer(steps_fn=step_probabilities),
    write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K),
    threshold=0.6,
  )
  assert strict["results"]["gsm8k"]["error_acc"] == 100.0


def test_splits_of_a_saved_dataset_dict(tmp_path):
  import datasets

  path = str(tmp_path / "pb")
  datasets.DatasetDict(
    {"math": datasets.Dataset.from_list(MATH), "gsm8k": datasets.Dataset.from_list(GSM8K)}
  ).save_to_disk(path)
  calls = []
  scorer = Scorer(steps_fn=lambda p, s: calls.append(len(p)) or step_probabilities(p, s))
  report = run("processbench", scorer, path)
  assert calls == [7]  # both splits in one call
  r = report["results"]
  assert list(r) == ["gsm8k", "math", "average_f1"]  # the official order
  assert r["math"] == {"error_acc": 100.0, "correct_acc": 100.0, "f1": 100.0}
  assert r["average_f1"] == pytest.approx((r["gsm8k"]["f1"] + 100) / 2)
  table = format_report(report)
  assert "gsm8k           math   Avg. F1" in table
  assert f"{'F1':>12}{r['gsm8k']['f1']:>15.1f}{100:>15.1f}{r['average_f1']:>10.1f}" in table
  only_math = run("processbench", Scorer(steps_fn=step_probabilities), path, split="math")
  assert list(only_math["results"]) == ["math", "average_f1"]


def test_unscorable_solutions_are_dropped_and_counted(tmp_path):
  too_long = lambda p, s: [
    None if len(steps) > 2 else probs for steps, probs in zip(s, step_probabilities(p, s))
  ]
  report = run("processbench", Scorer(steps_fn=too_long), write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K))
  assert report["dropped"]["total"] == 2  # samples 2 and 4 have 3 steps
  (reason,) = report["dropped"]["reasons"]
  assert reason.startswith("problem + steps longer than max_length")
  assert report["dropped"]["reasons"][reason]["examples"] == [
    f"{tmp_path}/gsm8k.jsonl:3",
    f"{tmp_path}/gsm8k.jsonl:5",
  ]
  assert report["results"]["gsm8k"]["error_acc"] == 0.0  # only sample 3 is left among the erroneous


@pytest.mark.parametrize(
  "bad, message",
  [
    ({**GSM8K[0], "label": 2}, "gsm8k.jsonl:2: field 'label': is 2; it is the index of the first wrong step"),
    ({**GSM8K[0], "label": True}, "gsm8k.jsonl:2: field 'label': expected an integer"),
    ({k: v for k, v in GSM8K[0].items() if k != "steps"}, "gsm8k.jsonl:2: field 'steps': is missing"),
  ],
)
def test_rows_outside_the_schema_name_row_and_field(tmp_path, bad, message):
  with pytest.raises(DataError, match=message):
    load("processbench", write_jsonl(tmp_path / "gsm8k.jsonl", [GSM8K[0], bad]))


def test_a_sequence_head_model_is_refused(tmp_path):
  with pytest.raises(EvaluationError, match="needs a token-head"):
    run("processbench", Scorer(rewards_fn=lambda c: [0.0] * len(c)), write_jsonl(tmp_path / "g.jsonl", GSM8K))


class RecordingPRM:
  """Stands in for a process RewardModel that calls every step correct; it records the
  ``max_length`` the benchmark's scorer asks for."""

  def __init__(self, head="token", num_labels=2):
    self.config = types.SimpleNamespace(head=head, num_labels=num_labels, max_position_embeddings=4096)
    self.attributes, self.max_lengths = None, []

  def encode_steps(self, problem, steps, *, max_length, where):
    del problem, where
    self.max_lengths.append(max_length)
    return list(range(len(steps))), list(range(len(steps)))

  def step_probabilities(self, encoded, *, batch_size, bucket, max_length):
    del batch_size, bucket, max_length
    return [[0.99] * len(positions) for _, positions in encoded]


def test_by_default_no_solution_is_cut_below_the_models_context(tmp_path):
  prm = RecordingPRM()
  report = run_benchmark("processbench", prm, write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K))
  assert prm.max_lengths == [4096] * len(GSM8K)  # the official harness cuts and drops nothing
  assert report["results"]["gsm8k"]["correct_acc"] == 100.0 and report["dropped"]["total"] == 0


def test_a_sequence_head_model_is_refused_by_its_kind(tmp_path):
  with pytest.raises(
    EvaluationError,
    match=re.escape(
      "processbench needs a token-head (process reward) model with 2 labels (step in error, step correct); "
      "this model has a sequence head with 1 output"
    ),
  ):
    run_benchmark(
      "processbench", RecordingPRM(head="sequence", num_labels=1), write_jsonl(tmp_path / "g.jsonl", GSM8K)
    )


def test_a_split_without_errors_prints_what_its_figures_mean(tmp_path):
  correct_only = [sample(20, ["ok"], -1), sample(21, ["ok", "bad"], -1)]
  report = run(
    "processbench", Scorer(steps_fn=step_probabilities), write_jsonl(tmp_path / "math.jsonl", correct_only)
  )
  table = format_report(report).splitlines()
  start = next(i for i, line in enumerate(table) if line.split() == ["math", "Avg.", "F1"])
  assert table[start + 1 : start + 5] == [
    "       error      no errors",
    "     correct           50.0",
    "          F1      no errors undefined",
    "     samples          0 / 2",
  ]
  assert "nan" not in "\n".join(table)


def test_the_prm_subset_table_says_what_an_undefined_metric_means():
  from jaxrm.evaluation import format_report as evaluation_report

  metrics = {
    "step_accuracy": 0.5,
    "positive_rate": 0.5,
    "recall_correct": 1.0,
    "recall_error": 0.0,
    "f1_error": 0.0,
    "first_error_found": 0.0,
    "loss": 0.7,
  }
  subsets = {
    "algebra": {"num_examples": 3, **metrics},
    # No step in error and none called one: F1 (error class) and first error found count nothing.
    "easy": {"num_examples": 2, **metrics, "f1_error": float("nan"), "first_error_found": float("nan")},
  }
  lines = evaluation_report(
    {"kind": "stepwise", "num_examples": 5, "metrics": metrics, "subsets": subsets}
  ).splitlines()
  assert lines[-2:] == [
    "algebra       3             0.5000             0.0000             0.0000             0.5000",
    "easy          2             0.5000          no errors          no errors             0.5000",
  ]
