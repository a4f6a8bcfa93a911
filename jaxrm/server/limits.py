"""``max_pending_bytes``: the bytes that request bodies hold from their first byte until they are
tokenized, all requests together, and ``max_client_pending_bytes``, one client's share of them.

A body's bytes count as they arrive, chunk by chunk, until its tokenizing ends, or until its
request gives up before tokenizing began. A Content-Length reserves nothing: a client that sends
headers and no body holds no more than what the connection buffers (uvicorn stops reading a
connection past 64 KiB unread), so a few such clients cannot lock the others out.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

# Which limit refused bytes: all clients' together, or the client's own share.
SERVER, CLIENT = "server", "client"


class PendingBytes:
  """The bytes held, against their limit and each client's share of it; ``on_change(held)``
  follows every change (the gauge)."""

  def __init__(self, limit: int, on_change: Callable[[int], None], client_limit: int | None = None):
    self.limit = limit
    self.client_limit = limit if client_limit is None else client_limit
    self._held = 0
    self._clients: dict[Hashable, int] = {}
    self._lock = threading.Lock()
    self._on_change = on_change

  def take(self, n: int, client: Hashable = None) -> str | None:
    """Holds ``n`` more bytes for ``client`` if they fit under both limits; else which refused
    them (SERVER or CLIENT)."""
    with self._lock:
      mine = self._clients.get(client, 0)
      if self._held + n > self.limit:
        return SERVER
      if mine + n > self.client_limit:
        return CLIENT
      self._held += n
      self._clients[client] = mine + n
      self._on_change(self._held)
    return None

  def give(self, n: int, client: Hashable = None) -> None:
    with self._lock:
      self._held -= n
      left = self._clients.pop(client, 0) - n
      if left:
        self._clients[client] = left
      self._on_change(self._held)


class HeldBody:
  """One request's bytes in :class:`PendingBytes`, given back exactly once: by the tokenizing thread
  when it ends, or by the handler when it stops waiting before the thread began (a thread that
  begins after that finds the body released and does nothing)."""

  def __init__(self, pending: PendingBytes, client: Hashable = None):
    self._pending = pending
    self.client = client
    self._lock = threading.Lock()
    self.size = 0
    self._claimed = False
    self._released = False

  def take(self, n: int) -> str | None:
    """``n`` more bytes of this body, if they fit (while it is read, before it is claimed); else
    which limit refused them."""
    refused = self._pending.take(n, self.client)
    if refused is None:
      self.size += n
    return refused

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
    self._pending.give(self.size, self.client)

  def abandon(self) -> None:
    """The handler stops waiting; a claimed body is released by its thread instead, as it still
    holds the bytes."""
    with self._lock:
      if self._claimed or self._released:
        return
      self._released = True
    self._pending.give(self.size, self.client)
