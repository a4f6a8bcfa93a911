"""``max_pending_bytes``: the bytes that request bodies hold from their first byte until they are
tokenized, all requests together.

The tokenizer takes one body at a time (:class:`~jaxrm.server.app.App`), so bodies wait for it; a
body's bytes count as they arrive, chunk by chunk, until its tokenizing ends, or until its request
gives up before tokenizing began. A Content-Length reserves nothing: a client that sends headers and
no body holds no more than what the connection buffers (uvicorn stops reading a connection past
64 KiB unread), so a few such clients cannot lock the others out.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class PendingBytes:
  """The bytes held, against their limit; ``on_change(held)`` follows every change (the gauge)."""

  def __init__(self, limit: int, on_change: Callable[[int], None]):
    self.limit = limit
    self._held = 0
    self._lock = threading.Lock()
    self._on_change = on_change

  def take(self, n: int) -> bool:
    """Holds ``n`` more bytes if they fit under the limit."""
    with self._lock:
      if self._held + n > self.limit:
        return False
      self._held += n
      self._on_change(self._held)
    return True

  def give(self, n: int) -> None:
    with self._lock:
      self._held -= n
      self._on_change(self._held)


class HeldBody:
  """One request's bytes in :class:`PendingBytes`, given back exactly once: by the tokenizing thread
  when it ends, or by the handler when it stops waiting before the thread began (a thread that
  begins after that finds the body released and does nothing)."""

  def __init__(self, pending: PendingBytes):
    self._pending = pending
    self._lock = threading.Lock()
    self.size = 0
    self._claimed = False
    self._released = False

  def take(self, n: int) -> bool:
    """``n`` more bytes of this body, if they fit (while it is read, before it is claimed)."""
    if not self._pending.take(n):
      return False
    self.size += n
    return True

  def claim(self) -> bool:
    """The tokenizing thread begins: False if the request gave up meanwhile (nothing to tokenize)."""
    with self._lock:
      if self._released:
        return False
      self._claimed = True
      return True

  def release(self) -> None:
    """The tokenizing thread ends."""
    with self._lock:
      if self._released:
        return
      self._released = True
    self._pending.give(self.size)

  def abandon(self) -> None:
    """The handler stops waiting; a claimed body is released by its thread instead, as it still
    holds the bytes."""
    with self._lock:
      if self._claimed or self._released:
        return
      self._released = True
    self._pending.give(self.size)
