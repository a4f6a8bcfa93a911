"""Host memory of jaxrm's commands (jaxrm/run/host_memory.py): a compiled program's large temporaries
on huge pages, the command restarted once with glibc's tunable.

Each case runs in a process of its own, since glibc reads its tunables when a process starts. The
probe allocates a 64 MiB block as XLA:CPU allocates its temporaries (``posix_memalign``) and reads
the flags of the mapping that holds it from ``/proc/self/smaps``: ``hg`` is the kernel's record of
``madvise(MADV_HUGEPAGE)``, what jaxrm arranges. How many faults a step then takes depends on
whether the kernel finds free 2 MiB pages at that moment (a fragmented host falls back to 4 KiB
pages), so that is measured in docs/benchmarks.md ("Page faults"), not asserted here.
"""

import ast
import json
import os
import sys

import pytest
import tiny_run

from jaxrm.run import host_memory

PROBE = r"""
import ctypes, json, os
from jaxrm.run import host_memory
host_memory.restart_with_huge_pages()
libc = ctypes.CDLL(None)
block = ctypes.c_void_p()
assert libc.posix_memalign(ctypes.byref(block), 64, ctypes.c_size_t(64 << 20)) == 0
flags = None
with open("/proc/self/smaps") as f:
  inside = False
  for line in f:
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
      lo, hi = (int(x, 16) for x in head.split("-"))
      inside = lo <= block.value < hi
    elif inside and head == "VmFlags:":
      flags = line.split()[1:]
libc.free(block)
print(json.dumps(dict(tunables=os.environ.get("GLIBC_TUNABLES"), flags=flags)))
"""

on_huge_pages = pytest.mark.skipif(
  not host_memory.huge_pages_env(),
  reason="glibc older than 2.35, another C library, the kernel's transparent huge pages not in "
  "madvise mode, or GLIBC_TUNABLES set in this environment",
)


def _probe(**env) -> dict:
  out = tiny_run.run([sys.executable, "-c", PROBE], timeout=120, **env)
  assert out.returncode == 0, out.stderr
  return json.loads(out.stdout.splitlines()[-1])


@on_huge_pages
def test_a_restarted_process_maps_its_large_blocks_for_huge_pages():
  """The command restarts with glibc's tunable, and a block the size of a step's temporaries lands
  in a mapping advised for huge pages. Measured on its own (docs/benchmarks.md): ~1/500th of the
  page faults of glibc's defaults for SmolLM2's step, where the kernel has free huge pages."""
  huge = _probe()
  assert huge["tunables"] == host_memory.TUNABLE
  assert huge["flags"] is not None and "hg" in huge["flags"], huge


@on_huge_pages
def test_glibcs_tunables_set_by_the_user_are_kept():
  """A ``GLIBC_TUNABLES`` already set, even empty, is kept: no restart, and glibc's large blocks
  are mapped without the advice (what the test above would see without the tunable)."""
  system = _probe(GLIBC_TUNABLES="")
  assert system["tunables"] == ""
  assert system["flags"] is not None and "hg" not in system["flags"], system


def test_only_madvise_mode_restarts(tmp_path, monkeypatch):
  """Transparent huge pages ``always`` on need no advice and ``never`` take none: no restart. The
  kernel's mode is a file the test writes, so it runs whatever this host's mode is."""
  thp = tmp_path / "enabled"
  monkeypatch.setattr(host_memory, "_THP", str(thp))
  thp.write_text("always [madvise] never\n")
  if not host_memory.huge_pages_env():
    pytest.skip("this host's C library takes no tunable (not glibc 2.35 or later, or GLIBC_TUNABLES set)")
  for mode, env in [
    ("always madvise [never]", {}),
    ("[always] madvise never", {}),
    ("always [madvise] never", {"GLIBC_TUNABLES": host_memory.TUNABLE}),
  ]:
    thp.write_text(mode + "\n")
    assert host_memory.huge_pages_env() == env, mode


@pytest.mark.parametrize("command", ["train", "evaluate", "serve"])
def test_the_commands_restart_before_anything_else(command):
  """Each command's module restarts under ``__main__`` before its first import past host_memory
  (their imports take seconds that a restart would spend twice)."""
  path = os.path.join(tiny_run.ROOT, "jaxrm", f"{command}.py")
  with open(path) as f:
    body = ast.parse(f.read()).body
  guard = next(i for i, node in enumerate(body) if isinstance(node, ast.If))
  assert ast.unparse(body[guard].test) == "__name__ == '__main__'"
  assert ast.unparse(body[guard].body[0]) == "host_memory.restart_with_huge_pages()"
  before = [ast.unparse(n) for n in body[:guard] if isinstance(n, (ast.Import, ast.ImportFrom))]
  assert before[-1] == "from jaxrm.run import host_memory", before
  assert all(
    n.split()[1] in ("__future__", "os", "sys", "signal", "logging", "ipaddress") for n in before[:-1]
  )
