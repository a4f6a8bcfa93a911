r"""Two ``python -m jaxrm.train`` runs started at the same moment into one new output folder, trial
after trial: the one the folder's lock refuses must leave the other's folder and lock as they are.

  python tests/lock_race.py MODEL_DIR ROOT TRIALS

Each run is a fork of this process that runs the command as ``python -m jaxrm.train`` does (the
module executed as ``__main__``, absl's flags and the tiny run's config file): the modules it
imports are imported here once, so a trial costs its runs' own work, not two interpreters'
start-up (about 1.7 CPU-s each). The runs wait on a pipe and are let go together. When the first
of them exits, the folder is read while the other still runs; then the other is killed (it never
gets to train). Prints one JSON line per trial: the first run's pid, exit code and last line of
output, the other's pid, whether it was still running, and the pid the folder's lock names (None:
no lock).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys


def main(model_dir: str, root: str, trials: int) -> None:
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  # The command's __main__ would restart the process with glibc's huge-page setting (this script,
  # each run again): the setting changes how memory is allocated, not what a run does.
  os.environ.setdefault("GLIBC_TUNABLES", "")
  import tiny_run

  from jaxrm import cli  # noqa: F401  (imported once, for every run)
  from jaxrm.run import run_lock

  for trial in range(trials):
    out = os.path.join(root, f"run{trial}")
    go_read, go_write = os.pipe()
    flags = tiny_run.cli(model_dir, out)[3:]
    pids = [_start(flags, go_read, os.path.join(root, f"run{trial}-{i}.log")) for i in range(2)]
    os.close(go_read)
    os.write(go_write, b"go")
    os.close(go_write)
    first, status = os.wait()
    (other,) = [p for p in pids if p != first]
    try:
      with open(os.path.join(out, run_lock.FILE)) as f:
        holder = json.load(f).get("pid")
    except (OSError, ValueError):
      holder = None
    running = os.waitpid(other, os.WNOHANG) == (0, 0)
    if running:
      os.kill(other, signal.SIGKILL)
      os.waitpid(other, 0)
    with open(os.path.join(root, f"run{trial}-{pids.index(first)}.log")) as f:
      said = f.read().strip().splitlines()[-1:]
    row = dict(trial=trial, first=first, first_exit=os.waitstatus_to_exitcode(status), first_said=said)
    print(json.dumps({**row, "other": other, "other_running": running, "lock_pid": holder}), flush=True)


def _start(flags: list[str], go: int, log: str) -> int:
  """A forked run of ``python -m jaxrm.train`` with ``flags``, waiting for a byte on ``go``."""
  pid = os.fork()
  if pid:
    return pid
  code = 1
  try:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.read(go, 1)
    sys.argv = ["jaxrm.train", *flags]
    runpy.run_module("jaxrm.train", run_name="__main__", alter_sys=True)
    code = 0
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
  if len(sys.argv) != 4:
    sys.exit("usage: python tests/lock_race.py MODEL_DIR ROOT TRIALS")
  main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
