"""Pairwise judges: a causal LM asked which of two responses is better (``reward.type=pairwise``).

A judge reads one user turn holding the conversation up to the responses, ``Response A``,
``Response B`` and its question (:meth:`Judge.content`), rendered by the tokenizer's chat template
with the generation prompt (:meth:`Judge.render`). Its score of (A, B) is
``log p(answer_A) - log p(answer_B)`` of the next token: as a verifier's, the LM head's two rows
dotted with the last hidden state (``head="lm"``, the answers' ids in ``verifier_tokens``), so a
judge is scored by the same model code.

A judge's preference moves with position, so everything here reads both orders:

* **training** presents every pair both ways (:meth:`Judge.examples`): a two-row preference
  example whose first row shows the better response as A (label A) and second as B (label B),
  trained with the cross-entropy over the two answers (:func:`judge_loss`); a ranked list gives
  each of its pairs, and an explicit judgment (``response_a``, ``response_b``, ``label`` "A" or
  "B") is read as the pair it ranks (:mod:`jaxrm.data.formats`). Validation reports the accuracy
  in each order, the consistency of the two orders and the position bias (the mean P(A) over both
  orders; 0.5 is none).
* **comparing** (:func:`compare`) averages the orders: ``(s(A, B) - s(B, A)) / 2``, the log-odds
  that A is better, antisymmetric exactly.
* **a group's rewards** (:func:`score_groups`) come from its comparisons (:func:`comparisons`:
  ``round_robin``, ``circular`` or ``reference``), aggregated by Bradley-Terry strengths
  (:func:`bradley_terry`) or win rates (:func:`win_rates`). Every judge text of a group starts
  with the same conversation, and those sharing a response A continue alike: they are scored
  with their common prefix written once (:mod:`jaxrm.scoring.shared_prefix`).

The task owns the rest of its path too, each part reaching the library as a field of
:data:`PAIRWISE`: a loaded judge's verbs (:data:`VERBS`: ``rm.compare``, ``rm.score_group``),
the server's ``POST /compare`` (:data:`ROUTES`), an RL batch's rewards grouped by prompt
(:class:`GroupRewards`), how ``jaxrm.evaluate`` and the benchmarks score and report it
(:data:`EVALUATION`, :data:`BENCHMARKS`), and its reward keys and command-line flags
(:class:`Judge`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrm.data import example_types, tokenize
from jaxrm.data.batches import PreferenceBatch
from jaxrm.data.drops import DropReport, row_error
from jaxrm.data.formats import json_type, parse_text, parse_texts
from jaxrm.data.records import PreferenceRecord, Text
from jaxrm.errors import ConfigError, DataError, EvaluationError
from jaxrm.run.metrics import Moments, Ratio, finalize_metrics
from jaxrm.tasks.asker import Asker
from jaxrm.tasks.base import BenchmarkScoring, ReadingScoring, Task, ones
from jaxrm.tasks.preference import PREFERENCE
from jaxrm.tasks.routes import Body, Meta, RequestError, Route, Scoring, choice, text

NAME = "pairwise"
DEFAULT_QUESTION = (
  "Which response is the better answer to the conversation, A or B? Answer with the letter A or B only."
)
DEFAULT_ANSWERS = ("A", "B")
# The judge's one user turn. Recorded with the judge (an export's jaxrm_verifier.json), so that a
# judge trained on it reads its inputs so whatever later versions of jaxrm default to.
TEMPLATE = (
  "[Conversation]\n{conversation}\n\n[Response A]\n{response_a}\n\n[Response B]\n{response_b}\n\n{question}"
)
_FIELDS = ("conversation", "response_a", "response_b", "question")
ROLES = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}

STRATEGIES = ("round_robin", "circular", "reference")
AGGREGATES = ("bradley_terry", "win_rate")
ORDERS = ("both", "ab")

JUDGE_TOO_LONG = "judge text (conversation + both responses + question) longer than max_length"


@dataclasses.dataclass(frozen=True)
class Judge(Asker):
  """What a pairwise judge asks (``question``), the two answers it weighs (``answers``: A is
  better, B is better) and the layout of its one user turn (``template``, with the fields
  ``{conversation}``, ``{response_a}``, ``{response_b}`` and ``{question}``)."""

  NOUN: ClassVar[str] = "a judge"
  WORD: ClassVar[str] = "judge"
  ROLES: ClassVar[str] = "A is better, then B is better"
  EXAMPLE: ClassVar[tuple[str, str]] = DEFAULT_ANSWERS
  PATH: ClassVar[str] = "jaxrm.tasks.pairwise.Judge"
  LOADED_AS: ClassVar[str] = "a pairwise judge (which of two responses is better)"
  SETTINGS: ClassVar[Mapping[str, tuple[str, str]]] = {
    "judge_question": (
      DEFAULT_QUESTION,
      "pairwise: the question asked after the conversation and the two responses (jaxrm.tasks.pairwise)",
    ),
    "judge_answers": (
      ",".join(DEFAULT_ANSWERS),
      'pairwise: its two answers, "A is better,B is better"; each must be one token of the tokenizer',
    ),
  }
  SWITCH: ClassVar[str] = (
    "Load --model, a causal LM, as a pairwise judge: log p(A) - log p(B) of its answer to "
    "--judge_question after a conversation and two responses (an export or training run of a judge "
    "is one without it). A judge compares responses; it gives no reward of one."
  )
  FLAGS: ClassVar[Mapping[str, tuple[str | None, str]]] = {
    "question": (
      None,
      "With --judge: the question asked after the two responses (default: the judge's own).",
    ),
    "answers": (
      None,
      "With --judge: its two answers, A is better then B is better, comma-separated; each must be "
      "one token (default: A,B).",
    ),
  }
  question: str = DEFAULT_QUESTION
  answers: tuple[str, str] = DEFAULT_ANSWERS
  template: str = TEMPLATE

  def __post_init__(self):
    super().__post_init__()
    if not isinstance(self.template, str) or any("{" + f + "}" not in self.template for f in _FIELDS):
      raise ConfigError(
        f"a judge's template must hold {', '.join('{' + f + '}' for f in _FIELDS)}; got {self.template!r}"
      )

  # ------------------------------------------------------------------ made from

  @classmethod
  def of_spec(cls, spec: Any) -> Judge:
    """The judge of a run's ``reward`` section (``judge_question``, ``judge_answers``); an error
    names the key at fault."""
    try:
      cls(spec.judge_question)
    except ConfigError as e:
      raise ConfigError(f"reward.judge_question={spec.judge_question!r}: {e}") from None
    try:
      return cls(spec.judge_question, spec.judge_answers)
    except ConfigError as e:
      raise ConfigError(f"reward.judge_answers={spec.judge_answers!r}: {e}") from None

  @classmethod
  def from_json(cls, saved: Mapping[str, Any]) -> Judge:
    """The judge a file records (:meth:`to_json`)."""
    return cls(saved["question"], tuple(saved["answers"]), saved.get("template", TEMPLATE))

  def to_json(self) -> dict[str, Any]:
    """What an export's ``jaxrm_verifier.json`` and a run's task record hold of this judge."""
    return {"task": NAME, "question": self.question, "answers": list(self.answers), "template": self.template}

  # ------------------------------------------------------------------ what it reads

  def content(self, prompt: Text, response_a: Text, response_b: Text) -> str:
    """The judge's one user turn: the conversation up to the responses, the two responses and the
    question. A string prompt is the user's turn; a response given as messages is their contents."""
    return self.template.format(
      conversation=conversation_text(prompt),
      response_a=_response_text(response_a),
      response_b=_response_text(response_b),
      question=self.question,
    )

  def check_tokenizer(self, tokenizer: Any) -> tuple[int, int]:
    """What a judge needs of ``tokenizer``, checked before a model is read: a chat template (its
    text is a chat turn) and answers of one token each. Returns the answers' ids."""
    _check_chat_template(tokenizer)
    return self.token_ids(tokenizer)

  def render(self, tokenizer: Any, prompt: Text, response_a: Text, response_b: Text) -> str:
    """The text this judge scores: :meth:`content` as one user turn, rendered by the tokenizer's
    chat template with the generation prompt. Tokenized without added special tokens (the
    template writes them), it gives the ids scored (``rm.judge_text`` returns it)."""
    _check_chat_template(tokenizer)
    turn = [{"role": "user", "content": self.content(prompt, response_a, response_b)}]
    return tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)

  def encode(
    self,
    tokenizer: Any,
    prompt: Text,
    response_a: Text,
    response_b: Text,
    max_length: int,
    source: str,
    *,
    cut: bool = True,
  ) -> tuple[list[int], bool] | None:
    """(the judge text's ids, whether the conversation lost its oldest turns to fit ``max_length``);
    None when it does not fit (with ``cut``: when no cut of the conversation's oldest turns makes it
    fit; a system message and the last turn are kept, as training's truncation='left' keeps them)."""
    ids = self._ids(tokenizer, prompt, response_a, response_b, source)
    if len(ids) <= max_length:
      return ids, False
    if cut and isinstance(prompt, list):
      head, starts = tokenize.turn_starts(prompt)
      for start in starts:
        shorter = self._ids(tokenizer, prompt[:head] + prompt[start:], response_a, response_b, source)
        if len(shorter) <= max_length:
          return shorter, True
    return None

  def _ids(self, tokenizer, prompt, response_a, response_b, source) -> list[int]:
    try:
      text = self.render(tokenizer, prompt, response_a, response_b)
    except ConfigError as e:
      raise row_error(source, "prompt", str(e)) from None
    return tokenize.text_ids(tokenizer, text, special=False)

  def tokenize_options(self, options: tokenize.TokenizeOptions) -> tokenize.TokenizeOptions:
    """``options`` with rows read as this judge reads them (:meth:`examples`)."""
    return dataclasses.replace(options, reads=self)

  def examples(
    self, record: PreferenceRecord, tokenizer: Any, opts: tokenize.TokenizeOptions, drops: DropReport
  ) -> list[tokenize.PreferenceExample]:
    """A preference row as a judge trains on it: one two-row example per pair (a ranked list gives
    each of its pairs), the first row showing the better response as A, the second as B. Pairs
    whose judge text does not fit ``opts.max_length`` are dropped and counted."""
    order = sorted(range(len(record.ranks)), key=lambda i: record.ranks[i])
    out = []
    for i, j in itertools.combinations(order, 2):
      better, worse = record.completions[i], record.completions[j]
      cut = opts.truncation == "left"
      first = self.encode(tokenizer, record.context, better, worse, opts.max_length, record.source, cut=cut)
      second = self.encode(tokenizer, record.context, worse, better, opts.max_length, record.source, cut=cut)
      if first is None or second is None:
        drops.drop(JUDGE_TOO_LONG, record.source)
        continue
      if first[0] == second[0]:
        drops.drop(tokenize.IDENTICAL_COMPLETIONS, record.source)
        continue
      drops.cut += first[1] or second[1]
      out.append(
        tokenize.PreferenceExample(
          input_ids=(np.asarray(first[0], np.int32), np.asarray(second[0], np.int32)),
          ranks=(0, 1),
          margin=0.0,
          source=record.source,
          meta=dict(record.meta),
          strength=record.strength,
        )
      )
    return out


def _check_chat_template(tokenizer: Any) -> None:
  if not getattr(tokenizer, "chat_template", None):
    raise ConfigError(
      "a judge asks its question in a chat turn, and the tokenizer has no chat template; give one "
      "(model.chat_template)"
    )


def conversation_text(prompt: Text) -> str:
  """The conversation as the judge's turn holds it: each turn ``Role: content``, a blank line
  between turns; a string is the user's one turn."""
  if isinstance(prompt, str):
    return f"User: {prompt}" if prompt else ""
  return "\n\n".join(
    f"{ROLES.get(m.get('role', ''), str(m.get('role', '')).title())}: {m.get('content', '')}" for m in prompt
  )


def _response_text(response: Text) -> str:
  return response if isinstance(response, str) else "\n\n".join(str(m.get("content", "")) for m in response)


# ---------------------------------------------------------------------------------------------
# Training and validation


def judge_loss(
  log_odds: jax.Array,  # [G, 2] float: s(better as A), s(better as B); s = log p(A) - log p(B)
  example_mask: jax.Array,  # [G] float32, 0 for filler groups
) -> tuple[jax.Array, dict]:
  """Cross-entropy over the two answers in both orders, ``-(log sigmoid(s_1) + log sigmoid(-s_2)) / 2``
  averaged over pairs.

  Metrics: ``accuracy`` (both orders), ``accuracy_first`` and ``accuracy_second`` (the better
  response shown as A, as B), ``consistency`` (the share of pairs both orders judge alike),
  ``position_bias`` (the mean P(A) over both orders: 0.5 for a judge that position does not move)
  and the log-odds' moments (``reward``). A log-odds of 0 counts as wrong.
  """
  if log_odds.ndim != 2 or log_odds.shape[1] != 2 or example_mask.shape != log_odds.shape[:1]:
    raise ValueError(
      f"a judge's batch is [G, 2] log-odds (both orders of each pair) and a [G] mask; got "
      f"{log_odds.shape} and {example_mask.shape}"
    )
  real = example_mask > 0
  s = jnp.where(real[:, None], log_odds.astype(jnp.float32), 0.0)
  first, second = s[:, 0], s[:, 1]
  nll = -(jax.nn.log_sigmoid(first) + jax.nn.log_sigmoid(-second)) / 2
  count = jnp.sum(real, dtype=jnp.float32)
  right_first, right_second = real & (first > 0), real & (second < 0)
  agree = real & ((first > 0) == (second < 0))
  p_a = jnp.where(real, (jax.nn.sigmoid(first) + jax.nn.sigmoid(second)) / 2, 0.0)
  both = jnp.concatenate([first, second])
  mask2 = jnp.concatenate([real, real])
  metrics = {
    "loss": Ratio(jnp.sum(jnp.where(real, nll, 0.0)), count),
    "accuracy": Ratio(
      jnp.sum(right_first, dtype=jnp.float32) + jnp.sum(right_second, dtype=jnp.float32), 2 * count
    ),
    "accuracy_first": Ratio(jnp.sum(right_first, dtype=jnp.float32), count),
    "accuracy_second": Ratio(jnp.sum(right_second, dtype=jnp.float32), count),
    "consistency": Ratio(jnp.sum(agree, dtype=jnp.float32), count),
    "position_bias": Ratio(jnp.sum(p_a), count),
    "reward": Moments(
      jnp.sum(jnp.where(mask2, both, 0.0)),
      jnp.sum(jnp.where(mask2, both * both, 0.0)),
      2 * count,
      jnp.min(jnp.where(mask2, both, jnp.inf)),
      jnp.max(jnp.where(mask2, both, -jnp.inf)),
    ),
  }
  return jnp.sum(jnp.where(real, nll, 0.0)) / jnp.maximum(count, 1.0), metrics


def _loss(spec, log_odds, batch):
  del spec  # the order of each example's rows says it all
  return judge_loss(log_odds, batch.example_mask)


def _example(spec) -> tuple[np.ndarray, PreferenceBatch]:
  """Log-odds [1, 2] of one pair in both orders."""
  del spec
  ids = np.zeros((2, 1), np.int32)
  batch = PreferenceBatch(
    ids, ids, np.array([[0, 1]], np.int32), np.zeros(1, np.float32), ones(1), strength=ones(1)
  )
  return np.zeros((1, 2), np.float32), batch


# How a judge is used once loaded: each pair judged in both orders.
USES = (
  "rm.compare([prompt], [response_a], [response_b])  # log-odds that A is the better response",
  "rm.score_group(prompt, [response, ...])  # a reward per response, from their comparisons",
)


# ---------------------------------------------------------------------------------------------
# Serving: POST /compare (the server answers it through Task.routes)

COMPARE_BODY = (
  '{"prompt": a text or messages, "responses": [two or more texts or messages], "strategy": '
  '"round_robin" | "circular" | "reference", "aggregate": "bradley_terry" | "win_rate", "reference": '
  "a text (strategy reference only)}"
)
# What an over-long judge text is called in the server's 400.
JUDGE_TEXT = "the judge text (conversation, both responses and the question)"
# Its counters in /metrics.
RANKED = "jaxrm_compared_responses"
JUDGE_TEXTS = "jaxrm_judge_texts"
COUNTERS = {
  RANKED: "Responses ranked by a pairwise judge (/compare).",
  JUDGE_TEXTS: "Judge texts (ordered comparisons) scored for /compare.",
}


def parse_compare(enc: Any, body: Body) -> Scoring:
  """``POST /compare``: a pairwise judge ranks a group of responses to one prompt.

  Body: ``prompt`` (a text, the user's turn, or the conversation's messages), ``responses`` (two or
  more, each a text or the assistant's messages), ``strategy`` (``round_robin``, the default: every
  ordered pair; ``circular``: each response against the next, both orders; ``reference``: each
  against ``reference``, both orders), ``aggregate`` (``bradley_terry``, the default, or
  ``win_rate``) and an optional ``model`` (not read: the server serves one). Answer:
  ``{"rewards": [float per response], "log_odds": [[float | null]]}`` -- the log-odds that row i's
  response is better than column j's (both orders averaged, null where not compared; a reference's
  row and column last), as ``RewardModel.score_groups`` gives them (:class:`GroupScores`).

  Each ordered pair is one judge text, the prompt in each: a group of G responses costs G(G-1)
  texts under round_robin, 2G under circular and reference, counted against max_batch (a group
  over it is refused, 400) and their tokens against max_queued_tokens; they are scored by the
  batcher with every other request's rows, those sharing the prompt with it written once.

  Args:
    enc: the server's request encoder (:class:`jaxrm.server.bodies.Encoder`), the served judge's.
    body: the request's JSON object.
  """
  prompt = _compare_prompt(enc, body)
  strategy = choice(body, "strategy", STRATEGIES)
  aggregate = choice(body, "aggregate", AGGREGATES)
  responses = _compare_responses(enc, body, strategy, aggregate)
  players = responses + _reference(enc, body, strategy)
  pairs = comparisons(len(responses), strategy)
  rows = [
    enc.asked(_pair_name(i, j, len(responses)), JUDGE_TEXT, prompt, players[i], players[j]) for i, j in pairs
  ]
  n, reference = len(players), strategy == "reference"

  def write(outputs: list[float], meta: Meta) -> Body:
    return group_scores(n, pairs, outputs, aggregate, reference=reference).to_json()

  return Scoring(rows, write, reward_rows=False, counts={RANKED: len(responses), JUDGE_TEXTS: len(rows)})


def _pair_name(i: int, j: int, n: int) -> str:
  """How an error names the judge text of (i, j); index ``n`` is the reference."""
  name = lambda k: "reference" if k == n else f"responses[{k}]"  # noqa: E731
  return f"{name(i)} as A, {name(j)} as B"


def _compare_prompt(enc: Any, body: Body):
  if "prompt" not in body:
    raise RequestError(400, f"the body has no 'prompt'; send {COMPARE_BODY}")
  prompt = body["prompt"]
  if isinstance(prompt, str):
    return prompt
  if isinstance(prompt, list):
    return enc.messages(prompt, "prompt")
  raise RequestError(400, f"'prompt' is {json_type(prompt)}; expected a text or a list of messages")


def _compare_responses(enc: Any, body: Body, strategy: str, aggregate: str) -> list:
  """The responses, checked: as many as ``strategy`` needs, and no more judge texts than max_batch."""
  if "responses" not in body:
    raise RequestError(400, f"the body has no 'responses'; send {COMPARE_BODY}")
  value = body["responses"]
  if not isinstance(value, list):
    raise RequestError(400, f"'responses' is {json_type(value)}; expected a list of texts or message lists")
  try:
    check_strategy(strategy, len(value), aggregate)
  except ValueError as e:
    raise RequestError(400, f"'responses': {e}") from None
  _check_texts(enc, strategy, len(value))
  return [text(enc, r, f"responses[{i}]") for i, r in enumerate(value)]


def _reference(enc: Any, body: Body, strategy: str) -> list:
  """``[reference]`` under strategy reference (which needs one), else ``[]`` (which takes none)."""
  given = body.get("reference") is not None
  if strategy != "reference":
    if given:
      raise RequestError(
        400,
        f'\'reference\' is compared with only under "strategy": "reference"; this body asks for {strategy!r}',
      )
    return []
  if not given:
    raise RequestError(
      400, "strategy 'reference' compares each response with 'reference', and the body has none: send it"
    )
  return [text(enc, body["reference"], "reference")]


def judge_texts(strategy: str, n: int) -> int:
  """How many judge texts a group of ``n`` responses costs (:func:`comparisons`)."""
  if strategy == "round_robin" or (strategy == "circular" and n <= 2):
    return n * (n - 1)
  return 2 * n


def _check_texts(enc: Any, strategy: str, n: int) -> None:
  """Refuses a group whose judge texts are more than max_batch, the items one request may score."""
  texts, limit = judge_texts(strategy, n), enc.config.max_batch
  if texts <= limit:
    return
  most = max(m for m in range(1, limit + 2) if m == 1 or judge_texts(strategy, m) <= limit)
  raise RequestError(
    400,
    f"'responses' has {n} responses, which strategy {strategy!r} compares in {texts} judge texts; "
    f"this server scores at most {limit} per request (--max_batch): send at most {most} responses"
    + ("" if strategy != "round_robin" else ", or strategy 'circular' (2 judge texts per response)"),
  )


ROUTES = {"/compare": Route(parse_compare, does="ranks responses with a pairwise judge", counters=COUNTERS)}


# ---------------------------------------------------------------------------------------------
# Evaluation and benchmarks: how jaxrm.evaluate and the benchmarks score and report a judge


class JudgeArrays(NamedTuple):
  log_odds: np.ndarray  # [N, 2] float32: s(better as A, worse as B), s(worse as A, better as B)


def judge_arrays(outputs: Callable[[int], np.ndarray], examples: list) -> tuple[JudgeArrays, dict[str, Any]]:
  """A judge's log-odds that A is better (``log p(A) - log p(B)``) of each pair in both orders
  (:meth:`Judge.examples` lays the better response out as A, then as B), from ``outputs(1)`` (float32
  [rows, 1], every eval row's); scores ``better_as_a`` and ``better_as_b`` [N]: each order's."""
  log_odds = outputs(1).reshape(-1, 2)[: len(examples)]
  return JudgeArrays(log_odds), {"better_as_a": log_odds[:, 0], "better_as_b": log_odds[:, 1]}


# Jitted: one compile per evaluation instead of one per operation, whatever the number of subsets.
_judge_sums = jax.jit(lambda *args: judge_loss(*args)[1])


def judge_metrics(a: JudgeArrays, mask: np.ndarray) -> dict[str, float]:
  """A judge's validation metrics over the pairs where ``mask`` [N] is 1: accuracy in each order and
  in both, consistency, position bias, loss and the log-odds' moments (:func:`judge_loss`)."""
  return finalize_metrics(_judge_sums(a.log_odds, mask))


def _judge_lines(result: dict[str, Any]) -> list[str]:
  m = result["metrics"]
  return [
    f"accuracy           {m['accuracy']:.4f}  (both orders; better shown as A {m['accuracy_first']:.4f}, "
    f"as B {m['accuracy_second']:.4f})",
    f"consistency        {m['consistency']:.4f}  (pairs both orders judge alike)",
    f"position bias      {m['position_bias']:.4f}  (mean P(A) over both orders; 0.5: none)",
    f"loss               {m['loss']:.4f}",
    f"log-odds           {m['reward_mean']:.4f} ± {m['reward_std']:.4f}",
  ]


def _judge_histograms(result: dict[str, Any]) -> tuple[list[tuple[str, np.ndarray]], str, str]:
  s = result["scores"]
  return (
    [("better response shown as A", s["better_as_a"]), ("better response shown as B", s["better_as_b"])],
    "log p(A) - log p(B)",
    "A judge's log-odds that A is better, in each order",
  )


EVALUATION = ReadingScoring(
  use="a pairwise judge's pairs",
  score=judge_arrays,
  metrics=judge_metrics,
  lines=_judge_lines,
  columns=lambda result: ("accuracy", "accuracy_first", "accuracy_second", "consistency", "position_bias"),
  histograms=_judge_histograms,
)


def _refusing_long(fn: Callable, *args, **kwargs) -> Any:
  """``fn(*args, **kwargs)``, a judge text longer than max_length an EvaluationError naming it (cut,
  it would lose a response)."""
  try:
    return fn(*args, **kwargs)
  except DataError as e:
    raise EvaluationError(f"{e}: raise --max_length (default the model's context for a judge)") from None


def benchmark_pairs(
  rm: Any, prompts: Sequence[Text], a: Sequence[Text], b: Sequence[Text], batch_size: int, max_length: int
) -> np.ndarray:
  """A benchmark's pairs: the log-odds that A is better, each pair in the order given (:func:`compare`)."""
  return _refusing_long(compare, rm, prompts, a, b, orders="ab", batch_size=batch_size, max_length=max_length)


def benchmark_groups(
  rm: Any, prompts: Sequence[Text], groups: Sequence[Sequence[Text]], batch_size: int, max_length: int
) -> list[np.ndarray]:
  """A benchmark's groups: each one's Bradley-Terry strengths from its round robin (:func:`score_groups`)."""
  scored = _refusing_long(score_groups, rm, prompts, groups, batch_size=batch_size, max_length=max_length)
  return [g.rewards for g in scored]


def order_figures(s_ab: np.ndarray, s_ba: np.ndarray) -> dict[str, float]:
  """A judge's figures over pairs asked in both orders, the better response shown as A (``s_ab``
  [N], its log-odds) and as B (``s_ba``): accuracy in each order, consistency and position bias,
  as its validation reports them (:func:`judge_loss`)."""
  log_odds = jnp.stack([jnp.asarray(s_ab, jnp.float32), jnp.asarray(s_ba, jnp.float32)], axis=1)
  metrics = finalize_metrics(judge_loss(log_odds, jnp.ones(len(s_ab), jnp.float32))[1])
  return {k: metrics[k] for k in ("accuracy_first", "accuracy_second", "consistency", "position_bias")}


def order_line(figures: dict[str, float], decides: str) -> str:
  """:func:`order_figures` as a report's line; ``decides``: what the benchmark counts as right."""
  return (
    f"a pairwise judge, each pair asked in both orders ({decides}): accuracy with "
    f"the better response shown as A {100 * figures['accuracy_first']:.1f}, as B "
    f"{100 * figures['accuracy_second']:.1f}; consistency {100 * figures['consistency']:.1f}; "
    f"position bias (mean P(A), 50: none) {100 * figures['position_bias']:.1f}"
  )


BENCHMARKS = BenchmarkScoring(
  pairs=benchmark_pairs,
  groups=benchmark_groups,
  figures=order_figures,
  line=order_line,
  groups_note="a pairwise judge's path: each completion's reward is its Bradley-Terry strength from a "
  "round robin of the judge over the prompt's completions (every ordered pair asked)",
)


# ---------------------------------------------------------------------------------------------
# RL rewards: a batch's completions grouped by prompt, each group's rewards from its comparisons


class Groups:
  """A batch's completions grouped for a pairwise judge: by equal prompt (and, under
  ``strategy="reference"``, equal reference: ``references[i]`` of row i), each group's row indices
  in batch order (:attr:`rows`). A row alone with its prompt (without a reference) is in no group:
  compared with nothing, it gets :attr:`default`, the reward of a group's average completion."""

  def __init__(
    self,
    prompts: Sequence[Text],
    completions: Sequence[Text],
    strategy: str,
    aggregate: str,
    references: Sequence[Text] | None = None,
  ):
    if len(prompts) != len(completions):
      raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    reference = strategy == "reference"
    if reference and references is None:
      raise ValueError(
        f"strategy='reference' compares each completion with its row's {REFERENCE_COLUMN!r} column "
        f"(a reference response), and the batch has none: add that column to the dataset"
      )
    if references is not None and len(references) != len(prompts):
      raise ValueError(f"{len(references)} references for {len(prompts)} completions")
    by_key: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
      key = _text_key([prompt, references[i]] if reference else prompt)
      by_key.setdefault(key, []).append(i)
    self.rows = [rows for rows in by_key.values() if reference or len(rows) > 1]
    self.prompts = [prompts[rows[0]] for rows in self.rows]
    self.groups = [[completions[i] for i in rows] for rows in self.rows]
    self.references = [references[rows[0]] for rows in self.rows] if reference else None
    self.default = 0.5 if aggregate == "win_rate" else 0.0  # the mean of a group's rewards
    self.size = len(prompts)

  def rewards(self, group_rewards: Sequence[Sequence[float]]) -> list[float]:
    """One reward per row of the batch, from each group's rewards (in :attr:`rows` order)."""
    out = [self.default] * self.size
    for rows, rewards in zip(self.rows, group_rewards):
      for i, r in zip(rows, rewards):
        out[i] = float(r)
    return out


def _text_key(text: Text) -> str:
  """``text`` (a string or a message list) as a key: equal texts, equal keys."""
  return json.dumps(text, sort_keys=True, ensure_ascii=False, default=repr)


REFERENCE_COLUMN = "reference"  # under strategy="reference": the batch's column each completion meets


class GroupRewards:
  """A judge's rewards in an RL loop (:attr:`Task.group_rewards`): the batch's completions grouped
  by equal prompt (:class:`Groups`), each group's rewards its comparisons aggregated, scored by the
  model in one pass (:meth:`local`) or by a server, one ``/compare`` request per group
  (:meth:`remote`)."""

  # The reward functions' options that ask for a judge's rewards, and their defaults.
  OPTIONS: ClassVar[Mapping[str, str]] = {"strategy": "round_robin", "aggregate": "bradley_terry"}
  FOR: ClassVar[str] = "a pairwise judge (its comparisons of a prompt's completions)"
  OWNER: ClassVar[str] = "a judge"  # whose options they are, in messages
  ROUTE: ClassVar[str] = "/compare"  # the server's route, one request per group
  COLUMN: ClassVar[str] = REFERENCE_COLUMN  # the batch's column a completion may be compared with

  def settings(self, given: Mapping[str, Any], others: Mapping[str, Any] | None = None) -> dict[str, str]:
    """``given`` (values of :attr:`OPTIONS`, None where left out) with the defaults, checked; an
    error naming any of ``others`` (the reward function's other options) that is given."""
    wrong = [k for k, v in (others or {}).items() if v not in (None, False)]
    if wrong:
      raise ValueError(
        f"{', '.join(f'{k}=' for k in wrong)}: a pairwise judge's rewards are its comparisons of each "
        "prompt's completions (strategy=, aggregate=): leave it out"
      )
    out = {k: given.get(k) or default for k, default in self.OPTIONS.items()}
    check_strategy(out["strategy"], 2, out["aggregate"])
    return out

  def against_reference(self, given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` asking that each completion be compared with its row's :attr:`COLUMN` (an RL
    loop's reference answer)."""
    return {**given, "strategy": "reference"}

  def local(
    self,
    rm: Any,
    prompts: Sequence[Text],
    completions: Sequence[Text],
    columns: Mapping[str, Any],
    settings: Mapping[str, str],
    batch_size: int,
  ) -> list[float]:
    """One reward per completion, from ``rm.score_groups`` (every group in one pass); a completion
    alone with its prompt gets a group's average reward. ``columns``: the batch's other columns."""
    groups = self._groups(prompts, completions, columns, settings)
    scored = rm.score_groups(
      groups.prompts, groups.groups, references=groups.references, batch_size=batch_size, **settings
    )
    return groups.rewards([g.rewards for g in scored])

  def remote(
    self,
    post: Callable[[dict], list],
    prompts: Sequence[Text],
    completions: Sequence[Text],
    columns: Mapping[str, Any],
    settings: Mapping[str, str],
  ) -> list[float]:
    """One reward per completion from a judge's server: ``post(body)`` (to :attr:`ROUTE`) once per
    group, answering the group's rewards."""
    groups = self._groups(prompts, completions, columns, settings)
    scored = []
    for g, (prompt, responses) in enumerate(zip(groups.prompts, groups.groups)):
      body = {"prompt": prompt, "responses": responses, **settings}
      if groups.references is not None:
        body["reference"] = groups.references[g]
      scored.append(post(body))
    return groups.rewards(scored)

  def _groups(self, prompts, completions, columns, settings) -> Groups:
    references = columns.get(self.COLUMN)
    return Groups(prompts, completions, settings["strategy"], settings["aggregate"], references)


GROUP_REWARDS = GroupRewards()


# ---------------------------------------------------------------------------------------------
# What a loaded judge does: RewardModel's verbs of this task (Task.verbs)


class JudgeVerbs:
  """What a loaded pairwise judge does beyond what every :class:`jaxrm.RewardModel` does:
  ``rm.judge``, ``rm.judge_text`` and ``rm.score_group``; ``rm.compare`` and ``rm.score_groups``
  are this module's :func:`compare` and :func:`score_groups` (:data:`VERBS`).

  Never instantiated: each is a function of the model (``rm``, first), which the model finds on its
  task (:attr:`jaxrm.tasks.Task.verbs`) and binds to itself, as a method (``judge`` as a property).
  Called on a model of another task, each refuses it saying what it needs (``rm.check_kind``).
  """

  @property
  def judge(rm) -> Judge | None:
    """A pairwise judge's question, answers and template (:class:`Judge`); None for any other model."""
    asker = rm.verifier
    return asker if isinstance(asker, Judge) else None

  def judge_text(rm, prompt: Text, response_a: Text, response_b: Text) -> str:
    """The text a pairwise judge scores for ``response_a`` (shown as A) against ``response_b``
    after ``prompt`` (:meth:`Judge.render`): tokenized without added special tokens, the ids whose
    next-token log-odds ``log p(A) - log p(B)`` is ``compare(..., orders="ab")`` (before any cut of
    the conversation's oldest turns to fit ``max_length``).

    Args:
      rm: the judge (a :class:`jaxrm.RewardModel`).
      prompt: the conversation up to the responses (a message list), or a string (a user's turn).
      response_a: the response shown as A, a string or assistant messages.
      response_b: the response shown as B, alike.
    """
    judge = _judge_of(rm, "judge_text()")
    return judge.render(
      rm._tokenizer(),  # the model's own refusal of a missing tokenizer: this is one of its methods
      parse_text(prompt, "judge_text", "prompt"),
      parse_text(response_a, "judge_text", "response_a"),
      parse_text(response_b, "judge_text", "response_b"),
    )

  def score_group(
    rm,
    prompt: Text,
    responses: Sequence[Text],
    *,
    strategy: str = "round_robin",
    aggregate: str = "bradley_terry",
    reference: Text | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    share_prefix: Any = True,
  ) -> np.ndarray:
    """float32 [n]: one reward per response to ``prompt``, from a pairwise judge's comparisons of
    them (``rm.score_groups`` of one group; its ``rewards``).

    Args:
      rm: the judge (a :class:`jaxrm.RewardModel`).
      prompt: the conversation up to the responses, or a string (a user's turn).
      responses: the responses compared, strings or assistant messages.
      strategy: as ``rm.score_groups`` takes it.
      aggregate: as ``rm.score_groups`` takes it.
      reference: the response every one is compared with, under ``strategy="reference"`` only.
      batch_size: as ``rm.compare`` takes it.
      max_length: as ``rm.compare`` takes it.
      share_prefix: as ``rm.compare`` takes it.
    """
    _judge_of(rm, "score_group()")
    return rm.score_groups(
      [parse_text(prompt, "score_group", "prompt")],
      [parse_texts(responses, "responses", "score_group")],
      strategy=strategy,
      aggregate=aggregate,
      references=None if reference is None else [reference],
      batch_size=batch_size,
      max_length=max_length,
      share_prefix=share_prefix,
    )[0].rewards


# ---------------------------------------------------------------------------------------------
# Comparisons and group rewards


def comparisons(n: int, strategy: str) -> list[tuple[int, int]]:
  """The ordered pairs (A, B) a group of ``n`` responses is judged on, each unordered pair in both
  orders: ``round_robin`` every pair, ``circular`` each response against the next (the last
  against the first), ``reference`` each response against the reference (index ``n``)."""
  check_strategy(strategy, n)
  if strategy == "reference":
    unordered = [(i, n) for i in range(n)]
  elif strategy == "circular" and n > 2:
    unordered = [(i, (i + 1) % n) for i in range(n)]
  else:
    unordered = list(itertools.combinations(range(n), 2))
  return [p for i, j in unordered for p in ((i, j), (j, i))]


def check_strategy(strategy: str, n: int, aggregate: str = "bradley_terry") -> None:
  """Refuses an unknown strategy or aggregate, and a group too small for its strategy."""
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
  if aggregate not in AGGREGATES:
    raise ValueError(f"aggregate must be one of {', '.join(AGGREGATES)}; got {aggregate!r}")
  least = 1 if strategy == "reference" else 2
  if n < least:
    raise ValueError(
      f"a group of {n} response{'s' if n != 1 else ''}: strategy={strategy!r} compares "
      f"{'each response with the reference' if least == 1 else 'responses with each other'}, so it "
      f"needs at least {least}"
    )


def bradley_terry(log_odds: np.ndarray, *, tol: float = 1e-10, max_iter: int = 100) -> np.ndarray:
  """The Bradley-Terry strengths float64 [n] of ``log_odds`` [n, n] (``log_odds[i, j]`` the
  log-odds that i beats j, antisymmetric; NaN where i and j were not compared), centred to mean 0.

  The maximum-likelihood strengths, no prior, with the pairwise probabilities ``sigmoid(d)`` taken
  as soft labels over every compared pair: they maximise
  ``sum_{i<j compared} p_ij log sigmoid(t_i - t_j) + (1 - p_ij) log sigmoid(t_j - t_i)``.
  The solver is Newton's method on this concave function (its Hessian a weighted graph
  Laplacian; the mean fixed at 0), halving a step until the likelihood does not fall; it stops
  when the largest entry of a Newton step is below ``tol`` or after ``max_iter`` steps. Soft labels are
  never exactly 0 or 1 here (``p_ij - sigmoid(x)`` is computed from the nearer side), so the
  strengths are finite for any finite log-odds; two responses get exactly ``t_i - t_j = d_ij``.

  Raises:
    ValueError: a log-odds that is not finite, a matrix that is not antisymmetric, or responses
      split into groups never compared with each other (their relative strength is undefined).
  """
  d = np.asarray(log_odds, np.float64)
  n = d.shape[0]
  if d.shape != (n, n):
    raise ValueError(f"log_odds must be square [n, n]; got {d.shape}")
  compared = ~np.isnan(d)
  np.fill_diagonal(compared, False)
  if not np.all(np.isfinite(d[compared])):
    raise ValueError("log_odds holds an infinite value: a judge's log-odds are finite")
  if not np.array_equal(compared, compared.T) or not np.allclose(
    d[compared], -d.T[compared], atol=0, rtol=1e-12
  ):
    raise ValueError("log_odds must be antisymmetric: log_odds[i, j] == -log_odds[j, i]")
  if n == 1:
    return np.zeros(1)
  if not _connected(compared):
    raise ValueError("some responses were never compared, directly or through others: strengths undefined")
  dc = np.where(compared, d, 0.0)
  # Started from the least-squares strengths (t_i - t_j as near d_ij as can be): exact where the
  # comparisons form no cycle, and a start Newton's method converges from in a few steps, where
  # from 0 it crawls about one unit a step towards large log-odds.
  laplacian = np.diag(compared.sum(1)) - compared
  t = np.append(np.linalg.solve(laplacian[:-1, :-1], dc.sum(1)[:-1]), 0.0)
  value = _bt_likelihood(t, dc, compared)
  for _ in range(max_iter):
    x = t[:, None] - t[None, :]
    grad = np.where(compared, _label_minus_sigmoid(dc, x), 0.0).sum(1)
    w = np.where(compared, _sigmoid(x) * _sigmoid(-x), 0.0)
    hess = np.diag(w.sum(1)) - w  # the negative Hessian: a Laplacian, singular along ones
    # The last strength held fixed: the Laplacian's minor of a connected graph is positive
    # definite at any scale (its entries are ~1e-17 near probabilities of 0 or 1, where a solver
    # that cuts small singular values would take no step at all).
    step = np.append(np.linalg.solve(hess[:-1, :-1], grad[:-1]), 0.0)
    step -= step.mean()
    # The Newton step, not the gradient: near probabilities of 0 or 1 the gradient is tiny long
    # before the strengths are found (it scales with sigmoid(-|d|)), the step does not.
    if np.max(np.abs(step)) < tol:
      break
    scale = 1.0
    while scale > 1e-12:
      candidate = t + scale * step
      new = _bt_likelihood(candidate, dc, compared)
      if new >= value:
        break
      scale /= 2
    else:
      break
    t, value = candidate, new
  return t - t.mean()


def _sigmoid(x: np.ndarray) -> np.ndarray:
  return np.exp(-np.logaddexp(0.0, -x))


def _label_minus_sigmoid(d: np.ndarray, x: np.ndarray) -> np.ndarray:
  """``sigmoid(d) - sigmoid(x)``, from the side where both are far from 1 (no cancellation)."""
  return np.where(d > 0, _sigmoid(-x) - _sigmoid(-d), _sigmoid(d) - _sigmoid(x))


def _bt_likelihood(t: np.ndarray, d: np.ndarray, compared: np.ndarray) -> float:
  x = t[:, None] - t[None, :]
  # each unordered pair appears twice (i, j) and (j, i): p_ij log s(x_ij) on both halves sums it once
  terms = _sigmoid(d) * -np.logaddexp(0.0, -x)
  return float(np.sum(np.where(compared, terms, 0.0)))


def _connected(compared: np.ndarray) -> bool:
  seen, todo = {0}, [0]
  while todo:
    for j in np.flatnonzero(compared[todo.pop()]):
      if int(j) not in seen:
        seen.add(int(j))
        todo.append(int(j))
  return len(seen) == compared.shape[0]


def win_rates(log_odds: np.ndarray) -> np.ndarray:
  """float64 [n]: each response's mean probability of winning its comparisons (``sigmoid`` of
  ``log_odds[i, j]`` over the j it was compared with; NaN entries were not compared)."""
  d = np.asarray(log_odds, np.float64)
  compared = ~np.isnan(d)
  np.fill_diagonal(compared, False)
  p = np.where(compared, _sigmoid(np.where(compared, d, 0.0)), 0.0)
  return p.sum(1) / np.maximum(compared.sum(1), 1)


def aggregate_rewards(log_odds: np.ndarray, aggregate: str, *, reference: bool = False) -> np.ndarray:
  """One reward float32 per response of ``log_odds`` [n, n] (:func:`bradley_terry` or
  :func:`win_rates`). With ``reference`` the last row is the reference: strengths are measured
  from it (the reference at 0), and it gets no reward of its own."""
  if aggregate == "win_rate":
    out = win_rates(log_odds)
  elif aggregate == "bradley_terry":
    out = bradley_terry(log_odds)
    if reference:
      out = out - out[-1]
  else:
    raise ValueError(f"aggregate must be one of {', '.join(AGGREGATES)}; got {aggregate!r}")
  return (out[:-1] if reference else out).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class GroupScores:
  """What a group's comparisons give: one reward per response, and the log-odds [n, n] each pair
  was judged with (both orders averaged; NaN where not compared; with a reference, its row and
  column last)."""

  rewards: np.ndarray  # float32 [n]
  log_odds: np.ndarray  # float32 [n, n] or [n + 1, n + 1]

  def to_json(self) -> dict[str, Any]:
    return {
      "rewards": [float(r) for r in self.rewards],
      "log_odds": [[None if math.isnan(x) else float(x) for x in row] for row in self.log_odds],
    }


def _judge_of(rm: Any, use: str) -> Judge:
  """``rm``'s judge; a clear error for a model that is none."""
  rm.check_kind(NAME, use=use)
  judge = getattr(rm, "verifier", None)
  if not isinstance(judge, Judge):
    raise ValueError(f"{use} needs a pairwise judge's question and answers; this model has none")
  return judge


def _tokenizer(rm: Any) -> Any:
  if rm.tokenizer is None:
    raise ValueError("a judge needs its tokenizer to lay out its texts; pass tokenizer= to from_pretrained")
  return rm.tokenizer


def _limit(rm: Any, max_length: int | None) -> int:
  return max_length or rm.config.max_position_embeddings


def _encoded(
  rm: Any, judge: Judge, prompt: Text, a: Text, b: Text, limit: int, where: str, drops: DropReport
) -> list[int]:
  out = judge.encode(_tokenizer(rm), prompt, a, b, limit, where)
  if out is None:
    raise DataError(
      f"{where}: the judge text is longer than max_length={limit} tokens even with every earlier turn cut"
    )
  drops.cut += out[1]
  return out[0]


def compare(
  rm: Any,
  prompts: Sequence[Text],
  responses_a: Sequence[Text],
  responses_b: Sequence[Text],
  *,
  orders: str = "both",
  batch_size: int = 8,
  max_length: int | None = None,
  share_prefix: Any = True,
) -> np.ndarray:
  """float32 [N]: a pairwise judge's log-odds that ``responses_a[i]`` is better than
  ``responses_b[i]`` after ``prompts[i]``.

  Args:
    rm: the judge (a :class:`jaxrm.RewardModel`).
    prompts: conversations up to the responses (message lists), or strings (a user's turn).
    responses_a: the responses shown as A, strings or assistant messages.
    responses_b: the responses shown as B, alike.
    orders: ``"both"`` averages the two orders, ``(s(A, B) - s(B, A)) / 2``, so that swapping
      the responses negates the result exactly; ``"ab"`` gives ``s(A, B)`` alone.
    batch_size: rows per forward pass, as ``rm.score`` takes it.
    max_length: the longest judge text in tokens (default: the model's context); a conversation
      too long for it loses its oldest turns.
    share_prefix: as ``rm.score`` takes it (True, a :class:`jaxrm.scoring.shared_prefix.Sharing`, or
      False): judge texts sharing a prefix are scored together.
  """
  judge = _judge_of(rm, "compare()")
  prompts = parse_texts(prompts, "prompts", "compare")
  responses_a = parse_texts(responses_a, "responses_a", "compare")
  responses_b = parse_texts(responses_b, "responses_b", "compare")
  if orders not in ORDERS:
    raise ValueError(f"orders must be one of {', '.join(ORDERS)}; got {orders!r}")
  if not (len(prompts) == len(responses_a) == len(responses_b)):
    raise ValueError(
      f"compare() takes as many prompts as responses_a and responses_b; got {len(prompts)}, "
      f"{len(responses_a)} and {len(responses_b)}"
    )
  limit, drops = _limit(rm, max_length), DropReport()
  rows: list[list[int]] = []
  where: list[tuple[int, int]] = []  # per item: rows of (A, B) and (B, A)
  for i, (p, a, b) in enumerate(zip(prompts, responses_a, responses_b)):
    ab = _encoded(rm, judge, p, a, b, limit, f"compare item {i}", drops)
    if orders == "ab":
      where.append((len(rows), -1))
      rows.append(ab)
      continue
    ba = _encoded(rm, judge, p, b, a, limit, f"compare item {i}", drops)
    # The two rows in one order whichever is A, so that compare(b, a) scores what compare(a, b)
    # scores, alike: its log-odds are then the exact negation.
    first, second = (ab, ba) if ab <= ba else (ba, ab)
    where.append((len(rows) + (ab is second), len(rows) + (ab is first)))
    rows += [first, second]
  s = rm.score_ids(rows, batch_size=batch_size, max_length=limit, share_prefix=share_prefix).astype(
    np.float32
  )
  if orders == "ab":
    return np.asarray([s[i] for i, _ in where], np.float32)
  return np.asarray([(s[i] - s[j]) / np.float32(2) for i, j in where], np.float32)


def score_groups(
  rm: Any,
  prompts: Sequence[Text],
  groups: Sequence[Sequence[Text]],
  *,
  strategy: str = "round_robin",
  aggregate: str = "bradley_terry",
  references: Sequence[Text] | None = None,
  batch_size: int = 8,
  max_length: int | None = None,
  share_prefix: Any = True,
) -> list[GroupScores]:
  """Each group's rewards and the log-odds of its compared pairs, from a pairwise judge's
  comparisons (:func:`comparisons`, :func:`aggregate_rewards`): every group's judge texts are
  scored in one pass, those sharing a prefix (the conversation; the conversation and response A)
  with it written once.

  Args:
    rm: the judge (a :class:`jaxrm.RewardModel`).
    prompts: one per group.
    groups: ``groups[g]``, the responses to ``prompts[g]``.
    strategy: the pairs compared: ``"round_robin"`` (every pair, both orders), ``"circular"``
      (each response with the next, both orders) or ``"reference"`` (each with
      ``references[g]``).
    aggregate: ``"bradley_terry"`` (the maximum-likelihood strengths, centred; measured from the
      reference under ``"reference"``) or ``"win_rate"`` (the mean probability of winning).
    references: one response per group, under ``strategy="reference"`` only.
    batch_size: as ``rm.compare`` takes it.
    max_length: as ``rm.compare`` takes it.
    share_prefix: as ``rm.compare`` takes it.
  """
  judge = _judge_of(rm, "score_groups()")
  prompts = parse_texts(prompts, "prompts", "score_groups")
  if isinstance(groups, str) or not isinstance(groups, (list, tuple)):
    raise DataError(
      f"score_groups: groups is {json_type(groups)}; expected a list of groups (lists of responses)"
    )
  groups = [parse_texts(g, f"groups[{i}]", "score_groups") for i, g in enumerate(groups)]
  if references is not None:
    references = parse_texts(references, "references", "score_groups")
  if len(prompts) != len(groups):
    raise ValueError(
      f"score_group takes one prompt per group; got {len(prompts)} prompts and {len(groups)} groups"
    )
  if (strategy == "reference") != (references is not None):
    raise ValueError(
      "strategy='reference' needs reference= (the response every one is compared with)"
      if strategy == "reference"
      else f"reference= is compared with only under strategy='reference', not {strategy!r}"
    )
  if references is not None and len(references) != len(groups):
    raise ValueError(f"one reference per group: got {len(references)} for {len(groups)} groups")
  limit, drops = _limit(rm, max_length), DropReport()
  rows: list[list[int]] = []
  index: dict[tuple[int, ...], int] = {}
  plans = []
  for g, (prompt, responses) in enumerate(zip(prompts, groups)):
    check_strategy(strategy, len(responses), aggregate)
    players = list(responses) + ([references[g]] if references is not None else [])
    slots = []
    for i, j in comparisons(len(responses), strategy):
      ids = _encoded(
        rm, judge, prompt, players[i], players[j], limit, f"group {g}, responses {i} and {j}", drops
      )
      key = tuple(ids)
      if key not in index:  # identical responses, or a pair met twice in a small circle
        index[key] = len(rows)
        rows.append(ids)
      slots.append((i, j, index[key]))
    plans.append((len(players), slots))
  s = rm.score_ids(rows, batch_size=batch_size, max_length=limit, share_prefix=share_prefix).astype(
    np.float32
  )
  reference = references is not None
  return [
    group_scores(n, [(i, j) for i, j, _ in slots], [s[r] for *_, r in slots], aggregate, reference=reference)
    for n, slots in plans
  ]


def group_scores(
  n: int, pairs: Sequence[tuple[int, int]], scores: Sequence[float], aggregate: str, *, reference: bool
) -> GroupScores:
  """A group's :class:`GroupScores` from the judge's score ``scores[k]`` of each ordered pair
  ``pairs[k]`` (A, B) of its ``n`` players (with ``reference``, the last is the reference): each
  pair's log-odds its two orders' mean, then the rewards aggregated."""
  raw = np.full((n, n), np.nan, np.float32)
  for (i, j), score in zip(pairs, scores):
    raw[i, j] = score
  log_odds = ((raw - raw.T) / np.float32(2)).astype(np.float32)
  return GroupScores(aggregate_rewards(log_odds, aggregate, reference=reference), log_odds)


# The model's verbs: JudgeVerbs' and the two functions above that take the model first.
VERBS = {
  **{name: verb for name, verb in vars(JudgeVerbs).items() if not name.startswith("_")},
  "compare": compare,
  "score_groups": score_groups,
}


PAIRWISE = Task(
  name=NAME,
  reward_types=(NAME,),
  data="preference",
  dataset="PreferenceDataset",
  example_types=(example_types.PREFERENCE,),
  evaluation="pairwise",
  evaluation_scoring=EVALUATION,  # its pairs' log-odds in both orders, their metrics and report
  benchmark_scoring=BENCHMARKS,  # pairs asked in both orders, groups ranked by their round robin
  # An example is a pair in both orders, two rows of one group: the preference layouts hold it,
  # and shared-prompt packing writes the judge's opening and conversation once for both.
  batches=PREFERENCE.batches,
  packing_refused="",
  head="lm",
  scores="comparisons",
  num_labels=1,
  losses={(NAME, None): _loss},
  samples=None,
  example=_example,
  needs="a pairwise judge (a causal LM answering which of two responses is better)",
  train="train one with reward.type=pairwise, or load a causal LM with "
  "RewardModel.from_pretrained(path, judge=True)",
  use_instead="a pairwise judge compares responses: rm.compare or rm.score_group, POST /compare, or "
  "jaxrm.evaluate on preference pairs",
  asker=Judge,
  routes=ROUTES,  # POST /compare
  route_instead=f"a pairwise judge, which compares responses: POST /compare with {COMPARE_BODY}",
  uses=USES,
  group_rewards=GROUP_REWARDS,
  verbs=VERBS,
)
