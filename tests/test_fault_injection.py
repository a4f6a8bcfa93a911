"""Faults injected into the tiny run, in seeded trials: a run killed at a random moment (SIGKILL,
SIGTERM) and between Orbax's commit of a checkpoint and its checksum list, and a random file of its
checkpoints damaged (cut short, a flipped byte, an emptied value, a checksum list deleted). Each
ends in one of two ways: the run (or the loaded model) is the same as the uninterrupted run's, or
it stops with a message naming the damaged file. Never a traceback, never a silent wrong result.

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
from helpers import around

from jaxrm import RewardModel
from jaxrm.errors import CheckpointError
from jaxrm.run import checkpointing, preemption

TRIALS = 24
SEED = 35


def _last_validation(output_dir):
  val = [r for r in tiny_run.read_metrics(output_dir) if "validation-default_loss" in r][-1]
  return val["step"], val["validation-default_loss"], val["validation-train_sample_accuracy"]


def _assert_same_run(output_dir, baseline):
  """Each step's training metrics and the last validation are the uninterrupted run's."""
  keys = ("train/loss", "train/grad_norm")
  tiny_run.assert_resumed_equals_uninterrupted(output_dir, baseline, [1, 2, 3, 4], keys, logged_again=True)
  val, val_ref = _last_validation(output_dir), _last_validation(baseline)
  assert val[0] == val_ref[0] and val[1:] == pytest.approx(val_ref[1:], abs=1e-6)


# ------------------------------------------------------------------ kills


def _logged(output_dir, step):
  """Whether the run's training row of ``step`` is in metrics.jsonl."""
  path = os.path.join(output_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return False
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.endswith("\n")]
  return any(r["step"] == step and "train/loss" in r for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_run_killed_at_a_random_moment_resumes_to_the_same_end(signum, baseline, model_dir, tmp_path):
  """The command line run is killed at a seeded random moment of its training: once step 1, 2 or
  3 is logged, and up to 50 ms later (in a step, a validation or a save: the rest of the run takes
  several times that). It was interrupted; run again, it ends as the uninterrupted run. (A SIGTERM
  stops after the step under way, or the next. Once step N is logged, step N+1 is under way: a
  step's metrics are read once the next one is launched, or, where the state after N is read (a
  validation, a save), N+1 is launched right after. In step 4 a SIGTERM would let the run end: so
  not after 3.)"""
  out = str(tmp_path / "run")
  rng = random.Random(f"{SEED}-{signum}")
  after_step = rng.choice([1, 2, 3] if signum == signal.SIGKILL else [1, 2])
  delay = rng.uniform(0.0, 0.05)
  run = subprocess.Popen(
    tiny_run.cli(model_dir, out),
    cwd=tiny_run.ROOT,
    env=tiny_run.subprocess_env(),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
  )
  deadline = time.time() + 240
  while run.poll() is None and time.time() < deadline and not _logged(out, after_step):
    time.sleep(0.005)
  time.sleep(delay)
  run.send_signal(signum)
  _, stderr = run.communicate(timeout=240)
  assert "Traceback" not in stderr, stderr[-3000:]
  if signum == signal.SIGKILL:
    assert run.returncode == -signal.SIGKILL, stderr[-3000:]
  else:
    stopped_at = max(tiny_run.train_losses(out))
    assert run.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert after_step < stopped_at <= after_step + 2
    assert stderr.strip().splitlines()[-1] == (
      f"stopped by SIGTERM after step {stopped_at} of 4: checkpoint saved in {out}/checkpoints/"
      f"{stopped_at}; run the same command again (the same config and output_dir) to continue from it"
    )
  tiny_run.train(tiny_run.config(model_dir, out))
  _assert_same_run(out, baseline)


# The command line run, killed as it commits step 4's checkpoint (Orbax renames the step's
# temporary folder to its name), before jaxrm writes the step's checksum list.
_KILLED_AT_COMMIT = """
import os, runpy, signal, sys
rename = os.rename
def committing(src, dst, *args, **kwargs):
  rename(src, dst, *args, **kwargs)
  if os.path.basename(str(dst)) == "4" and "orbax-checkpoint-tmp" in str(src):
    os.kill(os.getpid(), signal.SIGKILL)
os.rename = committing
runpy.run_module("jaxrm.train", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_a_run_killed_between_commit_and_checksums_resumes_to_the_same_end(
  baseline, model_dir, tmp_path, caplog
):
  """Step 4 committed without its checksum list (before, it was taken for a checkpoint older than
  checksums and loaded unverified): set aside as damaged, and the run resumes from step 2."""
  out = str(tmp_path / "run")
  command = tiny_run.cli(model_dir, out)
  killed = tiny_run.run([command[0], "-c", _KILLED_AT_COMMIT, *command[3:]])
  checkpoints = os.path.join(out, "checkpoints")
  assert killed.returncode == -signal.SIGKILL, tiny_run.describe(killed)
  assert os.path.isdir(os.path.join(checkpoints, "4"))
  assert not os.path.exists(os.path.join(checkpoints, "4", checkpointing.CHECKSUMS))
  with caplog.at_level("WARNING", logger="jaxrm.train"):
    tiny_run.train(tiny_run.config(model_dir, out))
  warned = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
  assert len(warned) == 1 and warned[0].startswith(
    f"{checkpoints}/4: the checkpoint of step 4 cannot be read ({checkpoints}/4/"
    f"{checkpointing.CHECKSUMS}, its files' checksums, is missing"
  ), warned
  assert os.path.isdir(os.path.join(checkpoints, "4.damaged"))
  _assert_same_run(out, baseline)


def test_a_sigint_after_a_sigterm_during_the_save_still_saves_and_stops(model_dir, tmp_path):
  """SIGTERM, then one Ctrl-C while the step's checkpoint is being saved: a first Ctrl-C, as the
  docs say (before, it stopped at once with a traceback and left a temporary folder): the run
  saves, stops and says where."""
  out = str(tmp_path / "run")
  save = checkpointing.Checkpointer.save

  def signalled_meanwhile(self, step, *args, **kwargs):
    if step == 2:  # the first save; the run then stops after step 3, saving it
      os.kill(os.getpid(), signal.SIGTERM)
      os.kill(os.getpid(), signal.SIGINT)
    return save(self, step, *args, **kwargs)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(checkpointing.Checkpointer, "save", signalled_meanwhile)
    with pytest.raises(preemption.Stopped) as e:
      try:
        tiny_run.train(tiny_run.config(model_dir, out))
      except KeyboardInterrupt:
        pytest.fail("the Ctrl-C after SIGTERM stopped the run at once, as a second Ctrl-C")
  assert e.value.signum == signal.SIGTERM and e.value.step == 3
  checkpoints = os.path.join(out, "checkpoints")
  assert sorted(os.listdir(checkpoints)) == ["2", "3", checkpointing.BEST_FILE]  # no temporary folder
  for step in ("2", "3"):
    assert checkpointing.CHECKSUMS in os.listdir(os.path.join(checkpoints, step))


def test_a_signal_after_the_last_step_lets_the_run_end_as_it_would_have(
  baseline, model_dir, tmp_path, monkeypatch, caplog
):
  """SIGTERM while the finished run prints its summary and waits for its last save: the run ends
  as it would have, says so, and holds its checkpoints (before, the process died mid-close)."""
  from jaxrm.run import trainer

  out = str(tmp_path / "run")
  shutil.copytree(baseline, out)

  def terminated_meanwhile(summary, run, seconds):
    os.kill(os.getpid(), signal.SIGTERM)
    return summary(run, seconds)

  around(monkeypatch, trainer, "_final_summary", terminated_meanwhile)
  with caplog.at_level("WARNING", logger="jaxrm.train"):
    tiny_run.train(tiny_run.config(model_dir, out, train__max_steps=5))
  assert "SIGTERM received after the last step: the run ended as it would have" in caplog.text
  assert max(tiny_run.train_losses(out)) == 5
  assert "5" in os.listdir(os.path.join(out, "checkpoints"))


def test_the_command_hands_sigterm_from_its_watch_straight_to_ignored(monkeypatch):
  """The command's watch ends (its run over or stopped) by setting SIGTERM to SIG_IGN: at no
  moment in between may the default action kill the exiting process (a SIGTERM just after the
  last step once ended the command with -15 and no message). A library call gets its handler back."""
  from jaxrm.run import preemption

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


def _delete(path, rng):
  os.remove(path)


# "deleted" is tried on checksum lists: any other file deleted is named by the list.
FAULTS = {
  "truncated": _truncate,
  "flipped byte": _flip_byte,
  "emptied value": _empty_value,
  "deleted": _delete,
}


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
  outcomes, undamaged, faults = [], {}, set()
  for trial in range(TRIALS):
    target = rng.choice(sorted(TARGETS))
    files_of, read = TARGETS[target]
    path = rng.choice(files_of(damaged_copy))
    fault = rng.choice(sorted(FAULTS))
    faults.add(fault)
    if fault == "deleted":
      path = os.path.join(os.path.dirname(path), checkpointing.CHECKSUMS)
      if not os.path.exists(path):  # best_checkpoint.json's folder: a step's list instead
        path = os.path.join(damaged_copy, "checkpoints", str(rng.choice(steps)), checkpointing.CHECKSUMS)
    step = rng.choice([None, *steps])  # None: the best checkpoint, as a user loads it
    if (target, step) not in undamaged:
      undamaged[target, step] = read(damaged_copy, step)
    expected = undamaged[target, step]
    with open(path, "rb") as f:
      intact = f.read()
    FAULTS[fault](path, rng)
    changed = not os.path.exists(path) or open(path, "rb").read() != intact
    try:
      got = read(damaged_copy, step)
    except CheckpointError as e:
      assert path in str(e), f"trial {trial}: {fault} {path}, read step {step}: {e}"
      outcomes.append("named")
    else:  # a file this read does not use, or one left as it was: the same values
      if fault == "deleted":  # a step without its list is never read unverified (before, it was)
        read_step = step or checkpointing.read_best(os.path.join(damaged_copy, "checkpoints"))["step"]
        assert f"/checkpoints/{read_step}/" not in path, f"trial {trial}: {path} deleted, step read"
      for a, b in zip(got[0], expected[0], strict=True):
        np.testing.assert_array_equal(a, b, err_msg=f"trial {trial}: {fault} {path} loaded wrong values")
      assert got[1] == expected[1], f"trial {trial}: {fault} {path}"
      outcomes.append("same" if changed else "unchanged")
    finally:
      with open(path, "wb") as f:
        f.write(intact)
  assert outcomes.count("named") >= TRIALS // 3, outcomes  # the trials do reach damage that matters
  assert "deleted" in faults, faults  # the seeded trials do delete a checksum list


def test_a_checkpoint_without_its_checksum_list_is_not_loaded(damaged_copy):
  """The list deleted and a byte of the parameters flipped: named, never loaded as wrong values
  (before, a step without its list was taken for one saved before checksums and read unverified)."""
  step_dir = os.path.join(damaged_copy, "checkpoints", "4")
  listed = os.path.join(step_dir, checkpointing.CHECKSUMS)
  params = max(
    (p for p in _checkpoint_files(damaged_copy) if p.startswith(f"{step_dir}/params/")), key=os.path.getsize
  )
  kept = {p: open(p, "rb").read() for p in (listed, params)}
  try:
    os.remove(listed)
    _flip_byte(params, random.Random(SEED))
    with pytest.raises(CheckpointError, match="is missing") as e:
      _load_checkpoint(damaged_copy, 4)
    assert str(e.value).startswith(
      f"{step_dir}: the checkpoint of step 4 cannot be read ({listed}, its files' checksums, is missing"
    )
  finally:
    for p, data in kept.items():
      with open(p, "wb") as f:
        f.write(data)


def test_a_checkpoint_from_before_checksums_is_read_unverified(damaged_copy):
  """A step whose meta lacks the mark (saved before jaxrm wrote checksum lists) loads without one."""
  step_dir = os.path.join(damaged_copy, "checkpoints", "4")
  listed, meta = os.path.join(step_dir, checkpointing.CHECKSUMS), os.path.join(step_dir, "meta", "metadata")
  kept = {p: open(p, "rb").read() for p in (listed, meta)}
  try:
    os.remove(listed)
    with open(meta) as f:
      older = {k: v for k, v in json.load(f).items() if k != checkpointing.WITH_CHECKSUMS}
    with open(meta, "w") as f:
      json.dump(older, f)
    _, reward_stats = _load_checkpoint(damaged_copy, 4)
  finally:
    for p, data in kept.items():
      with open(p, "wb") as f:
        f.write(data)
  assert reward_stats["std"] > 0  # the step's own meta, read


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
