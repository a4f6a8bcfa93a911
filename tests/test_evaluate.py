"""jaxrm.evaluation and its CLI: metrics on hand-built scores, agreement with rm.score, and the CLI."""

import dataclasses
import json
import math
import re
import sys
import types

import numpy as np
import pytest
import tiny_run
from helpers import REBATCHED, assistant, pref, right_padded, softplus, user

from jaxrm.data import registry
from jaxrm.data.batches import IGNORE_INDEX
from jaxrm.data.drops import DropReport
from jaxrm.data.tokenize import PAIR_TOO_LONG, RatedExample, StepwiseExample, TokenizeOptions
from jaxrm.errors import EvaluationError
from jaxrm.evaluation import NO_SUBSET, evaluate, format_report

# The stand-in models' rewards and the metrics are float32 (a reward of 0.3 is not exact in binary);
# a mean or a loss over a dozen of them is a few float32 roundings (~6e-8 each) from the float64
# value computed here. Rates (4 / 6) are ratios of counts: pytest.approx's default (rel 1e-6) holds
# them too.
F32_RTOL = 1e-6


# ------------------------------------------------------------------------ metrics on known scores


class RowsOfTokens:
  """``outputs_of_ids`` of a stand-in model: its ``score_tokens`` of each row alone."""

  def outputs_of_ids(self, rows, **kwargs):
    del kwargs
    return [self.score_tokens(np.asarray([r], np.int32), np.ones((1, len(r)), np.int32))[0] for r in rows]


class LastTokenRM(RowsOfTokens):
  """Stands in for a RewardModel: a row's reward is its last real token id / 10."""

  config = types.SimpleNamespace(head="sequence", num_labels=1, pad_token_id=0)
  tokenizer = None
  attributes = None

  def score_tokens(self, input_ids, attention_mask):
    last = attention_mask.sum(axis=1) - 1
    return (input_ids[np.arange(len(input_ids)), last] / 10).astype(np.float32)


class ParityPRM(RowsOfTokens):
  """Stands in for a token-head RewardModel: even tokens say "step correct", odd ones "error"."""

  config = types.SimpleNamespace(head="token", num_labels=2, pad_token_id=0)
  tokenizer = None
  attributes = None

  def score_tokens(self, input_ids, attention_mask):
    del attention_mask
    even = input_ids % 2 == 0
    return np.stack([~even, even], axis=-1).astype(np.float32)  # [B, T, 2]


# Rewards best-first (last token / 10); comments give chosen vs rejected.
PREFERENCES = [
  pref([1, 2, 30], [1, 2, 10], subset="math", margin=0.5),  # 3.0 vs 1.0: right
  pref([1, 5], [1, 4, 20], subset="math"),  # 0.5 vs 2.0: wrong
  pref([1, 40], [1, 50], [1, 10], subset="facts"),  # 4.0 vs 1.0: right; pairs 2 of 3 right
  pref([1, 7], [2, 7], subset="facts"),  # 0.7 vs 0.7: a tie, not right
  pref([1, 9], [1, 2], subset="math"),  # 0.9 vs 0.2: right
  pref([3, 3], [3, 1]),  # 0.3 vs 0.1: right, no subset
]


def test_preference_metrics_by_hand():
  result = evaluate(LastTokenRM(), PREFERENCES, batch_size=4)  # two batches, the last one padded
  m = result["metrics"]
  chosen = np.array([3.0, 0.5, 4.0, 0.7, 0.9, 0.3])
  rejected = np.array([1.0, 2.0, 1.0, 0.7, 0.2, 0.1])
  margins = chosen - rejected
  assert result["kind"] == "preference" and result["num_examples"] == 6
  assert m["accuracy"] == pytest.approx(4 / 6)
  assert m["tie_rate"] == pytest.approx(1 / 6)
  assert m["pairwise_accuracy"] == pytest.approx(5 / 8)
  assert m["chosen_reward"] == pytest.approx(chosen.mean(), rel=F32_RTOL)
  assert m["rejected_reward"] == pytest.approx(rejected.mean(), rel=F32_RTOL)
  assert m["margin"] == pytest.approx(margins.mean(), rel=F32_RTOL)
  assert m["chosen_reward_std"] == pytest.approx(chosen.std(), rel=F32_RTOL)
  assert m["rejected_reward_std"] == pytest.approx(rejected.std(), rel=F32_RTOL)
  assert m["margin_std"] == pytest.approx(margins.std(), rel=F32_RTOL)
  all_rewards = [3, 1, 0.5, 2, 4, 5, 1, 0.7, 0.7, 0.9, 0.2, 0.3, 0.1]
  assert m["reward_mean"] == pytest.approx(np.mean(all_rewards), rel=F32_RTOL)
  # reward_std is finalised as sqrt(E[x^2] - E[x]^2) from float32 sums: the subtraction cancels
  # digits that np.std (used for the other stds) keeps.
  assert m["reward_std"] == pytest.approx(np.std(all_rewards), rel=1e-5)
  # Example 0's margin of 0.5 is subtracted inside the loss.
  losses = [softplus(-(2.0 - 0.5))] + [softplus(-x) for x in margins[1:]]
  assert m["loss"] == pytest.approx(np.mean(losses), rel=F32_RTOL)
  np.testing.assert_allclose(result["scores"]["chosen"], chosen, rtol=F32_RTOL)
  np.testing.assert_allclose(result["scores"]["rejected"], rejected, rtol=F32_RTOL)

  subsets = result["subsets"]
  assert list(subsets) == [NO_SUBSET, "facts", "math"]
  assert [subsets[s]["num_examples"] for s in subsets] == [1, 2, 3]
  assert subsets["math"]["accuracy"] == pytest.approx(2 / 3)
  assert subsets["facts"]["accuracy"] == pytest.approx(1 / 2)
  assert subsets["facts"]["pairwise_accuracy"] == pytest.approx(2 / 4)
  assert subsets["facts"]["tie_rate"] == pytest.approx(1 / 2)
  assert subsets[NO_SUBSET]["accuracy"] == 1.0
  assert subsets["math"]["margin"] == pytest.approx((2.0 - 1.5 + 0.7) / 3, rel=F32_RTOL)

  report = format_report(result)
  assert "accuracy           0.6667  (best completion scored above the worst; ties 0.1667)" in report
  assert "math         3             0.6667" in report


def test_no_subset_column_means_no_subsets():
  result = evaluate(LastTokenRM(), [pref([1, 30], [1, 10]), pref([1, 5], [1, 20])])
  assert result["subsets"] == {}
  assert result["metrics"]["accuracy"] == 0.5
  assert "subset" not in format_report(result)


def steps(predicted, labels, subset):
  """A stepwise example: a prompt token, then per step a filler token and a separator token whose
  parity sets ParityPRM's prediction (even: correct) and which carries the step's label."""
  ids, lab = [3], [IGNORE_INDEX]
  for p, y in zip(predicted, labels):
    ids += [11, 4 if p else 5]
    lab += [IGNORE_INDEX, y]
  return StepwiseExample(
    input_ids=np.asarray(ids, np.int32),
    labels=np.asarray(lab, np.int32),
    source=f"hand[{labels}]",
    meta={"subset": subset},
  )


def test_stepwise_metrics_by_hand():
  examples = [
    steps(predicted=[0, 0], labels=[1, 1], subset="x"),
    steps(predicted=[1, 1, 0], labels=[1, 0, 0], subset="x"),  # first error predicted one step late
    steps(predicted=[0, 0], labels=[0, 0], subset="y"),  # first error found
    steps(predicted=[1], labels=[1], subset="y"),
  ]
  result = evaluate(ParityPRM(), examples, batch_size=3)
  m = result["metrics"]
  assert result["kind"] == "stepwise"
  assert m["step_accuracy"] == pytest.approx(5 / 8)
  assert m["recall_correct"] == pytest.approx(2 / 4)
  assert m["recall_error"] == pytest.approx(3 / 4)
  assert m["f1_error"] == pytest.approx(2 * 3 / (4 + 5))  # 2TP / (labelled errors + predicted errors)
  assert m["first_error_found"] == pytest.approx(1 / 2)
  assert m["positive_rate"] == pytest.approx(4 / 8)  # the always-correct baseline's accuracy
  right, wrong = softplus(-1.0), softplus(1.0)  # cross-entropy of logits (0, 1) / (1, 0)
  assert m["loss"] == pytest.approx((5 * right + 3 * wrong) / 8, rel=F32_RTOL)
  assert result["subsets"]["x"]["step_accuracy"] == pytest.approx(2 / 5)
  assert result["subsets"]["x"]["first_error_found"] == 0.0
  assert result["subsets"]["y"]["step_accuracy"] == 1.0
  assert result["subsets"]["y"]["first_error_found"] == 1.0
  p = 1 / (1 + math.exp(-1))  # P(correct) when a step is predicted correct
  np.testing.assert_allclose(result["scores"]["correct"], [1 - p, 1 - p, p, p], rtol=F32_RTOL)
  np.testing.assert_allclose(result["scores"]["error"], [p, 1 - p, 1 - p, 1 - p], rtol=F32_RTOL)
  report = format_report(result)
  assert "step accuracy      0.6250  (baseline calling every step correct: 0.5000)" in report
  assert "first error found  0.5000" in report


class TwoAttributeRM(RowsOfTokens):
  """Stands in for a regression RewardModel: quality = last real token id / 10, polish = length."""

  config = types.SimpleNamespace(head="sequence", num_labels=2, pad_token_id=0)
  tokenizer = None
  attributes = ("quality", "polish")

  def score_tokens(self, input_ids, attention_mask):
    length = attention_mask.sum(axis=1)
    last = input_ids[np.arange(len(input_ids)), length - 1]
    return np.stack([last / 10, length], axis=-1).astype(np.float32)  # [B, 2]


def rated(ids, quality, polish, group, subset):
  """A rated example; polish None: unrated."""
  return RatedExample(
    input_ids=np.asarray(ids, np.int32),
    labels=np.asarray([quality, polish or 0], np.float32),
    label_mask=np.asarray([1, polish is not None], np.float32),
    group=group,
    source=f"hand[{ids}]",
    meta={"subset": subset},
  )


# Predictions (quality, polish) in the comments; two responses per prompt (group).
RATED = [
  rated([1, 20], 2, 1, 0, "a"),  # (2.0, 2)
  rated([1, 5, 30], 3, None, 0, "a"),  # (3.0, 3)
  rated([2, 10], 2, 2, 1, "b"),  # (1.0, 2)
  rated([2, 9, 9, 40], 1, 4, 1, "b"),  # (4.0, 4)
  rated([3, 15], 1, 3, 2, "a"),  # (1.5, 2)
  rated([3, 7, 25], 4, 3, 2, "a"),  # (2.5, 3)
]


def test_regression_metrics_by_hand():
  from scipy import stats

  result = evaluate(TwoAttributeRM(), RATED, batch_size=4)  # two batches, the second with filler
  m = result["metrics"]
  assert result["kind"] == "regression" and result["attributes"] == ["quality", "polish"]
  assert result["combine"] == "quality" and result["num_examples"] == 6
  pred = {"quality": np.array([2.0, 3.0, 1.0, 4.0, 1.5, 2.5]), "polish": np.array([2.0, 2, 4, 2, 3])}
  rating = {"quality": np.array([2.0, 3, 2, 1, 1, 4]), "polish": np.array([1.0, 2, 4, 3, 3])}
  err = {a: pred[a] - rating[a] for a in pred}
  assert m["mse"] == pytest.approx(np.mean(np.concatenate(list(err.values())) ** 2), rel=F32_RTOL)
  assert m["loss"] == pytest.approx(m["mse"], rel=F32_RTOL)  # every attribute weighs 1
  for a in pred:
    assert m[f"mse_{a}"] == pytest.approx(np.mean(err[a] ** 2), rel=F32_RTOL)
    assert m[f"mae_{a}"] == pytest.approx(np.mean(np.abs(err[a])), rel=F32_RTOL)
    assert m[f"pearson_{a}"] == pytest.approx(np.corrcoef(pred[a], rating[a])[0, 1], rel=1e-5)
    assert m[f"spearman_{a}"] == pytest.approx(stats.spearmanr(pred[a], rating[a]).statistic, rel=1e-12)
  # Same-prompt pairs whose quality differs: 3.0 > 2.0 right, 1.0 vs 4.0 wrong, 2.5 > 1.5 right.
  assert m["pairwise_accuracy"] == pytest.approx(2 / 3)
  assert result["subsets"]["b"]["mse_quality"] == pytest.approx((1 + 9) / 2, rel=F32_RTOL)
  assert result["subsets"]["b"]["pairwise_accuracy"] == 0.0
  np.testing.assert_array_equal(result["scores"]["rated"][:, 1], [1, 0, 1, 1, 1, 1])
  np.testing.assert_allclose(result["scores"]["predictions"][:, 0], pred["quality"], rtol=F32_RTOL)
  report = format_report(result)
  assert (
    "pairwise accuracy  0.6667  (same-prompt responses whose ratings differ, ranked by quality)" in report
  )
  assert (
    f"quality      {m['mse_quality']:.4f}    {m['mae_quality']:.4f}    {m['pearson_quality']:.4f}" in report
  )

  # quality + 2 polish, over the rows that rate both: targets 4 | 6, 9 | 7, 10 against predictions
  # 6 | 5, 12 | 5.5, 8.5: both pairs ordered right (the first prompt has one such row, no pair).
  both = evaluate(TwoAttributeRM(), RATED, combine="quality=1,polish=2")
  assert both["combine"] == "quality=1,polish=2" and both["metrics"]["pairwise_accuracy"] == 1.0
  assert both["metrics"]["mse"] == m["mse"]


@pytest.mark.parametrize(
  "rm, examples, combine, message",
  [
    (LastTokenRM(), RATED, None, "rated data needs a regression model"),
    (
      TwoAttributeRM(),
      [pref([1, 2], [1, 3])],
      None,
      "preference data needs a sequence-head reward model with one output (a preference reward model) or a "
      "verifier (a causal LM scoring the log-odds of its answers to a question) or a pointwise reward model "
      "(a sequence head with one output: the log-odds that a response is good); this "
      "model has a sequence head with 2 outputs (quality, polish); a regression model is evaluated on rated data",
    ),
    (TwoAttributeRM(), [pref([1, 2], [1, 3]), RATED[0]], None, "mixes preference and regression rows"),
    (
      TwoAttributeRM(),
      [dataclasses.replace(RATED[0], labels=np.zeros(3, np.float32), label_mask=np.ones(3, np.float32))],
      None,
      "the rated rows hold 3 ratings each and the model has 2 outputs",
    ),
    (
      TwoAttributeRM(),
      RATED,
      "length",
      "combine names 'length', not among the model's attributes quality, polish",
    ),
    (
      LastTokenRM(),
      [pref([1, 2], [1, 3])],
      "quality",
      "combine='quality' ranks the attributes of rated rows",
    ),
  ],
)
def test_regression_model_and_data_must_fit(rm, examples, combine, message):
  with pytest.raises(EvaluationError, match=re.escape(message)):
    evaluate(rm, examples, combine=combine)


@pytest.mark.parametrize(
  "rm, examples, message",
  [
    (ParityPRM(), [pref([1, 2], [1, 3])], "preference data needs a sequence-head reward model"),
    (LastTokenRM(), [steps([1], [1], "x")], "stepwise data needs a token-head"),
    (LastTokenRM(), [pref([1, 2], [1, 3]), steps([1], [1], "x")], "mixes preference and stepwise"),
    (LastTokenRM(), [], "nothing to evaluate"),
  ],
)
def test_model_and_data_must_fit(rm, examples, message):
  with pytest.raises(EvaluationError, match=message):
    evaluate(rm, examples)


# ----------------------------------------------------------------- a real model and its tokenizer


ROWS = [
  {
    "prompt": [user("What is 2 + 2?")],
    "chosen": [assistant("4")],
    "rejected": [assistant("5")],
    "subset": "math",
  },
  {
    "prompt": [user("What is 3 × 3?")],
    "chosen": [assistant("9")],
    "rejected": [assistant("6")],
    "subset": "math",
  },
  {
    "prompt": [user("Capital of France?")],
    "chosen": [assistant("Paris")],
    "rejected": [assistant("Lyon")],
    "subset": "facts",
  },
  {
    "context": [user("Name a prime.")],
    "subset": "facts",
    "completions": [
      {"rank": 0, "completion": [assistant("7")]},
      {"rank": 2, "completion": [assistant("9")]},
      {"rank": 1, "completion": [assistant("2")]},
    ],
  },
  {"prompt": [user("Say x.")], "chosen": [assistant("x")], "rejected": [assistant("x")], "subset": "math"},
  {
    "prompt": [user("Count.")],
    "chosen": [assistant("one " * 80)],
    "rejected": [assistant("one")],
    "subset": "math",
  },
  {"prompt": "Say hi.", "chosen": " Hi!", "rejected": " Bye."},
]
# (chosen, rejected) of each row that is kept, as rm.score takes them.
KEPT = [
  ([user("What is 2 + 2?"), assistant("4")], [user("What is 2 + 2?"), assistant("5")]),
  ([user("What is 3 × 3?"), assistant("9")], [user("What is 3 × 3?"), assistant("6")]),
  ([user("Capital of France?"), assistant("Paris")], [user("Capital of France?"), assistant("Lyon")]),
  ([user("Name a prime."), assistant("7")], [user("Name a prime."), assistant("9")]),
  ("Say hi. Hi!", "Say hi. Bye."),
]
KEPT_SUBSETS = ["math", "math", "facts", "facts", NO_SUBSET]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("data") / "pairs.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
  return str(path)


def test_rewards_equal_rm_score(tiny_rm, data_file):
  drops = DropReport()
  records = registry.load_records("PreferenceDataset", data_file, split="validation", drops=drops)
  result = evaluate(tiny_rm, records, options=TokenizeOptions(max_length=96), batch_size=2, drops=drops)
  chosen = tiny_rm.score([c for c, _ in KEPT])
  rejected = tiny_rm.score([r for _, r in KEPT])
  # Padded to other lengths in other batches: equal up to float32 rounding.
  np.testing.assert_allclose(result["scores"]["chosen"], chosen, **REBATCHED)
  np.testing.assert_allclose(result["scores"]["rejected"], rejected, **REBATCHED)
  right = chosen > rejected
  assert result["metrics"]["accuracy"] == pytest.approx(right.mean())
  for name in ("math", "facts", NO_SUBSET):
    rows = np.array(KEPT_SUBSETS) == name
    assert result["subsets"][name]["num_examples"] == rows.sum()
    assert result["subsets"][name]["accuracy"] == pytest.approx(right[rows].mean())
  assert result["dropped"]["total"] == 2
  assert result["dropped"]["reasons"][PAIR_TOO_LONG]["examples"] == [f"{data_file}:6"]


def test_token_head_scores_are_step_probabilities(tiny_prm):
  prm = tiny_prm
  drops = DropReport()
  records = registry.load_records("demo_arithmetic_steps", None, split="validation", drops=drops, num_rows=3)
  result = evaluate(prm, records, options=TokenizeOptions(max_length=256), drops=drops)
  # Each separator's last token carries its step's label; one padded batch scores every row.
  encode = lambda text: prm.tokenizer(text, add_special_tokens=False)["input_ids"]
  rows, label_at = [], []
  for r in records:  # plain-text prompts: prompt (with special tokens), separator, step, separator...
    ids = prm.tokenizer(r.prompt)["input_ids"] + encode("\n")
    for step, label in zip(r.steps, r.labels):
      ids = ids + encode(step) + encode("\n")
      label_at.append((len(rows), len(ids) - 1, label))
    rows.append(ids)
  input_ids, mask = right_padded(rows, pad=0, length=256)
  logits = prm.score_tokens(input_ids, mask)
  expected = {True: [], False: []}
  for i, t, label in label_at:
    expected[label].append(np.exp(logits[i, t, 1]) / np.exp(logits[i, t]).sum())
  # evaluate batches and pads the rows itself; the reference scores them in one batch of 256.
  np.testing.assert_allclose(result["scores"]["correct"], expected[True], **REBATCHED)
  np.testing.assert_allclose(result["scores"]["error"], expected[False], **REBATCHED)
  assert result["metrics"]["positive_rate"] == pytest.approx(
    len(expected[True]) / (len(expected[True]) + len(expected[False]))
  )


# --------------------------------------------------------------------------------------------- CLI


def _cli(*args):
  return tiny_run.run([sys.executable, "-m", "jaxrm.evaluate", *args])


def test_cli_prints_and_writes_report(tiny_rm, model_dir, data_file, tmp_path):
  out = tmp_path / "eval"
  proc = _cli(
    f"--model={model_dir}", f"--data={data_file}", "--max_length=96", "--batch_size=4", f"--output={out}"
  )
  assert proc.returncode == 0, proc.stderr
  assert "PyTorch" not in proc.stderr, proc.stderr  # transformers' advice: the commands never need it
  report = json.loads((out / "eval.json").read_text())
  assert report["model"] == model_dir and report["data"] == data_file
  assert report["num_examples"] == 5 and report["dropped"]["total"] == 2
  assert "scores" not in report
  chosen, rejected = tiny_rm.score([c for c, _ in KEPT]), tiny_rm.score([r for _, r in KEPT])
  assert report["metrics"]["accuracy"] == pytest.approx((chosen > rejected).mean())
  # Another process, batching the rows its own way (batch_size=4).
  assert report["metrics"]["chosen_reward"] == pytest.approx(
    chosen.mean(), rel=REBATCHED["rtol"], abs=REBATCHED["atol"]
  )
  assert sorted(report["subsets"]) == [NO_SUBSET, "facts", "math"]
  assert (out / "rewards.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert f"accuracy           {report['metrics']['accuracy']:.4f}" in proc.stdout
  assert "dropped rows: 2 rows dropped" in proc.stdout
  assert f"(e.g. {data_file}:5)" in proc.stdout


@pytest.mark.parametrize(
  "rows, model, message",
  [
    (None, "/nonexistent/model", "no such file or directory"),
    (
      [ROWS[0], {"prompt": "p", "chosen": "c"}],
      "/nonexistent/model",
      "bad.jsonl:2: field 'rejected': is missing",
    ),
    ([ROWS[0]], "junk.gguf", "junk.gguf: not a readable GGUF file: GGUF magic invalid"),
  ],
)
def test_cli_errors_without_traceback(tmp_path, rows, model, message):
  data = tmp_path / "bad.jsonl"
  if rows is not None:
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  if model.endswith(".gguf"):
    model = tmp_path / model
    model.write_bytes(b"not a gguf file" * 4)
  proc = _cli(f"--model={model}", f"--data={data}")
  assert proc.returncode == 1
  assert message in proc.stderr and proc.stderr.startswith("error: ")
  assert "Traceback" not in proc.stderr


def test_length_bias_of_preference_data():
  examples = [
    pref([1, 5, 5, 30], [1, 10]),  # 3.0 vs 1.0, 3 tokens after the prompt vs 1: right, chosen longer
    pref([1, 2], [1, 4, 4, 20]),  # 0.2 vs 2.0, 1 token vs 3: wrong, chosen shorter
    pref([1, 7], [1, 6]),  # 0.7 vs 0.6, 1 token each: right
  ]
  bias = evaluate(LastTokenRM(), examples)["length_bias"]
  assert bias["unit"] == "tokens"
  assert bias["chosen_longer"] == {"accuracy": 1.0, "num_pairs": 1}
  assert bias["chosen_shorter"] == {"accuracy": 0.0, "num_pairs": 1}
  assert bias["same_length"] == {"accuracy": 1.0, "num_pairs": 1}
  # Ranks of the rewards (3, 1, .2, 2, .7, .6): 6 4 1 5 3 2; of the lengths (3, 1, 1, 3, 1, 1),
  # ties averaged: 5.5 2.5 2.5 5.5 2.5 2.5. Pearson of the ranks: 12 / sqrt(17.5 * 12).
  assert bias["spearman"]["rho"] == pytest.approx(12 / math.sqrt(17.5 * 12))
  assert bias["spearman"]["num_responses"] == 6


# ------------------------------------------------------------------------------------ benchmarks


RB_ROWS = [
  {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5", "subset": "math-prm", "id": 0},
  {"prompt": "Capital of France?", "chosen": "Paris", "rejected": "Lyon", "subset": "hep-python", "id": 1},
  {"prompt": "Say hi.", "chosen": "Hi!", "rejected": "Go away.", "subset": "hep-python", "id": 2},
  {"prompt": "Name a prime.", "chosen": "7", "rejected": "9", "subset": "alpacaeval-easy", "id": 3},
]


def test_cli_runs_a_benchmark(tiny_rm, model_dir, tmp_path):
  data = tmp_path / "rb.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in RB_ROWS))
  out = tmp_path / "eval"
  proc = _cli(
    f"--model={model_dir}", "--benchmark=rewardbench", f"--data={data}", "--max_length=96", f"--output={out}"
  )
  assert proc.returncode == 0, proc.stderr
  report = json.loads((out / "eval.json").read_text())
  # The official harness's conversations: the prompt as a user turn, the response as the reply.
  chat = lambda r, key: [user(r["prompt"]), assistant(r[key])]
  chosen = tiny_rm.score([chat(r, "chosen") for r in RB_ROWS])
  rejected = tiny_rm.score([chat(r, "rejected") for r in RB_ROWS])
  right = chosen > rejected
  assert np.all(np.abs(chosen - rejected) > 1e-4)  # no pair so close that rebatching could flip it
  results = report["results"]
  assert results["math-prm"] == float(right[0]) and results["alpacaeval-easy"] == float(right[3])
  assert results["hep-python"] == pytest.approx(right[1:3].mean())
  reasoning = (984 * right[0] + 164 * right[1:3].mean()) / (984 + 164)
  assert results["Reasoning"] == pytest.approx(reasoning)
  assert results["Score"] == pytest.approx((results["Chat"] + reasoning) / 4)  # Chat Hard, Safety: 0
  assert report["model"] == model_dir and report["throughput"]["items"] == 8
  assert report["throughput"]["truncated"] == 0
  assert report["length_bias"]["spearman"]["num_responses"] == 8
  assert (out / "length_bias.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "    Score |      Chat | Chat Hard |    Safety | Reasoning" in proc.stdout
  assert "items/s" in proc.stdout and "length bias (characters)" in proc.stdout


def test_a_rewardbench_file_scored_plainly_says_why_its_figures_differ(tiny_rm, tmp_path):
  from jaxrm.evaluation import run_benchmark

  data = tmp_path / "rb.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in RB_ROWS))
  plain = evaluate(tiny_rm, str(data))
  bench = run_benchmark("rewardbench", tiny_rm, str(data))
  # Plain evaluation reads the file as training does: prompt + response as one plain text...
  prompts = [r["prompt"] for r in RB_ROWS]
  np.testing.assert_allclose(
    plain["scores"]["chosen"],
    tiny_rm.score(prompts=prompts, completions=[r["chosen"] for r in RB_ROWS]),
    **REBATCHED,
  )
  # ...the benchmark as its harness does: a user turn and the assistant's reply, chat-templated.
  chat = lambda key: tiny_rm.score([[user(r["prompt"]), assistant(r[key])] for r in RB_ROWS])
  right = chat("chosen") > chat("rejected")
  assert [bench["results"][s] for s in ("math-prm", "alpacaeval-easy")] == [right[0], right[3]]
  assert plain["subsets"]["math-prm"]["accuracy"] != bench["results"]["math-prm"]  # so they differ
  assert plain["note"].startswith("these rows are RewardBench's (every subset is one of its own)")
  report = format_report(plain)
  assert "note: these rows are RewardBench's" in report and "--benchmark=rewardbench" in report
  other = [dict(r, subset="mine") for r in RB_ROWS]  # not RewardBench's subsets: no note
  (tmp_path / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in other))
  assert "note" not in evaluate(tiny_rm, str(tmp_path / "mine.jsonl"))


def test_cli_benchmark_offline_hub_error_without_traceback():
  # The data is read before the model, so a missing model is never reached; HF_HUB_OFFLINE makes the
  # hub fail at once instead of after retries. (Row errors are tested in test_benchmark_*.py.)
  proc = tiny_run.run(
    [sys.executable, "-m", "jaxrm.evaluate", "--model=/nonexistent/model", "--benchmark=rewardbench"],
    HF_HUB_OFFLINE="1",
  )
  assert proc.returncode == 1, proc.stderr
  assert proc.stderr.startswith(
    "error: allenai/reward-bench: not a local path, and reading it as a hub "
    "dataset (split 'filtered', config None) failed"
  )
  assert "Traceback" not in proc.stderr
