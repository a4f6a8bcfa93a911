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
  "B") is read as the pair it ranks (:mod:`jaxrm.data.formats`). Validation reports the accuracy in each order, the consistency of the two
  orders and the position bias (the mean P(A) over both orders; 0.5 is none).
* **comparing** (:func:`compare`) averages the orders: ``(s(A, B) - s(B, A)) / 2``, the log-odds
  that A is better, antisymmetric exactly.
* **a group's rewards** (:func:`score_groups`) come from its comparisons (:func:`comparisons`:
  ``round_robin``, ``circular`` or ``reference``), aggregated by Bradley-Terry strengths
  (:func:`bradley_terry`) or win rates (:func:`win_rates`). Every judge text of a group starts
  with the same conversation, and those sharing a response A continue alike: they are scored
  with their common prefix written once (:mod:`jaxrm.shared_prefix`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxrm.batches import PreferenceBatch
from jaxrm.data import example_types, tokenize
from jaxrm.data.drops import DropReport, row_error
from jaxrm.data.records import PreferenceRecord, Text
from jaxrm.errors import ConfigError, DataError
from jaxrm.metrics import Moments, Ratio
from jaxrm.tasks.base import Task, ones
from jaxrm.tasks.preference import PREFERENCE
from jaxrm.verifier import Asker

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


PAIRWISE = Task(
  name=NAME,
  reward_types=(NAME,),
  data="preference",
  dataset="PreferenceDataset",
  example_types=(example_types.PREFERENCE,),
  evaluation="pairwise",
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
  uses=USES,
)


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
  """float32 [N]: the log-odds that ``responses_a[i]`` is better than ``responses_b[i]`` after
  ``prompts[i]``. ``orders="both"``: ``(s(A, B) - s(B, A)) / 2``, so that ``compare(b, a)`` is
  ``-compare(a, b)`` exactly; ``"ab"``: ``s(A, B)`` alone."""
  judge = _judge_of(rm, "compare()")
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
  """Each group's rewards from its comparisons (:func:`comparisons`, :func:`aggregate_rewards`):
  ``groups[g]`` the responses to ``prompts[g]``, ``references[g]`` its reference (``strategy``
  ``reference`` only). Every group's judge texts are scored in one pass, those sharing a prefix
  (the conversation; the conversation and response A) with it written once."""
  judge = _judge_of(rm, "score_group()")
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
