"""One run at a time in an output directory: a lock file held by the run that writes there.

The lock is ``<output_dir>/run.lock``, a JSON object naming its holder (host, pid, start time and
command line); a checkpoint directory outside the output directory holds one too. A second run
into the same directory is refused, naming the holder, and removes nothing. A lock left by
a run that died without releasing it (``kill -9``, a lost node) is recognised and taken over with
a warning: on this host, by its process being gone; on another host (a shared file system), by its
age, which the holder refreshes every :data:`HEARTBEAT_SECONDS` while it runs. A multi-host run
holds it once, from process 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shlex
import shutil
import socket
import sys
import threading
import time

from jaxrm.errors import ConfigError
from jaxrm.run import refused_writes

log = logging.getLogger(__name__)

FILE = "run.lock"
HEARTBEAT_SECONDS = 30.0
# A lock from another host untouched for this long belongs to a run that no longer runs.
STALE_SECONDS = 10 * HEARTBEAT_SECONDS
WRITE_SECONDS = 5.0  # a lock younger than this that does not read yet is being written


def hold(output_dir: str, key: str = "output_dir") -> RunLock:
  """``output_dir``'s lock, taken (see :meth:`RunLock.acquire`); ``key`` is the setting that names
  the directory, which a refusal says to change."""
  lock = RunLock(output_dir, key)
  try:
    lock.acquire()
  except OSError as e:
    code = refused_writes.refusal(e)
    if code is None:
      raise
    folder = os.path.abspath(output_dir)
    raise ConfigError(
      f"{key}={folder}: the run cannot write its lock there ({os.strerror(code)}); "
      f"{refused_writes.what_is_needed(code, folder, key)}"
    ) from None
  return lock


class RunLock:
  """The lock of ``output_dir``, taken by :meth:`acquire` and given back by :meth:`release`."""

  def __init__(self, output_dir: str, key: str = "output_dir"):
    if not isinstance(output_dir, str) or not output_dir:
      raise ValueError(f"RunLock: {key} must be a directory path, got {output_dir!r}")
    self.path = os.path.join(output_dir, FILE)
    self.key = key
    # Whether the directory was absent when acquire began: a run that stops during its set-up
    # removes such a directory, and only while it holds the lock.
    self.made_directory = False
    self._mine: dict | None = None
    self._stop = threading.Event()
    self._beat: threading.Thread | None = None

  @property
  def directory(self) -> str:
    return os.path.dirname(self.path)

  def acquire(self) -> None:
    """Takes the lock (making ``output_dir``), or raises a ConfigError naming the run that holds it.
    Making the directory is all it does before the lock is held."""
    self.made_directory = not os.path.isdir(os.path.dirname(self.path))
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    me = {
      "host": socket.gethostname(),
      "pid": os.getpid(),
      "started": time.strftime("%Y-%m-%d %H:%M:%S"),
      "command": shlex.join(getattr(sys, "orig_argv", sys.argv)),
    }
    while True:
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        self._take_over_if_stale(me)
        continue
      with os.fdopen(fd, "w") as f:
        json.dump(me, f)
      break
    self._mine = me
    self._beat = threading.Thread(target=self._heartbeat, name="jaxrm-run-lock", daemon=True)
    self._beat.start()

  def release(self) -> None:
    """Gives the lock back, if this process still holds it."""
    if self._mine is None:
      return
    self._stop.set()
    if self._beat is not None:
      self._beat.join()
    if _read(self.path) == self._mine:
      try:
        os.remove(self.path)
      except FileNotFoundError:
        pass
    self._mine = None

  def __enter__(self) -> RunLock:
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()

  def _heartbeat(self) -> None:
    while not self._stop.wait(HEARTBEAT_SECONDS):
      try:
        os.utime(self.path)
      except OSError:  # removed meanwhile: nothing to refresh
        pass

  def _take_over_if_stale(self, me: dict) -> None:
    """Removes a lock whose holder is gone (warning that it does); raises naming a live holder."""
    holder = _read(self.path)
    if holder is None:
      if not os.path.exists(self.path):
        return  # released meanwhile: try again
      if _age(self.path) < WRITE_SECONDS:
        time.sleep(0.05)  # being written by a run that started a moment ago: read it again
        return
      reason = "an unreadable lock"
    else:
      alive, why = _alive(holder, me["host"], _age(self.path))
      if alive:
        raise ConfigError(
          f"{os.path.dirname(self.path)} is in use by another run: {_describe(holder)} ({why}; "
          f"{self.path}). Wait for it to end or stop it, or train into another {self.key}"
        )
      reason = f"a lock left by {_describe(holder)}, which {why}"
    if self._set_aside(holder):
      log.warning("taking over %s: %s", self.path, reason)

  def _set_aside(self, judged: dict | None) -> bool:
    """Removes the lock judged stale. Another run may have taken it over and written its own since
    it was read: the lock is moved aside first, and put back if it is no longer the one judged."""
    aside = f"{self.path}.{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}"
    try:
      os.rename(self.path, aside)
    except FileNotFoundError:
      return False  # released or taken over meanwhile: try again
    moved = _read(aside)
    if moved != judged:
      with contextlib.suppress(FileExistsError):
        os.link(aside, self.path)  # back in place, unless yet another run holds it now
    os.remove(aside)
    return moved == judged


def _read(path: str) -> dict | None:
  try:
    with open(path) as f:
      holder = json.load(f)
  except (OSError, ValueError):
    return None
  return holder if isinstance(holder, dict) and {"host", "pid"} <= holder.keys() else None


def _age(path: str) -> float:
  try:
    return time.time() - os.stat(path).st_mtime
  except FileNotFoundError:
    return 0.0


def _alive(holder: dict, host: str, age: float) -> tuple[bool, str]:
  """Whether the lock's holder still runs, and the evidence."""
  if holder["host"] == host:
    try:
      os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
      return False, "is no longer running"
    except PermissionError:  # a process of another user holds that pid
      return True, "its process is running"
    except (TypeError, ValueError):
      return False, "names no process"
    return True, "its process is running"
  if age > STALE_SECONDS:
    return False, f"has not refreshed it for {age:.0f} s"
  return True, f"refreshed {age:.0f} s ago from {holder['host']}"


def _describe(holder: dict) -> str:
  started = f", started {holder['started']}" if holder.get("started") else ""
  command = f": {holder['command']}" if holder.get("command") else ""
  return f"pid {holder['pid']} on {holder['host']}{started}{command}"


# ------------------------------------------------------------------ a run's directories


@dataclasses.dataclass
class Held:
  """The locks this process holds on a run's directories (none on a process other than 0) and
  the directories the run made, judged while it held their locks."""

  locks: list[RunLock]
  made: list[str]

  def release(self) -> None:
    for lock in reversed(self.locks):
      lock.release()

  def give_back(self, remove_made: bool) -> None:
    """Releases the locks; with ``remove_made`` (a set-up that failed), first empties the
    directories this run made while the locks are still held, then removes those that are still
    empty once released: another run may hold one by then."""
    made = self.made if remove_made else []
    for directory in made:
      if os.path.isdir(directory):
        for name in os.listdir(directory):
          if name != FILE:
            _remove(os.path.join(directory, name))
    self.release()
    for directory in made:
      with contextlib.suppress(OSError):
        os.rmdir(directory)


def hold_run(run_dir: str, checkpoint_dir: str, checkpointing: bool, *, main: bool) -> Held:
  """The main process takes the lock of ``run_dir``, then that of ``checkpoint_dir`` where it lies
  outside and is used (``checkpointing``) or exists; the others hold nothing. Nothing but a lock's
  own directory is made before that lock is held, and a run a lock refuses removes nothing.

  Raises:
    ConfigError: another run holds a lock, or a lock cannot be written.
  """
  run_dir, checkpoint_dir = os.path.abspath(run_dir), os.path.abspath(checkpoint_dir)
  held = Held([], [])
  if not main:
    return held
  held.locks.append(hold(run_dir))
  try:
    if not inside(checkpoint_dir, run_dir) and (checkpointing or os.path.isdir(checkpoint_dir)):
      held.locks.append(hold(checkpoint_dir, "checkpointing.checkpoint_dir"))
  except BaseException:
    held.made = [run_dir] if held.locks[0].made_directory else []
    held.give_back(remove_made=True)
    raise
  held.made = [lock.directory for lock in held.locks if lock.made_directory]
  if inside(checkpoint_dir, run_dir) and not os.path.exists(checkpoint_dir):
    held.made.append(checkpoint_dir)
  return held


def inside(path: str, run_dir: str) -> bool:
  """Whether ``path`` is ``run_dir`` or lies under it."""
  run_dir = os.path.abspath(run_dir)
  return os.path.commonpath([run_dir, os.path.abspath(path)]) == run_dir


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path, ignore_errors=True)
  else:
    with contextlib.suppress(OSError):
      os.remove(path)
