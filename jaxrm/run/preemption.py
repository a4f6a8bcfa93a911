"""Stopping a run cleanly when it is told to: SIGTERM (what Slurm and cloud schedulers send before
they kill a job) and SIGINT (Ctrl-C).

While :func:`watch` holds, either signal is remembered instead of ending the process; the
training loop asks :meth:`Watch.reached` after each step and, where it says so, saves a
checkpoint of that step and raises :class:`Stopped`. Every process of a multi-host run stops at the
same step: there JAX's preemption sync manager (the one Orbax's ``CheckpointManager.should_save``
asks) receives SIGTERM on any host and names the step at which all of them save; a SIGINT is
passed on to it as a SIGTERM. A second Ctrl-C stops at once, as Python does (a save it interrupts
is removed: :mod:`jaxrm.run.checkpointing`); a Ctrl-C after a SIGTERM is a first Ctrl-C, and the run
still saves and stops. Further SIGTERMs are ignored (launchers often send one per process group).

A command whose run is over has nothing left that a SIGTERM could save or lose: it calls
:func:`ignore_sigterm_after_watch` first, and the watch's end then hands SIGTERM straight to
``SIG_IGN``, with no moment between in which the default action would kill the exiting process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading

import jax

log = logging.getLogger("jaxrm.train")

SIGNALS = (signal.SIGTERM, signal.SIGINT)

# Whether a watch's end ignores SIGTERM (a command) rather than restoring its handler (a library call).
_ignore_sigterm_after_watch = False


def ignore_sigterm_after_watch() -> None:
  """From the end of every later :func:`watch` on, SIGTERM is ignored rather than restored: for a
  command, whose process only saves, reports and exits once its run is over."""
  global _ignore_sigterm_after_watch
  _ignore_sigterm_after_watch = True


class Stopped(Exception):
  """The run stopped at a step boundary on a signal; the message says where its checkpoint is and
  how to continue. ``exit_code`` is the shell's code of a process ended by that signal."""

  def __init__(self, message: str, signum: int, step: int):
    super().__init__(message)
    self.signum = signum
    self.step = step
    self.exit_code = 128 + signum


class Watch:
  """Which signal arrived (``received``), and whether all processes have reached the step to stop
  at (:meth:`reached`)."""

  def __init__(self):
    self.received: int | None = None
    self._interrupts = 0  # Ctrl-Cs received: the second stops at once
    self._previous: dict[int, object] = {}
    self._jax_sync = jax.process_count() > 1 and _jax_sync_available()

  def install(self) -> None:
    if threading.current_thread() is not threading.main_thread():
      return  # signal handlers belong to the main thread: a run in another thread keeps the defaults
    for signum in SIGNALS:
      if signum == signal.SIGTERM and self._jax_sync:
        continue  # JAX's preemption notifier holds SIGTERM and tells every host
      self._previous[signum] = signal.signal(signum, self._handle)

  def uninstall(self) -> None:
    if self._previous and _ignore_sigterm_after_watch:  # JAX's notifier's SIGTERM too
      signal.signal(signal.SIGTERM, signal.SIG_IGN)
      self._previous.pop(signal.SIGTERM, None)
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous.clear()

  def _handle(self, signum: int, frame) -> None:
    name = signal.Signals(signum).name
    if signum == signal.SIGINT:
      self._interrupts += 1
      if self._interrupts > 1:  # Ctrl-C twice: stop now, as Python would have at the first
        signal.signal(signum, self._previous.pop(signum))
        raise KeyboardInterrupt
    if self.received is not None:
      log.warning(
        "%s received%s: still saving at the end of the current step, then stopping%s",
        name,
        " again" if signum == self.received else f" after {self.name}",
        " (Ctrl-C again to stop at once, without saving)" if signum == signal.SIGINT else "",
      )
      return
    self.received = signum
    log.warning(
      "%s received: saving a checkpoint at the end of the current step, then stopping%s",
      name,
      " (Ctrl-C again to stop at once, without saving)" if signum == signal.SIGINT else "",
    )
    if self._jax_sync and signum != signal.SIGTERM:
      os.kill(os.getpid(), signal.SIGTERM)  # through JAX's notifier, to every host

  def reached(self, step: int) -> bool:
    """Whether to save and stop after ``step``; every process calls it at every step."""
    if jax.process_count() == 1:
      return self.received is not None
    from jax.experimental import multihost_utils

    if self._jax_sync:
      return multihost_utils.reached_preemption_sync_point(step)
    # Without JAX's preemption service (jax_enable_preemption_service=False) the hosts agree here.
    flags = multihost_utils.process_allgather(int(self.received is not None))
    return bool(flags.any())

  @property
  def signum(self) -> int:
    """The signal this process received, or (another host's) SIGTERM."""
    return self.received or signal.SIGTERM

  @property
  def name(self) -> str:
    return signal.Signals(self.signum).name


def _jax_sync_available() -> bool:
  from jax.experimental import multihost_utils

  try:
    multihost_utils.reached_preemption_sync_point(-1)
  except RuntimeError:  # the preemption service is off
    return False
  return True


@contextlib.contextmanager
def watch():
  """SIGTERM and SIGINT remembered (not acted on) within the block; yields the :class:`Watch`."""
  w = Watch()
  w.install()
  try:
    yield w
  finally:
    w.uninstall()
