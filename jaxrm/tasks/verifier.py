"""Generative verifiers (``reward.type=verifier``): a causal LM asked a yes/no question about the
response, trained on preferences as a preference model is, and used wherever one reward per
response is.

A verifier's score of a conversation is ``log p(yes) - log p(no)`` of the token that follows the
conversation and one more user turn holding :attr:`Verifier.question`, rendered by the tokenizer's
chat template with the generation prompt (:mod:`jaxrm.data.tokenize` lays it out). The softmax's
normaliser cancels in the difference, so the score is ``z_yes - z_no``: the last hidden state
dotted with the difference of the two answers' rows of the LM head
(:func:`jaxrm.models.heads.verifier_log_odds`), and no other logit is computed.

This module holds the task (:data:`VERIFIER`), what names a verifier (:class:`Verifier`: its
question and answers, checked one token each by :class:`jaxrm.tasks.asker.Asker`) and the
conversation it reads (:func:`jaxrm.data.tokenize.asked_conversation`, :meth:`Verifier.render`); an export records it in
:data:`jaxrm.tasks.asker.FILE`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from jaxrm.data import example_types, tokenize
from jaxrm.data.batches import LabelledBatch, PackedLabelledBatch
from jaxrm.errors import ConfigError
from jaxrm.tasks import losses, preference
from jaxrm.tasks.asker import Asker
from jaxrm.tasks.base import Task
from jaxrm.tasks.preference import PREFERENCE

DEFAULT_QUESTION = "Is the last response correct and helpful? Answer Yes or No."
DEFAULT_ANSWERS = ("Yes", "No")


@dataclasses.dataclass(frozen=True)
class Verifier(Asker):
  """What a verifier asks (``question``) and the two answers it weighs (``answers``: yes, no)."""

  NOUN: ClassVar[str] = "a verifier"
  WORD: ClassVar[str] = "verifier"
  ROLES: ClassVar[str] = "yes, then no"
  EXAMPLE: ClassVar[tuple[str, str]] = DEFAULT_ANSWERS
  PATH: ClassVar[str] = "jaxrm.tasks.verifier.Verifier"
  LOADED_AS: ClassVar[str] = "a verifier (one reward per response)"
  SETTINGS: ClassVar[Mapping[str, tuple[str, str]]] = {
    "verifier_question": (
      DEFAULT_QUESTION,
      "verifier: the question asked after each response, in a user turn (jaxrm.tasks.verifier)",
    ),
    "verifier_answers": (
      ",".join(DEFAULT_ANSWERS),
      'verifier: its two answers, "yes,no"; each must be one token of the model\'s tokenizer',
    ),
  }
  SWITCH: ClassVar[str] = (
    "Score --model, a causal LM, as a generative verifier: log p(yes) - log p(no) of its answer to "
    "--verifier_question after each conversation (an export or training run of a verifier is one "
    "without it)."
  )
  FLAGS: ClassVar[Mapping[str, tuple[str | None, str]]] = {
    "question": (DEFAULT_QUESTION, "With --verifier: the question asked after each conversation."),
    "answers": (
      ",".join(DEFAULT_ANSWERS),
      "With --verifier: its two answers, yes then no, comma-separated; each must be one token.",
    ),
  }

  question: str = DEFAULT_QUESTION
  answers: tuple[str, str] = DEFAULT_ANSWERS

  @classmethod
  def of_spec(cls, spec: Any) -> Verifier:
    """The verifier of a run's ``reward`` section (``verifier_question``, ``verifier_answers``)."""
    try:
      return cls(spec.verifier_question, spec.verifier_answers)
    except ConfigError as e:
      raise ConfigError(
        f"reward.verifier_question={spec.verifier_question!r}, reward.verifier_answers="
        f"{spec.verifier_answers!r}: {e}"
      ) from None

  @classmethod
  def from_json(cls, saved: Mapping[str, Any]) -> Verifier:
    """The verifier a file records (:meth:`to_json`)."""
    return cls(question=saved["question"], answers=tuple(saved["answers"]))

  def tokenize_options(self, options: Any) -> Any:
    """``options`` (:class:`jaxrm.data.tokenize.TokenizeOptions`) with each completion followed by
    this verifier's question."""
    return dataclasses.replace(options, verifier_question=self.question)

  def render(self, tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> str:
    """The text this verifier scores of the conversation ``messages``, before any truncation:
    :func:`jaxrm.data.tokenize.asked_conversation` rendered by the tokenizer's chat template with the generation prompt.
    Tokenized without added special tokens (the template writes them), it gives the ids
    ``RewardModel.encode`` scores."""
    return tokenizer.apply_chat_template(
      tokenize.asked_conversation(messages, self.question), tokenize=False, add_generation_prompt=True
    )

  def to_json(self) -> dict[str, Any]:
    """What :data:`FILE` holds."""
    return {"question": self.question, "answers": list(self.answers)}


def _or_labelled(pairwise: losses.SpecLoss) -> losses.SpecLoss:
  """A verifier's loss: ``pairwise`` on preference batches, the cross-entropy over its two answers
  on labelled items."""

  def loss(spec, outputs, batch):
    if isinstance(batch, LABELLED_BATCHES):
      return losses.labelled(spec, outputs, batch)
    return pairwise(spec, outputs, batch)

  return loss


# A verifier's batches of labelled items, unpacked or packed: their outputs are alike, log-odds [G].
LABELLED_BATCHES = (LabelledBatch, PackedLabelledBatch)


def _labelled_scores(spec, outputs, batch):
  """Validation's scores of labelled items (their AUROC); none of preference batches."""
  return losses.labelled_scores(spec, outputs, batch) if isinstance(batch, LABELLED_BATCHES) else {}


VERIFIER = Task(
  name="verifier",
  reward_types=("verifier",),
  data="preference",
  dataset="PreferenceDataset",
  example_types=(example_types.PREFERENCE, example_types.LABELLED),
  evaluation="preference",
  # Labelled items become LABELLED_BATCHES instead; data.packing='shared_prompt' is refused for
  # them once their rows are read (jaxrm.data.packing.check_packable).
  batches=PREFERENCE.batches,
  packing_refused="",
  head="lm",
  scores="reward",
  num_labels=1,
  losses={
    ("verifier", None): _or_labelled(losses.bradley_terry),
    ("verifier", "plackett_luce"): _or_labelled(losses.plackett_luce),
    ("verifier", "all_pairs"): _or_labelled(losses.all_pairs),
  },
  samples=_labelled_scores,
  example=preference.example,
  needs="a verifier (a causal LM scoring the log-odds of its answers to a question)",
  train="train one with reward.type=verifier, or load a causal LM with "
  "RewardModel.from_pretrained(path, verifier=True)",
  use_instead="a verifier scores conversations: rm.score, or preference data",
  loss_choice="verifier_loss",
  serves=(PREFERENCE.name,),
  asker=Verifier,
)
