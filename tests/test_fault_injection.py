"""Faults injected into the tiny run, in seeded trials: a run killed at a random moment (SIGKILL,
SIGTERM), and a random file of its checkpoints damaged (cut short, a flipped byte, an emptied
value). Each ends in one of two ways: the run (or the loaded model) is the same as the
uninterrupted run's, or it stops with a message naming the damaged file. Never a traceback, never
a silent wrong result.

Cheap by design: every trial compares against the session's one uninterrupted run (``baseline``,
4 steps, checkpoints at 2 and 4); the kills are two command-line runs, each continued in this
process; the damage trials read the checkpoint in this process, restoring the file after each.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import time

import jax
import numpy as np
import pytest
import tiny_run
from flax import nnx

from jaxrm import RewardModel
from jaxrm.errors import CheckpointError

TRIALS = 24
SEED = 35


def _final(output_dir):
  """What a run ends with: each step's training metrics and the last validation."""
  rows = tiny_run.read_metrics(output_dir)
  train = {r["step"]: (r["train/loss"], r["train/grad_norm"]) for r in rows if "train/loss" in r}
  val = [r for r in rows if "validation-default_loss" in r][-1]
  return train, (val["step"], val["validation-default_loss"], val["validation-train_sample_accuracy"])


def _assert_same_run(output_dir, baseline):
  (train, val), (train_ref, val_ref) = _final(output_dir), _final(baseline)
  assert sorted(train) == sorted(train_ref) == [1, 2, 3, 4]
  np.testing.assert_allclose(
    [train[s] for s in train_ref], [train_ref[s] for s in train_ref], rtol=0, atol=1e-6
  )
  assert val[0] == val_ref[0] and val[1:] == pytest.approx(val_ref[1:], abs=1e-6)


# ------------------------------------------------------------------ kills


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_run_killed_at_a_random_moment_resumes_to_the_same_end(signum, baseline, model_dir, tmp_path):
  """The command line run is killed a seeded random time after its first training step (in a
  step, a validation or a save, or after the end); run again, it ends as the uninterrupted run."""
  out = str(tmp_path / "run")
  delay = random.Random(f"{SEED}-{signum}").uniform(0.0, 2.0)
  run = subprocess.Popen(
    tiny_run.cli(model_dir, out),
    cwd=tiny_run.ROOT,
    env=tiny_run.subprocess_env(),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
  )
  metrics = os.path.join(out, "metrics.jsonl")
  deadline = time.time() + 240
  while run.poll() is None and time.time() < deadline:  # until step 1 is logged: training has begun
    with open(metrics) if os.path.exists(metrics) else open(os.devnull) as f:
      if '"train/loss"' in f.read():
        break
    time.sleep(0.01)
  time.sleep(delay)
  run.send_signal(signum)
  _, stderr = run.communicate(timeout=240)
  assert "Traceback" not in stderr, stderr[-3000:]
  if run.returncode != 0:  # killed before it finished
    if signum == signal.SIGKILL:
      assert run.returncode == -signal.SIGKILL, stderr[-3000:]
    else:
      stopped_at = max(tiny_run.train_losses(out))
      assert run.returncode == 128 + signal.SIGTERM, stderr[-3000:]
      assert stderr.strip().splitlines()[-1] == (
        f"stopped by SIGTERM after step {stopped_at} of 4: checkpoint saved in {out}/checkpoints/"
        f"{stopped_at}; run the same command again (the same config and output_dir) to continue from it"
      )
  tiny_run.train(tiny_run.config(model_dir, out))
  _assert_same_run(out, baseline)


def test_a_signal_after_the_last_step_lets_the_run_end_as_it_would_have(
  baseline, model_dir, tmp_path, monkeypatch, caplog
):
  """SIGTERM while the finished run prints its summary and waits for its last save: the run ends
  as it would have, says so, and holds its checkpoints (before, the process died mid-close)."""
  from jaxrm import trainer

  out = str(tmp_path / "run")
  shutil.copytree(baseline, out)
  summary = trainer._final_summary

  def terminated_meanwhile(run, seconds):
    os.kill(os.getpid(), signal.SIGTERM)
    return summary(run, seconds)

  monkeypatch.setattr(trainer, "_final_summary", terminated_meanwhile)
  with caplog.at_level("WARNING", logger="jaxrm.train"):
    tiny_run.train(tiny_run.config(model_dir, out, train__max_steps=5))
  assert "SIGTERM received after the last step: the run ended as it would have" in caplog.text
  assert max(tiny_run.train_losses(out)) == 5
  assert "5" in os.listdir(os.path.join(out, "checkpoints"))


def test_the_command_hands_sigterm_from_its_watch_straight_to_ignored(monkeypatch):
  """The command's watch ends (its run over or stopped) by setting SIGTERM to SIG_IGN: at no
  moment in between may the default action kill the exiting process (a SIGTERM just after the
  last step once ended the command with -15 and no message). A library call gets its handler back."""
  from jaxrm import preemption

  calls = []
  real = signal.signal

  def recorded(signum, handler):
    calls.append((signum, handler))
    return real(signum, handler)

  before = signal.getsignal(signal.SIGTERM)
  monkeypatch.setattr(preemption.signal, "signal", recorded)
  try:
    with preemption.watch():
      pass
    assert signal.getsignal(signal.SIGTERM) == before  # a library call: restored
    monkeypatch.setattr(preemption, "_ignore_sigterm_after_watch", False)
    preemption.ignore_sigterm_after_watch()
    calls.clear()
    with preemption.watch():
      pass
    handed = [h for s, h in calls if s == signal.SIGTERM]
    assert len(handed) == 2 and handed[0].__self__.__class__ is preemption.Watch, handed
    assert handed[1] is signal.SIG_IGN  # from the watch's handler straight to ignored
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
  finally:
    real(signal.SIGTERM, before)


# ------------------------------------------------------------------ damaged files


def _truncate(path, rng):
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    f.truncate(rng.randrange(size) if size else 0)


def _flip_byte(path, rng):
  with open(path, "r+b") as f:
    data = bytearray(f.read())
    if not data:
      return _truncate(path, rng)
    at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    f.seek(0)
    f.write(data)


def _empty_value(path, rng):
  """One value of a JSON file made empty (``""``); a file that is not JSON emptied whole."""
  try:
    with open(path) as f:
      value = json.load(f)
  except (ValueError, UnicodeDecodeError):
    open(path, "wb").close()
    return
  holders = []

  def walk(node):
    if isinstance(node, dict):
      holders.extend((node, k) for k in node)
      for v in node.values():
        walk(v)
    elif isinstance(node, list):
      holders.extend((node, i) for i in range(len(node)))
      for v in node:
        walk(v)

  walk(value)
  if not holders:
    open(path, "wb").close()
    return
  node, key = rng.choice(holders)
  node[key] = ""
  with open(path, "w") as f:
    json.dump(value, f)


FAULTS = {"truncated": _truncate, "flipped byte": _flip_byte, "emptied value": _empty_value}


def _checkpoint_files(run_dir):
  """Every file of the run's checkpoints (Orbax's, the checksums, best_checkpoint.json)."""
  top = os.path.join(run_dir, "checkpoints")
  return sorted(os.path.join(d, f) for d, _, names in os.walk(top) for f in names)


def _load_checkpoint(run_dir, step):
  """The parameters and reward statistics a user gets from the run (its best checkpoint, or
  ``step``)."""
  rm = RewardModel.from_pretrained(run_dir, step=step)
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(rm.model))], rm.reward_stats


# What each kind of file is damaged in, and how a trial on it reads it back: cache trials
# (jaxrm/data/cache.py's entries, damaged the same three ways, read back by tokenizing the data
# again: rebuilt with a warning naming the entry, never used as is) join this table.
TARGETS = {"checkpoint": (_checkpoint_files, _load_checkpoint)}


@pytest.fixture(scope="module")
def damaged_copy(baseline, tmp_path_factory):
  """A copy of the uninterrupted run that the trials damage, one file at a time."""
  return str(shutil.copytree(baseline, tmp_path_factory.mktemp("faults") / "run"))


def test_damaged_files_are_named_or_harmless(damaged_copy):
  rng = random.Random(SEED)
  steps = sorted(int(d) for d in os.listdir(os.path.join(damaged_copy, "checkpoints")) if d.isdigit())
  outcomes, undamaged = [], {}
  for trial in range(TRIALS):
    target = rng.choice(sorted(TARGETS))
    files_of, read = TARGETS[target]
    path = rng.choice(files_of(damaged_copy))
    fault = rng.choice(sorted(FAULTS))
    step = rng.choice([None, *steps])  # None: the best checkpoint, as a user loads it
    if (target, step) not in undamaged:
      undamaged[target, step] = read(damaged_copy, step)
    expected = undamaged[target, step]
    with open(path, "rb") as f:
      intact = f.read()
    FAULTS[fault](path, rng)
    changed = open(path, "rb").read() != intact
    try:
      got = read(damaged_copy, step)
    except CheckpointError as e:
      assert path in str(e), f"trial {trial}: {fault} {path}, read step {step}: {e}"
      outcomes.append("named")
    else:  # a file this read does not use, or one left as it was: the same values
      for a, b in zip(got[0], expected[0], strict=True):
        np.testing.assert_array_equal(a, b, err_msg=f"trial {trial}: {fault} {path} loaded wrong values")
      assert got[1] == expected[1], f"trial {trial}: {fault} {path}"
      outcomes.append("same" if changed else "unchanged")
    finally:
      with open(path, "wb") as f:
        f.write(intact)
  assert outcomes.count("named") >= TRIALS // 3, outcomes  # the trials do reach damage that matters


def test_resume_from_a_flipped_byte_stops_naming_the_file(baseline, model_dir, tmp_path):
  """A byte flipped in the only checkpoint's parameters: the run stops, naming the file, rather
  than train on from wrong values."""
  out = str(shutil.copytree(baseline, tmp_path / "run"))
  checkpoints = os.path.join(out, "checkpoints")
  first, *later = sorted(int(d) for d in os.listdir(checkpoints) if d.isdigit())
  for step in later:  # the first checkpoint alone, as after a kill
    shutil.rmtree(os.path.join(checkpoints, str(step)))
  rng = random.Random(SEED)
  params = [p for p in _checkpoint_files(out) if "/params/" in p and os.path.getsize(p) > 1000]
  path = rng.choice(params)
  _flip_byte(path, rng)
  with pytest.raises(CheckpointError, match="no intact checkpoint to resume from") as e:
    tiny_run.train(tiny_run.config(model_dir, out))
  assert f"({path} differs from what was written (its CRC32))" in str(e.value)
