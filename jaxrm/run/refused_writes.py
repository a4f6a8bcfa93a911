"""Writes the file system refuses for a reason the user can fix: no room (a full disk, a quota, a
file size limit), too many open files, no permission (or a read-only file system).

:func:`refusal` finds which in an exception (an ``OSError``, or tensorstore's text of one, anywhere
in its chain of causes); :func:`what_is_needed` says what the user needs, naming the folder.
"""

from __future__ import annotations

import errno
import os
import re
import resource
import shutil

NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
NO_DESCRIPTOR = (errno.EMFILE, errno.ENFILE)
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
_FIXABLE = NO_ROOM + NO_DESCRIPTOR + NOT_WRITABLE
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def refusal(e: BaseException) -> int | None:
  """The errno of ``e`` (or of an exception it came from) when a write was refused for want of room,
  of file descriptors or of permission; None for any other failure."""
  seen: BaseException | None = e
  for _ in range(16):  # a chain of causes, not a cycle
    if seen is None:
      return None
    if isinstance(seen, OSError) and seen.errno in _FIXABLE:
      return seen.errno
    code = _OS_ERROR_CODE.search(str(seen))
    if code and int(code.group(1)) in _FIXABLE:
      return int(code.group(1))
    seen = seen.__cause__ or seen.__context__
  return None


def size_text(n: int) -> str:
  """``12.3 kB (12,320 bytes)``."""
  for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if n >= size:
      return f"{n / size:.1f} {unit} ({n:,} bytes)"
  return f"{n} bytes"


def what_is_needed(code: int, folder: str, elsewhere: str | None) -> str:
  """What a write into ``folder`` refused with ``code`` needs, as a sentence; ``elsewhere`` names the
  setting that moves the writes to another folder, if there is one."""
  if code in NO_ROOM:
    moved = f", or set {elsewhere} to a disk with room" if elsewhere else ""
    return f"{size_text(free_bytes(folder))} are free there. Free some space{moved}"
  if code in NO_DESCRIPTOR:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = "no limit" if hard == resource.RLIM_INFINITY else str(hard)
    return (
      f"this process may open {soft} files at once (ulimit -n; the hard limit is {limit}), too few "
      f"for the save's files: raise it (ulimit -n {max(4096, 4 * soft)})"
    )
  moved = f", or set {elsewhere} to a folder this user can write" if elsewhere else ""
  return f"the folder must be writable: make it so{moved}"


def free_bytes(folder: str) -> int:
  """The bytes free for writing in ``folder`` (or in the nearest folder above it that exists)."""
  while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
    folder = os.path.dirname(folder)
  try:
    return shutil.disk_usage(folder).free
  except OSError:
    return 0
