"""What a scoring route of the server reads and answers, in terms a task can use without importing the
server: a request body parsed into a :class:`Scoring` (the token rows to score, and how the answer is
written from their outputs), or refused with a :class:`RequestError`.

The server's own routes (:mod:`jaxrm.server.formats`) are written with these, and so is a route a
task adds (:attr:`jaxrm.tasks.Task.routes`, a :class:`Route`). A route's parse function is given
the server's request encoder (:class:`jaxrm.server.bodies.Encoder`: ``messages``, ``asked``,
``config``...) and the body.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jaxrm.data.formats import json_type

Body = dict[str, Any]


class RequestError(Exception):
  """A request the server refuses, with the HTTP status and headers to answer."""

  def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status = status
    self.headers = headers or {}


@dataclasses.dataclass(frozen=True)
class Meta:
  """What an answer names besides its rewards."""

  request_id: str
  model: str  # the served model's name, when the request names none
  created: int  # unix seconds
  # The reward's health over the server's last rewards, this request's included
  # (jaxrm.scoring.reward_health; the server's /metrics reports the same values).
  health: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Scoring:
  """One request's token rows, and how its answer is written from their rewards."""

  rows: list[list[int]]
  write: Callable[[list[float], Meta], Any]
  truncated: int = 0  # rows cut to fit, as the request asked (vLLM's truncate_prompt_tokens)
  # Whether each row's output is a reward, read into the reward's health; False where they are not
  # (a pairwise judge's texts: the log-odds of one ordered pair each).
  reward_rows: bool = True
  # The route's own counters (Route.counters) and what this request adds to each.
  counts: Mapping[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Route:
  """A POST route a task adds to the server, answered only when the served model is of that task."""

  # fn(encoder, body) -> Scoring: the request's JSON object parsed with the server's request encoder
  parse: Callable[[Any, Body], Scoring]
  # What it does, after its path, in the 400 it answers a model of another task ("/compare ranks
  # responses with a pairwise judge; this server's model has ...").
  does: str
  # The counters /metrics keeps of it (name -> help), each added to by its Scoring's counts.
  counters: Mapping[str, str] = dataclasses.field(default_factory=dict)


def choice(body: Body, name: str, choices: tuple[str, ...]) -> str:
  """``body[name]``, one of ``choices`` (the first when it is left out)."""
  value = body.get(name, choices[0])
  if value not in choices:
    shown = repr(value) if isinstance(value, str) else json_type(value)
    raise RequestError(400, f"'{name}' is {shown}; expected one of {', '.join(choices)}")
  return value


def text(enc: Any, value: Any, field: str) -> Any:
  """A text, or a list of messages checked as a conversation by ``enc.messages``."""
  if isinstance(value, str):
    return value
  if isinstance(value, list):
    return enc.messages(value, field)
  raise RequestError(400, f"{field} is {json_type(value)}; expected a text or a list of messages")
