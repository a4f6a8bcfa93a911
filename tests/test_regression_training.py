"""A regression reward model end to end on the tiny random Llama: training on a hidden learnable
attribute task, validation metrics, scoring, checkpoint -> from_pretrained -> HF export, and
transformers' scores of the export."""

import json
import math
import os
import sys

import numpy as np
import pytest
import start_checks
import tiny_run
import torch
import transformers
from helpers import PARITY_ATOL, right_padded, write_jsonl

from jaxrm import RewardModel
from jaxrm.config import RewardSpec, validation_metrics
from jaxrm.errors import ConfigError

ATTRIBUTES = ("quality", "polish")
# The hidden rule: a response's last word sets its quality, its first word its polish.
QUALITY = {"awful": 0, "poor": 1, "fine": 2, "good": 3, "great": 4}
POLISH = {"rough": 0, "smooth": 4}
STEPS = 30


def rated_rows(n, seed):
  """Two responses per prompt; polish is rated for every other prompt only (masked elsewhere)."""
  rng = np.random.default_rng(seed)
  rows = []
  for i in range(n // 2):
    for _ in range(2):
      first, last = rng.choice(list(POLISH)), rng.choice(list(QUALITY))
      row = {"prompt": f"Item {seed}-{i}:", "response": f" {first} {last}", "quality": QUALITY[last]}
      if i % 2 == 0:
        row["polish"] = POLISH[first]
      rows.append(row)
  return rows


def regression_config(model_dir, out, data_dir, **overrides):
  train = write_jsonl(data_dir / "train.jsonl", rated_rows(160, seed=1))
  val = write_jsonl(data_dir / "val.jsonl", rated_rows(48, seed=2))
  keys = dict(
    reward__type="regression",
    reward__attributes=",".join(ATTRIBUTES),
    reward__attribute_range="0,4",
    reward__combine="quality",
    data__dataset_name="RatedDataset",
    data__train_data_path=train,
    data__max_length=32,
    data__bucket_multiple=32,
    data__max_train_rows=0,
    data__max_val_rows=0,
    train__max_steps=STEPS,
    eval__val_period=STEPS,
    checkpointing__save_period=STEPS,
  )
  c = tiny_run.config(model_dir, out, **(keys | overrides))
  c.data.val_data_paths = {"default": val}
  return c


@pytest.fixture(scope="module")
def run(model_dir, tmp_path_factory):
  """A regression run of 30 steps of 8 rated responses; its output dir and last validation."""
  tmp = tmp_path_factory.mktemp("regression")
  out = str(tmp / "run")
  return out, tiny_run.train(regression_config(model_dir, out, tmp))


def val_labels():
  rows = rated_rows(48, seed=2)
  return {a: np.array([r[a] for r in rows if a in r], np.float64) for a in ATTRIBUTES}


def test_regression_learns_the_hidden_attribute(run):
  _, val = run
  print({k: round(v, 4) for k, v in val.items()})
  labels = val_labels()
  # A clear correlation, and well below the squared error of always predicting the mean rating.
  assert val["validation-default_pearson_quality"] > 0.8
  assert val["validation-default_spearman_quality"] > 0.8
  assert val["validation-default_mse_quality"] < 0.5 * labels["quality"].var()
  # Every attribute reports its metrics, the masked one over its rated rows only.
  for a in ATTRIBUTES:
    for m in ("mse", "mae", "pearson", "spearman"):
      assert math.isfinite(val[f"validation-default_{m}_{a}"]), (m, a)
  # Same-prompt pairs with different quality exist in the validation set, ordered by quality.
  assert val["validation-default_pairwise_accuracy"] > 0.8
  # What checkpointing.metric_name is checked against before a run starts is what validation reports.
  reported = {k.removeprefix("validation-default_") for k in val if k.startswith("validation-default_")}
  assert set(validation_metrics(RewardSpec(type="regression", attributes=",".join(ATTRIBUTES)))) == reported


def test_run_scores_attributes_and_combinations(run):
  out, _ = run
  rm = RewardModel.from_pretrained(out)
  assert rm.attributes == ATTRIBUTES
  prompts, responses = ["Item 9-0:"] * 2, [" smooth great", " rough awful"]
  scores = rm.score(prompts=prompts, completions=responses)
  assert scores.shape == (2, 2) and scores.dtype == np.float32
  assert scores[0, 0] > scores[1, 0]  # great > awful
  np.testing.assert_allclose(
    rm.score(prompts=prompts, completions=responses, combine="quality"), scores[:, 0]
  )
  combined = rm.score(prompts=prompts, completions=responses, combine={"quality": 0.5, "polish": 2.0})
  np.testing.assert_allclose(combined, 0.5 * scores[:, 0] + 2.0 * scores[:, 1], rtol=1e-6)
  with pytest.raises(ValueError, match="'length', not among the model's attributes quality, polish"):
    rm.score(prompts=prompts, completions=responses, combine="length")
  with pytest.raises(ValueError, match="combine this model's 2 outputs into one"):
    rm.score(prompts=prompts, completions=responses, normalize=True)


def test_reward_func_and_server_take_a_combination(run):
  from jaxrm.errors import ConfigError
  from jaxrm.server.app import check_model, score_fn
  from jaxrm.server.config import ServerConfig

  out, _ = run
  rm = RewardModel.from_pretrained(out)
  prompts, responses = ["Item 9-0:"] * 2, [" smooth great", " rough awful"]
  weights = {"quality": 0.5, "polish": 2.0}
  want = rm.score(prompts=prompts, completions=responses, combine=weights)
  f = rm.as_reward_func(combine=weights)
  assert f(prompts=prompts, completions=responses, completion_ids=[[1], [2]]) == want.tolist()
  with pytest.raises(
    ValueError,
    match=r"this model has a sequence head with 2 outputs \(quality, polish\): it "
    r"scores one output per attribute, and a reward function takes one reward "
    r"per row: pass combine=",
  ):
    rm.as_reward_func()
  # The server's one scoring call combines as rm.score does.
  rows = [rm.encode(p, c) for p, c in zip(prompts, responses)]
  width = max(map(len, rows))
  ids = np.array([r + [0] * (width - len(r)) for r in rows], np.int32)
  mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows], np.int32)
  np.testing.assert_allclose(score_fn(rm, False, "quality=0.5,polish=2")(ids, mask), want, rtol=1e-6)
  with pytest.raises(
    ConfigError,
    match=r"this model has a sequence head with 2 outputs \(quality, polish\): it "
    r"scores one output per attribute, and the server takes one reward per "
    r"row: pass --combine",
  ):
    check_model(rm, ServerConfig())
  with pytest.raises(
    ConfigError, match=r"--combine='length': score\(combine=...\): combine names 'length', not among"
  ):
    check_model(rm, ServerConfig(combine="length"))


def test_export_names_attributes_and_transformers_scores_alike(run, tmp_path):
  out, _ = run
  rm = RewardModel.from_pretrained(out)
  rm.save_pretrained(tmp_path / "hf")
  config = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert config["num_labels"] == 2 and config["problem_type"] == "regression"
  assert config["id2label"] == {"0": "quality", "1": "polish"}
  assert config["label2id"] == {"quality": 0, "polish": 1}

  hf = transformers.AutoModelForSequenceClassification.from_pretrained(
    tmp_path / "hf", dtype=torch.float32, attn_implementation="eager"
  ).eval()
  assert hf.config.problem_type == "regression" and hf.config.id2label == {0: "quality", 1: "polish"}
  rows = [rm.encode("Item 3-1:", " rough good"), rm.encode("Item 5-0:", " smooth poor fine")]
  ids, mask = right_padded(rows, rm.tokenizer.pad_token_id)
  with torch.no_grad():
    theirs = hf(
      input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)
    ).logits.numpy()
  np.testing.assert_allclose(rm.score_tokens(ids, mask), theirs, atol=PARITY_ATOL, rtol=0)

  back = RewardModel.from_pretrained(tmp_path / "hf")
  assert back.attributes == ATTRIBUTES
  np.testing.assert_allclose(back.score_tokens(ids, mask), rm.score_tokens(ids, mask), rtol=0, atol=0)


def test_evaluate_reports_what_validation_reported(run, model_dir, tmp_path):
  out, val = run
  data = os.path.join(os.path.dirname(out), "val.jsonl")  # the run's validation file
  proc = tiny_run.run(
    [
      sys.executable,
      "-m",
      "jaxrm.evaluate",
      f"--model={out}",
      f"--data={data}",
      "--dataset_name=RatedDataset",
      "--max_length=32",
      "--batch_size=5",
      "--combine=quality",
      f"--output={tmp_path / 'eval'}",
    ]
  )
  assert proc.returncode == 0, proc.stderr
  report = json.loads((tmp_path / "eval" / "eval.json").read_text())
  assert report["kind"] == "regression" and report["attributes"] == list(ATTRIBUTES)
  assert report["num_examples"] == 48 and report["dropped"]["total"] == 0
  # Another process scores the rows in batches of 5 padded to 64 tokens, validation in its own of
  # 32: each prediction moves by float32 roundings (within REBATCHED's 1e-5 relative). MSE, MAE
  # and Pearson's r then move by about 2e-5 * |prediction| / rms error relative: under 1e-4 at
  # these predictions (~2) and errors (0.7-1), where one misread row (1/48 of the set) would move
  # them by far more. Ranks and same-prompt orderings change only if two predictions lie within
  # that rounding of each other.
  for a in ATTRIBUTES:
    for m in ("mse", "mae", "pearson"):
      assert report["metrics"][f"{m}_{a}"] == pytest.approx(val[f"validation-default_{m}_{a}"], rel=1e-4)
    assert report["metrics"][f"spearman_{a}"] == pytest.approx(
      val[f"validation-default_spearman_{a}"], rel=1e-12
    )
  assert report["metrics"]["pairwise_accuracy"] == val["validation-default_pairwise_accuracy"]
  assert "ranked by quality" in proc.stdout
  assert (tmp_path / "eval" / "rewards.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # A rated dataset is read for the model's attributes: a Bradley-Terry model has none.
  proc = tiny_run.run(
    [
      sys.executable,
      "-m",
      "jaxrm.evaluate",
      f"--model={model_dir}",
      f"--data={data}",
      "--dataset_name=RatedDataset",
    ]
  )
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  assert proc.stderr.startswith("error: RatedDataset (rated rows) needs a regression model")


@pytest.mark.parametrize(
  "attributes,message",
  [
    (
      "quality,polsh",
      "no row of {train} rates 'polsh' (did you mean 'polish'?); its rows have the columns polish, "
      "prompt, quality, response",
    ),
    # Every attribute misspelled: not "all rows were dropped", but the same message.
    (
      "qualty,polsh",
      "no row of {train} rates 'qualty', 'polsh' (did you mean 'quality' and 'polish'?); its rows have "
      "the columns polish, prompt, quality, response",
    ),
  ],
)
def test_an_attribute_no_row_rates_is_refused_before_the_model_loads(
  model_dir, tmp_path, monkeypatch, attributes, message
):
  c = regression_config(
    model_dir, str(tmp_path / "run"), tmp_path, reward__attributes=attributes, reward__combine=""
  )
  assert start_checks.refusal(c, monkeypatch) == f"reward.attributes={attributes!r}: " + message.format(
    train=tmp_path / "train.jsonl"
  )


def test_regression_refuses_shared_prompt_packing(model_dir, tmp_path):
  c = regression_config(model_dir, str(tmp_path / "run"), tmp_path, data__packing="shared_prompt")
  with pytest.raises(
    ConfigError,
    match=r"^data.packing='shared_prompt' writes a preference group's prompt once; rated responses are "
    r"one sequence each, with no group to share it: use data.packing='packed'$",
  ):
    tiny_run.train(c)


def test_regression_needs_rated_data(model_dir, tmp_path):
  c = regression_config(model_dir, str(tmp_path / "run"), tmp_path, data__dataset_name="demo_arithmetic")
  c.data.train_data_path = ""
  c.data.val_data_paths = {"default": "validation"}
  with pytest.raises(
    ConfigError,
    match="reward.type='regression' does not fit data.dataset_name='demo_arithmetic', "
    "which holds preference data",
  ):
    tiny_run.train(c)


def test_hf_regression_checkpoint_loads_as_a_regression_model(tmp_path):
  import hf_tiny

  names = {0: "helpfulness", 1: "correctness", 2: "verbosity"}
  cfg = hf_tiny.tiny_config(
    "llama",
    num_labels=3,
    problem_type="regression",
    id2label=names,
    label2id={v: k for k, v in names.items()},
  )
  torch.manual_seed(0)
  hf = transformers.AutoModelForSequenceClassification.from_config(
    cfg, attn_implementation="eager", dtype=torch.float32
  ).eval()
  with torch.no_grad():
    for p in hf.parameters():
      p.add_(torch.randn_like(p) * 0.05)  # away from the default init, so a misplaced weight shows
  hf.save_pretrained(tmp_path / "hf")
  rm = RewardModel.from_pretrained(tmp_path / "hf")
  assert rm.attributes == ("helpfulness", "correctness", "verbosity")
  ids, mask = hf_tiny.batch(hf_tiny.LENGTHS, seed=1)
  theirs = hf_tiny.torch_forward(hf, ids, mask)
  np.testing.assert_allclose(rm.score_tokens(ids, mask), theirs, atol=PARITY_ATOL, rtol=0)
  # A one-output head that transformers marked "regression" (any model trained through its own
  # loss) is a plain reward model, not a one-attribute one.
  hf_tiny.build("llama").save_pretrained(tmp_path / "bt")
  config = json.loads((tmp_path / "bt" / "config.json").read_text())
  (tmp_path / "bt" / "config.json").write_text(json.dumps({**config, "problem_type": "regression"}))
  assert RewardModel.from_pretrained(tmp_path / "bt").attributes is None
