"""RewardBench: the official figures of hand-written rows, scored by a stub reward."""

import json
import math
import re
import types

import numpy as np
import pytest
from helpers import write_jsonl

from jaxrm import benchmarks
from jaxrm.benchmarks import format_report, load, run
from jaxrm.benchmarks.scoring import Scorer, chat, tulu_text
from jaxrm.errors import DataError, EvaluationError
from jaxrm.evaluation import core, run_benchmark


class TableRewards:
  """A reward read off a table by the response text; it records the size of each call."""

  def __init__(self, table):
    self.table, self.calls = table, []

  def __call__(self, conversations):
    self.calls.append(len(conversations))
    for c in conversations:
      assert [m["role"] for m in c] == ["user", "assistant"] and c[0]["content"].startswith("Q")
    return [self.table[c[-1]["content"]] for c in conversations]


def row(i, subset, chosen, rejected):
  return {
    "prompt": f"Q{i}",
    "chosen": chosen,
    "rejected": rejected,
    "chosen_model": "m1",
    "rejected_model": "m2",
    "subset": subset,
    "id": i,
  }


# Chosen and rejected responses; their rewards are in REWARDS. Lengths are the string lengths.
ROWS = [
  row(0, "alpacaeval-easy", "long good answer", "bad"),  # right; chosen longer
  row(1, "alpacaeval-easy", "ok", "longer bad answer"),  # wrong; chosen shorter
  row(2, "mt-bench-easy", "fine reply", "poor reply"),  # right; same length
  row(3, "mt-bench-hard", "tie one", "tie two"),  # a tie is not right
  row(4, "xstest-should-refuse", "I can't help", "Here is how to"),  # right; chosen shorter
  row(5, "xstest-should-respond", "Sure, here.", "I refuse."),  # wrong; chosen longer
  row(6, "math-prm", "x = 2", "x = 3"),  # right
  row(7, "hep-python", "def f(): ok", "def f(): no"),  # right
  row(8, "hep-python", "def g(): ok", "def g(): no"),  # wrong
]
REWARDS = {
  "long good answer": 2.0,
  "bad": 1.0,
  "ok": 0.5,
  "longer bad answer": 1.5,
  "fine reply": 1.0,
  "poor reply": 0.0,
  "tie one": 0.7,
  "tie two": 0.7,
  "I can't help": 3.0,
  "Here is how to": -1.0,
  "Sure, here.": -2.0,
  "I refuse.": 1.0,
  "x = 2": 0.3,
  "x = 3": 0.2,
  "def f(): ok": 1.0,
  "def f(): no": 0.0,
  "def g(): ok": 0.0,
  "def g(): no": 0.1,
}


def test_official_figures_by_hand(tmp_path):
  rewards = TableRewards(REWARDS)
  report = run("rewardbench", Scorer(rewards), write_jsonl(tmp_path / "rb.jsonl", ROWS))
  r = report["results"]
  assert rewards.calls == [18]  # every response of the benchmark in one call
  assert r["alpacaeval-easy"] == 0.5 and r["mt-bench-easy"] == 1.0 and r["mt-bench-hard"] == 0.0
  assert r["hep-python"] == 0.5
  # Sections weigh subsets by the official EXAMPLE_COUNTS, not by the rows present: Chat is
  # (0.5 * 100 + 1 * 28) / 128, not 2 of 3 rows right.
  assert r["Chat"] == pytest.approx(78 / 128)
  assert r["Chat Hard"] == 0.0
  # Official counts: xstest-should-refuse 250, should-respond 154 (copies that swap them give 154 / 404).
  assert r["Safety"] == pytest.approx(250 / 404)
  # math-prm counts 984 (its 447 rows upweighted to the six code subsets' 6 * 164).
  assert r["Reasoning"] == pytest.approx((984 + 0.5 * 164) / (984 + 164))
  assert r["Score"] == pytest.approx((78 / 128 + 0 + 250 / 404 + 1066 / 1148) / 4)
  assert "Prior Sets (0.5 weight)" not in r
  assert report["counts"]["alpacaeval-easy"] == 2 and "hep-go" in report["missing_subsets"]

  bias = report["length_bias"]
  assert bias["chosen_longer"] == {"accuracy": 0.5, "num_pairs": 2}  # rows 0 (right) and 5 (wrong)
  assert bias["chosen_shorter"] == {"accuracy": 0.5, "num_pairs": 2}  # rows 1 (wrong) and 4 (right)
  # Rows 2, 6, 7 right; 3 (a tie) and 8 wrong.
  assert bias["same_length"] == {"accuracy": pytest.approx(3 / 5), "num_pairs": 5}
  categories = bias["length_categories"]  # constants.py LENGTH_CATEGORIES
  assert categories["True"]["subsets"] == ["alpacaeval-easy", "xstest-should-respond"]
  assert categories["True"]["accuracy"] == pytest.approx(1 / 3)  # rows 0, 1, 5
  assert categories["False"]["accuracy"] == pytest.approx(2 / 3)  # rows 2, 3, 4
  assert categories["Neutral"]["accuracy"] == pytest.approx(2 / 3)  # rows 6, 7, 8
  assert report["throughput"]["items"] == 18

  table = format_report(report)
  assert f"{100 * r['Score']:>9.1f} | {100 * r['Chat']:>9.1f}" in table
  assert "length category True" in table and "items/s" in table


def test_prior_sets_weigh_half(tmp_path):
  prior = [row(20, "anthropic_helpful", "help", "nope"), row(21, "shp", "meh", "good")]
  table = {**REWARDS, "help": 1.0, "nope": 0.0, "meh": 0.0, "good": 1.0}
  r = run("rewardbench", Scorer(TableRewards(table)), write_jsonl(tmp_path / "rb.jsonl", ROWS + prior))[
    "results"
  ]
  sections = [r[s] for s in ("Chat", "Chat Hard", "Safety", "Reasoning")]
  assert r["Prior Sets (0.5 weight)"] == 0.5  # mean of anthropic_helpful (1) and shp (0)
  assert r["Score"] == pytest.approx((2 * sum(sections) + 0.5) / 9)


def test_parquet_and_outputs(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  path = tmp_path / "rb.parquet"
  pq.write_table(pa.Table.from_pylist(ROWS[:3]), path)
  report = run_benchmark(
    "rewardbench",
    Scorer(TableRewards(REWARDS)),
    str(path),
    output_dir=str(tmp_path / "out"),
    info={"model": "stub"},
  )
  saved = json.loads((tmp_path / "out" / "eval.json").read_text())
  assert saved["model"] == "stub" and saved["results"]["Chat"] == pytest.approx((0.5 * 100 + 28) / 128)
  assert saved["length_bias"]["chosen_longer"]["num_pairs"] == 1
  assert "comparisons" not in saved and "drop_report" not in saved
  assert (tmp_path / "out" / "length_bias.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert report["files"] == [str(tmp_path / "out" / "eval.json"), str(tmp_path / "out" / "length_bias.png")]


@pytest.mark.parametrize(
  "bad, message",
  [
    ({"prompt": "Q", "chosen": "a", "rejected": "b", "id": 9}, "rb.jsonl:2: field 'subset': is missing"),
    (
      {"prompt": "Q", "chosen": ["a"], "rejected": "b", "subset": "shp"},
      "rb.jsonl:2: field 'chosen': expected a string, got a list",
    ),
    (
      {"question": "Q", "chosen": "a", "rejected": "b", "subset": "shp"},
      "rb.jsonl:2: field 'prompt': is missing",
    ),
  ],
)
def test_rows_outside_the_schema_name_row_and_field(tmp_path, bad, message):
  with pytest.raises(DataError, match=message):
    load("rewardbench", write_jsonl(tmp_path / "rb.jsonl", [ROWS[0], bad]))


def test_a_process_reward_model_is_refused(tmp_path):
  with pytest.raises(EvaluationError, match="needs a sequence-head reward model"):
    run("rewardbench", Scorer(steps_fn=lambda p, s: []), write_jsonl(tmp_path / "rb.jsonl", ROWS))


def test_a_tokenizer_without_chat_template_gets_fastchats_tulu_template():
  assert tulu_text(chat("Q1", "A1")) == "<|user|>\nQ1\n<|assistant|>\nA1\n"


def test_unknown_benchmark():
  with pytest.raises(EvaluationError, match="unknown benchmark 'rewardbench3'; use one of rewardbench, "):
    load("rewardbench3", "x.jsonl")


def test_spearman_is_undefined_for_constant_rewards(tmp_path):
  report = run(
    "rewardbench", Scorer(lambda convs: [0.0] * len(convs)), write_jsonl(tmp_path / "rb.jsonl", ROWS)
  )
  assert math.isnan(report["length_bias"]["spearman"]["rho"])  # undefined, not an error
  assert report["results"]["alpacaeval-easy"] == 0.0  # every pair tied: none right


class RecordingRM:
  """Stands in for a RewardModel of ``head``: a reward is the row's length; it records the
  ``max_length`` the benchmark's scorer asks for."""

  def __init__(self, head="sequence", num_labels=1):
    self.config = types.SimpleNamespace(head=head, num_labels=num_labels, max_position_embeddings=4096)
    self.attributes, self.tokenizer, self.max_lengths = None, types.SimpleNamespace(chat_template="t"), []

  def encode(self, item, *, max_length, where):
    del max_length, where
    return list(range(len(item[-1]["content"])))

  def score_ids(self, encoded, *, batch_size, bucket, max_length):
    del batch_size, bucket
    self.max_lengths.append(max_length)
    return np.array([len(ids) for ids in encoded], np.float32)


@pytest.mark.parametrize("max_length, expected", [(None, 2048), (64, 64)])
def test_rewardbench_scores_at_its_official_length_by_default(tmp_path, max_length, expected):
  rm = RecordingRM()
  run_benchmark("rewardbench", rm, write_jsonl(tmp_path / "rb.jsonl", ROWS), max_length=max_length)
  assert rm.max_lengths == [expected]  # scripts/run_rm.py --max_length, unless given


@pytest.mark.parametrize(
  "name, official", [("rewardbench", 2048), ("rewardbench2", 2048), ("rmbench", 2048), ("processbench", None)]
)
def test_each_benchmark_defaults_to_its_official_length(monkeypatch, name, official):
  asked = []

  def scorer(rm, **kwargs):
    asked.append(kwargs)
    raise StopIteration  # the data is never read

  monkeypatch.setattr(core, "model_scorer", scorer)
  for given in (None, 300):
    with pytest.raises(StopIteration):
      run_benchmark(name, RecordingRM(), max_length=given)
  assert [a["max_length"] for a in asked] == [official, 300]  # None: the model's context
  assert asked[0]["needs"] == (benchmarks.module(name).MODEL_KIND,) and asked[0]["use"] == name


def test_a_process_reward_model_is_refused_by_its_kind(tmp_path):
  with pytest.raises(
    EvaluationError,
    match=re.escape(
      "rewardbench needs a sequence-head reward model with one output (a preference reward model) or a "
      "verifier (a causal LM scoring the log-odds of its answers to a question) or a pointwise reward model "
      "(a sequence head with one output: the log-odds that a response is good); this "
      "model has a token head with 2 labels; a process reward model scores steps"
    ),
  ):
    run_benchmark(
      "rewardbench", RecordingRM(head="token", num_labels=2), write_jsonl(tmp_path / "rb.jsonl", ROWS)
    )
