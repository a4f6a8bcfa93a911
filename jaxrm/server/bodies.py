"""Request bodies: checked, then tokenized into the rows the batcher scores."""

from __future__ import annotations

import copy
import functools
import itertools
import json
import re
import time
from collections.abc import Callable
from typing import Any

import jinja2

from jaxrm.data.drops import DropReport
from jaxrm.data.formats import json_type, validate_messages
from jaxrm.errors import ConfigError, DataError
from jaxrm.scoring import step_rewards
from jaxrm.server.config import ServerConfig
from jaxrm.tasks.routes import RequestError

QUERY = "a list of strings (prompt + response texts)"
CONVERSATIONS = 'a list of conversations (lists of {"role", "content"} messages)'


RETRY_AFTER = {"Retry-After": "1"}


def timed_out(timeout: float, headers: dict[str, str] | None = None) -> RequestError:
  return RequestError(
    504,
    f"no rewards within {timeout:g} s (--request_timeout): the server is overloaded; "
    "retry later, or send fewer items",
    {**RETRY_AFTER, **(headers or {})},
  )


class GaveUp(Exception):
  """The request's handler no longer waits for its tokens (it answered 504, or its client left)."""


def parse_json(raw: bytes) -> dict[str, Any]:
  if not raw.strip():
    raise RequestError(400, "the body is empty; send a JSON object")
  try:
    body = json.loads(raw)
  except ValueError as e:  # not UTF-8, not JSON, an integer of over 4300 digits
    raise RequestError(400, f"the body is not valid JSON: {e}") from None
  except RecursionError:
    raise RequestError(400, "the body is not valid JSON: it nests too deeply") from None
  if not isinstance(body, dict):
    raise RequestError(400, f"the body is {json_type(body)}; expected a JSON object")
  if (where := _lone_surrogate(body)) is not None:
    raise RequestError(
      400,
      f"{where} holds a lone surrogate (an escape in \\ud800-\\udfff), which is not text: send valid Unicode",
    )
  return body


# What may hold a lone surrogate: the rest (numbers, booleans, null) is skipped.
_TEXTS = {str, list, dict}


def _lone_surrogate(body: dict[str, Any]) -> str | None:
  """Where the body holds a lone surrogate, as ``not_text`` names it; found at C speed where there
  is none, and walked only through the texts, lists and objects of lists where there is: a body of
  millions of numbers would otherwise cost seconds of Python each."""
  try:
    json.dumps(body, ensure_ascii=False).encode("utf-8")
    return None
  except UnicodeEncodeError:
    pass
  todo: list[tuple[str, Any, Any]] = [("", None, body)]  # (parent's path, key or index, value)
  while todo:
    parent, key, x = todo.pop()
    if isinstance(x, str) and _is_text(x):
      continue
    path = _child(parent, key)
    if isinstance(x, str):
      return f"field '{path}'"
    if isinstance(x, dict):
      for k, v in reversed(x.items()):
        if not _is_text(k):
          return f"a key of {f'field {path!r}' if path else 'the body'}"
        todo.append((path, k, v))
    elif isinstance(x, list):
      texts = itertools.compress(range(len(x)), map(_TEXTS.__contains__, map(type, x)))
      todo.extend((path, i, x[i]) for i in reversed(list(texts)))
  return None


def _child(parent: str, key: Any) -> str:
  """A value's path, as ``not_text`` writes it: ``a[0].b``."""
  if key is None:
    return parent
  if isinstance(key, int):
    return f"{parent}[{key}]"
  return f"{parent}.{key}" if parent else key


def _is_text(s: str) -> bool:
  try:
    s.encode("utf-8")
  except UnicodeEncodeError:
    return False
  return True


class Encoder:
  """Turns request bodies into token-id rows: jaxrm's and OpenRLHF's here, as ``rm.score`` would;
  the other formats (:mod:`jaxrm.server.formats`) through :meth:`text_ids`, :meth:`given_ids` and
  :meth:`fitted`. :meth:`for_request` gives the encoder of one request, which stops at its deadline."""

  def __init__(self, rm, config: ServerConfig):
    self.rm = rm
    self.config = config
    self._openrlhf = _openrlhf_stripper(rm.tokenizer) if config.openrlhf_text else None
    self._until: float | None = None
    self._gave_up: Callable[[], bool] = lambda: False
    self._messages = 0
    self.truncated = 0  # the request's items cut to fit: as the client asked, or their oldest context

  def for_request(self, until: float, gave_up: Callable[[], bool]) -> Encoder:
    """This encoder for one request: it counts the request's messages against max_messages, and
    stops before its next item once ``time.monotonic()`` passes ``until`` (504) or ``gave_up()``
    (its handler answered already): the tokenizer then goes to the requests behind it."""
    enc = copy.copy(self)
    enc._until, enc._gave_up, enc._messages = until, gave_up, 0
    enc.truncated = 0
    return enc

  def check_time(self) -> None:
    if self._gave_up():
      raise GaveUp()
    if self._until is not None and time.monotonic() > self._until:
      raise timed_out(self.config.request_timeout)

  def get_reward(self, body: dict[str, Any]) -> list[list[int]]:
    """OpenRLHF's ``{"query": [text, ...]}``; its ``prompts`` and ``labels`` are ignored."""
    texts = self.items(body, "query", QUERY)
    for i, text in enumerate(texts):
      if not isinstance(text, str):
        raise RequestError(400, f"query[{i}] is {json_type(text)}; expected a string")
    if self._openrlhf is not None:
      return [self._openrlhf_ids(f"query[{i}]", self._openrlhf(t)) for i, t in enumerate(texts)]
    return [self.encode(f"query[{i}]", t) for i, t in enumerate(texts)]

  def score(self, body: dict[str, Any]) -> list[list[int]]:
    """``{"conversations": [...]}``, or ``{"prompts": [...], "completions": [...]}`` pairs."""
    if "conversations" in body:
      conversations = [
        self.messages(c, f"conversations[{i}]")
        for i, c in enumerate(self.items(body, "conversations", CONVERSATIONS))
      ]
      return [self.encode(f"conversations[{i}]", c) for i, c in enumerate(conversations)]
    if "prompts" not in body and "completions" not in body:
      raise RequestError(
        400,
        "the body has neither 'conversations' nor 'prompts' and 'completions'; send "
        f'{{"conversations": {CONVERSATIONS}}} or {{"prompts": [...], "completions": '
        '[...]}} (strings, or message lists), or vLLM\'s {"text_1": ..., "text_2": ...} '
        '(or "queries" and "documents")',
      )
    prompts = self.items(body, "prompts", "a list of prompts (strings or message lists)")
    completions = self.items(body, "completions", "a list of completions (strings or message lists)")
    if len(prompts) != len(completions):
      raise RequestError(
        400,
        f"{len(prompts)} prompts but {len(completions)} completions; send one "
        "completion per prompt (repeat a prompt for each of its completions)",
      )
    pairs = [
      (self._text(p, f"prompts[{i}]"), self._text(c, f"completions[{i}]"))
      for i, (p, c) in enumerate(zip(prompts, completions))
    ]
    return [self.encode(f"prompts[{i}] + completions[{i}]", p, c) for i, (p, c) in enumerate(pairs)]

  def solutions(self, body: dict[str, Any]) -> list[tuple[list[int], list[int]] | None]:
    """A process model's ``{"prompts", "completions"}`` (each completion cut into steps at the
    model's step separator) or ``{"prompts", "steps"}`` (a list of steps per prompt): each
    solution's token ids and the positions of its step labels, laid out as stepwise training
    lays them out; None for a solution with no steps."""
    separator = self.rm.step_separator
    if ("completions" in body) == ("steps" in body):
      raise RequestError(
        400,
        "send 'prompts' with 'completions' (texts, cut into steps at the model's step "
        f"separator {separator!r}) or with 'steps' (a list of step texts per prompt), one of the two",
      )
    prompts = self.items(body, "prompts", "a list of prompts (strings or message lists)")
    key = "steps" if "steps" in body else "completions"
    given = self.items(
      body,
      key,
      "a list of step lists (lists of strings)" if key == "steps" else "a list of completions (strings)",
    )
    if len(prompts) != len(given):
      raise RequestError(400, f"{len(prompts)} prompts but {len(given)} {key}; send one per prompt")
    out = []
    for i, (prompt, value) in enumerate(zip(prompts, given)):
      steps = self._steps(value, f"{key}[{i}]", separator)
      where = f"prompts[{i}] + {key}[{i}]"
      prompt = self._text(prompt, f"prompts[{i}]")
      if not steps:
        out.append(None)
        continue
      encode = functools.partial(
        self.rm.encode_steps, prompt, steps, max_length=self.config.max_length, where=where
      )
      out.append(self._encoded(where, encode))
    return out

  @staticmethod
  def _steps(value: Any, where: str, separator: str) -> list[str]:
    """A solution's steps: a completion (a string) cut at the step separator, or a list of steps
    as given -- one string is refused there, as ``rm.score_steps`` refuses it. A solution of no
    steps has no reward (null), as the Python reward functions give None."""
    if where.startswith("completions"):
      if not isinstance(value, str):
        raise RequestError(400, f"{where} is {json_type(value)}; expected a string")
      return step_rewards.split_steps(value, separator)
    try:
      return step_rewards.check_steps(
        value,
        where,
        f"or send the solution as one of 'completions', which are cut at the step separator {separator!r}",
      )
    except ValueError as e:
      raise RequestError(400, str(e)) from None

  def items(self, body: dict[str, Any], key: str, expected: str) -> list:
    """``body[key]``, a list of at most max_batch items."""
    if key not in body:
      raise RequestError(400, f"the body has no '{key}'; send {{\"{key}\": {expected}}}")
    items = body[key]
    if not isinstance(items, list):
      raise RequestError(400, f"'{key}' is {json_type(items)}; expected {expected}")
    self.check_count(key, len(items))
    return items

  def check_count(self, key: str, n: int) -> None:
    if n > self.config.max_batch:
      raise RequestError(
        413,
        f"'{key}' has {n} items; this server scores at most "
        f"{self.config.max_batch} per request (--max_batch): split the request",
      )

  def messages(self, value: Any, field: str) -> list[dict]:
    """``value`` checked as a conversation: a non-empty list of messages, within the request's
    max_messages."""
    if isinstance(value, list):
      self._messages += len(value)
      if self._messages > self.config.max_messages:
        raise RequestError(
          413,
          f"{field} brings the request to {self._messages} messages; this server takes at most "
          f"{self.config.max_messages} per request (--max_messages): split the request, or send "
          "only the turns that fit in max_length",
        )
    try:
      messages = validate_messages(value, "request", field)
    except DataError as e:
      raise RequestError(400, str(e)) from None
    if not messages:
      raise RequestError(400, f"{field} has no messages")
    return messages

  def _text(self, value: Any, field: str):
    return value if isinstance(value, str) else self.messages(value, field)

  def encode(self, where: str, item, completion=None) -> list[int]:
    """A conversation or text (with its completion, if given) laid out as training lays it out:
    over max_length, its oldest context is cut (counted in :attr:`truncated`)."""
    drops = DropReport()
    ids = self._encoded(
      where,
      lambda: self.rm.encode(item, completion, max_length=self.config.max_length, where=where, drops=drops),
    )
    self.truncated += drops.cut
    return ids

  def asked(self, where: str, what: str, *parts) -> list[int]:
    """The text the served model's asker lays out of ``parts`` (``rm.verifier.encode(tokenizer,
    *parts, max_length, where)``: a pairwise judge's prompt and two responses), tokenized on one of
    the server's tokenizers in its turn and counted against max_tokenize_chars; over max_length,
    the conversation's oldest turns are cut (counted in :attr:`truncated`), or, when no cut fits, it
    is refused naming ``where`` and ``what`` (what the text holds)."""
    self.check_time()
    asker, max_length = self.rm.verifier, self.config.max_length
    chars = len(asker.content(*parts))

    def encode(model):
      return asker.encode(model.tokenizer, *parts, max_length, where)

    try:
      out = self.rm.work(chars, encode) if hasattr(self.rm, "work") else encode(self.rm)
    except (ValueError, jinja2.TemplateError) as e:
      raise RequestError(400, f"cannot score {where}: {e}") from None
    if out is None:
      raise RequestError(
        400,
        f"cannot score {where}: {what} is longer than max_length={max_length} tokens even with every "
        "earlier turn cut (--max_length)",
      )
    self.truncated += out[1]
    return out[0]

  def _encoded(self, where: str, encode):
    """``encode()``, its refusal (over-long or empty, or a template refusing it) a 400 naming ``where``."""
    self.check_time()
    try:
      return encode()
    except (ValueError, jinja2.TemplateError) as e:
      message = str(e) if str(e).startswith(where) else f"{where}: {e}"
      hint = " (--max_length)" if "longer than max_length" in message else ""
      raise RequestError(400, f"cannot score {message}{hint}") from None

  def _openrlhf_ids(self, where: str, text: str) -> list[int]:
    """As OpenRLHF tokenizes: no special tokens added (the text has its own); too long is refused
    where OpenRLHF would cut the end, eos included."""
    return self.fitted(where, self.text_ids(where, text, special=False))

  def text_ids(self, where: str, text: Any, *, special: bool) -> list[int]:
    """A plain text's token ids as the tokenizer gives them, special tokens (BOS) added if
    ``special`` -- as vLLM and SGLang tokenize a prompt -- not yet checked against max_length."""
    if not isinstance(text, str):
      raise RequestError(400, f"{where} is {json_type(text)}; expected a string")
    self.check_time()
    ids = list(self.rm.tokenizer(text, add_special_tokens=special)["input_ids"])
    if not ids:
      raise RequestError(400, f"cannot score {where}: no tokens to score")
    return ids

  def given_ids(self, where: str, ids: Any) -> list[int]:
    """Token ids sent as such: a non-empty list of ids of the model's vocabulary."""
    if not isinstance(ids, list) or not ids:
      raise RequestError(400, f"{where} is {json_type(ids)}; expected a non-empty list of token ids")
    vocab = self.rm.config.vocab_size
    if set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < vocab:
      return ids  # checked at C speed: a body may hold millions of ids
    for j, t in enumerate(ids):
      if isinstance(t, bool) or not isinstance(t, int):
        raise RequestError(400, f"{where}[{j}] is {json_type(t)}; expected a token id (an integer)")
      if not 0 <= t < vocab:
        raise RequestError(400, f"{where}[{j}] is {t}, not a token id of this model (0 to {vocab - 1})")
    return ids

  def fitted(self, where: str, ids: list[int], truncate: int | None = None, side: str = "left") -> list[int]:
    """``ids`` cut to their last (side "left") or first ``truncate`` tokens if asked, then checked
    against max_length."""
    if truncate is not None and len(ids) > truncate:
      ids = ids[len(ids) - truncate :] if side == "left" else ids[:truncate]
      self.truncated += 1
    if len(ids) > self.config.max_length:
      raise RequestError(
        400,
        f"cannot score {where}: {len(ids)} tokens, longer than max_length="
        f"{self.config.max_length} (--max_length)",
      )
    return ids


def _openrlhf_stripper(tokenizer):
  """OpenRLHF's ``serve_rm`` text handling: leading and trailing pad/eos removed, one eos appended."""
  specials = [t for t in {tokenizer.pad_token, tokenizer.eos_token} if t]
  if tokenizer.eos_token is None:
    raise ConfigError("openrlhf_text appends the eos token, and this tokenizer has none")
  alternatives = "|".join(re.escape(t) for t in specials)
  head, tail = re.compile(f"^(?:{alternatives})+"), re.compile(f"(?:{alternatives})+$")
  return lambda text: tail.sub("", head.sub("", text)) + tokenizer.eos_token
