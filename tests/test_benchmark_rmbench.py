"""RM-Bench: the 3x3 style matrix and its hard / normal / easy accuracies, by hand."""

import numpy as np
import pytest
from helpers import write_jsonl

from jaxrm.benchmarks import format_report, load, run
from jaxrm.benchmarks.scoring import Scorer
from jaxrm.errors import DataError


def rewards_from_text(conversations):
  """Each response is "<reward> <words>": the stub reads its reward off the text."""
  return [float(c[-1]["content"].split()[0]) for c in conversations]


def row(i, domain, chosen, rejected):
  styles = ("short", "long plain", "long **markdown**")
  return {
    "id": i,
    "prompt": f"prompt {i}",
    "domain": domain,
    "chosen": [f"{x} {s}" for x, s in zip(chosen, styles)],
    "rejected": [f"{x} {s}" for x, s in zip(rejected, styles)],
  }


ROWS = [
  row(0, "chat", [3, 5, 6], [4, 1, 2]),  # wins by chosen style: [0 1 1], [1 1 1], [1 1 1]
  row(1, "chat", [1, 1, 1], [0, 1, 2]),  # every chosen style: [1 0 0] (a tie is not a win)
  row(2, "safety-refuse", [2, 2, 2], [1, 1, 3]),  # every chosen style: [1 1 0]
]


def test_official_figures_by_hand(tmp_path):
  calls = []
  scorer = Scorer(lambda convs: calls.append(len(convs)) or rewards_from_text(convs))
  report = run("rmbench", scorer, write_jsonl(tmp_path / "rmb.jsonl", ROWS))
  assert calls == [18]
  chat = report["details"]["chat"]
  np.testing.assert_allclose(chat["style_matrix"], [[0.5, 0.5, 0.5], [1, 0.5, 0.5], [1, 0.5, 0.5]])
  assert chat["hard_acc"] == pytest.approx(1.5 / 3)  # upper triangle: chosen plainer than rejected
  assert chat["normal_acc"] == pytest.approx(0.5)  # diagonal
  assert chat["easy_acc"] == pytest.approx(2.5 / 3)  # lower triangle
  safety = report["details"]["safety"]  # safety-refuse counts as safety
  assert (safety["hard_acc"], safety["normal_acc"], safety["easy_acc"]) == pytest.approx((1 / 3, 2 / 3, 1))
  r = report["results"]
  assert r["chat"] == pytest.approx((0.5 + 0.5 + 2.5 / 3) / 3)
  assert r["safety"] == pytest.approx(2 / 3)
  # Overall: means over the domains present, not over rows.
  assert r["hard_acc"] == pytest.approx((0.5 + 1 / 3) / 2)
  assert r["normal_acc"] == pytest.approx((0.5 + 2 / 3) / 2)
  assert r["easy_acc"] == pytest.approx((2.5 / 3 + 1) / 2)
  assert r["total_avg_acc"] == pytest.approx((11 / 18 + 2 / 3) / 2)
  assert set(r) == {"chat", "safety", "hard_acc", "normal_acc", "easy_acc", "total_avg_acc"}
  assert report["missing_subsets"] == ["math", "code"]
  assert report["length_bias"]["spearman"]["num_responses"] == 18
  buckets = ("chosen_longer", "chosen_shorter", "same_length")
  assert sum(report["length_bias"][k]["num_pairs"] for k in buckets) == 27  # 9 style pairs a row
  table = format_report(report)
  assert "   Chat |  Safety |    Easy |  Normal |    Hard |     Avg" in table
  assert f"{100 * r['total_avg_acc']:>7.1f}" in table


@pytest.mark.parametrize(
  "bad, message",
  [
    (
      {**ROWS[0], "chosen": ROWS[0]["chosen"][:2]},
      "rmb.jsonl:2: field 'chosen': has 2 entries; this benchmark has exactly 3",
    ),
    (
      {**ROWS[0], "domain": "finance"},
      "rmb.jsonl:2: field 'domain': is 'finance'; RM-Bench domains start with",
    ),
    (
      {**ROWS[0], "rejected": ["a", 2, "c"]},
      r"rmb.jsonl:2: field 'rejected\[1\]': expected a string, got an integer",
    ),
  ],
)
def test_rows_outside_the_schema_name_row_and_field(tmp_path, bad, message):
  with pytest.raises(DataError, match=message):
    load("rmbench", write_jsonl(tmp_path / "rmb.jsonl", [ROWS[0], bad]))
