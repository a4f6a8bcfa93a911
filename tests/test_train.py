"""The trainer end to end on a tiny random Llama: metrics, best-k checkpoints, exact resume,
gradient accumulation, non-finite stops, SIGTERM, SIGKILL and resume."""

import glob
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_run
from flax import nnx
from helpers import around

from jaxrm.config import TrainSpec, normalize_metric_name
from jaxrm.errors import UserError
from jaxrm.hf.safetensors_io import HFCheckpoint
from jaxrm.run import checkpointing, run_files, steps, update

TRAIN_KEYS = (
  "train/loss",
  "train/accuracy",
  "train/grad_norm",
  "train/learning_rate",
  "timing/train/step_time",
  "train/tokens_per_second",
)
VAL_SETS = ("default", "train_sample")


@pytest.fixture(scope="module")
def stopped(model_dir, tmp_path_factory):
  """The baseline's run stopped after 2 of its 4 steps."""
  out = str(tmp_path_factory.mktemp("stopped") / "run")
  tiny_run.train(tiny_run.config(model_dir, out), stop_after_steps=2)
  return out


@pytest.fixture(scope="module")
def sigtermed(model_dir, tmp_path_factory):
  """The baseline's run sent SIGTERM during its step 3, between two validations: it saves step 3
  and stops."""
  from jaxrm.run import preemption, trainer

  out = str(tmp_path_factory.mktemp("sigtermed") / "run")

  def signalled(dispatch, run, step):
    if step == 3:  # the signal arrives while the step is under way
      os.kill(os.getpid(), signal.SIGTERM)
    return dispatch(run, step)

  with pytest.MonkeyPatch.context() as m:
    around(m, trainer, "_dispatch", signalled)
    with pytest.raises(preemption.Stopped) as e:
      tiny_run.train(tiny_run.config(model_dir, out))
  assert str(e.value) == (
    f"stopped by SIGTERM after step 3 of 4: checkpoint saved in {out}/checkpoints/3; run the same "
    "command again (the same config and output_dir) to continue from it"
  )
  assert e.value.exit_code == 143
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler was given back
  return out


def checkpoint_steps(output_dir):
  return sorted(int(d) for d in os.listdir(os.path.join(output_dir, "checkpoints")) if d.isdigit())


def rows_with(output_dir, key):
  return {r["step"]: r for r in tiny_run.read_metrics(output_dir) if key in r}


# ------------------------------------------------------------------ logging


def test_metrics_jsonl_names_every_event(baseline):
  train_rows = rows_with(baseline, "train/loss")
  assert list(train_rows) == [1, 2, 3, 4]  # log_period=1
  for row in train_rows.values():
    for key in TRAIN_KEYS:
      assert math.isfinite(row[key]), (key, row)
    assert 0.0 <= row["train/accuracy"] <= 1.0
    assert row["train/tokens_per_second"] > 0
  # Warmup over 2 steps to 1e-3, then constant; the rate logged is the one each update used.
  lrs = [train_rows[s]["train/learning_rate"] for s in (1, 2, 3, 4)]
  np.testing.assert_allclose(lrs, [0.0, 5e-4, 1e-3, 1e-3], rtol=1e-6)

  val_rows = rows_with(baseline, "timing/validation/total_validation_time")
  assert list(val_rows) == [2, 4]  # val_period=2
  for row in val_rows.values():
    for name in VAL_SETS:
      assert math.isfinite(row[f"validation-{name}_loss"])
      assert 0.0 <= row[f"validation-{name}_accuracy"] <= 1.0
    assert not any(k.startswith("train/") for k in row)


def test_run_directory_files(baseline):
  events = glob.glob(os.path.join(baseline, "tensorboard", "events.out.tfevents.*"))
  assert len(events) == 1
  with open(events[0], "rb") as f:
    data = f.read()
  for tag in (b"train/loss", b"validation-default_loss", b"validation-train_sample_accuracy"):
    assert tag in data

  with open(os.path.join(baseline, "dropped_rows.json")) as f:
    drops = json.load(f)
  assert set(drops) == {"train", "validation-default", "validation-train_sample"}
  # No row is bad; what the row limits leave out is counted (the demo sets hold 4000 and 500 rows).
  limits = {
    "train": (4000, "data.max_train_rows=64", 64),
    "validation-default": (500, "data.max_val_rows=8", 8),
    "validation-train_sample": (4000, "data.max_val_rows=8", 8),
  }
  for name, (rows, key, kept) in limits.items():
    reason = f"not used: after the first {kept} records ({key})"
    assert drops[name]["total"] == 0 and drops[name]["unused"] == rows - kept, name
    assert list(drops[name]["reasons"]) == [reason], name

  with open(os.path.join(baseline, "config.json")) as f:
    assert json.load(f)["train"]["max_steps"] == 4
  assert os.path.exists(os.path.join(baseline, "tokenizer", "tokenizer.json"))
  assert not os.path.exists(os.path.join(baseline, "run.lock"))  # the finished run gave it back
  assert os.path.exists(os.path.join(baseline, run_files.RUN_MODEL_CONFIG))


# ------------------------------------------------------------------ checkpoints


def test_best_checkpoint_by_validation_loss_and_latest_kept(baseline):
  val_loss = {
    s: r["validation-default_loss"] for s, r in rows_with(baseline, "validation-default_loss").items()
  }
  assert val_loss[2] != val_loss[4]
  best = min(val_loss, key=val_loss.get)
  info = checkpointing.read_best(os.path.join(baseline, "checkpoints"))
  assert info["step"] == best
  assert info["metric_name"] == "validation-default_loss"  # from "val:validation-default_loss"
  assert info["value"] == pytest.approx(val_loss[best], abs=1e-7)
  assert info["path"] == os.path.join(baseline, "checkpoints", str(best))
  # keep_top_k=1: the best, and the latest for resuming.
  assert checkpoint_steps(baseline) == sorted({best, 4})


def _tiny_state(value):
  params = nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
  params = jax.tree.map(lambda x: jnp.full_like(x, value), params)
  return {"params": params, "opt_state": {"mu": jnp.full((3,), value)}}


@pytest.mark.parametrize(
  "name,higher,values,kept,best",
  [
    ("val:validation-default_accuracy", True, [0.5, 0.9, 0.7, 0.6], [2, 3, 4], 2),
    ("validation-default_loss", False, [0.5, 0.9, 0.7, 0.6], [1, 4], 1),
  ],
)
def test_checkpointer_keeps_best_k_and_latest(tmp_path, name, higher, values, kept, best):
  metric = normalize_metric_name(name)
  ckpt = checkpointing.Checkpointer(
    str(tmp_path), metric_name=name, higher_is_better=higher, keep_top_k=2 if higher else 1
  )
  for step, v in enumerate(values, start=1):
    ckpt.save(step, _tiny_state(step), {"position": step}, {"step": step}, metrics={metric: v})
  assert ckpt.all_steps() == kept
  assert ckpt.best_step() == best and ckpt.latest_step() == 4
  assert checkpointing.read_best(str(tmp_path))["step"] == best
  ckpt.close()

  # A new manager reads the ranking back from disk; a save without metrics stays only while latest.
  ckpt = checkpointing.Checkpointer(
    str(tmp_path), metric_name=name, higher_is_better=higher, keep_top_k=2 if higher else 1
  )
  assert ckpt.best_step() == best
  ckpt.save(5, _tiny_state(5), {"position": 5}, {"step": 5}, metrics=None)
  assert ckpt.all_steps() == sorted(set(kept) - {4} | {5}) and ckpt.best_step() == best
  worst = min(values) - 1 if higher else max(values) + 1
  ckpt.save(6, _tiny_state(6), {"position": 6}, {"step": 6}, metrics={metric: worst})
  assert ckpt.all_steps() == sorted(set(kept) - {4} | {6}) and ckpt.best_step() == best

  state, data, meta = ckpt.restore(best, _tiny_state(0.0))
  assert float(state["params"]["kernel"].get_value()[0, 0]) == best
  assert float(state["opt_state"]["mu"][0]) == best
  assert data == {"position": best} and meta == {"step": best}
  ckpt.close()


def test_checkpointer_without_metric_keeps_latest_k(tmp_path):
  ckpt = checkpointing.Checkpointer(str(tmp_path), metric_name="", keep_top_k=2)
  for step in (1, 2, 3):
    ckpt.save(step, _tiny_state(step), {}, {}, metrics={"validation-default_loss": 0.1})
  assert ckpt.all_steps() == [2, 3] and ckpt.best_step() == 3
  assert checkpointing.read_best(str(tmp_path))["step"] == 3
  ckpt.close()


# ------------------------------------------------------------------ resume


@pytest.mark.parametrize("stopped_by,trained,saved", [("stopped", 2, [2]), ("sigtermed", 3, [2, 3])])
def test_resume_equals_uninterrupted_run(
  baseline, stopped_by, trained, saved, model_dir, tmp_path, monkeypatch, request
):
  """Stopped after 2 of 4 steps by stop_after_steps, or after 3 by SIGTERM, then run again."""
  out = str(tmp_path / "run")
  shutil.copytree(request.getfixturevalue(stopped_by), out)
  assert list(tiny_run.train_losses(out)) == list(range(1, trained + 1))
  assert checkpoint_steps(out) == saved

  def unread(self, key):  # the checkpoint holds every parameter: the HF weights are not read
    raise AssertionError(f"a resumed run read {key} from {model_dir}")

  monkeypatch.setattr(HFCheckpoint, "get_tensor", unread)
  tiny_run.train(tiny_run.config(model_dir, out))

  tiny_run.assert_resumed_equals_uninterrupted(out, baseline, steps=[1, 2, 3, 4])
  val_resumed, val_uninterrupted = (
    rows_with(out, "validation-default_loss"),
    rows_with(baseline, "validation-default_loss"),
  )
  assert list(val_resumed) == [2, 4]
  assert val_resumed[4]["validation-default_loss"] == pytest.approx(
    val_uninterrupted[4]["validation-default_loss"], abs=1e-6
  )


def test_non_finite_loss_stops_naming_the_step(stopped, model_dir, tmp_path, monkeypatch):
  out = str(tmp_path / "run")
  shutil.copytree(stopped, out)
  restore = checkpointing.Checkpointer.restore

  def poisoned(self, step, state):  # the resumed parameters turn NaN: step 3's loss is NaN
    state, data, meta = restore(self, step, state)
    score = state["params"]["score"]
    score.set_value(score.get_value() * jnp.nan)
    return state, data, meta

  monkeypatch.setattr(checkpointing.Checkpointer, "restore", poisoned)
  with pytest.raises(
    UserError,
    match=r"non-finite loss \(nan\) or gradient norm \(nan\) at step 3; "
    r"stopping\. Last good checkpoint: step 2 in ",
  ):
    tiny_run.train(tiny_run.config(model_dir, out))
  assert checkpoint_steps(out) == [2]
  assert list(tiny_run.train_losses(out)) == [1, 2]


def test_a_step_is_launched_before_the_last_ones_metrics_are_read(model_dir, tmp_path, monkeypatch):
  """The host reads and sends step N+1's batch while the devices compute step N: N's metrics are
  read once N+1 is launched, except where the state after N is read (saved at 3, the last step)."""
  from jaxrm.data import pipeline
  from jaxrm.run import trainer

  events, to_global, finalize = [], pipeline.to_global_batch, trainer.finalize_metrics
  monkeypatch.setattr(
    pipeline, "to_global_batch", lambda *a, **k: events.append("launch") or to_global(*a, **k)
  )
  monkeypatch.setattr(trainer, "finalize_metrics", lambda *a, **k: events.append("read") or finalize(*a, **k))
  out = str(tmp_path / "run")
  c = tiny_run.config(
    model_dir, out, eval__val_period=0, eval__val_at_end=False, checkpointing__save_period=3
  )
  tiny_run.train(c)
  assert events == ["launch", "launch", "read", "launch", "read", "read", "launch", "read"]
  assert list(tiny_run.train_losses(out)) == [1, 2, 3, 4]


def test_gradient_accumulation_equals_one_big_batch(baseline, model_dir, tmp_path):
  out = str(tmp_path / "accum")
  # 8 pairs per step as 2 micro-batches of 4.
  tiny_run.train(
    tiny_run.config(
      model_dir,
      out,
      train__micro_batch_size=4,
      eval__val_period=0,
      eval__val_at_end=False,
      checkpointing__enabled=False,
    )
  )
  accumulated, whole = rows_with(out, "train/loss"), rows_with(baseline, "train/loss")
  assert list(accumulated) == [1, 2, 3, 4]
  for key in ("train/loss", "train/accuracy", "train/grad_norm"):
    np.testing.assert_allclose(
      [accumulated[s][key] for s in (1, 2, 3, 4)],
      [whole[s][key] for s in (1, 2, 3, 4)],
      rtol=0,
      atol=1e-5,
      err_msg=key,
    )


def test_trainer_and_bench_tools_build_the_update_in_one_place(model_dir, tmp_path, monkeypatch):
  """The trainer, the benchmark and the memory plan build their update with update.build_update,
  so the scripts time and size what a run trains: with accumulation over unpacked micro-batches,
  the trainer's micro-batched step, planned with the default TrainSpec's optimizer."""
  built = []
  build_update = update.build_update

  def spy(model, reward, train, **kwargs):
    built.append((train, kwargs, build_update(model, reward, train, **kwargs)))
    return built[-1][2]

  monkeypatch.setattr(update, "build_update", spy)
  monkeypatch.syspath_prepend(os.path.join(tiny_run.ROOT, "scripts"))
  import bench
  import bench_common
  import memory_plan

  # 8 pairs per step as 2 micro-batches of 4, each padded to its own length.
  tiny_run.train(
    tiny_run.config(
      model_dir,
      str(tmp_path / "run"),
      train__max_steps=1,
      train__micro_batch_size=4,
      eval__val_period=0,
      eval__val_at_end=False,
      checkpointing__enabled=False,
    )
  )
  bench._jaxrm_update(bench_common.SHAPES["tiny"], seed=0, num_steps=2)
  memory_plan.plan_one("tiny", 32, "none", (1, 1, 1), "auto", grad_accum=2)
  trainer, timed, planned = built
  assert [type(b.train_step) for _, _, b in built] == [
    steps.MicroBatchedStep,
    steps.CompiledPerShape,
    steps.MicroBatchedStep,
  ]
  accumulation = lambda kwargs: (kwargs["grad_accum"], kwargs["micro_batched"])
  assert accumulation(trainer[1]) == accumulation(planned[1]) == (2, True)
  assert planned[0] == TrainSpec() and timed[0] == TrainSpec(**bench.TRAIN, seed=0)


def test_stepwise_run_reports_step_metrics(cache_root, tmp_path):
  out = str(tmp_path / "prm")
  tiny_run.train(
    tiny_run.config(
      tiny_run.tiny_model_dir(cache_root, head="token"),
      out,
      reward__type="stepwise",
      data__dataset_name="demo_arithmetic_steps",
      train__max_steps=2,
      data__val_data_paths={"default": "validation"},
    )
  )
  train_rows = rows_with(out, "train/loss")
  assert list(train_rows) == [1, 2]
  for key in ("train/step_accuracy", "train/recall_correct", "train/recall_error", "train/f1_error"):
    assert key in train_rows[2]
  val = rows_with(out, "validation-default_loss")[2]
  for key in (
    "validation-default_step_accuracy",
    "validation-default_f1_error",
    "validation-default_first_error_found",
  ):
    assert key in val
  assert checkpointing.read_best(os.path.join(out, "checkpoints"))["step"] == 2
  with open(os.path.join(out, run_files.RUN_MODEL_CONFIG)) as f:
    assert json.load(f)["jaxrm"]["head"] == "token"


# ------------------------------------------------------------------ config errors


def test_metric_name_must_name_a_validation_set(model_dir, tmp_path):
  c = tiny_run.config(model_dir, str(tmp_path / "run"), checkpointing__metric_name="validation-nosuch_loss")
  with pytest.raises(
    UserError,
    match=r"checkpointing.metric_name='validation-nosuch_loss' names no "
    r"validation set; .* one of default, train_sample",
  ):
    tiny_run.train(c)


def test_metric_name_must_be_a_validation_metric(model_dir, tmp_path):
  c = tiny_run.config(
    model_dir,
    str(tmp_path / "run"),
    checkpointing__metric_name="validation-default_nosuch",
    eval__val_at_start=True,
  )
  with pytest.raises(
    UserError,
    match=r"'validation-default_nosuch' is not a validation metric; "
    r"available: .*validation-default_accuracy",
  ):
    tiny_run.train(c)


def test_bad_reward_type_and_batch_sizes(model_dir, tmp_path):
  c = tiny_run.config(model_dir, str(tmp_path / "run"), reward__type="pairs")
  with pytest.raises(
    UserError,
    match=r"reward.type must be one of bradley_terry, ranking, stepwise, regression, "
    r"verifier, pairwise, pointwise; got 'pairs'",
  ):
    tiny_run.train(c)
  c = tiny_run.config(model_dir, str(tmp_path / "run"), train__micro_batch_size=3)
  with pytest.raises(
    UserError,
    match=r"train.global_batch_size=8 must be a multiple of "
    r"micro_batch_size x data-parallel devices = 3 x 1",
  ):
    tiny_run.train(c)


# ------------------------------------------------------------------ SIGKILL


@pytest.mark.slow
def test_sigkilled_run_resumes_from_latest_checkpoint(model_dir, tmp_path, caplog):
  out = str(tmp_path / "run")
  # 64 rows make 8 steps an epoch: max_epochs=2 ends the run at step 16, before max_steps.
  overrides = {
    "train.max_steps": 100,
    "train.max_epochs": 2,
    "checkpointing.save_period": 5,
    "eval.val_period": 5,
  }
  cmd = tiny_run.cli(model_dir, out, *(f"--config.{k}={v}" for k, v in overrides.items()))
  killed = subprocess.Popen(
    cmd,
    cwd=tiny_run.ROOT,
    env=tiny_run.subprocess_env(),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
  )
  # The first checkpoint whole: its checksum list is the last file a save writes.
  first_checkpoint = os.path.join(out, "checkpoints", "5", checkpointing.CHECKSUMS)
  deadline = time.time() + 240
  while not os.path.exists(first_checkpoint) and killed.poll() is None and time.time() < deadline:
    time.sleep(0.02)
  killed.send_signal(signal.SIGKILL)
  _, stderr = killed.communicate()
  assert killed.returncode == -signal.SIGKILL, stderr[-3000:]
  killed_at = max(tiny_run.train_losses(out))
  latest = max(checkpoint_steps(out))
  assert 5 <= latest <= killed_at < 16

  # The killed run's lock names a process that is gone.
  with open(os.path.join(out, "run.lock")) as f:
    assert json.load(f)["pid"] == killed.pid

  # The same run again (here in-process) takes the lock over and continues from the latest
  # checkpoint, and finishes.
  with caplog.at_level(logging.WARNING, logger="jaxrm.run.run_lock"):
    tiny_run.train(tiny_run.set_keys(tiny_run.config(model_dir, out), overrides))
  assert f"a lock left by pid {killed.pid} on " in caplog.text and "is no longer running" in caplog.text
  assert not os.path.exists(os.path.join(out, "run.lock"))
  assert checkpoint_steps(out)[-1] == 16
  # The rows the killed run wrote after its last checkpoint were dropped and written again.
  train_rows = rows_with(out, "train/loss")
  assert list(train_rows) == list(range(1, 17))
  assert train_rows[16]["train/epoch"] == 2.0
  assert list(rows_with(out, "validation-default_loss")) == [5, 10, 15, 16]
