"""The server's tokenizers, shared fairly by the requests being tokenized.

:class:`Tokenizers` holds ``ServerConfig.tokenizers`` copies of the model's tokenizer (a fast
tokenizer is not safe to share between threads). Each request is parsed in a thread of its own, and
its items (a text, a conversation, a pair) take a tokenizer one at a time: among the items waiting,
the one whose request has had the fewest characters tokenized goes first, so a request of many
items does not keep the others waiting. With two tokenizers or more, one only takes items under
``SMALL_ITEM_CHARS`` characters: a short request never waits for a long item.

A request sees the model through :meth:`Tokenizers.for_request`: each distinct text or item is
tokenized once, and counted once against ``max_tokenize_chars``, before it is tokenized (413 past
it). A long text that extends one the request already had tokenized (vLLM's score pairs each
``text_1 + text_2[i]``, the same ``text_1``) reuses that one's tokens up to ``MARGIN`` tokens before
their shared part ends, where tokenizing again from that point gives the same tokens; only the rest
is tokenized (and counted). Waiting for a tokenizer ends at the request's deadline (504) or when its
handler gave up.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxrm.data.drops import DropReport
from jaxrm.server.bodies import GaveUp, RequestError, timed_out

log = logging.getLogger("jaxrm.server")

# Items under this many characters may take the tokenizer kept for them: one takes milliseconds.
SMALL_ITEM_CHARS = 2**16
# A chat message counts this many characters besides its content: its template's markup, rendered
# (a conversation losing its oldest turns is rendered a few times).
MESSAGE_CHARS = 64
# Texts at least this long are tokenized with their offsets, for a later text sharing their start.
SPLICE_CHARS = 4096
# Tokens before the end of a shared part that are tokenized again with what follows it: what
# follows a text can change its last tokens (a word continued), never ones this far back.
MARGIN = 16
# How often a waiting item looks whether its request gave up, in seconds.
POLL_S = 0.05


@dataclasses.dataclass(eq=False)
class _Ticket:
  served: int  # characters its request has had tokenized: the fewest go first
  order: int
  small: bool


@dataclasses.dataclass(frozen=True)
class _Tokens:
  """A long text's token ids (no special tokens) and where each token ends in it."""

  text: str
  ids: list[int]
  ends: list[int]


class Tokenizers:
  """``count`` copies of ``rm``'s tokenizer, and who takes which; ``max_chars`` characters
  tokenized per request."""

  def __init__(self, rm, count: int, max_chars: int, request_timeout: float):
    self.rm = rm
    self.max_chars = max_chars
    self.request_timeout = request_timeout  # named by the 504 of an item that waited past it
    # The copies are made when first needed (a copy takes a fifth of a second or so).
    self._models = [rm] + [None] * (count - 1)
    self._free = list(range(count))
    self._waiting: list[_Ticket] = []
    self._order = itertools.count()
    self._cond = threading.Condition()
    self.specials = _special_tokens(rm.tokenizer)

  def for_request(self, until: float, gave_up: Callable[[], bool]) -> RequestModel:
    """The model as one request's encoder sees it: its tokenizing waits until ``until``
    (``time.monotonic()``) at most, and stops once ``gave_up()``."""
    return RequestModel(self, until, gave_up)

  def acquire(self, served: int, chars: int, until: float, gave_up: Callable[[], bool]) -> int:
    """A free tokenizer's index, for an item of ``chars`` characters of a request that has had
    ``served`` tokenized."""
    ticket = _Ticket(served, next(self._order), chars < SMALL_ITEM_CHARS)
    with self._cond:
      self._waiting.append(ticket)
      try:
        while (slot := self._granted(ticket)) is None:
          left = until - time.monotonic()
          if gave_up():
            raise GaveUp()
          if left <= 0:
            raise timed_out(self.request_timeout)
          self._cond.wait(min(left, POLL_S))
        self._free.remove(slot)
        return slot
      finally:
        self._waiting.remove(ticket)
        self._cond.notify_all()  # the next in line may take what this one leaves

  def model(self, slot: int):
    """The model whose tokenizer ``slot`` is: only the thread holding the slot asks."""
    if self._models[slot] is None:
      self._models[slot] = _with_copied_tokenizer(self.rm)
    return self._models[slot]

  def release(self, slot: int) -> None:
    with self._cond:
      self._free.append(slot)
      self._cond.notify_all()

  def _granted(self, ticket: _Ticket) -> int | None:
    """The tokenizer ``ticket`` takes now, if any: those waiting are served fewest characters
    first, each taking a free tokenizer it may use."""
    free = set(self._free)
    for t in sorted(self._waiting, key=lambda t: (t.served, t.order)):
      slot = self._usable(t, free)
      if slot is None:
        continue
      if t is ticket:
        return slot
      free.discard(slot)
    return None

  def _usable(self, ticket: _Ticket, free: set[int]) -> int | None:
    # Tokenizer 0 is kept for small items where there are others; a small item takes it first.
    if ticket.small:
      return min(free, default=None)
    return min((s for s in free if s > 0 or len(self._models) == 1), default=None)


class RequestModel:
  """The model as one request sees it (``Encoder.rm``): its tokenizing shares the server's
  tokenizers, each distinct text once, within ``max_tokenize_chars``."""

  def __init__(self, tokenizers: Tokenizers, until: float, gave_up: Callable[[], bool]):
    self._tokenizers = tokenizers
    self._until = until
    self._gave_up = gave_up
    self.chars = 0  # characters tokenized for this request so far
    self._done: dict[Any, list[int]] = {}
    self._last_long: _Tokens | None = None
    self.tokenizer = _RequestTokenizer(self)

  def __getattr__(self, name: str):
    return getattr(self._tokenizers.rm, name)

  def encode(
    self, item, completion=None, *, max_length: int | None = None, where: str = "item", drops=None
  ) -> list[int]:
    """``rm.encode``, once per distinct item of the request; ``drops.cut`` counts a cut item each
    time it is asked for."""
    key = ("encode", _key(item), _key(completion), max_length)
    if key not in self._done:
      report = DropReport()
      ids = self.work(
        _chars(item) + _chars(completion),
        lambda rm: rm.encode(item, completion, max_length=max_length, where=where, drops=report),
      )
      self._done[key] = (ids, report.cut)
    ids, cut = self._done[key]
    if drops is not None:
      drops.cut += cut
    return list(ids)

  def encode_steps(self, prompt, steps, **kwargs):
    chars = _chars(prompt) + sum(len(s) for s in steps if isinstance(s, str))
    return self.work(chars, lambda rm: rm.encode_steps(prompt, steps, **kwargs))

  def _once(self, key, chars: int, fn: Callable) -> list[int]:
    if key not in self._done:
      self._done[key] = self.work(chars, fn)
    return list(self._done[key])

  def charge(self, chars: int) -> None:
    """Counts ``chars`` more characters to tokenize, or refuses them past max_tokenize_chars."""
    limit = self._tokenizers.max_chars
    if self.chars + chars > limit:
      raise RequestError(
        413,
        f"the request needs {self.chars + chars} characters tokenized (each distinct text "
        f"once), over the {limit} this server tokenizes per request (--max_tokenize_chars): "
        "split the request, or send shorter texts",
      )
    self.chars += chars

  def work(self, chars: int, fn: Callable, charged: bool = False):
    """``fn(model)`` on a free tokenizer's model, for an item of ``chars`` characters."""
    if not charged:
      self.charge(chars)
    tokenizers = self._tokenizers
    slot = tokenizers.acquire(self.chars - chars, chars, self._until, self._gave_up)
    try:
      return fn(tokenizers.model(slot))
    finally:
      tokenizers.release(slot)

  def text_ids(self, text: str, special: bool) -> list[int]:
    """A plain text's token ids (special tokens added if ``special``), its start shared with the
    last long text where it can be."""
    key = ("text", text, special)
    if key in self._done:
      return list(self._done[key])
    specials = self._tokenizers.specials
    if len(text) < SPLICE_CHARS or specials is None:
      return self._once(key, len(text), lambda rm: _ids(rm.tokenizer, text, special))
    tokens = self._spliced(text) or self._long(text)
    self._last_long = tokens
    pre, post = specials if special else ([], [])
    self._done[key] = pre + tokens.ids + post
    return list(self._done[key])

  def _long(self, text: str) -> _Tokens:
    return self.work(len(text), lambda rm: _with_ends(rm.tokenizer, text))

  def _spliced(self, text: str) -> _Tokens | None:
    """``text``'s tokens, those of the last long text reused up to MARGIN tokens before their
    shared start ends; None where they share too little, or tokenizing from that point does not
    give the same tokens again."""
    last = self._last_long
    if last is None:
      return None
    shared = _common_prefix(last.text, text)
    k = bisect.bisect_right(last.ends, shared) - MARGIN  # tokens kept as they are
    if shared < SPLICE_CHARS or k < 1:
      return None
    cut = last.ends[k - 1]
    chars = len(last.text) - cut + len(text) - cut
    self.charge(chars)

    def again(rm) -> tuple[_Tokens, _Tokens]:
      return _with_ends(rm.tokenizer, last.text[cut:]), _with_ends(rm.tokenizer, text[cut:])

    before, tail = self.work(chars, again, charged=True)
    if before.ids != last.ids[k:] or tail.ids[: MARGIN // 2] != last.ids[k : k + MARGIN // 2]:
      return None
    return _Tokens(text, last.ids[:k] + tail.ids, last.ends[:k] + [cut + e for e in tail.ends])


class _RequestTokenizer:
  """The tokenizer as one request sees it: ``tok(text, add_special_tokens=...)["input_ids"]``
  goes through :meth:`RequestModel.text_ids`; its attributes are the model's tokenizer's."""

  def __init__(self, model: RequestModel):
    self._model = model

  def __getattr__(self, name: str):
    return getattr(self._model._tokenizers.rm.tokenizer, name)

  def __call__(self, text, add_special_tokens: bool = True, **kwargs):
    if kwargs or not isinstance(text, str):
      return self._model.work(_chars(text), lambda rm: rm.tokenizer(text, add_special_tokens, **kwargs))
    return {"input_ids": self._model.text_ids(text, add_special_tokens)}


def _ids(tokenizer, text: str, special: bool) -> list[int]:
  return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _with_ends(tokenizer, text: str) -> _Tokens:
  out = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
  ends, end = [], 0
  for _, e in out["offset_mapping"]:
    end = max(end, e)  # offsets trimmed of whitespace may step back
    ends.append(end)
  return _Tokens(text, list(out["input_ids"]), ends)


def _common_prefix(a: str, b: str) -> int:
  """The length of ``a`` and ``b``'s common start, by halving (each comparison runs in C)."""
  lo, hi = 0, min(len(a), len(b))
  while lo < hi:
    mid = (lo + hi + 1) // 2
    if a[:mid] == b[:mid]:
      lo = mid
    else:
      hi = mid - 1
  return lo


def _special_tokens(tokenizer) -> tuple[list[int], list[int]] | None:
  """The ids the tokenizer adds before and after a text's own (BOS, EOS), if it adds the same
  around every text and gives offsets; else None, and long texts are tokenized whole."""
  found = set()
  try:
    for text in ("a", "Hello, world.\n"):
      plain = _ids(tokenizer, text, False)
      full = _ids(tokenizer, text, True)
      starts = [i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain]
      if not starts:
        return None
      found.add((tuple(full[: starts[0]]), tuple(full[starts[0] + len(plain) :])))
    _with_ends(tokenizer, "a b")
  except Exception:  # pylint: disable=broad-except  # a slow tokenizer has no offsets: no reuse
    return None
  if len(found) != 1:
    return None
  pre, post = found.pop()
  return list(pre), list(post)


def _with_copied_tokenizer(rm):
  """``rm`` sharing its weights, with a tokenizer of its own."""
  twin = copy.copy(rm)
  twin.tokenizer = copy.deepcopy(rm.tokenizer)
  return twin


def _key(item) -> Any:
  return item if item is None or isinstance(item, str) else json.dumps(item, sort_keys=True)


def _chars(item) -> int:
  """Characters an item costs to tokenize: a text's, or a conversation's contents and markup."""
  if item is None:
    return 0
  if isinstance(item, str):
    return len(item)
  if isinstance(item, list):
    return sum(_chars(m) for m in item)
  if isinstance(item, dict):
    content = item.get("content")
    return MESSAGE_CHARS + (len(content) if isinstance(content, str) else 0)
  return 0
