"""A reward model as the reward function of an RL trainer.

Two calling conventions:

* TRL's ``GRPOTrainer(reward_funcs=[f])`` calls ``f(prompts=..., completions=..., **columns)``.
  ``prompts`` and ``completions`` are both strings (standard data) or both message lists
  (conversational data: a completion is ``[{"role": "assistant", "content": ...}]``); extra
  keyword arguments (dataset columns, ``completion_ids``, ``trainer_state``...) are ignored. TRL
  logs the rewards under ``f.__name__``.
* TRL also awaits an ``async def`` reward function (``remote_reward_func(..., asynchronous=True)``),
  running its async reward functions side by side.
* CoMLRL-style multi-agent trainers call ``f(*agent_completions, batch_items=[item])``: one list
  of completions per agent, all of the same length (joint responses are aligned by position), and
  the task item(s). ``formatter(item, *completions)`` builds what the model scores -- a string or
  a message list -- from the task item and one joint response.

A process reward model (a token head, ``reward.type=stepwise``) rewards a completion from its
steps: the completion is cut at the model's step separator, as its training rows were
(:func:`jaxrm.scoring.step_rewards.split_steps`), each step gets the probability that it is correct, and
``step_aggregation`` (:data:`jaxrm.scoring.step_rewards.AGGREGATIONS`; ``"min"`` by default) makes them one
reward. A completion with no steps (empty, or only separators) gets ``None``: TRL's "no reward from
this function", which GRPOTrainer leaves out of its group statistics instead of reading it as 0.

A pairwise judge (``reward.type=pairwise``, or a causal LM loaded with ``judge=True``) rewards a
completion by comparing it with the other completions of its prompt: the batch's completions are
grouped by equal prompts (GRPO's G completions of a prompt, wherever they stand in the batch) and
each group's rewards are its comparisons aggregated (``RewardModel.score_groups``, every group in
one pass). A prompt with a single completion has nothing to be compared with: it gets the
reward of a group's average response (0.0 under ``bradley_terry``, whose strengths are centred;
0.5 under ``win_rate``).

These functions know no task: a model whose scores are not one per completion is rewarded as its
task's :attr:`~jaxrm.tasks.Task.group_rewards` says (the judge's is
:class:`jaxrm.tasks.pairwise.GroupRewards`), and the options that ask for such rewards
(``strategy=``, ``aggregate=``) are checked by it.

:func:`as_reward_funcs` gives a regression model's attributes one reward function each, for TRL's
``reward_weights`` and ``multi_objective_aggregation``; the functions share one forward pass per batch.

:func:`remote_reward_func` is the TRL function of a model served by ``python -m jaxrm.serve`` on
another host: the same call, scored by the server's ``/score`` (``/score_steps`` for a process
reward model; for a judge, its group rewards' route, ``/compare``, once per prompt's group).

Every TRL function reports the reward's health of each batch (:mod:`jaxrm.scoring.reward_health`) through
the ``log_metric`` and ``log_extra`` that TRL 1.16 passes it (:func:`log_health`).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from jaxrm import tasks
from jaxrm.data.records import Text
from jaxrm.models.config import ModelConfig
from jaxrm.scoring import kinds, reward_health, step_rewards


class Scorer(Protocol):
  """What a reward function scores with: a :class:`jaxrm.RewardModel`, or anything alike."""

  @property
  def config(self) -> ModelConfig: ...

  def score(
    self,
    items: Sequence[Text] | None = None,
    *,
    prompts: Sequence[Text] | None = None,
    completions: Sequence[Text] | None = None,
    normalize: bool = False,
    batch_size: int = 8,
    combine=None,
  ) -> np.ndarray:
    """Rewards float32 [N] of ``items``, or of ``prompts`` joined with ``completions``."""
    ...

  @property
  def step_separator(self) -> str: ...

  def score_steps_batch(
    self, prompts: Sequence[Text], steps_lists: Sequence[Sequence[str]], *, batch_size: int = 8
  ) -> list[list[float]]:
    """P(step correct) of each step of each solution (a process reward model)."""
    ...


# What combines a regression model's outputs into one reward: an attribute's name, "name=w,...",
# a dict of names to weights, or one weight per output (see RewardModel.score).
Combine = str | dict[str, float] | Sequence[float] | None


def _check_scorer(rm: Scorer, combine: Combine, normalize: bool, step_aggregation: str | None) -> str | None:
  """The aggregation of a process reward model's step probabilities (None for a sequence head), or
  an error saying why ``rm`` and these options do not make a reward function."""
  kind = kinds.check_kind(
    rm,
    *tasks.scoring("reward", "attributes", "steps"),
    use="a reward function",
    one_reward=True,
    combine=combine,
  )
  if tasks.scores_of(kind) != "steps":
    if step_aggregation is not None:
      head = kinds.describe(rm.config, getattr(rm, "attributes", None))
      raise ValueError(
        f"step_aggregation={step_aggregation!r} is for a process reward model (a token head, "
        f"scored by its steps); this model has {head}: leave step_aggregation out"
      )
    return None
  if combine is not None or normalize:
    given = "combine" if combine is not None else "normalize"
    raise ValueError(
      f"{given}= is for a sequence-head model's rewards; a process reward model's reward is an "
      f"aggregate of its step probabilities (step_aggregation=, one of "
      f"{', '.join(step_rewards.AGGREGATIONS)}): leave {given} out"
    )
  return step_rewards.check_aggregation(step_aggregation or step_rewards.DEFAULT_AGGREGATION)


def _solution_text(completion: Text, where: str) -> str:
  """The text of a completion whose steps a process reward model scores: the string itself, or
  the content of a conversational completion's one assistant message."""
  if isinstance(completion, str):
    return completion
  if (
    isinstance(completion, list)
    and len(completion) == 1
    and isinstance(completion[0], dict)
    and completion[0].get("role") == "assistant"
    and isinstance(completion[0].get("content"), str)
  ):
    return completion[0]["content"]
  raise ValueError(
    f"{where}: a process reward model scores the steps of one solution: a string, or one "
    f"assistant message [{{'role': 'assistant', 'content': ...}}]; got {str(completion)[:200]}"
  )


def _step_scores(
  rm: Scorer, prompts: Sequence[Text], solutions: Sequence[str], how: str, batch_size: int
) -> list[float | None]:
  """One reward per solution (None for one with no steps), its steps cut at ``rm``'s separator."""
  steps = [step_rewards.split_steps(s, rm.step_separator) for s in solutions]
  probabilities = rm.score_steps_batch(list(prompts), steps, batch_size=batch_size)
  return [step_rewards.aggregate(p, how) if p else None for p in probabilities]


def _grouping(rm: Scorer, given: dict[str, Any]) -> Any:
  """The group rewards of ``rm``'s task (:attr:`jaxrm.tasks.Task.group_rewards`), None for a model
  scored one reward per completion; an error for group options (``given``: their values, None
  where left out) that such a model does not take."""
  task = kinds.task_of(rm)
  if task is not None and task.group_rewards is not None:
    return task.group_rewards
  named = [k for k, v in given.items() if v is not None]
  if named:
    grouping = tasks.grouping(*named)
    head = kinds.describe(rm.config, getattr(rm, "attributes", None), task)
    raise ValueError(
      f"{_options(grouping.OPTIONS)} are for {grouping.FOR}; this model has {head}: leave them out"
    )
  return None


def _options(names: Sequence[str]) -> str:
  """``strategy= and aggregate=``: keyword options as messages name them."""
  return " and ".join(f"{k}=" for k in names)


def _named(f: Callable, name: str) -> Callable:
  f.__name__ = f.__qualname__ = name
  return f


def as_reward_func(
  rm: Scorer,
  *,
  normalize: bool = False,
  batch_size: int = 8,
  name: str = "jaxrm_reward",
  combine: Combine = None,
  step_aggregation: str | None = None,
  strategy: str | None = None,
  aggregate: str | None = None,
) -> Callable[..., list[float | None]]:
  """``f(prompts, completions, **kwargs) -> list[float]`` for TRL's GRPOTrainer.

  Each reward scores prompt + completion laid out as in training: a conversation rendered by the
  chat template, or the two strings joined. A process reward model scores the completion's steps
  (see the module docstring): the reward is ``step_rewards.aggregate(rm.score_steps(prompt,
  split_steps(completion, rm.step_separator)), step_aggregation)``, None for no steps. A pairwise
  judge rewards each completion by its comparisons with the other completions of an equal prompt
  (see the module docstring): a completion alone with its prompt in the batch gets 0.0 under
  ``bradley_terry``, 0.5 under ``win_rate``.

  Args:
    rm: a reward model with a tokenizer: a sequence head, or a process reward model's token head.
    normalize: (reward - mean) / std with the statistics recorded at validation (sequence heads).
    batch_size: rows per forward pass.
    name: ``f.__name__``, the name TRL logs the rewards under.
    combine: a regression model's outputs combined into one reward (required for one).
    step_aggregation: how a process reward model's step probabilities become one reward: ``"min"``
      (the default), ``"last"``, ``"product"`` or ``"mean"``; only for a process reward model.
    strategy: a pairwise judge's comparisons within a prompt's group: ``"round_robin"`` (the
      default: every pair, both orders), ``"circular"`` (each completion with the next, both
      orders) or ``"reference"`` (each completion with its row's ``reference`` column, a dataset
      column TRL passes); only for a judge.
    aggregate: how a judge's comparisons become rewards: ``"bradley_terry"`` (the default: the
      maximum-likelihood strengths, centred in each group) or ``"win_rate"``; only for a judge.
  """
  given = {"strategy": strategy, "aggregate": aggregate}
  grouping = _grouping(rm, given)
  if grouping is not None:
    options = dict(normalize=normalize, combine=combine, step_aggregation=step_aggregation)
    settings = grouping.settings(given, options)

    def grouped(prompts: Sequence[Text], completions: Sequence[Text], **kwargs: Any) -> list[float]:
      rewards = grouping.local(rm, prompts, completions, kwargs, settings, batch_size)
      log_health(kwargs, name, rewards, completions)
      return rewards

    return _named(grouped, name)
  how = _check_scorer(rm, combine, normalize, step_aggregation)
  extra = {} if combine is None else {"combine": combine}
  reward_range = None if how is not None else reward_health.validation_range(rm, normalize=normalize)

  def rewards_of(prompts: Sequence[Text], completions: Sequence[Text]) -> list[float | None]:
    if how is not None:
      solutions = [_solution_text(c, f"completions[{i}]") for i, c in enumerate(completions)]
      return _step_scores(rm, prompts, solutions, how, batch_size)
    return rm.score(
      prompts=prompts, completions=completions, normalize=normalize, batch_size=batch_size, **extra
    ).tolist()

  def reward_func(prompts: Sequence[Text], completions: Sequence[Text], **kwargs: Any) -> list[float | None]:
    rewards = rewards_of(prompts, completions)
    log_health(kwargs, name, rewards, completions, reward_range)
    return rewards

  return _named(reward_func, name)


def as_reward_funcs(
  rm: Scorer, *, batch_size: int = 8, name: str = "jaxrm_reward"
) -> list[Callable[..., list[float]]]:
  """One TRL reward function per attribute of a regression model, in the model's attribute order.

  Each is ``f(prompts, completions, **kwargs) -> list[float]`` named ``<name>_<attribute>`` (TRL
  logs its rewards under that name), giving that attribute's column of ``rm.score``; TRL's
  ``GRPOConfig(reward_weights=[...], multi_objective_aggregation=...)`` weighs them. The model
  scores a batch once for all of them: its outputs are kept for the last few batches, keyed by
  the batch's contents.

  Args:
    rm: a regression model (``reward.type=regression``) with a tokenizer.
    batch_size: rows per forward pass.
    name: the prefix of the functions' names.
  """
  attributes = _check_attributes(rm)
  outputs = _SharedOutputs(rm, batch_size)

  def attribute_func(i: int) -> Callable[..., list[float]]:
    def reward_func(prompts: Sequence[Text], completions: Sequence[Text], **kwargs: Any) -> list[float]:
      rewards = outputs(prompts, completions)[:, i].tolist()
      log_health(kwargs, f"{name}_{attributes[i]}", rewards, completions)
      return rewards

    return reward_func

  return [_named(attribute_func(i), f"{name}_{a}") for i, a in enumerate(attributes)]


def _check_attributes(rm: Scorer) -> tuple[str, ...]:
  """A regression model's attribute names, or an error saying which reward function fits ``rm``."""
  attributes = getattr(rm, "attributes", None)
  if kinds.kind_of(rm) in tasks.scoring("reward", "steps"):
    raise kinds.ModelKindError(
      f"as_reward_funcs gives one reward function per attribute of a regression model; this "
      f"model has {kinds.describe(rm.config, attributes)}, one reward per row: use as_reward_func"
    )
  kinds.check_kind(rm, *tasks.scoring("attributes"), use="as_reward_funcs")
  return tuple(attributes)


class _SharedOutputs:
  """A regression model's outputs float32 [N, A] of the last few batches it scored, keyed by the
  batch's contents: the attributes' reward functions, called one after another on the same
  batch, then share one forward pass."""

  KEPT = 4  # batches: TRL calls every reward function on one batch before the next

  def __init__(self, rm: Scorer, batch_size: int):
    self._rm, self._batch_size = rm, batch_size
    self._kept: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()
    self._lock = threading.Lock()  # one forward pass per batch, whichever thread asks first

  def __call__(self, prompts: Sequence[Text], completions: Sequence[Text]) -> np.ndarray:
    key = _batch_key(prompts, completions)
    with self._lock:
      if key not in self._kept:
        self._kept[key] = self._rm.score(
          prompts=list(prompts), completions=list(completions), batch_size=self._batch_size
        )
        if len(self._kept) > self.KEPT:
          self._kept.popitem(last=False)
      self._kept.move_to_end(key)
      return self._kept[key]


def _batch_key(prompts: Sequence[Text], completions: Sequence[Text]) -> bytes:
  """A digest of the batch's texts (strings or message lists): equal batches, equal keys."""
  text = json.dumps([list(prompts), list(completions)], sort_keys=True, ensure_ascii=False, default=repr)
  return hashlib.blake2b(text.encode(errors="surrogatepass"), digest_size=16).digest()


HEALTH_PREFIX = "reward_health/"  # TRL's metric names: reward_health/<function name>/<signal>


def log_health(
  trl_kwargs: dict[str, Any],
  name: str,
  rewards: Sequence[float | None],
  completions: Sequence[Text],
  reward_range: reward_health.Range | None = None,
) -> None:
  """Reports the batch's health (:func:`jaxrm.scoring.reward_health.batch_health`) through the
  ``log_metric`` that TRL (1.16 on) passes a reward function, as ``reward_health/<name>/<signal>``,
  and with a validation range each completion's ``<name>_out_of_range`` through ``log_extra`` (a
  column of TRL's completions table). Nothing without them (another trainer). The lengths are
  TRL's ``completion_ids`` in tokens, else the completions' characters."""
  log_metric, log_extra = trl_kwargs.get("log_metric"), trl_kwargs.get("log_extra")
  if log_metric is None and log_extra is None:
    return
  ids = trl_kwargs.get("completion_ids")
  lengths = [len(x) for x in ids] if ids is not None else [_text_length(c) for c in completions]
  if log_metric is not None:
    health = reward_health.batch_health(rewards, lengths, reward_range=reward_range)
    for signal, value in health.items():
      log_metric(f"{HEALTH_PREFIX}{name}/{signal}", value)
  if log_extra is not None and reward_range is not None:
    real = [float("nan") if r is None else r for r in rewards]
    log_extra(f"{name}_out_of_range", reward_health.out_of_range(real, reward_range).tolist())


def _text_length(completion: Text) -> int:
  if isinstance(completion, str):
    return len(completion)
  return sum(len(m.get("content") or "") for m in completion if isinstance(m, dict))


def as_multi_agent_reward_func(
  rm: Scorer,
  formatter: Callable[..., Text],
  *,
  normalize: bool = False,
  batch_size: int = 8,
  name: str = "jaxrm_reward",
  combine: Combine = None,
  step_aggregation: str | None = None,
) -> Callable[..., list[float]]:
  """``f(*agent_completions, batch_items) -> list[float]``: one reward per joint response.

  Args:
    rm: a reward model with a tokenizer: a sequence head, or a process reward model's token head.
    formatter: ``formatter(item, *completions) -> str | list[message]``: the text to score for one
      task item and one completion of each agent, in agent order. For a process reward model, a
      ``(prompt, solution)`` pair or a conversation ending in the assistant's solution: the
      solution's steps are scored (cut at the model's step separator), after the prompt.
    normalize: (reward - mean) / std with the statistics recorded at validation (sequence heads).
    batch_size: rows per forward pass.
    name: ``f.__name__``.
    combine: a regression model's outputs combined into one reward (required for one).
    step_aggregation: a process reward model's aggregation of step probabilities (see
      :func:`as_reward_func`). A joint response with no steps is an error here: a multi-agent
      trainer has no "no reward" value.
  """
  how = _check_scorer(rm, combine, normalize, step_aggregation)
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
      raise ValueError(
        f"{name}: {len(batch_items)} batch_items for {n} joint responses; give one item, or one per response"
      )
    texts = [formatter(item, *joint) for item, joint in zip(items, zip(*agent_completions))]
    if how is None:
      return rm.score(texts, normalize=normalize, batch_size=batch_size, **extra).tolist()
    pairs = [
      _prompt_and_solution(t, f"{name}: formatter's text for joint response {i}") for i, t in enumerate(texts)
    ]
    rewards = _step_scores(rm, [p for p, _ in pairs], [s for _, s in pairs], how, batch_size)
    for i, r in enumerate(rewards):
      if r is None:
        raise ValueError(
          f"{name}: joint response {i} has no steps to score (its solution is empty or only "
          f"step separators {rm.step_separator!r})"
        )
    return rewards

  return _named(reward_func, name)


def _prompt_and_solution(text: Text | tuple, where: str) -> tuple[Text, str]:
  """(prompt, solution) of what a multi-agent formatter gave for a process reward model."""
  if isinstance(text, tuple) and len(text) == 2 and isinstance(text[1], str):
    return text
  if isinstance(text, list) and text and isinstance(text[-1], dict) and text[-1].get("role") == "assistant":
    return text[:-1], _solution_text(text[-1:], where)
  raise ValueError(
    f"{where}: a process reward model scores a solution's steps after its prompt: return a "
    f"(prompt, solution) pair or a conversation ending in the assistant's solution; "
    f"got {str(text)[:200]}"
  )


# Statuses a busy server answers (queue full, request timed out): worth retrying after Retry-After.
RETRIED_STATUSES = (503, 504)


def remote_reward_func(
  url: str,
  *,
  api_key: str | None = None,
  timeout: float = 300.0,
  retries: int = 8,
  name: str = "jaxrm_reward",
  steps: bool = False,
  step_aggregation: str | None = None,
  strategy: str | None = None,
  aggregate: str | None = None,
  asynchronous: bool = False,
) -> Callable[..., Any]:
  """``f(prompts, completions, **kwargs) -> list[float]`` for TRL's GRPOTrainer, scored by a server.

  Sends the pairs to the ``/score`` endpoint of ``python -m jaxrm.serve``, which joins them as
  :func:`as_reward_func` does. A process reward model's server is asked for ``/score_steps``
  instead (``steps=True``, or any ``step_aggregation``): it cuts each completion into steps at the
  model's step separator and aggregates their probabilities as :func:`as_reward_func` does (an
  completion with no steps, empty or only separators: None, as the server answers it). A
  busy server's 503/504 is retried after its Retry-After, up to ``retries`` times; any other error
  raises with the server's message, and a server that cannot be reached a ConnectionError naming
  it. Connections go straight to ``url``, whatever HTTP proxy the environment names.

  Args:
    url: the server, ``http://HOST:PORT``.
    api_key: the server's ``--api_key``, if it has one.
    timeout: seconds to wait for one answer.
    retries: tries after a busy answer before giving up.
    name: ``f.__name__``, the name TRL logs the rewards under.
    steps: score a process reward model's steps (``/score_steps``), aggregated by the server's
      ``--step_aggregation``.
    step_aggregation: ``"min"``, ``"last"``, ``"product"`` or ``"mean"``: the aggregation asked of
      ``/score_steps`` (implies ``steps``).
    strategy: a pairwise judge's server (``strategy`` or ``aggregate`` implies it): the batch's
      completions are grouped by prompt as :func:`as_reward_func` groups them for a judge, and
      each group is sent to ``/compare`` with this strategy (default ``round_robin``;
      ``reference`` compares each completion with its row's ``reference`` column).
    aggregate: a judge server's aggregate of each group's comparisons (default
      ``bradley_terry``).
    asynchronous: ``f`` is an ``async def`` function, which TRL awaits beside its other async
      reward functions: the same request, retries and errors, sent from a worker thread.
  """
  url = _check_url(url, name)
  if step_aggregation is not None:
    step_aggregation = step_rewards.check_aggregation(step_aggregation)
  steps = steps or step_aggregation is not None
  given = {"strategy": strategy, "aggregate": aggregate}
  named = [k for k, v in given.items() if v is not None]
  grouping = tasks.grouping(*named) if named else None  # the server's model compares a group
  if grouping is not None:
    if steps:
      raise ValueError(
        f"{name}: steps= and step_aggregation= are a process reward model's; "
        f"{_options(grouping.OPTIONS)} {grouping.OWNER}'s: pass one"
      )
    settings = grouping.settings(given)
  path = grouping.ROUTE if grouping is not None else "/score_steps" if steps else "/score"
  post = _poster(url, path, api_key, timeout, retries, name)

  def rewards(
    prompts: Sequence[Text], completions: Sequence[Text], columns: dict[str, Any]
  ) -> list[float | None]:
    if grouping is not None:
      return grouping.remote(post, prompts, completions, columns, settings)
    if not steps:
      return post({"prompts": list(prompts), "completions": list(completions)})
    return _remote_step_rewards(post, prompts, completions, step_aggregation, name)

  if asynchronous:

    async def reward_func(
      prompts: Sequence[Text], completions: Sequence[Text], **kwargs: Any
    ) -> list[float | None]:
      # The blocking request, and its waits on a busy server, hold a worker thread, not the loop.
      scored = await asyncio.to_thread(rewards, list(prompts), list(completions), kwargs)
      log_health(kwargs, name, scored, completions)
      return scored

  else:

    def reward_func(
      prompts: Sequence[Text], completions: Sequence[Text], **kwargs: Any
    ) -> list[float | None]:
      scored = rewards(prompts, completions, kwargs)
      log_health(kwargs, name, scored, completions)
      return scored

  return _named(reward_func, name)


def _check_url(url: Any, name: str) -> str:
  """``url`` without its trailing slash, or an error saying what a server's address looks like."""
  if not isinstance(url, str) or not url.strip():
    raise ValueError(
      f"{name}: the reward server's URL is missing (got {url!r}); pass the address where "
      "`python -m jaxrm.serve` listens, e.g. 'http://HOST:8000'"
    )
  parts = urllib.parse.urlsplit(url.strip())
  if parts.scheme not in ("http", "https") or not parts.netloc:
    raise ValueError(f"{name}: {url!r} is not a server address; pass 'http://HOST:PORT'")
  return url.strip().rstrip("/")


def _poster(
  url: str, path: str, api_key: str | None, timeout: float, retries: int, name: str
) -> Callable[[dict], list[float | None]]:
  """``post(body) -> rewards``: one request to ``url + path``, retried while the server is busy."""
  endpoint = url + path
  headers = {"Content-Type": "application/json"}
  if api_key:
    headers["Authorization"] = f"Bearer {api_key}"
  opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

  def post(body: dict) -> list[float | None]:
    data = json.dumps(body).encode()
    attempt = 0
    while True:
      request = urllib.request.Request(endpoint, data=data, headers=headers, method="POST")
      try:
        with opener.open(request, timeout=timeout) as reply:
          return [None if r is None else float(r) for r in json.loads(reply.read())["rewards"]]
      except urllib.error.HTTPError as e:
        with e:
          message = _error_message(e)
          if e.code not in RETRIED_STATUSES or attempt == retries:
            raise ValueError(f"{name}: {endpoint} answered {e.code}: {message}") from None
          time.sleep(float(e.headers.get("Retry-After") or 1))
      except urllib.error.URLError as e:
        raise ConnectionError(
          f"{name}: cannot reach the reward server at {endpoint} ({e.reason}). Is `python -m jaxrm.serve` "
          f"running there? A server that was just started may still be loading its model, and takes "
          f"connections once GET {url}/health answers: wait for it and try again"
        ) from None
      attempt += 1

  return post


def _remote_step_rewards(
  post: Callable[[dict], list],
  prompts: Sequence[Text],
  completions: Sequence[Text],
  how: str | None,
  name: str,
) -> list[float | None]:
  """A process reward model's rewards from ``/score_steps`` (``post``), None where there is no step."""
  if len(prompts) != len(completions):
    raise ValueError(f"{name}: {len(prompts)} prompts but {len(completions)} completions")
  solutions = [_solution_text(c, f"completions[{i}]") for i, c in enumerate(completions)]
  if not solutions:
    return []
  # The server answers null for a solution with no steps, as as_reward_func gives None.
  body = {"prompts": list(prompts), "completions": solutions}
  return list(post(body if how is None else {**body, "aggregation": how}))


def _error_message(e: urllib.error.HTTPError) -> str:
  raw = e.read()
  try:
    return json.loads(raw)["error"]
  except (ValueError, KeyError, TypeError):
    return raw.decode(errors="replace")[:500]
