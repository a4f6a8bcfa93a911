"""The names a notebook imports from ``jaxrm``; ``jaxrm.evaluate`` is the command, the function is
``jaxrm.evaluation.evaluate``."""

import importlib
import json
import sys

import numpy as np
import pytest
import tiny_run

import jaxrm
from jaxrm import evaluation
from jaxrm.data import registry
from jaxrm.data.drops import DropReport
from jaxrm.data.formats import DROP_IDENTICAL
from jaxrm.data.tokenize import TokenizeOptions

WHERE = {
  "RewardModel": "jaxrm.scoring.reward_model",
  "RunConfig": "jaxrm.config",
  "ModelSpec": "jaxrm.config",
  "LoraSpec": "jaxrm.config",
  "DataSpec": "jaxrm.config",
  "RewardSpec": "jaxrm.config",
  "TrainSpec": "jaxrm.config",
  "EvalSpec": "jaxrm.config",
  "CheckpointSpec": "jaxrm.config",
  "LoggerSpec": "jaxrm.config",
  "MeshConfig": "jaxrm.sharding",
  "train_and_evaluate": "jaxrm.run.trainer",
  "load_dataset": "jaxrm.evaluation",
  "plot_scores": "jaxrm.evaluation",
  "as_reward_funcs": "jaxrm.scoring.reward_funcs",
  "remote_reward_func": "jaxrm.scoring.reward_funcs",
}


def test_all_is_the_notebook_names():
  assert sorted(jaxrm.__all__) == sorted(WHERE)


@pytest.mark.parametrize("name", sorted(WHERE))
def test_each_name_imports_from_jaxrm(name):
  namespace = {}
  exec(f"from jaxrm import {name}", namespace)  # the statement a notebook writes
  assert namespace[name] is getattr(importlib.import_module(WHERE[name]), name)


def test_an_unknown_name_is_an_attribute_error():
  with pytest.raises(AttributeError, match="module 'jaxrm' has no attribute 'evaluation_loop'"):
    jaxrm.evaluation_loop  # noqa: B018


def test_a_command_asked_for_as_a_function_names_the_function():
  for name, function in (("evaluate", "jaxrm.evaluation.evaluate"), ("train", "jaxrm.train_and_evaluate")):
    with pytest.raises(AttributeError, match=f"python -m jaxrm.{name}\\); in Python, call {function}"):
      getattr(jaxrm, name)


def test_the_commands_import_as_modules_and_jaxrm_stays_light():
  proc = tiny_run.run(
    [
      sys.executable,
      "-c",
      "import importlib.util, sys\n"
      "assert importlib.util.find_spec('torch') is None, 'the commands are tested without torch'\n"
      "import jaxrm\n"
      "assert 'jax' not in sys.modules, 'import jaxrm alone should stay light'\n"
      "import jaxrm.evaluate\n"
      "from jaxrm.evaluate import main\n"
      "from jaxrm.evaluation import evaluate\n"
      "assert jaxrm.evaluate.main is main and callable(evaluate)\n"
      "print('ok')\n",
    ]
  )
  assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr


def test_cli_help():
  proc = tiny_run.run([sys.executable, "-m", "jaxrm.evaluate", "--help"])  # absl exits 1 after --help
  assert "--benchmark" in proc.stdout and "--max_length" in proc.stdout, proc.stderr
  assert "--[no]verifier" in proc.stdout and "--verifier_question" in proc.stdout  # not only --helpfull
  assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------------- load_dataset


PAIRS = [
  {"prompt": "Say hi.", "chosen": " Hi!", "rejected": " Bye."},
  {"prompt": "Say x.", "chosen": " x", "rejected": " x"},  # identical completions: dropped
  {"prompt": "Count.", "chosen": " one two", "rejected": " one"},
  {"prompt": "Name a colour.", "chosen": " Red.", "rejected": " Seven."},
]


@pytest.fixture
def pairs_file(tmp_path):
  path = tmp_path / "pairs.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
  return str(path)


def test_load_dataset_prints_its_drops_unless_given_a_report(pairs_file, capsys):
  records = jaxrm.load_dataset("PreferenceDataset", pairs_file, split="validation")
  assert [r.source for r in records] == [f"{pairs_file}:1", f"{pairs_file}:3", f"{pairs_file}:4"]
  printed = capsys.readouterr().out
  assert "1 rows dropped" in printed and DROP_IDENTICAL in printed
  drops = DropReport()
  first = jaxrm.load_dataset("PreferenceDataset", pairs_file, max_rows=2, drops=drops)
  assert first == records[:2] and drops.total == 1 and capsys.readouterr().out == ""


# ----------------------------------------------------------------------- evaluate by dataset name


def _same(a, b):
  assert a["kind"] == b["kind"] and a["num_examples"] == b["num_examples"]
  assert a["metrics"] == b["metrics"] and a["subsets"] == b["subsets"] and a["dropped"] == b["dropped"]
  for key in ("chosen", "rejected"):
    np.testing.assert_array_equal(a["scores"][key], b["scores"][key])


def test_evaluate_a_dataset_by_name_as_records_read_by_hand(tiny_rm):
  by_name = evaluation.evaluate(tiny_rm, "demo_arithmetic", split="validation", max_rows=6, max_length=96)
  drops = DropReport()
  records = registry.load_records("demo_arithmetic", None, split="validation", drops=drops)[:6]
  by_hand = evaluation.evaluate(tiny_rm, records, options=TokenizeOptions(max_length=96), drops=drops)
  _same(by_name, by_hand)
  assert by_name["num_examples"] == 6


def test_evaluate_a_file_by_path_as_records_read_by_hand(tiny_rm, pairs_file):
  by_path = evaluation.evaluate(tiny_rm, pairs_file, max_rows=2, max_length=64)
  drops = DropReport()
  records = registry.load_records("PreferenceDataset", pairs_file, split="validation", drops=drops)[:2]
  _same(by_path, evaluation.evaluate(tiny_rm, records, options=TokenizeOptions(max_length=64), drops=drops))
  assert by_path["num_examples"] == 2 and by_path["dropped"]["total"] == 1
