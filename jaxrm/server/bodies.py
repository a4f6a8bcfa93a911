"""Request bodies: checked, then tokenized into the rows the batcher scores."""

from __future__ import annotations

import json
import re
from typing import Any

import jinja2

from jaxrm.data.formats import kind, validate_messages
from jaxrm.errors import ConfigError, DataError
from jaxrm.server.config import ServerConfig

QUERY = "a list of strings (prompt + response texts)"
CONVERSATIONS = "a list of conversations (lists of {\"role\", \"content\"} messages)"


class RequestError(Exception):
  """A request the server refuses, with the HTTP status and headers to answer."""

  def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status = status
    self.headers = headers or {}


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
    raise RequestError(400, f"the body is {kind(body)}; expected a JSON object")
  return body


class Encoder:
  """Turns ``/get_reward`` and ``/score`` bodies into token-id rows, as ``rm.score`` would."""

  def __init__(self, rm, config: ServerConfig):
    self.rm = rm
    self.config = config
    self._openrlhf = _openrlhf_stripper(rm.tokenizer) if config.openrlhf_text else None

  def get_reward(self, body: dict[str, Any]) -> list[list[int]]:
    """OpenRLHF's ``{"query": [text, ...]}``; its ``prompts`` and ``labels`` are ignored."""
    texts = self._items(body, "query", QUERY)
    for i, text in enumerate(texts):
      if not isinstance(text, str):
        raise RequestError(400, f"query[{i}] is {kind(text)}; expected a string")
    if self._openrlhf is not None:
      return [self._openrlhf_ids(f"query[{i}]", self._openrlhf(t)) for i, t in enumerate(texts)]
    return [self._encode(f"query[{i}]", t) for i, t in enumerate(texts)]

  def score(self, body: dict[str, Any]) -> list[list[int]]:
    """``{"conversations": [...]}``, or ``{"prompts": [...], "completions": [...]}`` pairs."""
    if "conversations" in body:
      conversations = [self._messages(c, f"conversations[{i}]")
                       for i, c in enumerate(self._items(body, "conversations", CONVERSATIONS))]
      return [self._encode(f"conversations[{i}]", c) for i, c in enumerate(conversations)]
    if "prompts" not in body and "completions" not in body:
      raise RequestError(400, "the body has neither 'conversations' nor 'prompts' and 'completions'; send "
                         f"{{\"conversations\": {CONVERSATIONS}}} or {{\"prompts\": [...], \"completions\": "
                         "[...]}} (strings, or message lists)")
    prompts = self._items(body, "prompts", "a list of prompts (strings or message lists)")
    completions = self._items(body, "completions", "a list of completions (strings or message lists)")
    if len(prompts) != len(completions):
      raise RequestError(400, f"{len(prompts)} prompts but {len(completions)} completions; send one "
                         "completion per prompt (repeat a prompt for each of its completions)")
    pairs = [(self._text(p, f"prompts[{i}]"), self._text(c, f"completions[{i}]"))
             for i, (p, c) in enumerate(zip(prompts, completions))]
    return [self._encode(f"prompts[{i}] + completions[{i}]", p, c) for i, (p, c) in enumerate(pairs)]

  def _items(self, body: dict[str, Any], key: str, expected: str) -> list:
    if key not in body:
      raise RequestError(400, f"the body has no '{key}'; send {{\"{key}\": {expected}}}")
    items = body[key]
    if not isinstance(items, list):
      raise RequestError(400, f"'{key}' is {kind(items)}; expected {expected}")
    if len(items) > self.config.max_batch:
      raise RequestError(413, f"'{key}' has {len(items)} items; this server scores at most "
                         f"{self.config.max_batch} per request (--max_batch): split the request")
    return items

  def _messages(self, value: Any, field: str) -> list[dict]:
    try:
      messages = validate_messages(value, "request", field)
    except DataError as e:
      raise RequestError(400, str(e)) from None
    if not messages:
      raise RequestError(400, f"{field} has no messages")
    return messages

  def _text(self, value: Any, field: str):
    return value if isinstance(value, str) else self._messages(value, field)

  def _encode(self, where: str, item, completion=None) -> list[int]:
    try:
      return self.rm.encode(item, completion, max_length=self.config.max_length, where=where)
    except (ValueError, jinja2.TemplateError) as e:  # over-long or empty, or a template refusing it
      message = str(e) if str(e).startswith(where) else f"{where}: {e}"
      hint = " (--max_length)" if "longer than max_length" in message else ""
      raise RequestError(400, f"cannot score {message}{hint}") from None


  def _openrlhf_ids(self, where: str, text: str) -> list[int]:
    """As OpenRLHF tokenizes: no special tokens added (the text has its own); too long is refused
    where OpenRLHF would cut the end, eos included."""
    ids = list(self.rm.tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(ids) > self.config.max_length:
      raise RequestError(400, f"cannot score {where}: {len(ids)} tokens, longer than max_length="
                         f"{self.config.max_length} (--max_length)")
    return ids


def _openrlhf_stripper(tokenizer):
  """OpenRLHF's ``serve_rm`` text handling: leading and trailing pad/eos removed, one eos appended."""
  specials = [t for t in {tokenizer.pad_token, tokenizer.eos_token} if t]
  if tokenizer.eos_token is None:
    raise ConfigError("openrlhf_text appends the eos token, and this tokenizer has none")
  alternatives = "|".join(re.escape(t) for t in specials)
  head, tail = re.compile(f"^(?:{alternatives})+"), re.compile(f"(?:{alternatives})+$")
  return lambda text: tail.sub("", head.sub("", text)) + tokenizer.eos_token
