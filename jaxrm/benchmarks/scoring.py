"""What a benchmark scores through: one function for rewards, one for step probabilities, and the
two of a model that compares responses (a pairwise judge's): its log-odds of pairs, and a group's
rewards from its comparisons.

Benchmarks never see a model. They hand every conversation of the benchmark to
:meth:`Scorer.rewards` in one call (the model side sorts them by length into padded buckets), and
every solution to :meth:`Scorer.step_probabilities`; a model that compares is asked every pair in
both orders by :meth:`Scorer.both_orders`, and every group by :meth:`Scorer.group_rewards`. Tests
pass stub functions; the CLI passes :func:`model_scorer`. What a model that compares gives, and
how a report words it (:func:`both_orders_figures`, :func:`both_orders_line`, :func:`groups_note`),
its task says (:attr:`jaxrm.tasks.Task.benchmark_scoring`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxrm import tasks
from jaxrm.data.records import Message, Text
from jaxrm.errors import DataError, EvaluationError
from jaxrm.scoring import kinds
from jaxrm.tasks.base import BenchmarkScoring

Conversation = list[Message]
# Conversations (user turn, assistant reply) -> rewards float [N].
RewardFn = Callable[[Sequence[Conversation]], Sequence[float]]
# (problems, steps of each solution) -> P(step correct) per step, or None for a solution that
# could not be scored (too long); it is then dropped and counted.
StepFn = Callable[[Sequence[str], Sequence[Sequence[str]]], Sequence[Sequence[float] | None]]

# (prompts, responses A, responses B) -> a pairwise judge's log-odds that A is better,
# log p(A) - log p(B) [N], each pair in the order given.
JudgeFn = Callable[[Sequence[str], Sequence[str], Sequence[str]], Sequence[float]]
# (prompts, each prompt's responses) -> each group's rewards from the judge's round robin.
GroupFn = Callable[[Sequence[str], Sequence[Sequence[str]]], Sequence[Sequence[float]]]

# No limit when encoding: rows are cut to max_length afterwards, from the left, as the scripts/run_rm.py
# of RewardBench and RM-Bench set their tokenizers (truncation_side="left"). RewardBench 2's run_v2.py
# leaves the tokenizer's own side, usually the right; jaxrm cuts its rows on the left too, since a
# row cut on the right loses the end of the reply that is being scored.
_NO_LIMIT = 1 << 30


def chat(prompt: str, response: str) -> Conversation:
  """The single-turn conversation the official harnesses score: a user prompt, an assistant reply."""
  return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def tulu_text(conversation: Conversation) -> str:
  """A conversation in FastChat's "tulu" template, the official RewardBench default
  (``--chat_template=tulu``) for a tokenizer without a chat template."""
  return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in conversation)


@dataclasses.dataclass
class Scorer:
  """The scoring functions of one model, and the time they took (for items/s)."""

  rewards_fn: RewardFn | None = None
  steps_fn: StepFn | None = None
  judge_fn: JudgeFn | None = None
  groups_fn: GroupFn | None = None
  items: int = 0
  seconds: float = 0.0
  truncated: int = 0  # conversations cut to max_length by the model's reward function

  def rewards(self, conversations: Sequence[Conversation], benchmark: str) -> np.ndarray:
    """Rewards float64 [N], one per conversation."""
    if self.rewards_fn is None and self.compares:
      raise EvaluationError(
        f"{benchmark} scores each response alone, and a pairwise judge compares two: run it on "
        "rewardbench, rewardbench2, rmbench or judgebench, whose judge's paths compare"
      )
    if self.rewards_fn is None:
      raise EvaluationError(
        f"{benchmark} scores whole responses and needs a sequence-head reward model; "
        "this one is a token-head (process reward) model: run it on processbench"
      )
    start = time.perf_counter()
    out = np.asarray(self.rewards_fn(list(conversations)), np.float64).reshape(-1)
    self._count(len(conversations), start)
    if len(out) != len(conversations):
      raise EvaluationError(
        f"the reward function returned {len(out)} rewards for {len(conversations)} conversations"
      )
    return out

  def step_probabilities(
    self, problems: Sequence[str], steps: Sequence[Sequence[str]], benchmark: str
  ) -> list[np.ndarray | None]:
    """P(step correct) float64 [S_i] of each solution, None where it could not be scored."""
    if self.steps_fn is None:
      raise EvaluationError(
        f"{benchmark} scores each step and needs a token-head (process reward) model; "
        "this one has a sequence head: run it on rewardbench, rewardbench2 or rmbench"
      )
    start = time.perf_counter()
    out = list(self.steps_fn(list(problems), [list(s) for s in steps]))
    self._count(len(problems), start)
    if len(out) != len(problems):
      raise EvaluationError(f"the step function returned {len(out)} results for {len(problems)} solutions")
    return [None if p is None else np.asarray(p, np.float64) for p in out]

  @property
  def compares(self) -> bool:
    """Whether this scores with a model that compares two responses, a pairwise judge (its pairs
    compared, not its responses scored)."""
    return self.judge_fn is not None

  def both_orders(
    self, prompts: Sequence[str], responses_a: Sequence[str], responses_b: Sequence[str], benchmark: str
  ) -> tuple[np.ndarray, np.ndarray]:
    """A judge's log-odds float64 of each pair in both orders, ``s(A, B)`` [N] and ``s(B, A)`` [N]
    (asked in one call: the model side scores them together)."""
    self._needs_judge(benchmark)
    n = len(prompts)
    start = time.perf_counter()
    a, b = list(responses_a), list(responses_b)
    out = np.asarray(self.judge_fn(list(prompts) * 2, a + b, b + a), np.float64).reshape(-1)
    self._count(2 * n, start)
    if len(out) != 2 * n:
      raise EvaluationError(f"the judge's function returned {len(out)} log-odds for {2 * n} pairs")
    return out[:n], out[n:]

  def group_rewards(
    self, prompts: Sequence[str], groups: Sequence[Sequence[str]], benchmark: str
  ) -> list[np.ndarray]:
    """Each group's rewards float64 [n_g] from the judge's round robin over it."""
    self._needs_judge(benchmark)
    start = time.perf_counter()
    out = [np.asarray(r, np.float64) for r in self.groups_fn(list(prompts), [list(g) for g in groups])]
    self._count(sum(len(g) for g in groups), start)
    if [len(r) for r in out] != [len(g) for g in groups]:
      raise EvaluationError("the judge's group function returned other sizes of groups than it was given")
    return out

  def _needs_judge(self, benchmark: str) -> None:
    if not self.compares:
      raise EvaluationError(f"{benchmark}'s judge's path needs a pairwise judge; this scorer has none")

  def _count(self, n: int, start: float) -> None:
    self.items += n
    self.seconds += time.perf_counter() - start

  def throughput(self) -> dict[str, float]:
    rate = self.items / self.seconds if self.seconds > 0 else float("nan")
    return {
      "items": self.items,
      "seconds": self.seconds,
      "items_per_second": rate,
      "truncated": self.truncated,
    }


def model_scorer(
  rm,
  *,
  needs: Sequence[str] = tasks.scoring("reward", "steps"),
  use: str = "a benchmark",
  batch_size: int = 32,
  bucket: int = 64,
  max_length: int | None = 2048,
) -> Scorer:
  """A :class:`Scorer` over a :class:`jaxrm.RewardModel`: rewards for a preference reward model,
  step probabilities for a process reward model, log-odds of pairs and groups' rewards for a
  pairwise judge.

  The model must be of a kind in ``needs`` (:func:`jaxrm.scoring.kinds.check_kind`; ``use`` names what
  needs it, e.g. the benchmark). Rows longer than ``max_length`` tokens (None: the model's
  context) lose their oldest tokens (rewards) or are dropped (solutions, whose cut steps would have
  no score).
  """
  kind = kinds.check_kind(rm, *needs, use=use, error=EvaluationError)
  max_length = max_length or rm.config.max_position_embeddings
  compared = tasks.named(kind).benchmark_scoring
  if compared is not None:
    return Scorer(
      judge_fn=lambda prompts, a, b: compared.pairs(rm, prompts, a, b, batch_size, max_length),
      groups_fn=lambda prompts, groups: compared.groups(rm, prompts, groups, batch_size, max_length),
    )
  if tasks.scores_of(kind) == "steps":
    return Scorer(
      steps_fn=lambda problems, steps: _model_steps(rm, problems, steps, batch_size, bucket, max_length)
    )
  scorer = Scorer()
  scorer.rewards_fn = lambda convs: _model_rewards(rm, convs, batch_size, bucket, max_length, scorer)
  return scorer


@functools.cache
def _comparing() -> BenchmarkScoring:
  """How the benchmarks report a model that compares responses: the first task whose models
  compare that says so (:attr:`jaxrm.tasks.Task.benchmark_scoring`)."""
  found = [s for name in tasks.scoring("comparisons") if (s := tasks.named(name).benchmark_scoring)]
  if not found:
    raise LookupError("no task whose models compare responses says how the benchmarks score them")
  return found[0]


def both_orders_figures(s_ab: np.ndarray, s_ba: np.ndarray) -> dict[str, float]:
  """The figures over pairs asked in both orders, the better response shown as A (``s_ab`` [N],
  the log-odds that A is better) and as B (``s_ba``): for a pairwise judge, accuracy in each order,
  consistency and position bias, as its validation reports them."""
  return _comparing().figures(s_ab, s_ba)


def both_orders_line(figures: dict[str, float], decides: str = "their mean log-odds decides") -> str:
  """:func:`both_orders_figures` as a report's line; ``decides``: what the benchmark counts as right."""
  return _comparing().line(figures, decides)


def groups_note() -> str:
  """How a group's rewards come from its comparisons (:meth:`Scorer.group_rewards`), as a report
  says it."""
  return _comparing().groups_note


def _model_rewards(rm, conversations, batch_size, bucket, max_length, scorer: Scorer) -> np.ndarray:
  if rm.tokenizer is None:
    raise EvaluationError(
      "the model has no tokenizer to encode benchmark texts with; pass tokenizer= to "
      "RewardModel.from_pretrained"
    )
  templated = bool(rm.tokenizer.chat_template)
  encoded = []
  for i, conv in enumerate(conversations):
    item: Text = conv if templated else tulu_text(conv)
    ids = rm.encode(item, max_length=_NO_LIMIT, where=f"conversation {i}")
    scorer.truncated += len(ids) > max_length
    encoded.append(ids[-max_length:])
  return rm.score_ids(encoded, batch_size=batch_size, bucket=bucket, max_length=max_length).astype(np.float64)


def _model_steps(rm, problems, steps_lists, batch_size, bucket, max_length):
  out: list[list[float] | None] = [None] * len(problems)
  rows, encoded = [], []
  for i, (problem, steps) in enumerate(zip(problems, steps_lists)):
    try:
      encoded.append(rm.encode_steps(problem, steps, max_length=max_length, where=f"solution {i}"))
      rows.append(i)
    except DataError:  # longer than max_length: reported as dropped by the benchmark
      continue
  for i, p in zip(
    rows, rm.step_probabilities(encoded, batch_size=batch_size, bucket=bucket, max_length=max_length)
  ):
    out[i] = p
  return out
