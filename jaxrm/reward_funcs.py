"""A reward model as the reward function of an RL trainer.

Two calling conventions:

* TRL's ``GRPOTrainer(reward_funcs=[f])`` calls ``f(prompts=..., completions=..., **columns)``.
  ``prompts`` and ``completions`` are both strings (standard data) or both message lists
  (conversational data: a completion is ``[{"role": "assistant", "content": ...}]``); extra
  keyword arguments (dataset columns, ``completion_ids``, ``trainer_state``...) are ignored. TRL
  logs the rewards under ``f.__name__``.
* CoMLRL-style multi-agent trainers call ``f(*agent_completions, batch_items=[item])``: one list
  of completions per agent, all of the same length (joint responses are aligned by position), and
  the task item(s). ``formatter(item, *completions)`` builds what the model scores -- a string or
  a message list -- from the task item and one joint response.

:func:`remote_reward_func` is the TRL function of a model served by ``python -m jaxrm.serve`` on
another host: the same call, scored by the server's ``/score``.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from jaxrm import kinds
from jaxrm.data.records import Text
from jaxrm.models.config import ModelConfig


class Scorer(Protocol):
  """What a reward function scores with: a :class:`jaxrm.RewardModel`, or anything alike."""

  @property
  def config(self) -> ModelConfig: ...

  def score(self, items: Sequence[Text] | None = None, *, prompts: Sequence[Text] | None = None,
            completions: Sequence[Text] | None = None, normalize: bool = False,
            batch_size: int = 8, combine=None) -> np.ndarray:
    """Rewards float32 [N] of ``items``, or of ``prompts`` joined with ``completions``."""
    ...


# What combines a regression model's outputs into one reward: an attribute's name, "name=w,...",
# a dict of names to weights, or one weight per output (see RewardModel.score).
Combine = str | dict[str, float] | Sequence[float] | None


def _check_scalar_head(rm: Scorer, combine: Combine) -> None:
  kinds.check_kind(rm, kinds.PREFERENCE, kinds.REGRESSION, use="a reward function", one_reward=True,
                   combine=combine)


def _named(f: Callable, name: str) -> Callable:
  f.__name__ = f.__qualname__ = name
  return f


def as_reward_func(rm: Scorer, *, normalize: bool = False, batch_size: int = 8,
                   name: str = "jaxrm_reward", combine: Combine = None) -> Callable[..., list[float]]:
  """``f(prompts, completions, **kwargs) -> list[float]`` for TRL's GRPOTrainer.

  Each reward scores prompt + completion laid out as in training: a conversation rendered by the
  chat template, or the two strings joined.

  Args:
    rm: a sequence-head reward model with a tokenizer.
    normalize: (reward - mean) / std with the statistics recorded at validation.
    batch_size: rows per forward pass.
    name: ``f.__name__``, the name TRL logs the rewards under.
    combine: a regression model's outputs combined into one reward (required for one).
  """
  _check_scalar_head(rm, combine)
  extra = {} if combine is None else {"combine": combine}

  def reward_func(prompts: Sequence[Text], completions: Sequence[Text], **kwargs: Any) -> list[float]:
    del kwargs  # dataset columns and trainer state: the model needs only the text
    return rm.score(prompts=prompts, completions=completions, normalize=normalize,
                    batch_size=batch_size, **extra).tolist()

  return _named(reward_func, name)


def as_multi_agent_reward_func(rm: Scorer, formatter: Callable[..., Text], *, normalize: bool = False,
                               batch_size: int = 8, name: str = "jaxrm_reward",
                               combine: Combine = None) -> Callable[..., list[float]]:
  """``f(*agent_completions, batch_items) -> list[float]``: one reward per joint response.

  Args:
    rm: a sequence-head reward model with a tokenizer.
    formatter: ``formatter(item, *completions) -> str | list[message]``: the text to score for one
      task item and one completion of each agent, in agent order.
    normalize: (reward - mean) / std with the statistics recorded at validation.
    batch_size: rows per forward pass.
    name: ``f.__name__``.
    combine: a regression model's outputs combined into one reward (required for one).
  """
  _check_scalar_head(rm, combine)
  extra = {} if combine is None else {"combine": combine}

  def reward_func(*agent_completions: Sequence[str], batch_items: Sequence[Any] | None = None) -> list[float]:
    if not agent_completions:
      raise ValueError(f"{name}: no agent completions were passed")
    n = len(agent_completions[0])
    lengths = [len(c) for c in agent_completions]
    if any(k != n for k in lengths):
      raise ValueError(f"{name}: each agent must give as many completions; got {lengths}")
    if not batch_items:
      raise ValueError(f"{name}: batch_items (the task items) is required to format what is scored")
    if len(batch_items) == 1:
      items = list(batch_items) * n  # one task item, shared by all its joint responses
    elif len(batch_items) == n:
      items = list(batch_items)
    else:
      raise ValueError(f"{name}: {len(batch_items)} batch_items for {n} joint responses; "
                       f"give one item, or one per response")
    texts = [formatter(item, *joint) for item, joint in zip(items, zip(*agent_completions))]
    return rm.score(texts, normalize=normalize, batch_size=batch_size, **extra).tolist()

  return _named(reward_func, name)


# Statuses a busy server answers (queue full, request timed out): worth retrying after Retry-After.
RETRIED_STATUSES = (503, 504)


def remote_reward_func(url: str, *, api_key: str | None = None, timeout: float = 300.0, retries: int = 8,
                       name: str = "jaxrm_reward") -> Callable[..., list[float]]:
  """``f(prompts, completions, **kwargs) -> list[float]`` for TRL's GRPOTrainer, scored by a server.

  Sends the pairs to the ``/score`` endpoint of ``python -m jaxrm.serve``, which joins them as
  :func:`as_reward_func` does. A busy server's 503/504 is retried after its Retry-After, up to
  ``retries`` times; any other error raises with the server's message. Connections go straight to
  ``url``, whatever HTTP proxy the environment names.

  Args:
    url: the server, ``http://HOST:PORT``.
    api_key: the server's ``--api_key``, if it has one.
    timeout: seconds to wait for one answer.
    retries: tries after a busy answer before giving up.
    name: ``f.__name__``, the name TRL logs the rewards under.
  """
  endpoint = url.rstrip("/") + "/score"
  headers = {"Content-Type": "application/json"}
  if api_key:
    headers["Authorization"] = f"Bearer {api_key}"
  opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

  def reward_func(prompts: Sequence[Text], completions: Sequence[Text], **kwargs: Any) -> list[float]:
    del kwargs  # dataset columns and trainer state: the model needs only the text
    body = json.dumps({"prompts": list(prompts), "completions": list(completions)}).encode()
    attempt = 0
    while True:
      request = urllib.request.Request(endpoint, data=body, headers=headers, method="POST")
      try:
        with opener.open(request, timeout=timeout) as reply:
          return [float(r) for r in json.loads(reply.read())["rewards"]]
      except urllib.error.HTTPError as e:
        with e:
          message = _error_message(e)
          if e.code not in RETRIED_STATUSES or attempt == retries:
            raise ValueError(f"{name}: {endpoint} answered {e.code}: {message}") from None
          time.sleep(float(e.headers.get("Retry-After") or 1))
      attempt += 1

  return _named(reward_func, name)


def _error_message(e: urllib.error.HTTPError) -> str:
  raw = e.read()
  try:
    return json.loads(raw)["error"]
  except (ValueError, KeyError, TypeError):
    return raw.decode(errors="replace")[:500]
