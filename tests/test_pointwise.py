"""The pointwise (binary) reward model (``reward.type=pointwise``): a sequence head's one output,
the log-odds that a response is good, trained with the logistic loss on labelled items; its
validation separates a learnable rule; it loads back as its own kind and scores one reward per row
as transformers' classifier of its export does; a wrong use or wrong data is refused by name."""

import dataclasses
import json

import hf_tiny
import numpy as np
import pytest
import start_checks
import tiny_run
import torch
import transformers
from helpers import (
  PARITY_ATOL,
  REBATCHED,
  SERVER_CONFIG,
  approx,
  assistant,
  call,
  right_padded,
  serving,
  user,
  write_jsonl,
)

from jaxrm import RewardModel, tasks
from jaxrm.config import RewardSpec
from jaxrm.errors import ConfigError
from jaxrm.evaluation import evaluate
from jaxrm.export import export
from jaxrm.scoring.kinds import ModelKindError

GOOD, BAD = "Yes, gladly: here it is.", "No."


def items(n: int, offset: int = 0) -> list[dict]:
  """TRL's unpaired rows: each prompt answered well (labelled true) and badly (false)."""
  rows = []
  for i in range(offset, offset + n // 2):
    prompt = [user(f"Can you list {i} colours?")]
    rows += [
      {"prompt": prompt, "completion": [assistant(GOOD)], "label": True},
      {"prompt": prompt, "completion": [assistant(BAD)], "label": False},
    ]
  return rows


@pytest.fixture(scope="module")
def pointwise_run(model_dir, tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("pointwise")
  train, val = (
    write_jsonl(tmp_path / "train.jsonl", items(64)),
    write_jsonl(tmp_path / "val.jsonl", items(16, offset=100)),
  )
  out = str(tmp_path / "run")
  tiny_run.train(
    tiny_run.config(
      model_dir,
      out,
      reward__type="pointwise",
      data__dataset_name="PreferenceDataset",
      data__train_data_path=train,
      data__val_data_paths={"default": val},
      data__max_val_rows=0,
      eval__val_at_start=True,
      eval__val_period=10,
      train__max_steps=10,
      checkpointing__save_period=10,
    )
  )
  return out, tmp_path


def test_training_separates_good_from_bad_items(pointwise_run):
  out, _ = pointwise_run
  val = {r["step"]: r for r in tiny_run.read_metrics(out) if "validation-default_loss" in r}
  assert list(val) == [0, 10]
  first, last = val[0], val[10]
  assert first["validation-default_positive_rate"] == 0.5  # the always-good baseline's accuracy
  assert last["validation-default_auroc"] > 0.95
  assert last["validation-default_accuracy"] > 0.75
  assert last["validation-default_loss"] < first["validation-default_loss"] - 0.1


def test_the_loss_is_the_logistic_loss():
  spec = RewardSpec(type="pointwise")
  s = np.array([2.0, -1.0, 0.5, 3.0, -4.0], np.float32)
  y = np.array([1.0, 0.0, 0.0, 1.0, 1.0], np.float32)
  mask = np.array([1, 1, 1, 1, 0], np.float32)  # the last row is a filler
  _, batch = tasks.POINTWISE.example(spec)
  ids = np.zeros((5, 1), np.int32)
  batch = batch.replace(input_ids=ids, attention_mask=ids, labels=y, example_mask=mask)
  loss, metrics = tasks.batch_loss(spec)(s, batch)
  p = 1 / (1 + np.exp(-s[:4].astype(np.float64)))
  expected = -np.mean(y[:4] * np.log(p) + (1 - y[:4]) * np.log(1 - p))
  assert float(loss) == pytest.approx(expected, abs=1e-6)
  assert float(metrics["accuracy"].total) == 3 and float(metrics["accuracy"].count) == 4


def test_a_run_loads_as_pointwise_and_scores_as_its_export_in_transformers(pointwise_run, tmp_path):
  out, _ = pointwise_run
  rm = RewardModel.from_pretrained(out)
  assert rm.kind == "pointwise"
  chats = [[user("Can you list 3 colours?"), assistant(a)] for a in (GOOD, BAD, "Red, blue, green.")]
  scores = rm.score(chats)
  assert scores.shape == (3,) and scores[0] > 0 > scores[1]

  exported = export(out, str(tmp_path / "export"))
  assert exported.kind == "pointwise"
  with open(tmp_path / "export" / "config.json") as f:
    assert json.load(f)["architectures"] == ["LlamaForSequenceClassification"]
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(
    tmp_path / "export", dtype=torch.float32
  ).eval()
  tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
  rows = [rm.encode(c) for c in chats]
  # Rows end "<|im_end|>\n": transformers pools at the last token that is not the pad id, the
  # last real token, where jaxrm reads the reward.
  ids, mask = right_padded(rows, pad=tok.pad_token_id, dtype=np.int64)
  np.testing.assert_allclose(scores, hf_tiny.torch_forward(hf, ids, mask)[:, 0], atol=PARITY_ATOL, rtol=0)
  back = RewardModel.from_pretrained(tmp_path / "export")
  assert back.kind == "pointwise"
  np.testing.assert_allclose(back.score(chats), scores, atol=PARITY_ATOL, rtol=0)


def test_it_serves_where_a_preference_model_does(pointwise_run):
  out, _ = pointwise_run
  rm = RewardModel.from_pretrained(out)
  chats = [[user("Can you list 5 colours?"), assistant(a)] for a in (GOOD, BAD)]
  want = rm.score(chats)
  rewards = rm.as_reward_func()(
    prompts=[c[:-1] for c in chats], completions=[c[-1:] for c in chats], trainer_state=None
  )
  np.testing.assert_allclose(rewards, want, **REBATCHED)
  with serving(rm, dataclasses.replace(SERVER_CONFIG, max_length=96, buckets=(96,))) as server:
    status, reply, _ = call(server.url, "/score", {"conversations": chats})
  assert status == 200 and reply["rewards"] == approx(want), reply


def test_evaluation_reads_labelled_items(pointwise_run):
  out, tmp_path = pointwise_run
  rm = RewardModel.from_pretrained(out)
  result = evaluate(rm, str(tmp_path / "val.jsonl"), max_length=96)
  assert result["kind"] == "labelled" and result["num_examples"] == 16
  (last,) = [r for r in tiny_run.read_metrics(out) if r["step"] == 10 and "validation-default_loss" in r]
  for key in ("loss", "accuracy", "auroc"):
    assert result["metrics"][key] == pytest.approx(last[f"validation-default_{key}"], abs=1e-5), key


def test_wrong_uses_and_wrong_data_are_refused(pointwise_run, model_dir, tmp_path, monkeypatch):
  out, _ = pointwise_run
  rm = RewardModel.from_pretrained(out)
  with pytest.raises(ModelKindError) as e:
    rm.score_steps("1 + 1?", ["1 + 1 = 2"])
  assert str(e.value) == (
    f"score_steps needs {tasks.PROCESS.needs}; this model has a sequence head with 1 output; "
    "a pointwise reward model scores one reward per response: rm.score, or labelled items or "
    "preference data"
  )
  pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "1 + 1?", "chosen": "2", "rejected": "3"}])
  c = tiny_run.config(
    model_dir,
    str(tmp_path / "run"),
    reward__type="pointwise",
    data__dataset_name="PreferenceDataset",
    data__train_data_path=pairs,
    data__val_data_paths={},
  )
  with pytest.raises(
    ConfigError,
    match=r"holds preference pairs \(prompt, ranked completions; .*pairs.jsonl:1\), which train "
    r"reward.type=bradley_terry or ranking or verifier or pairwise only, not 'pointwise': give labelled "
    r"items, or set reward.type='bradley_terry'$",
  ):
    tiny_run.train(c)
  c.output_dir = str(tmp_path / "run2")
  c.data.packing = "shared_prompt"
  assert start_checks.refusal(c, monkeypatch) == (
    "data.packing='shared_prompt' writes a preference group's prompt once; labelled items are one "
    "sequence each, with no group to share it: use data.packing='packed'"
  )
