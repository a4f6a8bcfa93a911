"""``python -m jaxrm.train`` fails on bad config keys, values and data with one line, no traceback."""

import os
import subprocess
import sys

import pytest
import tiny_run

GOOD_ROW = '{"prompt": "2+2?", "chosen": "4", "rejected": "5"}\n'


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
  """Every failing command, started together (each spends most of its time importing)."""
  tmp = tmp_path_factory.mktemp("cli")
  bad = tmp / "bad.jsonl"
  bad.write_text(GOOD_ROW + '{"prompt": "3+3?", "chosen": "6", "rejected": \n' + GOOD_ROW)
  rm = ["--config=configs/rm.py"]
  commands = {
    "unknown_key": rm + ["--config.train.nonexistent=1"],
    "wrong_type": rm + ["--config.train.max_steps=abc"],
    "unknown_variant": ["--config=configs/rm.py:bogus"],
    "no_coordinator": rm + ["--num_processes=2"],
    "process_id_out_of_range": rm
    + ["--coordinator_address=localhost:1", "--num_processes=2", "--process_id=2"],
  }
  procs = {
    name: subprocess.Popen(
      [sys.executable, "-m", "jaxrm.train", *args],
      cwd=tiny_run.ROOT,
      env=tiny_run.subprocess_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for name, args in commands.items()
  }
  procs["data_error"] = subprocess.Popen(
    tiny_run.cli(
      model_dir,
      str(tmp / "run"),
      "--config.data.dataset_name=PreferenceDataset",
      f"--config.data.train_data_path={bad}",
    ),
    cwd=tiny_run.ROOT,
    env=tiny_run.subprocess_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  results = {}
  for name, p in procs.items():
    stdout, stderr = p.communicate(timeout=300)
    results[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
  results["bad_path"] = str(bad)
  return results


def error_line(result, code):
  assert result.returncode == code, tiny_run.describe(result)
  assert "Traceback" not in result.stderr, result.stderr
  lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
  assert len(lines) == 1, result.stderr
  return lines[0]


def test_unknown_key_is_named(runs):
  line = error_line(runs["unknown_key"], 2)
  assert line.startswith(
    "error: --config.train.nonexistent: the config has no key 'train.nonexistent'; "
    "config.train has adam_beta1, adam_beta2, adam_epsilon, global_batch_size, "
  )


@pytest.mark.parametrize(
  "flag,message",
  [
    (
      "--config.nonexistent.x=1",
      "the config has no key 'nonexistent'; the config has changed_settings, checkpointing, data, eval, ",
    ),
    ("--noconfig.eval.val_atstart", "the config has no key 'eval.val_atstart'; config.eval has batch_size, "),
    (
      "--config.train.max_steps.x=1",
      "the config has no key 'train.max_steps.x'; config.train.max_steps has no keys (it is a value)",
    ),
  ],
)
def test_unknown_keys_at_any_depth(flag, message, capsys):
  from jaxrm import cli

  with pytest.raises(SystemExit) as exit_info:
    cli.check_config_keys(["train", f"--config={tiny_run.__file__}", flag])
  assert exit_info.value.code == 2
  assert capsys.readouterr().err.startswith(f"error: {flag.split('=')[0]}: {message}")
  cli.check_config_keys(
    [
      "train",
      f"--config={tiny_run.__file__}",
      "--config.train.max_steps=3",
      "--noconfig.eval.val_at_start",
      "--config.data.val_data_paths.default=x",
    ]
  )


def test_wrong_type_is_named(runs):
  assert error_line(runs["wrong_type"], 2) == (
    "error: flag --config.train.max_steps=abc: invalid literal for int() with base 10: 'abc'"
  )


def test_config_file_problems(runs, capsys):
  assert error_line(runs["unknown_variant"], 2) == (
    "error: flag --config=configs/rm.py:bogus: Error whilst parsing config file: "
    "ValueError: unknown variant 'bogus' of configs/rm.py; known: smoke, lora"
  )
  from jaxrm import cli

  with pytest.raises(SystemExit):
    cli.check_config_keys(["train", "--config=configs/nonexistent.py:smoke"])
  assert capsys.readouterr().err == (
    "error: --config=configs/nonexistent.py:smoke: no such config file 'configs/nonexistent.py'\n"
  )


def test_data_error_names_file_and_line(runs):
  line = error_line(runs["data_error"], 1)
  assert line.startswith(f"error: {runs['bad_path']}:2: not valid JSON: ")
  assert not os.path.exists(os.path.join(os.path.dirname(runs["bad_path"]), "run", "checkpoints"))


def test_a_new_validation_set_is_a_key_the_config_gains(capsys):
  from jaxrm import cli

  argv = [
    "train",
    f"--config={tiny_run.__file__}",
    "--config.data.val_data_paths.second=v.jsonl",
    "--config.data.val_data_paths.default=x",
  ]
  cli.check_config_keys(argv)  # no exit
  assert cli.added_entries(argv) == (
    ["train", f"--config={tiny_run.__file__}", "--config.data.val_data_paths.default=x"],
    [("data.val_data_paths.second", "v.jsonl")],
  )
  # Only names of the dict's own entries: nothing deeper.
  with pytest.raises(SystemExit):
    cli.check_config_keys(
      ["train", f"--config={tiny_run.__file__}", "--config.data.val_data_paths.second.x=1"]
    )
  assert "the config has no key 'data.val_data_paths.second'" in capsys.readouterr().err


def test_multi_host_flags_that_cannot_start_a_run_are_named(runs):
  assert error_line(runs["no_coordinator"], 2) == (
    "error: --num_processes=2 without --coordinator_address and --process_id: a multi-host run "
    "outside Slurm gives all three to every process, e.g. --coordinator_address=host0:1234 "
    "--num_processes=2 --process_id=0 (and --process_id=1 on the other)"
  )
  assert error_line(runs["process_id_out_of_range"], 2) == (
    "error: --process_id=2 with --num_processes=2: the processes are numbered 0 to 1"
  )


def test_slurm_supplies_what_the_multi_host_flags_leave_out(monkeypatch):
  from jaxrm import cli

  monkeypatch.setenv("SLURM_JOB_ID", "42")
  cli.check_distributed_flags(None, 2, None)  # no exit: jax.distributed reads the rest from Slurm
  monkeypatch.delenv("SLURM_JOB_ID")
  with pytest.raises(SystemExit):
    cli.check_distributed_flags(None, 2, None)
  cli.check_distributed_flags(None, None, None)  # one process
  cli.check_distributed_flags("localhost:1", 2, 1)


def test_a_file_given_for_the_whole_validation_dict_says_what_form_the_key_takes(capsys):
  from jaxrm import cli

  with pytest.raises(SystemExit) as exit_info:
    cli.check_config_keys(
      ["train", f"--config={tiny_run.__file__}", "--config.data.val_data_paths=val.jsonl"]
    )
  assert exit_info.value.code == 2
  assert capsys.readouterr().err == (
    "error: --config.data.val_data_paths=val.jsonl: data.val_data_paths maps validation set names "
    "to files; give each set its own key: --config.data.val_data_paths.default=val.jsonl (another "
    "set: --config.data.val_data_paths.<name>=<file>)\n"
  )


def test_each_askers_flags_ask_from_pretrained_for_it():
  """--verifier, --judge and their fields' flags come from the tasks' askers; from_pretrained is
  asked for each by its keyword, and a field's flag without its switch is refused."""
  from absl import flags

  from jaxrm import cli
  from jaxrm.errors import ConfigError
  from jaxrm.tasks.verifier import DEFAULT_QUESTION

  def parsed(*argv):
    f = flags.FlagValues()
    cli.define_verifier_flags(f)
    f(["prog", *argv])
    return f

  assert cli.asker_requests(parsed()) == {"verifier": None, "judge": None}
  assert cli.asker_requests(parsed("--judge")) == {"verifier": None, "judge": True}
  assert cli.asker_requests(parsed("--judge", "--judge_answers=X,Y")) == {
    "verifier": None,
    "judge": {"answers": "X,Y"},
  }
  assert cli.asker_requests(parsed("--verifier")) == {
    "verifier": {"question": DEFAULT_QUESTION, "answers": "Yes,No"},
    "judge": None,
  }
  with pytest.raises(ConfigError, match=r"^--judge_question applies with --judge$"):
    cli.asker_requests(parsed("--verifier", "--judge_question=A or B?"))
