"""A run started again into a folder that holds a run: refused when a setting that changes what it
computes differs (each named with both values), resumed when only free settings changed, started
afresh when ``changed_settings`` says so; the saved ``config.json`` kept by a run that does not train."""

import json
import logging
import os
import shutil

import pytest
import tiny_run

from jaxrm.config import RunConfig
from jaxrm.errors import ConfigError
from jaxrm.run import rerun, run_files

# Every config key, as a rerun may change it and resume (free) or not. A key added to the config
# must be listed here: whether changing it changes what a run computes is decided on purpose.
FREE = {
  *("output_dir", "changed_settings"),
  *("model.remat", "model.scan_layers", "model.attention"),
  *("train.max_steps", "train.max_epochs", "train.micro_batch_size", "train.log_period"),
  *("eval.val_period", "eval.val_at_start", "eval.val_at_end", "eval.batch_size"),
  *("checkpointing.save_period", "checkpointing.keep_top_k"),
  *("data.num_workers", "data.num_proc", "data.cache", "data.cache_dir", "data.bucket_multiple"),
  *("mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.context", "mesh.context_balance"),
  *("logger.tensorboard", "logger.log_dir", "logger.progress_bar", "logger.monitor_gpus"),
  *("logger.wandb_enabled", "logger.wandb.project", "logger.wandb.name"),
  *("logger.mlflow_enabled", "logger.mlflow.experiment_name", "logger.mlflow.run_name"),
  "logger.mlflow.tracking_uri",
}
NOT_FREE = {
  *("model.name_or_path", "model.dtype", "model.param_dtype", "model.seed", "model.chat_template"),
  *("model.lora.rank", "model.lora.alpha", "model.lora.dropout", "model.lora.target_modules"),
  "model.lora.base_dtype",
  *("reward.type", "reward.ranking_loss", "reward.center_rewards_coefficient"),
  *("reward.preference_strength_scaling", "reward.attributes", "reward.attribute_weights"),
  *("reward.attribute_range", "reward.combine", "reward.verifier_question", "reward.verifier_answers"),
  *("reward.verifier_loss", "reward.judge_question", "reward.judge_answers"),
  *("data.dataset_name", "data.train_data_path", "data.val_data_paths", "data.max_length"),
  *("data.truncation", "data.step_separator", "data.train_on_last_step_only", "data.packing"),
  *("data.packed_row_length", "data.shuffle_seed", "data.max_train_rows", "data.max_val_rows"),
  *("data.group_by_length", "data.packed_fit_multiple"),
  *("train.global_batch_size", "train.learning_rate", "train.lr_scheduler", "train.min_lr_ratio"),
  *("train.warmup_steps", "train.weight_decay", "train.max_grad_norm", "train.adam_beta1"),
  *("train.adam_beta2", "train.adam_epsilon", "train.seed"),
  "eval.val_batches",
  *("checkpointing.enabled", "checkpointing.checkpoint_dir", "checkpointing.metric_name"),
  "checkpointing.higher_is_better",
}


def saved_config(out):
  with open(os.path.join(out, run_files.RUN_CONFIG)) as f:
    return f.read()


def config_keys(tree, prefix=""):
  """The dotted keys of a config dict (a validation set's paths are one key)."""
  for key, value in tree.items():
    if isinstance(value, dict) and key != "val_data_paths":
      yield from config_keys(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}"


def test_every_config_key_is_free_or_not_on_purpose():
  keys = set(config_keys(RunConfig().to_dict()))
  assert not FREE & NOT_FREE
  assert keys - FREE - NOT_FREE == set(), "new config keys: list each in FREE or NOT_FREE above"
  assert FREE | NOT_FREE <= keys, "keys no longer in the config: remove them above"
  assert {k for k in keys if rerun.is_free(k)} == FREE


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
  folder's files too (the folder stays, with its lock), or moved into a folder beside it when kept."""
  run, outside = tmp_path / "run", tmp_path / "ckpts"
  for path in (run / "checkpoints" / "4", run / "tensorboard", run / "old-20260101-000000", outside / "4"):
    path.mkdir(parents=True)
  for name in ("config.json", "metrics.jsonl", "run.lock"):
    (run / name).write_text("{}")
  rerun.start_fresh("start_fresh_remove_old", str(run), str(run / "checkpoints"))
  assert sorted(os.listdir(run)) == ["old-20260101-000000", "run.lock"]
  (outside / "run.lock").write_text("{}")
  rerun.start_fresh("start_fresh_remove_old", str(run), str(outside))
  assert os.listdir(outside) == ["run.lock"]
  (outside / "4").mkdir(parents=True)
  rerun.start_fresh("start_fresh_keep_old", str(run), str(outside))
  (kept,) = [p for p in tmp_path.iterdir() if p.name.startswith("ckpts-old-")]
  assert os.listdir(kept) == ["4"]
  assert os.listdir(outside) == ["run.lock"]


def test_changed_settings_takes_only_its_three_values(model_dir, tmp_path):
  with pytest.raises(
    ConfigError, match="changed_settings='overwrite'; expected one of refuse, start_fresh_keep_old"
  ):
    tiny_run.train(tiny_run.config(model_dir, str(tmp_path / "run"), changed_settings="overwrite"))
