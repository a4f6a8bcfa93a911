"""One run at a time in an output directory (jaxrm.run.run_lock): a second run is refused naming the
holder; a lock whose holder is gone is taken over with a warning."""

import errno
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import tiny_run
from helpers import around

from jaxrm.errors import ConfigError
from jaxrm.run import run_lock


def write_lock(directory, **holder):
  path = directory / run_lock.FILE
  path.write_text(json.dumps({"host": socket.gethostname(), "started": "2026-01-02 03:04:05", **holder}))
  return path


def finished_pid() -> int:
  """The pid of a process that has exited."""
  proc = subprocess.run(
    [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
  )
  return int(proc.stdout)


def test_a_second_run_is_refused_naming_the_holder(tmp_path):
  lock = run_lock.hold(str(tmp_path / "run"))  # makes the directory
  holder = json.loads((tmp_path / "run" / "run.lock").read_text())
  assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
  with pytest.raises(ConfigError) as e:
    run_lock.hold(str(tmp_path / "run"))
  assert str(e.value) == (
    f"{tmp_path / 'run'} is in use by another run: pid {os.getpid()} on {socket.gethostname()}, "
    f"started {holder['started']}: {holder['command']} (its process is running; "
    f"{tmp_path / 'run' / 'run.lock'}). Wait for it to end or stop it, or train into another output_dir"
  )
  lock.release()
  assert not (tmp_path / "run" / "run.lock").exists()
  run_lock.hold(str(tmp_path / "run")).release()  # free again


def test_a_lock_of_a_process_that_is_gone_is_taken_over(tmp_path, caplog):
  pid = finished_pid()
  write_lock(tmp_path, pid=pid, command="python -m jaxrm.train --config=configs/rm.py")
  with caplog.at_level(logging.WARNING, logger="jaxrm.run.run_lock"):
    lock = run_lock.hold(str(tmp_path))
  assert caplog.messages == [
    f"taking over {tmp_path / 'run.lock'}: a lock left by pid {pid} on {socket.gethostname()}, started "
    "2026-01-02 03:04:05: python -m jaxrm.train --config=configs/rm.py, which is no longer running"
  ]
  assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
  lock.release()


def test_two_runs_taking_over_one_stale_lock_leave_one_holder(tmp_path, monkeypatch):
  """Run B judged the dead run's lock stale; before B removes it, run A takes it over: B must not
  remove A's lock, and stops naming A."""
  write_lock(tmp_path, pid=finished_pid())
  started, taken = [], []

  def a_takes_over_meanwhile(judge, holder, host, age):
    verdict = judge(holder, host, age)
    if not started:  # B's judgement: run A takes over between B's reading and B's removing
      started.append(True)
      taken.append(run_lock.hold(str(tmp_path)))
    return verdict

  around(monkeypatch, run_lock, "_alive", a_takes_over_meanwhile)
  with pytest.raises(ConfigError, match="is in use by another run"):
    run_lock.hold(str(tmp_path))  # run B
  assert sorted(os.listdir(tmp_path)) == ["run.lock"]
  taken[0].release()  # A's release removes only A's own lock: the one left is A's
  assert not os.listdir(tmp_path)


def test_another_hosts_lock_is_judged_by_its_age(tmp_path, caplog):
  path = write_lock(tmp_path, host="node-7", pid=1)
  with pytest.raises(ConfigError, match=r"pid 1 on node-7, started 2026-01-02 03:04:05 \(refreshed \d s ago"):
    run_lock.hold(str(tmp_path))
  old = time.time() - run_lock.STALE_SECONDS - 60
  os.utime(path, (old, old))
  with caplog.at_level(logging.WARNING, logger="jaxrm.run.run_lock"):
    run_lock.hold(str(tmp_path)).release()
  assert f"which has not refreshed it for {run_lock.STALE_SECONDS + 60:.0f} s" in caplog.text


def test_the_holder_refreshes_its_lock_while_it_runs(tmp_path, monkeypatch):
  monkeypatch.setattr(run_lock, "HEARTBEAT_SECONDS", 0.01)
  lock = run_lock.hold(str(tmp_path))
  old = time.time() - 1000
  os.utime(tmp_path / "run.lock", (old, old))
  deadline = time.time() + 10
  while time.time() - os.stat(tmp_path / "run.lock").st_mtime > 100 and time.time() < deadline:
    time.sleep(0.01)
  assert time.time() - os.stat(tmp_path / "run.lock").st_mtime < 100
  lock.release()


def test_release_leaves_a_lock_another_run_took_over(tmp_path):
  lock = run_lock.hold(str(tmp_path))
  write_lock(tmp_path, pid=os.getppid())  # taken over meanwhile (as if this process had stalled)
  lock.release()
  assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getppid()


def test_an_unreadable_old_lock_is_taken_over(tmp_path, caplog):
  path = tmp_path / run_lock.FILE
  path.write_text("{")
  old = time.time() - 60
  os.utime(path, (old, old))
  with caplog.at_level(logging.WARNING, logger="jaxrm.run.run_lock"):
    run_lock.hold(str(tmp_path)).release()
  assert "an unreadable lock" in caplog.text


def test_a_bad_directory_is_named():
  with pytest.raises(ValueError, match=r"output_dir must be a directory path, got ''"):
    run_lock.RunLock("")


def test_a_run_into_a_locked_directory_stops_before_the_model_loads(model_dir, tmp_path):
  out = tmp_path / "run"
  lock = run_lock.hold(str(out))  # another run of this host, still running
  try:
    with pytest.raises(
      ConfigError, match=rf"^{re.escape(str(out))} is in use by another run: pid {os.getpid()} "
    ):
      tiny_run.train(tiny_run.config(model_dir, str(out)))
    assert os.listdir(out) == ["run.lock"]  # nothing written, nothing removed
  finally:
    lock.release()


def test_two_runs_racing_for_a_new_folder_leave_the_winner_its_folder(model_dir, tmp_path):
  """20 trials of two ``python -m jaxrm.train`` runs let go together into a new folder (forks of one
  process, tests/lock_race.py): each time one is refused and exits 2 while the other still runs,
  its folder and lock in place (the refused run removes nothing)."""
  trials = 20
  result = tiny_run.run([sys.executable, "tests/lock_race.py", model_dir, str(tmp_path), str(trials)])
  assert result.returncode == 0, tiny_run.describe(result)
  rows = [json.loads(line) for line in result.stdout.splitlines()]
  assert len(rows) == trials, tiny_run.describe(result)
  for row in rows:
    assert row["first_exit"] == 2 and "is in use by another run" in row["first_said"][0], row
    assert row["other_running"] and row["lock_pid"] == row["other"], row


def test_a_folder_where_no_lock_can_be_written_is_refused_naming_what_is_needed(tmp_path, monkeypatch):
  """A read-only checkpoint folder is found by its lock, the first write of a run: one line naming
  the setting, the folder and what is needed (before, a bare ``[Errno 30]``). Root writes whatever
  a folder's mode says, so the refusal is made where the file system is asked."""
  folder = str(tmp_path / "ro" / "checkpoints")

  def refused(path, *args, **kwargs):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

  monkeypatch.setattr(os, "makedirs", refused)
  with pytest.raises(ConfigError) as e:
    run_lock.hold(folder, "checkpointing.checkpoint_dir")
  assert str(e.value) == (
    f"checkpointing.checkpoint_dir={folder}: the run cannot write its lock there (Read-only file "
    "system); the folder must be writable: make it so, or set checkpointing.checkpoint_dir to a "
    "folder this user can write"
  )
