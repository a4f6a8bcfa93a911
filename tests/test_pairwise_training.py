"""Training a pairwise judge (reward.type=pairwise): its rows, its runs, what it learns, what is
refused before a model loads; and the Bradley-Terry strengths and win rates its comparisons give."""

import contextlib
import io
import json
import math
import random
import re
import shutil

import mpmath
import numpy as np
import pytest
import scipy.optimize
import tiny_run
from helpers import REBATCHED

from jaxrm import RewardModel, tasks
from jaxrm.config import RewardSpec, validation_metrics
from jaxrm.data import formats, packing, pipeline, registry
from jaxrm.data.drops import DropReport
from jaxrm.data.tokenize import TokenizeOptions, pad_id, text_ids, tokenize_all
from jaxrm.errors import ConfigError
from jaxrm.run.metrics import finalize_metrics
from jaxrm.tasks import pairwise

# ------------------------------------------------------------------ Bradley-Terry and win rates


def _soft_labels(d, compared):
  return np.where(compared, 1 / (1 + np.exp(-np.where(compared, d, 0.0))), 0.0)


def _nll(t, d, compared):
  """The negative log-likelihood of strengths ``t``, written from the definition: each ordered
  compared pair (i, j) adds ``-p_ij log sigmoid(t_i - t_j)``, so each unordered pair adds both of
  its soft labels' terms."""
  x = t[:, None] - t[None, :]
  return float(np.sum(_soft_labels(d, compared) * np.logaddexp(0.0, -x)))


def _nll_grad(t, d, compared):
  x = t[:, None] - t[None, :]
  return np.sum(np.where(compared, 1 / (1 + np.exp(-x)) - _soft_labels(d, compared), 0.0), 1)


def _scipy_strengths(d):
  d = np.asarray(d, np.float64)
  compared = ~np.isnan(d)
  np.fill_diagonal(compared, False)
  fit = scipy.optimize.minimize(
    _nll, np.zeros(len(d)), args=(d, compared), jac=_nll_grad, method="BFGS", options={"gtol": 1e-12}
  )
  return fit.x - fit.x.mean()


def _exact_newton_step(t, d):
  """The largest entry of a Newton step on the log-likelihood from ``t``, computed in 60-digit
  arithmetic: near 0 only at the maximum (the function is concave). Float64 cannot check this at
  log-odds of 30-40: there the gradient is ~1e-17, below the rounding of the terms it sums."""
  mpmath.mp.dps = 60
  n = len(t)
  sig = lambda x: 1 / (1 + mpmath.exp(-x))
  grad, hess = mpmath.zeros(n - 1, 1), mpmath.zeros(n - 1, n - 1)
  for i in range(n - 1):
    for j in range(n):
      if i == j or math.isnan(d[i][j]):
        continue
      x = mpmath.mpf(float(t[i])) - mpmath.mpf(float(t[j]))
      w = sig(x) * sig(-x)
      grad[i] += sig(mpmath.mpf(float(d[i][j]))) - sig(x)
      hess[i, i] += w
      if j < n - 1:
        hess[i, j] -= w
  return float(max(abs(s) for s in mpmath.lu_solve(hess, grad)))


def _antisymmetric(upper):
  d = np.triu(np.asarray(upper, np.float64), 1)
  return d - d.T


# Fixed matrices: moderate log-odds, some pairs near probability 0 or 1, and a circle (each
# response compared with the next only; NaN where not compared).
_RNG = np.random.default_rng(0)
_MODERATE = _antisymmetric(_RNG.normal(0, 3, (5, 5)))
_NEAR_0_AND_1 = _antisymmetric(np.where(_RNG.random((6, 6)) < 0.4, 35.0, _RNG.normal(0, 10, (6, 6))))
_NEAR_0_AND_1[0, 1], _NEAR_0_AND_1[1, 0] = -40.0, 40.0
_CIRCLE = np.full((5, 5), np.nan)
for _i, _x in enumerate(_RNG.normal(0, 2, 5)):
  _CIRCLE[_i, (_i + 1) % 5], _CIRCLE[(_i + 1) % 5, _i] = _x, -_x


@pytest.mark.parametrize("d", [_MODERATE, _NEAR_0_AND_1, _CIRCLE], ids=["moderate", "near_0_and_1", "circle"])
def test_bradley_terry_is_the_maximum_likelihood(d):
  t = pairwise.bradley_terry(d)
  assert abs(t.mean()) < 1e-12
  assert _exact_newton_step(t, d) < 1e-9
  if d is not _NEAR_0_AND_1:
    # scipy's BFGS stops at a gradient of ~1e-12, where the likelihood is flat to second order:
    # its strengths agree to ~1e-7. (At log-odds of 35-40 it stalls far from the maximum, its
    # float64 gradient lost in rounding; the exact Newton step above checks those.)
    np.testing.assert_allclose(t, _scipy_strengths(d), atol=1e-6, rtol=0)


@pytest.mark.parametrize("d01", [0.3, -5.0, 30.0, -40.0])
def test_bradley_terry_of_two_is_their_log_odds(d01):
  t = pairwise.bradley_terry(np.array([[0.0, d01], [-d01, 0.0]]))
  np.testing.assert_allclose(t, [d01 / 2, -d01 / 2], rtol=1e-12, atol=0)


def test_bradley_terry_of_consistent_log_odds_and_of_a_cycle():
  s = np.array([0.0, 30.0, -10.0, 2.5])  # differences up to 40: probabilities within 1e-17 of 0 or 1
  np.testing.assert_allclose(pairwise.bradley_terry(s[:, None] - s[None, :]), s - s.mean(), atol=1e-9, rtol=0)
  cycle = _antisymmetric([[0, 3.0, -3.0], [0, 0, 3.0], [0, 0, 0]])  # 0 > 1 > 2 > 0 alike: all equal
  np.testing.assert_allclose(pairwise.bradley_terry(cycle), np.zeros(3), atol=1e-12, rtol=0)


def test_bradley_terry_is_antisymmetric_and_follows_the_order():
  t = pairwise.bradley_terry(_NEAR_0_AND_1)
  np.testing.assert_allclose(pairwise.bradley_terry(-_NEAR_0_AND_1), -t, atol=1e-9, rtol=0)
  order = np.array([3, 0, 5, 1, 4, 2])
  np.testing.assert_allclose(
    pairwise.bradley_terry(_NEAR_0_AND_1[np.ix_(order, order)]), t[order], atol=1e-9, rtol=0
  )


@pytest.mark.parametrize(
  "d, message",
  [
    (np.array([[0, 1.0, np.nan], [-1, 0, np.nan], [np.nan, np.nan, 0]]), "never compared"),
    (
      np.array(
        [[0, 1.0, np.nan, np.nan], [-1, 0, np.nan, np.nan], [np.nan, np.nan, 0, 2], [np.nan, np.nan, -2, 0]]
      ),
      "never compared",
    ),
    (np.array([[0, np.inf], [-np.inf, 0]]), "infinite"),
    (np.array([[0, 1.0], [1.0, 0]]), "antisymmetric"),
    (np.array([[0, 1.0], [np.nan, 0]]), "antisymmetric"),  # a NaN on one side only
    (np.zeros((2, 3)), "square"),
  ],
)
def test_bradley_terry_refuses(d, message):
  with pytest.raises(ValueError, match=message):
    pairwise.bradley_terry(d)


def test_win_rates_against_the_definition():
  for d in (_MODERATE, _NEAR_0_AND_1, _CIRCLE):
    want = [
      np.mean([1 / (1 + math.exp(-d[i, j])) for j in range(len(d)) if j != i and not math.isnan(d[i, j])])
      for i in range(len(d))
    ]
    np.testing.assert_allclose(pairwise.win_rates(d), want, rtol=1e-12, atol=0)
  # Near 0 and 1 the rates keep their relative precision: sigmoid(-40) is 4.2e-18, not 0.
  np.testing.assert_allclose(
    pairwise.win_rates(np.array([[0, -40.0], [40.0, 0]])), [4.248354255291589e-18, 1.0], rtol=1e-12
  )


# ------------------------------------------------------------------ a judge's rows


def test_a_ranked_list_gives_each_pair_in_both_orders(smollm2_tokenizer):
  judge = pairwise.Judge(question="A or B?")
  drops = DropReport()
  ranked = {
    "context": "Best fruit?",
    "completions": [{"rank": r, "completion": c} for r, c in ((2, "fig"), (0, "kiwi"), (1, "plum"))],
  }
  long = {"prompt": "Best fruit? " + "really " * 200, "response_a": "fig", "response_b": "kiwi", "label": "B"}
  turns = [
    {"role": r, "content": c}
    for r, c in (("user", "old " * 100), ("assistant", "ok"), ("user", "Best fruit?"))
  ]
  cut = {"prompt": turns, "response_a": "fig", "response_b": "kiwi", "label": "A"}
  records = [formats.parse_preference(row, f"row {i}", drops) for i, row in enumerate((ranked, long, cut))]
  options = judge.tokenize_options(TokenizeOptions(max_length=128, truncation="left"))
  examples = tokenize_all(records, smollm2_tokenizer, options, drops)
  ids = lambda context, a, b: text_ids(
    smollm2_tokenizer, judge.render(smollm2_tokenizer, context, a, b), special=False
  )
  # Better first: kiwi (rank 0) > plum > fig; row 0 shows the better as A, row 1 as B.
  pairs = [("kiwi", "plum"), ("kiwi", "fig"), ("plum", "fig")]
  assert [[list(r) for r in e.input_ids] for e in examples[:3]] == [
    [ids("Best fruit?", better, worse), ids("Best fruit?", worse, better)] for better, worse in pairs
  ]
  # The long prompt has no earlier turn to lose: dropped and counted; the conversation loses its
  # oldest turns to fit, counted as cut.
  assert dict(drops.counts) == {pairwise.JUDGE_TOO_LONG: 1} and drops.cut == 1
  assert [list(r) for r in examples[3].input_ids] == [
    ids(turns[2:], "fig", "kiwi"),
    ids(turns[2:], "kiwi", "fig"),
  ]


# ------------------------------------------------------------------ training a judge

# The rule a judge learns: the better response ends with "yes", the worse with "no"; the words
# before are random, so held-out pairs are new texts. Written as explicit judgments.
_WORDS = "red blue green cat dog sun moon tree fish bird stone river cloud apple bread".split()


def _judgments(n: int, seed: int) -> list[dict]:
  rng = random.Random(seed)
  rows = []
  for _ in range(n):
    good, bad = (" ".join(rng.sample(_WORDS, 2)) + end for end in (" yes", " no"))
    a_better = rng.random() < 0.5
    a, b = (good, bad) if a_better else (bad, good)
    rows.append({"prompt": "Answer.", "response_a": a, "response_b": b, "label": "A" if a_better else "B"})
  return rows


def _write_jsonl(path, rows):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  return str(path)


@pytest.fixture(scope="module")
def rule_run(causal_dir, tmp_path_factory):
  """A judge trained 40 steps on the rule, its pairs packed with each pair's prompt once; validated
  on held-out pairs before (zero-shot) and after. (Learnt by step ~25 at this learning rate over
  shuffle seeds 0-3; the loss sits at log 2 until then.) Returns (run dir, console output)."""
  root = tmp_path_factory.mktemp("judge")
  train = _write_jsonl(root / "train.jsonl", _judgments(256, seed=0))
  heldout = _write_jsonl(root / "heldout.jsonl", _judgments(32, seed=1))
  config = tiny_run.config(
    causal_dir,
    str(root / "run"),
    reward__type="pairwise",
    reward__judge_question="A or B?",
    data__dataset_name="PreferenceDataset",
    data__train_data_path=train,
    data__val_data_paths={"heldout": heldout},
    data__max_train_rows=256,
    data__max_val_rows=32,
    data__max_length=128,
    data__bucket_multiple=128,
    data__packing="shared_prompt",
    train__max_steps=40,
    train__learning_rate=5e-3,
    train__warmup_steps=10,
    eval__val_at_start=True,
    eval__val_period=40,
    checkpointing__save_period=40,
    checkpointing__metric_name="val:validation-heldout_consistency",
    checkpointing__higher_is_better=True,
  )
  console = io.StringIO()
  with contextlib.redirect_stdout(console):
    tiny_run.train(config)
  return str(root / "run"), console.getvalue()


def test_a_judge_learns_a_rule_in_both_orders(rule_run):
  run, console = rule_run
  val = {r["step"]: r for r in tiny_run.read_metrics(run) if "validation-heldout_accuracy" in r}
  zero_shot, trained = (
    {k.removeprefix("validation-heldout_"): v for k, v in val[s].items()} for s in (0, 40)
  )
  # The random model answers by position (here alone: one order always right, the other wrong).
  assert zero_shot["accuracy"] <= 0.6 and zero_shot["consistency"] <= 0.2, zero_shot
  for order in ("accuracy_first", "accuracy_second"):
    assert trained[order] >= 0.9, trained
  assert trained["consistency"] >= 0.9 and abs(trained["position_bias"] - 0.5) < 0.1, trained
  # The console's table holds the judge's metrics; the best checkpoint is ranked by one of them.
  for name in ("accuracy_first", "accuracy_second", "consistency", "position_bias"):
    assert re.search(rf"^  {name} +\d\.\d{{4}}$", console, re.M), name
  assert f"best checkpoint: step 40, validation-heldout_consistency = {trained['consistency']:.4f}" in console
  assert all(f"\n  {line}\n" in console for line in pairwise.USES)  # how to use it, under "use it:"
  rm = RewardModel.from_pretrained(run)
  assert rm.kind == "pairwise" and rm.judge == pairwise.Judge(question="A or B?")
  pairs = _judgments(8, seed=2)
  log_odds = rm.compare(
    [r["prompt"] for r in pairs], [r["response_a"] for r in pairs], [r["response_b"] for r in pairs]
  )
  assert [r["label"] for r in pairs] == ["A" if x > 0 else "B" for x in log_odds]


def test_validation_names_the_judge_metrics():
  assert set(validation_metrics(RewardSpec("pairwise"))) >= {
    "loss",
    "accuracy",
    "accuracy_first",
    "accuracy_second",
    "consistency",
    "position_bias",
  }


@pytest.mark.parametrize("shared", [False, True], ids=["packed", "shared_prompt"])
def test_packed_judge_batches_give_the_unpacked_loss(rule_run, shared):
  """Each pair's two orders are one group of two rows; packed, or with their common prefix (the
  template's opening and the conversation) written once, their log-odds, loss and metrics are the
  unpacked batch's."""
  rm = RewardModel.from_pretrained(rule_run[0])
  records = registry.load_records("demo_arithmetic", None, split="train", drops=DropReport())[:6]
  spec = RewardSpec("pairwise", judge_question="A or B?")
  options = rm.judge.tokenize_options(TokenizeOptions(max_length=160))
  examples = tokenize_all(records, rm.tokenizer, options, DropReport())
  assert len(examples) == 6 and all(len(e.input_ids) == 2 for e in examples)
  batch = dict(batch_size=6, buckets=(160,), pad_id=pad_id(rm.tokenizer), num_completions=2)
  (unpacked,) = pipeline.make_eval_batches(examples, **batch)
  pack = packing.PackSpec(row_length=320, length_multiple=16, shared_prompt=shared)
  (packed,) = pipeline.make_eval_batches(examples, **batch, pack=pack)
  assert packed.input_ids.size < unpacked.input_ids.size
  want_odds, got_odds = unpacked.outputs(rm.model), packed.outputs(rm.model)  # [6, 2] each
  assert want_odds.shape == (6, 2) and np.ptp(np.asarray(want_odds)) > 0.1
  loss = tasks.batch_loss(spec)
  want_loss, want = loss(want_odds, unpacked)
  got_loss, got = loss(got_odds, packed)
  # The same float32 sums over other padded lengths and orders (REBATCHED's reason); the accuracy,
  # consistency and counts are read from the log-odds' signs, equal unless one sits at 0.
  np.testing.assert_allclose(np.asarray(got_odds), np.asarray(want_odds), **REBATCHED)
  np.testing.assert_allclose(got_loss, want_loss, **REBATCHED)
  got, want = finalize_metrics(got), finalize_metrics(want)
  assert got.keys() == want.keys()
  np.testing.assert_allclose([got[k] for k in want], list(want.values()), **REBATCHED)


# ------------------------------------------------------------------ refused before the model loads


@pytest.fixture
def weightless_dir(causal_dir, tmp_path):
  """The tiny causal LM's config and tokenizer with an empty weights file: a run that reads its
  weights fails, so a judge's error shows it came first."""
  out = tmp_path / "lm"
  shutil.copytree(causal_dir, out, ignore=shutil.ignore_patterns("model.safetensors"))
  (out / "model.safetensors").write_bytes(b"")
  return out


def _train_judge(model_dir, out, **overrides):
  tiny_run.train(tiny_run.config(str(model_dir), str(out), reward__type="pairwise", **overrides))


def test_answers_of_several_tokens_are_refused_before_the_weights_are_read(weightless_dir, tmp_path):
  with pytest.raises(ConfigError) as e:
    _train_judge(weightless_dir, tmp_path / "run", reward__judge_answers="Apple pie,B")
  assert str(e.value) == (
    "the judge's answer 'Apple pie' is 2 tokens for this tokenizer ('Apple', 'Ġpie'); each answer "
    "must be one token: choose others (reward.judge_answers, or judge={'answers': [...]})"
  )
  assert not (tmp_path / "run").exists()


def test_a_tokenizer_without_chat_template_is_refused_before_the_weights_are_read(weightless_dir, tmp_path):
  template = (weightless_dir / "chat_template.jinja").read_text()
  (weightless_dir / "chat_template.jinja").unlink()
  with pytest.raises(ConfigError) as e:
    _train_judge(weightless_dir, tmp_path / "run")
  assert str(e.value) == (
    "a judge asks its question in a chat turn, and the tokenizer has no chat template; give one "
    "(model.chat_template)"
  )
  assert not (tmp_path / "run").exists()
  # model.chat_template gives it one: the run goes on to read the (empty) weights.
  with pytest.raises(Exception) as e:
    _train_judge(weightless_dir, tmp_path / "run", model__chat_template=template)
  assert "chat template" not in str(e.value)


@pytest.mark.parametrize(
  "answers, message",
  [
    ("A;B", "a judge's answers are two (A is better, then B is better), e.g. 'A,B'; got 'A;B'"),
    ("A,B,C", "a judge's answers are two (A is better, then B is better), e.g. 'A,B'; got 'A,B,C'"),
    ("A,A", "a judge's answers must be two different non-empty strings; got 'A,A'"),
    ("A,", "a judge's answers must be two different non-empty strings; got 'A,'"),
  ],
)
def test_malformed_judge_answers_are_refused_with_the_config(answers, message, tmp_path):
  with pytest.raises(ConfigError) as e:
    _train_judge(tmp_path / "no_model", tmp_path / "run", reward__judge_answers=answers)
  assert str(e.value) == f"reward.judge_answers={answers!r}: {message}"


def test_an_empty_judge_question_and_judge_keys_of_another_task_are_refused(tmp_path):
  with pytest.raises(
    ConfigError, match=r"^reward.judge_question='  ': a judge's question must be a non-empty"
  ):
    RewardSpec("pairwise", judge_question="  ")
  # A question set for a judge with reward.type left at its default would train no judge.
  with pytest.raises(
    ConfigError, match=r"^reward.judge_question applies to reward.type='pairwise', not 'bradley_terry'$"
  ):
    tiny_run.train(tiny_run.config(str(tmp_path), str(tmp_path / "run"), reward__judge_question="A or B?"))
