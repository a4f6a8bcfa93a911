"""The JSON each scoring endpoint reads and writes: jaxrm's, OpenRLHF's, vLLM's and SGLang's.

A parser turns a request body into a :class:`~jaxrm.tasks.routes.Scoring`: the token rows to score and how
to write the answer from their rewards (one float per row, as the server serves them: normalized or
combined if so configured). :data:`ROUTES` gives each POST path its parser: the server's own here,
then the routes each task adds (:attr:`jaxrm.tasks.Task.routes`), each refusing a model of another
task.

* ``/get_reward``: OpenRLHF's ``{"query": [text, ...], "prompts", "labels"}`` -> ``{"rewards",
  "scores", "extra_logs"}``, as its ``serve_rm`` answers (extra_logs: the reward's health).
* ``/score``: jaxrm's ``{"conversations"}`` or ``{"prompts", "completions"}`` -> ``{"rewards"}``;
  a body with vLLM's pair fields instead (``text_1``/``text_2``, or ``queries`` with ``documents``
  or ``items``, or ``data_1``/``data_2``; jaxrm's fields share no name with them) is vLLM's score
  request, answered as vLLM answers it. ``/v1/score`` takes vLLM's only.
* ``/classify``: vLLM's ``{"input"}`` or ``{"messages"}`` -> its ClassificationResponse (a
  verifier's: its two answers as labels, with their probabilities); SGLang's
  ``{"text"}`` or ``{"input_ids"}`` (its native reward endpoint) -> ``{"embedding": [reward],
  "meta_info"}`` per item. ``/v1/classify`` takes vLLM's only.
* ``/pooling``: vLLM's ``{"input"}`` or ``{"messages"}`` -> its PoolingResponse.
* ``/v1/embeddings``: SGLang's ``{"model", "input"}`` -> its EmbeddingResponse, ``embedding``
  ``[reward]`` per item (verl's reward loop with SGLang as the engine).
* ``/reward``: slime's ``{"prompt", "response", "label"}`` -> the reward, a bare JSON number.
* ``/compare``, a pairwise judge's route (:func:`jaxrm.tasks.pairwise.parse_compare`): ``{"prompt",
  "responses", "strategy", "aggregate", "reference"}`` -> ``{"rewards", "log_odds"}``, one reward
  per response from the judge's comparisons. The other endpoints refuse a model whose task gives no
  reward per row alone, naming the route to use instead (:attr:`jaxrm.tasks.Task.route_instead`).
* ``/score_steps`` (a process reward model): ``{"prompts", "completions"}`` (each completion cut
  into steps at the model's step separator) or ``{"prompts", "steps"}`` (lists of step texts) ->
  ``{"step_rewards": [[P(step correct), ...], ...], "rewards": [...]}``, each reward its solution's
  step probabilities aggregated (the request's ``"aggregation"``, else ``--step_aggregation``); a
  solution with no steps has ``[]`` and a null reward, as the Python reward functions give None. Such a
  model's ``/score`` takes the same prompts and completions and answers ``{"rewards"}``; the other
  endpoints score sequences and refuse it.

vLLM's shapes are its protocol classes (vllm/entrypoints/openai/protocol.py up to v0.10,
vllm/entrypoints/pooling/{classify,pooling,score}/protocol.py after); SGLang's, its
``EmbeddingReqInput`` and the ``{"embedding", "meta_info"}`` items its tokenizer manager returns
(python/sglang/srt/managers/io_struct.py, tokenizer_manager.py). As vLLM does for a one-output
head, classify, pooling and score answer sigmoid(reward) unless the request sends
``"use_activation": false`` (``"activation"`` before vLLM 0.11.2), and a regression model's output
as it is (vLLM reads ``problem_type="regression"`` from the export); SGLang's embedding is the
reward as it is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from jaxrm import tasks
from jaxrm.data.formats import json_type
from jaxrm.scoring import kinds, step_rewards
from jaxrm.server.bodies import Encoder
from jaxrm.tasks.routes import Body, Meta, RequestError, Route, Scoring

# vLLM's score request: (first, second) field names, in the order vLLM's ScoreRequest tries them.
SCORE_PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
JAXRM_SCORE_FIELDS = ("conversations", "prompts", "completions")
VLLM_INPUTS, SGLANG_INPUTS = ("input", "messages"), ("text", "input_ids")
VLLM_INPUT = "a text, a list of texts, or token ids"
HEALTH_PREFIX = "reward_health/"  # OpenRLHF's extra_logs keys: reward_health/reward_mean, ...


# ------------------------------------------------------------------ jaxrm and OpenRLHF


def parse_get_reward(enc: Encoder, body: Body) -> Scoring:
  """OpenRLHF's request -> the answer its ``serve_rm`` gives: ``rewards`` (what PPO trains on),
  ``scores`` (what its dynamic filtering reads; the same values) and ``extra_logs`` (logged as
  they are: the reward's health, ``reward_health/<signal>``, one value per query)."""
  rows = enc.get_reward(body)

  def write(rewards: list[float], meta: Meta) -> Body:
    logs = {f"{HEALTH_PREFIX}{name}": [value] * len(rewards) for name, value in meta.health.items()}
    return {"rewards": rewards, "scores": rewards, "extra_logs": logs}

  return Scoring(rows, write)


def parse_jaxrm_score(enc: Encoder, body: Body) -> Scoring:
  if tasks.scores_of(enc.rm.kind) == "steps":
    if "conversations" in body:
      raise RequestError(
        400,
        "this server's model is a process reward model, which scores the steps of a "
        "solution: send 'prompts' with 'completions' (or 'steps'), not 'conversations'",
      )
    steps = parse_score_steps(enc, body)
    return Scoring(steps.rows, lambda outputs, meta: {"rewards": steps.write(outputs, meta)["rewards"]})
  return Scoring(enc.score(body), _rewards)


def _rewards(rewards: list[float], meta: Meta) -> Body:
  return {"rewards": rewards}


# ------------------------------------------------------------------ vLLM


def parse_vllm_classify(enc: Encoder, body: Body) -> Scoring:
  """ClassificationRequest -> ClassificationResponse: one ``probs`` entry per item, the served
  output's (``num_classes`` 1); a verifier's: its two answers' probabilities (``num_classes`` 2),
  labelled by the likelier answer."""
  if enc.rm.verifier is not None:  # a verifier's asker (one giving no reward per row is refused first)
    return _verifier_classify(enc, body)
  rows, act, label, model = _vllm_rows(enc, body), _activation(enc, body), _label(enc), _model(body)

  def write(rewards: list[float], meta: Meta) -> Body:
    data = [{"index": i, "label": label, "probs": [act(r)], "num_classes": 1} for i, r in enumerate(rewards)]
    return {**_vllm_head("classify", model, meta), "data": data, "usage": _usage(rows)}

  return Scoring(rows, write)


def _verifier_classify(enc: Encoder, body: Body) -> Scoring:
  """A verifier's ClassificationResponse: ``probs`` [p(yes), p(no)] of its answers, the softmax
  over the two (``sigmoid`` of the served log-odds), ``label`` the likelier answer."""
  if body.get("use_activation") is False or body.get("activation") is False:
    raise RequestError(
      400,
      "this server's model is a verifier, which classifies by its answers' probabilities: leave "
      "'use_activation' out (its log-odds are /score's rewards)",
    )
  rows, model, (yes, no) = _vllm_rows(enc, body), _model(body), enc.rm.verifier.answers

  def write(rewards: list[float], meta: Meta) -> Body:
    data = []
    for i, r in enumerate(rewards):
      p = _sigmoid(r)
      data.append({"index": i, "label": yes if p >= 0.5 else no, "probs": [p, 1.0 - p], "num_classes": 2})
    return {**_vllm_head("classify", model, meta), "data": data, "usage": _usage(rows)}

  return Scoring(rows, write)


def parse_vllm_pooling(enc: Encoder, body: Body) -> Scoring:
  """PoolingRequest -> PoolingResponse: ``data`` [reward] per item, in floats."""
  if body.get("encoding_format") not in (None, "float"):
    raise RequestError(
      400,
      f"encoding_format={body['encoding_format']!r}: this server answers floats; "
      'send "float" (or leave it out)',
    )
  rows, act, model = _vllm_rows(enc, body), _activation(enc, body), _model(body)

  def write(rewards: list[float], meta: Meta) -> Body:
    data = [{"index": i, "object": "pooling", "data": [act(r)]} for i, r in enumerate(rewards)]
    return {**_vllm_head("pool", model, meta), "data": data, "usage": _usage(rows)}

  return Scoring(rows, write)


def parse_vllm_score(enc: Encoder, body: Body) -> Scoring:
  """ScoreRequest -> ScoreResponse. Pairs are 1:1, 1:N or N:N, as vLLM pairs them; each pair is
  scored as the one text ``first + second`` with special tokens, as vLLM scores a pair with a
  decoder (no separator token)."""
  first, second = _score_fields(body)
  for name in ("max_tokens_per_query", "max_tokens_per_doc"):
    if body.get(name):
      raise RequestError(
        400,
        f"{name}={body[name]!r}: this server does not cut queries or documents; "
        "send them within max_length tokens",
      )
  lefts, rights = _score_texts(body, first), _score_texts(body, second)
  if not lefts or not rights or (len(lefts) > 1 and len(lefts) != len(rights)):
    raise RequestError(
      400,
      f"'{first}' has {len(lefts)} texts and '{second}' {len(rights)}: pair 1 with N, "
      "or N with N (N at least 1)",
    )
  enc.check_count(second, len(rights))
  truncate, side = _truncation(enc, body)
  rows = []
  for i, b in enumerate(rights):
    j = 0 if len(lefts) == 1 else i
    where = f"{first}[{j}] + {second}[{i}]"
    rows.append(enc.fitted(where, enc.text_ids(where, lefts[j] + b, special=True), truncate, side))
  act, model = _activation(enc, body), _model(body)

  def write(rewards: list[float], meta: Meta) -> Body:
    data = [{"index": i, "object": "score", "score": act(r)} for i, r in enumerate(rewards)]
    return {**_vllm_head("score", model, meta), "data": data, "usage": _usage(rows)}

  return Scoring(rows, write)


def _vllm_rows(enc: Encoder, body: Body) -> list[list[int]]:
  """The rows of vLLM's completion ``input`` (texts or token ids) or chat ``messages`` (one
  conversation, rendered by the chat template as training renders it)."""
  given = [k for k in VLLM_INPUTS if k in body]
  if len(given) != 1:
    raise RequestError(
      400,
      (
        "the body has both 'input' and 'messages'; send one"
        if given
        else "the body has neither 'input' nor 'messages'; send vLLM's {\"input\": "
        f'{VLLM_INPUT}}} or {{"messages": a conversation}}'
      ),
    )
  truncate, side = _truncation(enc, body)
  if given == ["messages"]:
    ids = enc.encode("messages", enc.messages(_text_parts_joined(body["messages"]), "messages"))
    return [enc.fitted("messages", ids, truncate, side)]
  rows = _input_rows(enc, body, _flag(body, "add_special_tokens", True))
  return [enc.fitted(where, ids, truncate, side) for where, ids in rows]


def _input_rows(enc: Encoder, body: Body, special: bool) -> list[tuple[str, list[int]]]:
  """(where, ids) of each item of an OpenAI-style ``input``: a text, a list of texts, token ids,
  or a list of token-id lists; texts tokenized with special tokens if ``special``."""
  value = body["input"]
  if isinstance(value, str):
    items = [("input", enc.text_ids("input", value, special=special))]
  elif _token_ids(value):  # one row of token ids
    items = [("input", enc.given_ids("input", value))]
  elif isinstance(value, list) and value:
    enc.check_count("input", len(value))
    items = [
      (
        f"input[{i}]",
        enc.given_ids(f"input[{i}]", x)
        if isinstance(x, list)
        else enc.text_ids(f"input[{i}]", x, special=special),
      )
      for i, x in enumerate(value)
    ]
  else:
    raise RequestError(400, f"'input' is {json_type(value)}; expected {VLLM_INPUT} (not empty)")
  return items


def _text_parts_joined(messages: Any) -> Any:
  """vLLM's chat messages, a content given as text parts (``[{"type": "text", "text": ...}]``)
  joined by newlines as vLLM joins them (vllm/entrypoints/chat_utils.py); other parts are refused."""
  if not isinstance(messages, list):
    return messages  # enc.messages says what is wrong
  out = []
  for i, message in enumerate(messages):
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):
      for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
          raise RequestError(
            400,
            f'messages[{i}].content[{j}] is not a text part ({{"type": "text", '
            '"text": ...}); this server scores text',
          )
      message = {**message, "content": "\n".join(part["text"] for part in content)}
    out.append(message)
  return out


def _score_fields(body: Body) -> tuple[str, str]:
  pairs = [p for p in SCORE_PAIRS if p[0] in body and p[1] in body]
  if len(pairs) == 1:
    return pairs[0]
  if pairs:
    raise RequestError(
      400,
      f"the body has {' and '.join(map(repr, sorted({k for p in pairs for k in p})))}: "
      "send one pair of texts to score",
    )
  raise RequestError(
    400,
    "vLLM's score request pairs 'text_1' with 'text_2' (or 'queries' with 'documents' "
    "or 'items', or 'data_1' with 'data_2'); the body lacks one of a pair",
  )


def _score_texts(body: Body, field: str) -> list[str]:
  value = body[field]
  texts = value if isinstance(value, list) else [value]
  for i, text in enumerate(texts):
    if not isinstance(text, str):
      raise RequestError(
        400, f"{field}[{i}] is {json_type(text)}; this server scores texts: expected a string"
      )
  return texts


def _truncation(enc: Encoder, body: Body) -> tuple[int | None, str]:
  """vLLM's ``truncate_prompt_tokens`` (-1: max_length) and ``truncation_side``; jaxrm cuts the
  start ("left") unless told otherwise, keeping the response whose last token is scored."""
  side = body.get("truncation_side") or "left"
  if side not in ("left", "right"):
    raise RequestError(400, f'truncation_side={side!r}; expected "left" or "right"')
  n = body.get("truncate_prompt_tokens")
  if n is None:
    return None, side
  if not _is_int(n) or n == 0 or n < -1:
    raise RequestError(
      400,
      f"truncate_prompt_tokens={n!r}; expected a number of tokens (at least 1), or -1 for "
      "this server's max_length",
    )
  return (enc.config.max_length if n == -1 else n), side


def _activation(enc: Encoder, body: Body) -> Callable[[float], float]:
  """Sigmoid, or the reward as it is: as the request's ``use_activation`` (``activation`` before
  vLLM 0.11.2) says, else as vLLM would for this model's export (get_classification_act_fn in
  vllm/model_executor/layers/pooler: identity for problem_type "regression", sigmoid for one label)."""
  given = {k: body[k] for k in ("use_activation", "activation") if body.get(k) is not None}
  for name, value in given.items():
    if not isinstance(value, bool):
      raise RequestError(400, f"'{name}' is {json_type(value)}; expected true, false or null")
  if len(set(given.values())) > 1:
    raise RequestError(400, "'use_activation' and 'activation' disagree; send one")
  on = next(iter(given.values()), tasks.scores_of(enc.rm.kind) != "attributes")
  return _sigmoid if on else float


def _sigmoid(x: float) -> float:
  return 0.5 * (1.0 + math.tanh(0.5 * x))  # tanh, unlike exp, cannot overflow


def _label(enc: Encoder) -> str:
  """The name of the output served: the combination, the one attribute, or transformers' default."""
  return enc.config.combine or (enc.rm.attributes or ("LABEL_0",))[0]


def _model(body: Body) -> str | None:
  """The model the request names, echoed in the answer. vLLM refuses a name it does not serve;
  this server serves one model under whatever name its clients were given."""
  model = body.get("model")
  return model if isinstance(model, str) and model else None


def _vllm_head(prefix: str, model: str | None, meta: Meta) -> Body:
  return {
    "id": f"{prefix}-{meta.request_id}",
    "object": "list",
    "created": meta.created,
    "model": model or meta.model,
  }


def _usage(rows: list[list[int]]) -> Body:
  tokens = sum(map(len, rows))
  return {
    "prompt_tokens": tokens,
    "total_tokens": tokens,
    "completion_tokens": 0,
    "prompt_tokens_details": None,
  }


# ------------------------------------------------------------------ SGLang


def parse_sglang_classify(enc: Encoder, body: Body) -> Scoring:
  """SGLang's ``/classify`` (an ``EmbeddingReqInput``): ``text`` or ``input_ids``, one item or a
  list -> ``{"embedding": [reward], "meta_info": {"id", "prompt_tokens"}}``, or a list of them.
  Texts are tokenized with special tokens, as SGLang's tokenizer manager does."""
  if ("text" in body) == ("input_ids" in body):
    raise RequestError(
      400,
      "send SGLang's 'text' (a text or a list of texts) or 'input_ids' (token ids, or "
      "a list of them), one of the two",
    )
  if "text" in body:
    single = isinstance(body["text"], str)
    texts = [body["text"]] if single else enc.items(body, "text", "a text or a list of texts")
    wheres = ["text"] if single else [f"text[{i}]" for i in range(len(texts))]
    rows = [enc.fitted(w, enc.text_ids(w, t, special=True)) for w, t in zip(wheres, texts)]
  else:
    value = body["input_ids"]
    single = _token_ids(value)
    items = [value] if single else enc.items(body, "input_ids", "token ids, or a list of them")
    wheres = ["input_ids"] if single else [f"input_ids[{i}]" for i in range(len(items))]
    rows = [enc.fitted(w, enc.given_ids(w, ids)) for w, ids in zip(wheres, items)]
  rids = body.get("rid")

  def write(rewards: list[float], meta: Meta) -> Any:
    out = [
      {"embedding": [r], "meta_info": {"id": _rid(rids, i, single, meta), "prompt_tokens": len(row)}}
      for i, (r, row) in enumerate(zip(rewards, rows))
    ]
    return out[0] if single else out

  return Scoring(rows, write)


def parse_sglang_embeddings(enc: Encoder, body: Body) -> Scoring:
  """SGLang's OpenAI-compatible ``/v1/embeddings`` (its ``EmbeddingRequest``) of a reward model:
  ``input`` a text, a list of texts, token ids or a list of them -> an ``EmbeddingResponse`` whose
  item ``embedding`` is ``[reward]``, as SGLang answers for a reward model (verl's reward loop, SGLang
  engine, reads ``data[-1].embedding[-1]``). Texts are tokenized with special tokens, as SGLang
  tokenizes them."""
  if "input" not in body:
    raise RequestError(400, f"the body has no 'input'; send {{\"input\": {VLLM_INPUT}}}")
  rows = [enc.fitted(where, ids) for where, ids in _input_rows(enc, body, special=True)]
  model = _model(body)

  def write(rewards: list[float], meta: Meta) -> Body:
    data = [{"object": "embedding", "embedding": [r], "index": i} for i, r in enumerate(rewards)]
    tokens = sum(map(len, rows))
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model or meta.model, "usage": usage}

  return Scoring(rows, write)


def _rid(rids: Any, i: int, single: bool, meta: Meta) -> str:
  """The request's own ``rid`` for item ``i`` if it sent one, else one made of the request id."""
  if single and isinstance(rids, str):
    return rids
  if not single and isinstance(rids, list) and i < len(rids) and isinstance(rids[i], str):
    return rids[i]
  return meta.request_id if single else f"{meta.request_id}-{i}"


# ------------------------------------------------------------------ slime


def parse_slime_reward(enc: Encoder, body: Body) -> Scoring:
  """slime's ``remote_rm`` (``--rm-type remote_rm --rm-url``): ``{"prompt", "response", "label"}``
  -> the reward as the whole body, a bare number. The prompt is text (slime's, chat template
  applied or not) joined with the response as it is, or a conversation the response answers as
  the assistant. A process model's is the solution's reward (its steps' probabilities aggregated by
  --step_aggregation; null for a response with no step). The label is not read: the model judges
  the response alone."""
  for key in ("prompt", "response"):
    if key not in body:
      raise RequestError(400, f'the body has no \'{key}\'; send slime\'s {{"prompt", "response", "label"}}')
  prompt, response = body["prompt"], body["response"]
  if not isinstance(prompt, str | list):
    raise RequestError(400, f"'prompt' is {json_type(prompt)}; expected a text or a list of messages")
  if not isinstance(response, str):
    raise RequestError(400, f"'response' is {json_type(response)}; expected a string")
  if isinstance(prompt, list) and tasks.scores_of(enc.rm.kind) != "steps":
    response = [{"role": "assistant", "content": response}]
  pair = {"prompts": [prompt], "completions": [response]}
  scoring = (
    parse_score_steps(enc, pair) if tasks.scores_of(enc.rm.kind) == "steps" else parse_jaxrm_score(enc, pair)
  )
  return Scoring(scoring.rows, lambda outputs, meta: scoring.write(outputs, meta)["rewards"][0])


# ------------------------------------------------------------------ process reward models


def parse_score_steps(enc: Encoder, body: Body) -> Scoring:
  """Each solution's step probabilities (class 1 at its step labels, as ``RewardModel.score_steps``)
  and their aggregate."""
  if tasks.scores_of(enc.rm.kind) != "steps":
    raise RequestError(
      400,
      "/score_steps scores the steps of solutions with a process reward model (a token "
      f"head); this server's model has {kinds.describe(enc.rm.config, enc.rm.attributes)}: "
      "POST /score or /get_reward",
    )
  how = body.get("aggregation", enc.config.step_aggregation)
  try:
    step_rewards.check_aggregation(how, flag="aggregation")
  except ValueError as e:
    raise RequestError(400, str(e)) from None
  solutions = enc.solutions(body)
  scored = [s for s in solutions if s is not None]

  def write(outputs: list, meta: Meta) -> Body:
    found = iter([float(p) for p in out[positions]] for out, (_, positions) in zip(outputs, scored))
    steps = [[] if s is None else next(found) for s in solutions]
    return {"step_rewards": steps, "rewards": [step_rewards.solution_reward(p, how) for p in steps]}

  return Scoring([ids for ids, _ in scored], write)


def _sequences_only(
  path: str, parse: Callable[[Encoder, Body], Scoring]
) -> Callable[[Encoder, Body], Scoring]:
  """``parse``, refusing a process reward model (its rewards are per step)."""

  def checked(enc: Encoder, body: Body) -> Scoring:
    if tasks.scores_of(enc.rm.kind) == "steps":
      raise RequestError(
        400,
        f"{path} scores whole sequences, and this server's model is a process reward "
        "model: POST /score_steps (each step's probability) or /score (one reward per "
        "solution), with 'prompts' and 'completions'",
      )
    return parse(enc, body)

  return checked


# ------------------------------------------------------------------ every task's routes


def _one_reward(path: str, parse: Callable[[Encoder, Body], Scoring]) -> Callable[[Encoder, Body], Scoring]:
  """``parse``, refusing a model whose task gives no reward per row (a pairwise judge's compares
  responses), in its task's words (:attr:`jaxrm.tasks.Task.route_instead`)."""

  def checked(enc: Encoder, body: Body) -> Scoring:
    instead = _task_of(enc).route_instead
    if instead is not None:
      raise RequestError(400, f"{path} gives one reward per item, and this server's model is {instead}")
    return parse(enc, body)

  return checked


def _of_task(task: tasks.Task, path: str, route: Route) -> Callable[[Encoder, Body], Scoring]:
  """``route.parse``, refusing a model of another task than ``task``, whose route it is."""

  def checked(enc: Encoder, body: Body) -> Scoring:
    if _task_of(enc) is not task:
      raise RequestError(
        400,
        f"{path} {route.does}; this server's model has "
        f"{kinds.describe(enc.rm.config, enc.rm.attributes)} ({enc.rm.kind}), which scores each "
        "response alone: POST /score with 'prompts' and 'completions'"
        + (" (or /score_steps)" if tasks.scores_of(enc.rm.kind) == "steps" else ""),
      )
    return route.parse(enc, body)

  return checked


def _task_of(enc: Encoder) -> tasks.Task:
  """The served model's task (every served model has one: the server checks it first)."""
  return tasks.named(enc.rm.kind)


# ------------------------------------------------------------------ paths shared by formats


def parse_score(enc: Encoder, body: Body) -> Scoring:
  """jaxrm's score request, or vLLM's: told apart by their fields, which no name shares."""
  vllm = sorted({k for pair in SCORE_PAIRS for k in pair if k in body})
  own = [k for k in JAXRM_SCORE_FIELDS if k in body]
  if vllm and own:
    raise RequestError(
      400,
      f"the body has jaxrm's {own[0]!r} and vLLM's {vllm[0]!r}: send jaxrm's score request "
      "or vLLM's (see /v1/score), not both",
    )
  if vllm:
    return _sequences_only("vLLM's score request", parse_vllm_score)(enc, body)
  return parse_jaxrm_score(enc, body)


def parse_classify(enc: Encoder, body: Body) -> Scoring:
  """vLLM's classification request, or SGLang's: told apart by their input fields."""
  vllm = [k for k in VLLM_INPUTS if k in body]
  sglang = [k for k in SGLANG_INPUTS if k in body]
  if vllm and sglang:
    raise RequestError(400, f"the body has vLLM's {vllm[0]!r} and SGLang's {sglang[0]!r}: send one format")
  if sglang:
    return parse_sglang_classify(enc, body)
  if vllm:
    return parse_vllm_classify(enc, body)
  raise RequestError(
    400,
    f'send vLLM\'s {{"input": {VLLM_INPUT}}} (or "messages") or SGLang\'s {{"text": '
    'a text or a list of texts}} (or "input_ids")',
  )


def _flag(body: Body, name: str, default: bool) -> bool:
  value = body.get(name)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise RequestError(400, f"'{name}' is {json_type(value)}; expected true or false")
  return value


def _is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _token_ids(value: Any) -> bool:
  """Whether ``value`` is one row of token ids: a non-empty list of integers (checked at C speed)."""
  return isinstance(value, list) and bool(value) and set(map(type, value)) == {int}


def _counted(parse: Callable[[Encoder, Body], Scoring]) -> Callable[[Encoder, Body], Scoring]:
  """``parse``, its Scoring counting the rows the encoder cut (the reward's health reports them)."""

  def counted(enc: Encoder, body: Body) -> Scoring:
    scoring = parse(enc, body)
    return dataclasses.replace(scoring, truncated=enc.truncated) if enc.truncated else scoring

  return counted


# The server's own routes, each giving one reward (or a process model's steps) per item.
_ONE_REWARD: dict[str, Callable[[Encoder, Body], Scoring]] = {
  "/get_reward": _sequences_only("/get_reward", parse_get_reward),
  "/score": parse_score,
  "/classify": _sequences_only("/classify", parse_classify),
  "/pooling": _sequences_only("/pooling", parse_vllm_pooling),
  "/v1/score": _sequences_only("/v1/score", parse_vllm_score),
  "/v1/classify": _sequences_only("/v1/classify", parse_vllm_classify),
  "/score_steps": parse_score_steps,
  "/v1/embeddings": _sequences_only("/v1/embeddings", parse_sglang_embeddings),
  "/reward": parse_slime_reward,
}
# The routes the tasks add (Task.routes), after the server's own.
TASK_ROUTES = {path: (task, route) for task in tasks.TASKS.values() for path, route in task.routes.items()}
# Every POST path -> its parser.
ROUTES: dict[str, Callable[[Encoder, Body], Scoring]] = {
  **{path: _counted(_one_reward(path, parse)) for path, parse in _ONE_REWARD.items()},
  **{path: _counted(_of_task(task, path, route)) for path, (task, route) in TASK_ROUTES.items()},
}
# The counters /metrics keeps of the tasks' routes: name -> help.
COUNTERS = {name: what for _, route in TASK_ROUTES.values() for name, what in route.counters.items()}
