"""What a benchmark scores through: one function for rewards, one for step probabilities.

Benchmarks never see a model. They hand every conversation of the benchmark to
:meth:`Scorer.rewards` in one call (the model side sorts them by length into padded buckets), and
every solution to :meth:`Scorer.step_probabilities`. Tests pass stub functions; the CLI passes
:func:`model_scorer`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxrm import kinds
from jaxrm.data.records import Message, Text
from jaxrm.errors import DataError, EvaluationError

Conversation = list[Message]
# Conversations (user turn, assistant reply) -> rewards float [N].
RewardFn = Callable[[Sequence[Conversation]], Sequence[float]]
# (problems, steps of each solution) -> P(step correct) per step, or None for a solution that
# could not be scored (too long); it is then dropped and counted.
StepFn = Callable[[Sequence[str], Sequence[Sequence[str]]], Sequence[Sequence[float] | None]]

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
  items: int = 0
  seconds: float = 0.0
  truncated: int = 0  # conversations cut to max_length by the model's reward function

  def rewards(self, conversations: Sequence[Conversation], benchmark: str) -> np.ndarray:
    """Rewards float64 [N], one per conversation."""
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
  needs: Sequence[str] = (kinds.PREFERENCE, kinds.PROCESS),
  use: str = "a benchmark",
  batch_size: int = 32,
  bucket: int = 64,
  max_length: int | None = 2048,
) -> Scorer:
  """A :class:`Scorer` over a :class:`jaxrm.RewardModel`: rewards for a preference reward model,
  step probabilities for a process reward model.

  The model must be of a kind in ``needs`` (:func:`jaxrm.kinds.check_kind`; ``use`` names what
  needs it, e.g. the benchmark). Rows longer than ``max_length`` tokens (None: the model's
  context) lose their oldest tokens (rewards) or are dropped (solutions, whose cut steps would have
  no score).
  """
  kind = kinds.check_kind(rm, *needs, use=use, error=EvaluationError)
  max_length = max_length or rm.config.max_position_embeddings
  if kind == kinds.PROCESS:
    return Scorer(
      steps_fn=lambda problems, steps: _model_steps(rm, problems, steps, batch_size, bucket, max_length)
    )
  scorer = Scorer()
  scorer.rewards_fn = lambda convs: _model_rewards(rm, convs, batch_size, bucket, max_length, scorer)
  return scorer


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
