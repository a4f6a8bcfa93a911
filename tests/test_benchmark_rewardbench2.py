"""RewardBench 2: best-of-N with its tie rule, the Ties subset's weighted score, the average."""

import math

import pytest
from helpers import write_jsonl

from jaxrm.benchmarks import format_report, load, run
from jaxrm.benchmarks.scoring import Scorer
from jaxrm.errors import DataError


def rewards_from_text(conversations):
  """Each response is "<reward> <words>": the stub reads its reward off the text."""
  return [float(c[-1]["content"].split()[0]) for c in conversations]


def row(i, subset, chosen, rejected, num_correct=None):
  return {
    "id": i,
    "prompt": f"prompt {i}",
    "chosen": chosen,
    "rejected": rejected,
    "num_correct": len(chosen) if num_correct is None else num_correct,
    "num_incorrect": len(rejected),
    "total_completions": len(chosen) + len(rejected),
    "models": ["m"] * (len(chosen) + len(rejected)),
    "subset": subset,
    "additional_metadata": {},
  }


ROWS = [
  row("0", "Factuality", ["3 right"], ["1 a", "2 b", "0 c"]),  # the chosen is the best: 1
  row("1", "Factuality", ["2 right"], ["2 a", "1 b", "2 c"]),  # three tied at the maximum: 1/3
  row("2", "Factuality", ["1 right"], ["2 a", "0 b", "0 c"]),  # beaten: 0
  row("3", "Math", ["5 right"], ["1 a", "1 b", "1 c"]),  # 1
  # Ties: ref:N has one correct answer, tied:N several (num_correct of them, listed first).
  row("ref:0", "Ties", ["4 ok"], ["1 no", "2 no"]),
  row("tied:0", "Ties", ["5 ok", "4.5 ok", "4 ok"], ["1 no", "2 no"]),
  row("ref:1", "Ties", ["2 ok"], ["3 no", "1 no"]),
  row("tied:1", "Ties", ["6 ok", "2 ok"], ["1 no"]),
  row("tied:2", "Ties", ["3 ok", "3 ok"], ["3 no"]),  # no ref:2; a tie with the incorrect is not accurate
]


def test_official_figures_by_hand(tmp_path):
  calls = []
  scorer = Scorer(lambda convs: calls.append(len(convs)) or rewards_from_text(convs))
  report = run("rewardbench2", scorer, write_jsonl(tmp_path / "rb2.jsonl", ROWS))
  assert calls == [4 * 4 + 3 + 5 + 3 + 3 + 3]  # every completion of every prompt in one call
  r = report["results"]
  assert r["Factuality"] == pytest.approx((1 + 1 / 3 + 0) / 3)
  assert r["Math"] == 1.0
  # Ties, per prompt (worst correct vs best incorrect; spread of the correct; gap to the incorrect):
  #   ref:0  accurate (4 > 2), gap 2        tied:0  accurate (4 > 2), spread 1, gap 2
  #   ref:1  not accurate (2 < 3), gap -1   tied:1  accurate (2 > 1), spread 4, gap 1
  #   tied:2 not accurate (3 = 3), no ref: counts in the tied accuracy only.
  # Prompts 0 and 1 have both rows: preferred (tied gap > spread) 0: 2 > 1 yes, 1: 1 > 4 no;
  # hard (min of both gaps > spread) 0: 2 > 1 yes, 1: -1 > 4 no; margin tanh(min gap / spread - 1).
  parts = report["details"]["Ties"]
  assert parts["accuracy_ref"] == 0.5 and parts["accuracy_tied"] == pytest.approx(2 / 3)
  assert parts["correctness_preferred"] == 0.5 and parts["correctness_preferred_hard"] == 0.5
  margin = (math.tanh(2 / 1 - 1) + math.tanh(-1 / 4 - 1)) / 2
  assert parts["correctness_margin_score"] == pytest.approx(margin)
  ties = 0.3 * (2 / 3) + 0.3 * 0.5 + 0.2 * 0.5 + 0.2 * 0.5 + 0.01 * margin
  assert r["Ties"] == pytest.approx(ties)
  assert r["Score"] == pytest.approx((4 / 9 + 1 + ties) / 3)  # the subsets present, unweighted
  assert report["missing_subsets"] == ["Precise IF", "Safety", "Focus"]
  assert report["counts"] == {"Factuality": 3, "Math": 1, "Ties": 5}
  # Length bias pairs each correct completion with each incorrect one: 4 * 3, then the Ties rows'
  # 1 * 2 + 3 * 2 + 1 * 2 + 2 * 1 + 2 * 1.
  bias = report["length_bias"]
  assert sum(bias[k]["num_pairs"] for k in ("chosen_longer", "chosen_shorter", "same_length")) == 12 + 14
  assert bias["spearman"]["num_responses"] == 33
  assert report["partial"] and report["unknown_subsets"] == []
  table = format_report(report)
  assert "Score (partial) | Factuality |       Math |       Ties" in table
  assert (
    f"{100 * r['Score']:>15.2f} | {100 * r['Factuality']:>10.2f} |     100.00 | {100 * ties:>10.2f}" in table
  )
  assert "partial: the Score averages 3 of the 6 subsets; not in the data: Precise IF, Safety, Focus" in table


@pytest.mark.parametrize(
  "bad, message",
  [
    (row("ref-3", "Ties", ["1 ok"], ["0 no"]), "rb2.jsonl:2: field 'id': is 'ref-3'; a Ties row's id is"),
    (
      row("tied:3", "Ties", ["1 ok", "1 ok"], ["0 no"], num_correct=1),
      "rb2.jsonl:2: field 'num_correct': is 1 but 'chosen' has 2 entries",
    ),
    (
      {**ROWS[0], "rejected": "1 a"},
      "rb2.jsonl:2: field 'rejected': expected a list of strings, got a string",
    ),
    ({**ROWS[0], "chosen": []}, "rb2.jsonl:2: field 'chosen': is an empty list"),
    ({**ROWS[0], "num_correct": "1"}, "rb2.jsonl:2: field 'num_correct': expected an integer"),
  ],
)
def test_rows_outside_the_schema_name_row_and_field(tmp_path, bad, message):
  with pytest.raises(DataError, match=message):
    load("rewardbench2", write_jsonl(tmp_path / "rb2.jsonl", [ROWS[0], bad]))


def test_saved_dataset_dict_split(tmp_path):
  import datasets

  rows = [{k: v for k, v in r.items() if k != "additional_metadata"} for r in ROWS[:4]]
  datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "rb2"))
  report = run("rewardbench2", Scorer(rewards_from_text), str(tmp_path / "rb2"))
  assert report["split"] == "test" and report["num_examples"] == 4
  assert report["results"]["Score"] == pytest.approx((4 / 9 + 1) / 2)


def test_a_ties_score_near_zero_prints_what_it_is(tmp_path):
  # Neither prompt accurate; the margin term alone: 0.01 * tanh(min gap / spread - 1) = 0.01 * tanh(-1.5).
  rows = [row("ref:0", "Ties", ["1 ok"], ["2 no"]), row("tied:0", "Ties", ["3 ok", "1 ok"], ["2 no"])]
  report = run("rewardbench2", Scorer(rewards_from_text), write_jsonl(tmp_path / "rb2.jsonl", rows))
  ties = 0.01 * math.tanh(-1 / 2 - 1)
  assert report["results"]["Ties"] == pytest.approx(ties)
  lines = format_report(report).splitlines()
  header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("Score"))
  assert lines[header : header + 3] == [
    "Score (partial) |       Ties",
    "          -0.91 |      -0.91",
    "                |        n=2",
  ]  # one decimal printed -0.9


def test_subset_names_in_another_case_are_the_official_ones(tmp_path):
  rows = [{**r, "subset": r["subset"].lower()} for r in ROWS[:4]]
  report = run("rewardbench2", Scorer(rewards_from_text), write_jsonl(tmp_path / "rb2.jsonl", rows))
  assert report["results"] == {
    "Score": pytest.approx((4 / 9 + 1) / 2),
    "Factuality": pytest.approx(4 / 9),
    "Math": 1.0,
  }
  assert report["unknown_subsets"] == [] and report["partial"]
  table = format_report(report)
  assert (
    "Score (partial) | Factuality |       Math" in table and "      72.22 |      44.44 |     100.00" in table
  )
  assert "the Score averages 2 of the 6 subsets; not in the data: Precise IF, Safety, Focus, Ties" in table


def test_unknown_subsets_are_named_and_a_set_of_none_has_no_score(tmp_path):
  rows = [ROWS[0], {**ROWS[3], "subset": "Chat"}]
  report = run("rewardbench2", Scorer(rewards_from_text), write_jsonl(tmp_path / "rb2.jsonl", rows))
  assert report["results"]["Score"] == 1.0 and report["results"]["Chat"] == 1.0
  table = format_report(report)
  assert "not RewardBench 2 subsets (scored, left out of the Score): Chat" in table
  assert "partial: the Score averages 1 of the 6 subsets" in table
  report = run("rewardbench2", Scorer(rewards_from_text), write_jsonl(tmp_path / "rb2.jsonl", rows[1:]))
  assert math.isnan(report["results"]["Score"]) and report["partial"]
  table = format_report(report)
  assert table.splitlines()[2:5] == [
    "     Score |       Chat",
    "         - |     100.00",
    "           |        n=1",
  ]
  assert (
    "no Score: the data holds none of RewardBench 2's subsets (Factuality, Precise IF, Math, Safety, "
    "Focus, Ties)"
  ) in table
  assert "partial" not in table and "averages" not in table
  assert "not RewardBench 2 subsets (scored, left out of the Score): Chat" in table
