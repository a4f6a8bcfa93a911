"""Host memory of jaxrm's own processes: a step's temporaries on huge pages.

XLA:CPU allocates a compiled program's temporaries (for a training step, gigabytes: every layer's
activations) at each run and frees them at its end; glibc serves blocks that large with a mapping
of their own and unmaps them when freed, so every step maps and faults in its temporaries anew,
one 4 KiB page at a time: for SmolLM2-135M at two pairs a step, 3.2 GB and ~778,000 minor page
faults a step, 22 times TRL's (docs/benchmarks.md, "Page faults: a step's temporaries on huge
pages").

glibc 2.35 and later can back those mappings with transparent huge pages (the tunable
``glibc.malloc.hugetlb=1``): 2 MiB a fault, ~1/500th of the faults, the same memory. glibc reads
tunables only when a process starts, so the commands (``python -m jaxrm.train``, ``evaluate``,
``serve``) restart themselves once, at their very start, with it set: :func:`restart_with_huge_pages`.
glibc marks its large mappings for huge pages (``madvise(MADV_HUGEPAGE)``) only where the kernel's
transparent huge pages are in ``madvise`` mode; in ``always`` mode the kernel backs them so already,
and where they are ``never``, not at all: nothing is restarted in either. Nothing changes where
glibc is older or absent, or where ``GLIBC_TUNABLES`` is already set (the user's choice, kept as it
is: setting it, even empty, turns this off). Whether the kernel finds a free 2 MiB page at each
fault is its own affair (memory fragmented by other processes falls back to 4 KiB pages).

Kept from one step to the next instead (glibc's main heap for every thread, nothing trimmed), the
temporaries fault once, but blocks of differently shaped steps pin each other in the heap: the
process held 1.4-1.5x the memory (docs/benchmarks.md), so that is not done.
"""

from __future__ import annotations

import ctypes
import os
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_env() -> dict[str, str]:
  """The environment a process needs for huge-page temporaries: ``{"GLIBC_TUNABLES": ...}``, or
  ``{}`` where it would change nothing or the environment already sets glibc's tunables."""
  if not sys.platform.startswith("linux") or "GLIBC_TUNABLES" in os.environ:
    return {}
  try:
    libc = ctypes.CDLL(None)
    version = libc.gnu_get_libc_version
  except (OSError, AttributeError):
    return {}  # another C library (musl): its allocator is left as it is
  version.restype = ctypes.c_char_p
  if tuple(int(x) for x in version().decode().split(".")[:2]) < (2, 35):
    return {}
  try:
    with open(_THP) as f:
      if "[madvise]" not in f.read():
        return {}  # "always": the kernel needs no advice; "never": none is taken
  except OSError:
    return {}
  return {"GLIBC_TUNABLES": TUNABLE}


def restart_with_huge_pages() -> None:
  """Restarts this process with :func:`huge_pages_env` set (the same interpreter, flags and
  arguments, the same process id), where it changes something; else returns. Call it first in a
  command's ``__main__``, before anything else has run."""
  env = huge_pages_env()
  if env:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, {**os.environ, **env})
