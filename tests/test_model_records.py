"""A model says what it is and how it reads its inputs: a run and an export record the task (with
its attribute names) and how training rendered its rows, and loading, evaluation and scoring follow
them; a model saved before they were recorded loads with its task told from its head."""

import json

import numpy as np
import pytest
import tiny_run
from helpers import assistant, user, write_jsonl

from jaxrm import RewardModel, evaluation
from jaxrm.data.drops import DropReport
from jaxrm.data.records import PreferenceRecord, RatedRecord
from jaxrm.data.tokenize import PLAIN_TEXT, TokenizeOptions, tokenize_preference
from jaxrm.run.run_files import RunFiles
from jaxrm.scoring.loading import ScoringInfo

RATED = [
  {"prompt": "Item 1:", "response": " good", "LABEL_0": 3, "helpfulness": 3},
  {"prompt": "Item 1:", "response": " awful", "LABEL_0": 0, "helpfulness": 0},
  {"prompt": "Item 2:", "response": " fine", "LABEL_0": 2, "helpfulness": 2},
]


def one_attribute_export(tiny_rm, out):
  """An export of a one-output regression model whose one attribute has transformers' default name
  (which config.json's id2label alone cannot tell from a Bradley-Terry model's)."""
  RewardModel(tiny_rm.model, tiny_rm.tokenizer, ScoringInfo(attributes=("LABEL_0",))).save_pretrained(out)
  return out


def test_an_export_records_its_task_and_loads_as_it(tiny_rm, tmp_path):
  out = one_attribute_export(tiny_rm, tmp_path / "export")
  entry = json.loads((out / "config.json").read_text())["jaxrm"]
  assert entry["task"] == {"name": "regression", "attributes": ["LABEL_0"]}
  rm = RewardModel.from_pretrained(out)
  assert rm.kind == "regression" and rm.attributes == ("LABEL_0",)


def test_an_export_without_the_record_loads_with_its_task_told_from_its_head(tiny_rm, tmp_path):
  out = one_attribute_export(tiny_rm, tmp_path / "export")
  config = json.loads((out / "config.json").read_text())
  del config["jaxrm"]["task"]  # as exports were written before they recorded it
  (out / "config.json").write_text(json.dumps(config))
  assert RewardModel.from_pretrained(out).kind == "preference"  # LABEL_0 names no attribute
  config["id2label"] = {"0": "helpfulness"}
  (out / "config.json").write_text(json.dumps(config))
  old = RewardModel.from_pretrained(out)
  assert old.kind == "regression" and old.attributes == ("helpfulness",)


def test_a_run_without_its_config_loads_as_the_task_its_files_record(tiny_rm, tmp_path):
  """A one-output sequence head recorded as regression with one attribute is a regression model."""
  run = tmp_path / "run"
  (run / "tokenizer").mkdir(parents=True)
  task = {"name": "regression", "attributes": ["helpfulness"]}
  RunFiles(str(run), tiny_rm.config, task=task).write(None)
  rm = RewardModel.from_pretrained(run, load_weights=False, tokenizer=tiny_rm.tokenizer)
  assert rm.kind == "regression" and rm.attributes == ("helpfulness",)
  rm, records = evaluation.read_data(write_jsonl(tmp_path / "rated.jsonl", RATED), lambda: rm)
  assert rm.kind == "regression" and all(isinstance(r, RatedRecord) for r in records)
  RunFiles(str(run), tiny_rm.config).write(None)  # as runs were written before they recorded it
  assert RewardModel.from_pretrained(run, load_weights=False).kind == "preference"


def test_a_regression_export_is_evaluated_on_rated_rows_without_naming_their_format(tiny_rm, tmp_path):
  rm = RewardModel.from_pretrained(one_attribute_export(tiny_rm, tmp_path / "export"))
  result = evaluation.evaluate(rm, write_jsonl(tmp_path / "rated.jsonl", RATED), max_length=32)
  assert result["kind"] == "regression" and result["num_examples"] == 3
  np.testing.assert_allclose(
    result["scores"]["predictions"][:, 0],
    rm.score(prompts=[r["prompt"] for r in RATED], completions=[r["response"] for r in RATED]),
    rtol=1e-5,
    atol=1e-5,
  )


PAIRS = [
  {"prompt": f"Q{i}: what is {i} + {i}?", "chosen": f" {2 * i}", "rejected": f" {2 * i + 1}"}
  for i in range(16)
]


@pytest.fixture(scope="module")
def plain_run(model_dir, tmp_path_factory):
  """Two steps on TRL rows given as plain strings."""
  tmp = tmp_path_factory.mktemp("plain")
  out = str(tmp / "run")
  keys = dict(
    data__dataset_name="PreferenceDataset",
    data__train_data_path=write_jsonl(tmp / "train.jsonl", PAIRS),
    train__max_steps=2,
    eval__val_period=0,
    checkpointing__save_period=2,
    checkpointing__metric_name="",
  )
  c = tiny_run.config(model_dir, out, **keys)
  c.data.val_data_paths = {}
  tiny_run.train(c)
  return RewardModel.from_pretrained(out)


def test_a_model_trained_on_plain_text_scores_a_conversation_as_it_trained(plain_run, tmp_path):
  rm = plain_run
  assert rm.rendering == PLAIN_TEXT
  prompt, completion = PAIRS[0]["prompt"], PAIRS[0]["chosen"]
  record = PreferenceRecord(context=prompt, completions=(completion,), ranks=(0,), source="row")
  trained = tokenize_preference(record, rm.tokenizer, TokenizeOptions(96), DropReport()).input_ids[0]
  conversation = [user(prompt), assistant(completion)]
  assert rm.encode(conversation) == rm.encode(prompt, completion) == trained.tolist()
  as_messages, as_strings = rm.score([conversation]), rm.score(prompts=[prompt], completions=[completion])
  assert as_messages[0] == as_strings[0]
  export = RewardModel.from_pretrained(rm.save_pretrained(tmp_path / "export") or tmp_path / "export")
  assert export.rendering == PLAIN_TEXT and export.encode(conversation) == trained.tolist()
