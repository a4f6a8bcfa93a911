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
import json
import logging
import os
import shlex
import socket
import sys
import threading
import time

from jaxrm.errors import ConfigError

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
  lock.acquire()
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
