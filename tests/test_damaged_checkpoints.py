"""A checkpoint damaged after it was saved (its largest file cut short, as a full disk or a bad
copy leaves it): scoring names the step and what to do; resuming falls back to the newest intact
checkpoint and says which step it skipped."""

import os
import re
import shutil
import sys

import pytest
import tiny_run

from jaxrm import RewardModel
from jaxrm.errors import CheckpointError, UserError


@pytest.fixture(scope="module")
def run_dir(model_dir, tmp_path_factory):
  """Two training steps, checkpointed after each."""
  out = str(tmp_path_factory.mktemp("run"))
  tiny_run.train(_config(model_dir, out, max_steps=2))
  return out


def _config(model_dir, out, max_steps):
  return tiny_run.config(
    model_dir,
    out,
    train__max_steps=max_steps,
    eval__val_period=1,
    checkpointing__save_period=1,
    checkpointing__keep_top_k=3,
    data__max_train_rows=16,
  )


@pytest.fixture
def run_copy(run_dir, tmp_path):
  return str(shutil.copytree(run_dir, tmp_path / "run"))


def _truncate_largest(step_dir: str) -> str:
  files = [os.path.join(d, f) for d, _, names in os.walk(step_dir) for f in names]
  largest = max(files, key=os.path.getsize)
  with open(largest, "r+b") as f:
    f.truncate(os.path.getsize(largest) // 2)
  return largest


def test_scoring_a_damaged_checkpoint_names_the_step_and_what_to_do(run_copy):
  checkpoints = os.path.join(run_copy, "checkpoints")
  _truncate_largest(os.path.join(checkpoints, "2"))
  with pytest.raises(
    CheckpointError, match=re.escape(f"{checkpoints}/2: the checkpoint of step 2 cannot be read (")
  ) as e:
    RewardModel.from_pretrained(run_copy, step=2)
  assert e.value.args[0].endswith(
    f"it looks damaged (a truncated file, as a full disk or an interrupted copy "
    f"leaves it). Load another checkpoint with step=N (available: 1), or remove "
    f"{checkpoints}/2"
  )
  assert RewardModel.from_pretrained(run_copy, step=1).reward_stats  # the intact one still loads


def test_the_export_cli_reports_a_damaged_checkpoint_in_one_line(run_copy, tmp_path):
  _truncate_largest(os.path.join(run_copy, "checkpoints", "2"))
  bad = tiny_run.run(
    [
      sys.executable,
      "-m",
      "jaxrm.export",
      f"--model={run_copy}",
      "--step=2",
      f"--out={tmp_path / 'out'}",
    ]
  )
  assert bad.returncode == 1, tiny_run.describe(bad)
  assert "Traceback" not in bad.stderr and "Exception ignored" not in bad.stderr
  last = bad.stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: {run_copy}/checkpoints/2: the checkpoint of step 2 cannot be read")
  assert last.endswith(f"or remove {run_copy}/checkpoints/2")


def test_resume_skips_a_damaged_checkpoint_and_says_so(run_copy, model_dir, caplog):
  checkpoints = os.path.join(run_copy, "checkpoints")
  before = tiny_run.train_losses(run_copy)
  _truncate_largest(os.path.join(checkpoints, "2"))
  with caplog.at_level("WARNING", logger="jaxrm.train"):
    tiny_run.train(_config(model_dir, run_copy, max_steps=3))
  warned = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
  assert len(warned) == 1 and warned[0].startswith(
    f"{checkpoints}/2: the checkpoint of step 2 cannot be read"
  )
  assert warned[0].endswith(f"skipped, and moved to {checkpoints}/2.damaged")
  assert sorted(os.listdir(checkpoints)) == ["1", "2", "2.damaged", "3", "best_checkpoint.json"]
  losses = tiny_run.train_losses(run_copy)
  # Step 2 was trained again from step 1's state (parameters, optimizer, data iterator, RNG):
  # the same program on the same inputs as the first time, so the same loss (1e-6, as the
  # resumed-vs-uninterrupted tests hold it).
  assert sorted(losses) == [1, 2, 3]
  assert losses[2] == pytest.approx(before[2], rel=1e-6, abs=1e-6)
  RewardModel.from_pretrained(run_copy, step=3)


def test_resume_with_no_intact_checkpoint_stops_naming_them(run_copy, model_dir):
  checkpoints = os.path.join(run_copy, "checkpoints")
  for step in ("1", "2"):
    _truncate_largest(os.path.join(checkpoints, step))
  with pytest.raises(
    UserError,
    match=re.escape(
      f"{checkpoints}: no intact checkpoint to resume from; step(s) 2, 1 are damaged (moved to "
      "<step>.damaged)"
    ),
  ):
    tiny_run.train(_config(model_dir, run_copy, max_steps=3))
