"""What a benchmark scores through: one function for rewards, one for step probabilities.

Benchmarks never see a model. They hand every conversation of the benchmark to
:meth:`Scorer.rewards` in one call (the model side sorts them by length into padded buckets), and
every solution to :meth:`Scorer.step_probabilities`. Tests pass stub functions; the CLI passes
:func:`model_scorer`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from jaxrm.data.records import Message, Text
from jaxrm.errors import DataError, EvaluationError
from jaxrm.models.heads import correct_probability

Conversation = list[Message]
# Conversations (user turn, assistant reply) -> rewards float [N].
RewardFn = Callable[[Sequence[Conversation]], Sequence[float]]
# (problems, steps of each solution) -> P(step correct) per step, or None for a solution that
# could not be scored (too long); it is then dropped and counted.
StepFn = Callable[[Sequence[str], Sequence[Sequence[str]]], Sequence[Sequence[float] | None]]

# No limit when encoding: rows are cut to max_length afterwards, from the left, as the official
# harnesses' tokenizers do (truncation_side="left").
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
      raise EvaluationError(f"{benchmark} scores whole responses and needs a sequence-head reward model; "
                            "this one is a token-head (process reward) model: run it on processbench")
    start = time.perf_counter()
    out = np.asarray(self.rewards_fn(list(conversations)), np.float64).reshape(-1)
    self._count(len(conversations), start)
    if len(out) != len(conversations):
      raise EvaluationError(f"the reward function returned {len(out)} rewards for "
                            f"{len(conversations)} conversations")
    return out

  def step_probabilities(self, problems: Sequence[str], steps: Sequence[Sequence[str]],
                         benchmark: str) -> list[np.ndarray | None]:
    """P(step correct) float64 [S_i] of each solution, None where it could not be scored."""
    if self.steps_fn is None:
      raise EvaluationError(f"{benchmark} scores each step and needs a token-head (process reward) model; "
                            "this one has a sequence head: run it on rewardbench, rewardbench2 or rmbench")
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
    return {"items": self.items, "seconds": self.seconds, "items_per_second": rate, "truncated": self.truncated}


def model_scorer(rm, *, batch_size: int = 32, bucket: int = 64, max_length: int = 2048) -> Scorer:
  """A :class:`Scorer` over a :class:`jaxrm.RewardModel`: rewards for a sequence head, step
  probabilities for a token head. Rows longer than ``max_length`` tokens lose their oldest tokens
  (rewards) or are dropped (solutions, whose cut steps would have no score)."""
  if rm.config.head == "sequence":
    if rm.config.num_labels != 1:
      raise EvaluationError(f"a reward model has one output; this sequence head has {rm.config.num_labels}")
    scorer = Scorer()
    scorer.rewards_fn = lambda convs: _model_rewards(rm, convs, batch_size, bucket, max_length, scorer)
    return scorer
  return Scorer(steps_fn=lambda problems, steps: _model_steps(rm, problems, steps, batch_size, bucket,
                                                              max_length))


def _model_rewards(rm, conversations, batch_size, bucket, max_length, scorer: Scorer) -> np.ndarray:
  if rm.tokenizer is None:
    raise EvaluationError("the model has no tokenizer to encode benchmark texts with; pass tokenizer= to "
                          "RewardModel.from_pretrained")
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
  logits = rm.outputs_of_ids([ids for ids, _ in encoded], batch_size=batch_size, bucket=bucket,
                             max_length=max_length)
  for j, logits_tc in enumerate(logits):
    out[rows[j]] = correct_probability(logits_tc[encoded[j][1]]).tolist()
  return out
