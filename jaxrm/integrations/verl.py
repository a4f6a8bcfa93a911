"""verl's custom reward function, scored by a jaxrm server (``python -m jaxrm.serve``).

verl's reward loop (``verl/experimental/reward_loop/reward_manager/naive.py``, verl 0.9) awaits
``compute_score(data_source=, solution_str=, ground_truth=, extra_info=, **reward_kwargs)`` once
per response, ``reward_kwargs`` being ``reward.custom_reward_function.reward_kwargs`` of its config;
it reads the answer's ``"score"`` as the reward (docs/verl.md has the config lines)::

  reward.custom_reward_function.path=pkg://jaxrm.integrations.verl
  reward.custom_reward_function.name=compute_score
  +reward.custom_reward_function.reward_kwargs.url=http://HOST:8000

The request is :func:`jaxrm.scoring.reward_funcs.remote_reward_func`'s, with its retries and errors.

A pairwise judge's server (``judge=True``: ``+reward.custom_reward_function.reward_kwargs.judge=true``)
is asked to compare the response with verl's reference answer (``ground_truth``): ``POST /compare``
with ``strategy="reference"``, the response the one of ``responses`` and the reference answer
``reference``; the reward is the response's, the log-odds that it is better than the reference
under ``aggregate="bradley_terry"`` (0 where the judge finds them alike), its probability of winning
under ``win_rate``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from jaxrm import tasks
from jaxrm.scoring import reward_funcs

URL_ENV = "JAXRM_REWARD_URL"  # the server, when reward_kwargs gives no url
API_KEY_ENV = "JAXRM_API_KEY"  # its key, when reward_kwargs gives no api_key (the server reads it too)
PROMPT_KEYS = ("prompt", "question")  # where extra_info holds the prompt (verl's examples: "question")
NAME = "jaxrm_verl"


async def compute_score(
  data_source: str,
  solution_str: str,
  ground_truth: Any,
  extra_info: dict | None = None,
  *,
  url: str | None = None,
  api_key: str | None = None,
  steps: bool = False,
  step_aggregation: str | None = None,
  prompt_key: str | None = None,
  chat: bool = True,
  no_steps_score: float | None = None,
  judge: bool = False,
  aggregate: str | None = None,
  timeout: float = 300.0,
  retries: int = 8,
  **kwargs: Any,
) -> dict[str, float]:
  """``{"score": reward}`` of one response, scored with its prompt by a jaxrm server.

  Args:
    data_source: verl's; unused.
    ground_truth: verl's reference answer: a reward model reads the prompt and the response only,
      a judge (``judge``) compares the response with it (a string, or any value as ``str`` writes
      it).
    solution_str: the response, as verl decoded it.
    extra_info: the row's ``extra_info``, which holds its prompt under ``prompt_key``.
    url: the server, ``http://HOST:PORT``; default ``$JAXRM_REWARD_URL``.
    api_key: the server's ``--api_key``; default ``$JAXRM_API_KEY``.
    steps, step_aggregation: a process reward model's server, as :func:`remote_reward_func`
      takes them (``min``, ``last``, ``product`` or ``mean``).
    prompt_key: the key of ``extra_info`` holding the prompt (a string or a message list);
      default the first of ``prompt``, ``question`` that it has.
    chat: score a string prompt as a user's message and the response as the assistant's reply,
      rendered by the model's chat template (as verl's own reward-model path renders them);
      False joins the two strings as they are. A prompt given as messages is always a chat.
    no_steps_score: the reward of a response a process reward model finds no step in (empty or
      only step separators). verl needs a number for every response; without this, such a
      response is an error.
    judge: the server holds a pairwise judge: the response is compared with ``ground_truth``
      (``/compare``, ``strategy="reference"``).
    aggregate: with ``judge``, ``"bradley_terry"`` (the default) or ``"win_rate"``.
    timeout, retries: as :func:`remote_reward_func` takes them.
    kwargs: verl's ``reward_router_address`` and ``reward_model_tokenizer`` (for reward models
      verl serves itself), unused.
  """
  del data_source, kwargs
  if judge and (steps or step_aggregation is not None):
    raise ValueError(
      f"{NAME}: judge= compares with the reference answer; steps= and step_aggregation= score a process reward model's steps: pass one"
    )
  if aggregate is not None and not judge:
    raise ValueError(f"{NAME}: aggregate= is a judge's (with judge=true); leave it out")
  # judge=true: the server's model compares each response with a reference answer, as the task
  # whose reward functions take aggregate= does.
  grouping = tasks.grouping("aggregate") if judge else None
  options = () if grouping is None else tuple(grouping.against_reference({"aggregate": aggregate}).items())
  reward = _reward_func(
    _url(url),
    api_key or os.environ.get(API_KEY_ENV) or None,
    steps,
    step_aggregation,
    options,
    timeout,
    retries,
  )
  prompt = _prompt(extra_info, prompt_key)
  if chat and isinstance(prompt, str):
    prompt = [{"role": "user", "content": prompt}]
  if grouping is not None:
    reference = ground_truth if isinstance(ground_truth, str) else str(ground_truth)
    columns = {grouping.COLUMN: [reference]}
    (score,) = await reward(prompts=[prompt], completions=[solution_str], **columns)
    return {"score": score}
  # After a conversation, the response is the assistant's next message.
  response = [{"role": "assistant", "content": solution_str}] if isinstance(prompt, list) else solution_str
  (score,) = await reward(prompts=[prompt], completions=[response])
  if score is None:
    if no_steps_score is None:
      raise ValueError(
        f"{NAME}: the process reward model found no step in the response {solution_str[:200]!r} "
        "(empty, or only step separators), and verl needs a number for every response: set "
        "+reward.custom_reward_function.reward_kwargs.no_steps_score (0.0 is the lowest a step "
        "probability can be)"
      )
    score = float(no_steps_score)
  return {"score": score}


def _url(url: str | None) -> str:
  url = url or os.environ.get(URL_ENV)
  if not url:
    raise ValueError(
      f"{NAME}: no reward server given: set +reward.custom_reward_function.reward_kwargs.url="
      f"http://HOST:8000 (where `python -m jaxrm.serve` listens), or ${URL_ENV} in the reward workers' environment"
    )
  return url


@functools.lru_cache(maxsize=8)
def _reward_func(
  url: str,
  api_key: str | None,
  steps: bool,
  step_aggregation: str | None,
  options: tuple[tuple[str, Any], ...],
  timeout: float,
  retries: int,
) -> Callable[..., Any]:
  """One asynchronous remote reward function per server and settings, made on first use
  (``options``: a group's, as :func:`remote_reward_func` takes them)."""
  return reward_funcs.remote_reward_func(
    url,
    api_key=api_key,
    timeout=timeout,
    retries=retries,
    name=NAME,
    steps=steps,
    step_aggregation=step_aggregation,
    asynchronous=True,
    **dict(options),
  )


def _prompt(extra_info: dict | None, key: str | None) -> Any:
  """The prompt that ``extra_info`` holds: a string, or a list of messages."""
  info = extra_info or {}
  keys = (key,) if key else PROMPT_KEYS
  found = next((k for k in keys if k in info), None)
  if found is None:
    where = f"{key!r}" if key else " or ".join(map(repr, PROMPT_KEYS))
    raise ValueError(
      f"{NAME}: extra_info has no {where} to score the response against (it has "
      f"{', '.join(map(repr, info)) or 'nothing'}): put each row's prompt in its extra_info when "
      "preparing the data (verl's example preprocessors keep it as extra_info['question']), or "
      "name its key with +reward.custom_reward_function.reward_kwargs.prompt_key"
    )
  prompt = info[found]
  if hasattr(prompt, "tolist"):  # a message list read back from parquet is a numpy array
    prompt = prompt.tolist()
  if isinstance(prompt, tuple):
    prompt = list(prompt)
  if not isinstance(prompt, (str, list)):
    raise ValueError(
      f"{NAME}: extra_info[{found!r}] is {type(prompt).__name__}; expected the prompt as a string or a list of messages"
    )
  return prompt
