"""A run started again into a folder that holds a run: refused when a setting that changes what it
computes differs (each named with both values), resumed when only free settings changed, started
afresh when ``changed_settings`` says so; the saved ``config.json`` kept by a run that does not train."""

import json
import logging
import os
import shutil

import pytest
import tiny_run

from jaxrm import loading, rerun
from jaxrm.errors import ConfigError


def saved_config(out):
  with open(os.path.join(out, loading.RUN_CONFIG)) as f:
    return f.read()


@pytest.fixture
def finished(baseline, tmp_path):
  """A copy of the baseline: 4 steps done, its checkpoint at step 4."""
  out = str(tmp_path / "run")
  shutil.copytree(baseline, out)
  return out


def test_cli_refuses_changed_settings_naming_each_key_before_the_model_loads(finished, model_dir):
  before = saved_config(finished)
  result = tiny_run.run(
    tiny_run.cli(model_dir, finished, "--config.train.learning_rate=0.01", "--config.data.max_train_rows=32")
  )
  assert result.returncode == 2, tiny_run.describe(result)
  err = result.stderr
  assert "Traceback" not in err, err
  assert f"{finished} holds a run (checkpoint at step 4) trained with other settings" in err, err
  assert "train.learning_rate  0.001 when saved, 0.01 now" in err, err
  assert "data.max_train_rows  64 when saved, 32 now" in err, err
  for way in (
    "--config.output_dir=<new folder>",
    "--config.changed_settings=start_fresh_keep_old",
    "--config.changed_settings=start_fresh_remove_old",
  ):
    assert way in err, err
  assert "jaxrm:" not in result.stdout  # refused before the run's summary: the model never loaded
  assert saved_config(finished) == before


def test_changed_validation_set_is_refused(finished, model_dir):
  """The best checkpoint would be chosen among metrics of two validation sets."""
  with pytest.raises(
    ConfigError,
    match=r'data\.val_data_paths  \{"default": "validation", "train_sample": "train"\} when saved, '
    r'\{"default": "train"\} now',
  ):
    tiny_run.train(tiny_run.config(model_dir, finished, data__val_data_paths={"default": "train"}))


def test_free_settings_resume_and_a_finished_run_keeps_its_config(finished, model_dir, caplog):
  before = saved_config(finished)
  with caplog.at_level(logging.INFO, logger="jaxrm.train"):
    tiny_run.train(tiny_run.config(model_dir, finished, eval__val_period=4, logger__tensorboard=False))
  assert "eval.val_period: 2 when saved, 4 now (resuming is unaffected)" in caplog.text
  assert saved_config(finished) == before  # nothing trained: the saved settings are the run's
  assert max(tiny_run.train_losses(finished)) == 4


def test_raised_max_steps_trains_on_and_saves_the_new_length(finished, model_dir):
  tiny_run.train(tiny_run.config(model_dir, finished, train__max_steps=6))
  assert list(tiny_run.train_losses(finished)) == [1, 2, 3, 4, 5, 6]
  assert json.loads(saved_config(finished))["train"]["max_steps"] == 6


def test_changed_settings_start_fresh_keeping_the_old_run(finished, model_dir):
  old_losses = tiny_run.train_losses(finished)
  # 2 steps at another rate: a resumed run would have been finished at step 4, and trained none.
  how = "start_fresh_keep_old"
  tiny_run.train(
    tiny_run.config(model_dir, finished, train__learning_rate=1e-4, train__max_steps=2, changed_settings=how)
  )
  assert list(tiny_run.train_losses(finished)) == [1, 2]
  assert json.loads(saved_config(finished))["train"]["learning_rate"] == 1e-4
  (old,) = [d for d in os.listdir(finished) if d.startswith("old-")]
  assert json.loads(saved_config(os.path.join(finished, old)))["train"]["learning_rate"] == 1e-3
  assert tiny_run.train_losses(os.path.join(finished, old)) == old_losses
  assert "4" in os.listdir(os.path.join(finished, old, "checkpoints"))


def test_changed_settings_start_fresh_removing_the_old_run(tmp_path):
  """What the run finds to remove (its lock and earlier old-* folders stay); an outside checkpoint
  folder too, or renamed beside itself when kept."""
  run, outside = tmp_path / "run", tmp_path / "ckpts"
  for path in (run / "checkpoints" / "4", run / "tensorboard", run / "old-20260101-000000", outside / "4"):
    path.mkdir(parents=True)
  for name in ("config.json", "metrics.jsonl", "run.lock"):
    (run / name).write_text("{}")
  rerun._start_fresh("start_fresh_remove_old", str(run), str(run / "checkpoints"))
  assert sorted(os.listdir(run)) == ["old-20260101-000000", "run.lock"]
  rerun._start_fresh("start_fresh_remove_old", str(run), str(outside))
  assert not outside.exists()
  (outside / "4").mkdir(parents=True)
  rerun._start_fresh("start_fresh_keep_old", str(run), str(outside))
  assert len([p for p in tmp_path.iterdir() if p.name.startswith("ckpts-old-")]) == 1
  assert not outside.exists()


def test_changed_settings_takes_only_its_three_values(model_dir, tmp_path):
  with pytest.raises(
    ConfigError, match="changed_settings='overwrite'; expected one of refuse, start_fresh_keep_old"
  ):
    tiny_run.train(tiny_run.config(model_dir, str(tmp_path / "run"), changed_settings="overwrite"))
