"""The host allocator of jaxrm's own processes: a step's large blocks kept for the next step.

XLA:CPU allocates a compiled program's temporaries (for a training step, gigabytes: every layer's
activations) at each run, from the thread that runs it, and frees them at its end. glibc serves a
block that large from a thread with a mapping of its own and unmaps it when freed, so every step
maps, faults in and zeroes its temporaries anew: for SmolLM2-135M at two pairs a step, 3.2 GB and
~778,000 minor page faults a step (`docs/benchmarks.md`, "CPU: where the step's time goes").

:func:`keep_freed_blocks` makes every thread allocate from glibc's main heap, which grows by
``brk``, serves no block by a mapping of its own and is never trimmed: a freed block stays in the
process for the next step (none of those faults after the first step). The commands call it
before JAX starts its threads; a thread that has already allocated keeps the heap it has. It
changes nothing where the C library is not glibc, and nothing where the environment already sets
glibc's allocator (any ``MALLOC_*_``-style variable or ``GLIBC_TUNABLES``): those are the user's.
"""

from __future__ import annotations

import ctypes
import os
import sys

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

# The environment through which glibc reads allocator settings at start.
_GLIBC_MALLOC_ENV = (
  "MALLOC_ARENA_MAX",
  "MALLOC_ARENA_TEST",
  "MALLOC_MMAP_MAX_",
  "MALLOC_MMAP_THRESHOLD_",
  "MALLOC_TOP_PAD_",
  "MALLOC_TRIM_THRESHOLD_",
  "GLIBC_TUNABLES",
)


def keep_freed_blocks() -> bool:
  """One heap for every thread, no block mapped on its own, nothing returned to the system.

  Returns whether the allocator was changed (False off glibc, or where the environment sets
  glibc's allocator). Call it before JAX creates its threads: at the start of a command.
  """
  if not sys.platform.startswith("linux") or any(k in os.environ for k in _GLIBC_MALLOC_ENV):
    return False
  libc = ctypes.CDLL(None)
  if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
    return False  # another C library (musl): its allocator is left as it is
  mallopt = libc.mallopt
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  # -1 as M_TRIM_THRESHOLD turns trimming off (mallopt(3)).
  return all(mallopt(p, v) == 1 for p, v in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1)))
