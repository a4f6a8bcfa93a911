"""What an LM-head task asks: a causal LM's question and the two answers it weighs (:class:`Asker`,
which a verifier's :class:`jaxrm.tasks.verifier.Verifier` and a pairwise judge's
:class:`jaxrm.tasks.pairwise.Judge` are), the check that each answer is one token, and the file an
export records an asker in (:data:`FILE`, read back by :func:`read_record`)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from jaxrm.errors import CheckpointError, ConfigError

FILE = "jaxrm_verifier.json"  # beside an export's config.json: what its asker asks (Asker.to_json)


@dataclasses.dataclass(frozen=True)
class Asker:
  """A causal LM's question (``question``) and the two answers it weighs (``answers``), each one
  token: what a verifier and a pairwise judge (:class:`jaxrm.tasks.pairwise.Judge`) share. A
  subclass names itself in messages by its class words."""

  NOUN: ClassVar[str] = "an asker"  # what messages call a model that asks it
  WORD: ClassVar[str] = "asker"  # its keyword in from_pretrained (verifier=...) and reward keys
  ROLES: ClassVar[str] = "first, then second"  # what its two answers mean, in order
  EXAMPLE: ClassVar[tuple[str, str]] = ("Yes", "No")  # the answers its messages show
  PATH: ClassVar[str] = "jaxrm.tasks.asker.Asker"  # where users import it from
  # what a causal LM is loaded as with its from_pretrained keyword, and what it then scores
  LOADED_AS: ClassVar[str] = "an asker (its first answer's log-odds)"
  # The reward section's keys of its task (jaxrm.config.RewardSpec is built with them): reward.<key>
  # -> (its default, what it means); one set for a reward.type of another task is refused.
  SETTINGS: ClassVar[Mapping[str, tuple[str, str]]] = {}
  # Its command-line flags (jaxrm.cli.define_verifier_flags): --<WORD> loads a causal LM as this
  # asker (SWITCH: its help), --<WORD>_<field> sets one of its fields (FLAGS: field -> the flag's
  # default, None for the asker's own, and its help); from_pretrained's <WORD>= takes what they ask.
  SWITCH: ClassVar[str] = ""
  FLAGS: ClassVar[Mapping[str, tuple[str | None, str]]] = {}
  # fn(self, tokenizer) checking what a run of its task needs of the tokenizer before any weight is
  # read (a judge's chat template), or None: its answers are checked as the model loads.
  check_tokenizer: ClassVar[Callable[..., Any] | None] = None
  question: str
  answers: tuple[str, str]

  def __post_init__(self):
    if not isinstance(self.question, str) or not self.question.strip():
      raise ConfigError(f"a {self.WORD}'s question must be a non-empty string; got {self.question!r}")
    answers = self.answers
    if isinstance(answers, str):
      answers = tuple(a.strip() for a in answers.split(","))
    if not isinstance(answers, (tuple, list)) or len(answers) != 2:
      raise ConfigError(
        f"a {self.WORD}'s answers are two ({self.ROLES}), e.g. '{','.join(self.EXAMPLE)}'; got {self.answers!r}"
      )
    if not all(isinstance(a, str) and a for a in answers) or answers[0] == answers[1]:
      raise ConfigError(
        f"a {self.WORD}'s answers must be two different non-empty strings; got {self.answers!r}"
      )
    object.__setattr__(self, "answers", tuple(answers))

  @classmethod
  def of(cls, value: Any) -> Any:
    """``True`` (the defaults), a dict with ``question`` and/or ``answers``, or one of these."""
    if isinstance(value, cls):
      return value
    if value is True:
      return cls()
    if isinstance(value, Mapping):
      unknown = sorted(set(value) - {"question", "answers"})
      if unknown:
        raise ConfigError(f"{cls.WORD}= takes 'question' and 'answers'; got {', '.join(map(repr, unknown))}")
      return cls(**value)
    raise ConfigError(
      f"{cls.WORD}= takes True, a dict {{'question': ..., 'answers': {list(cls.EXAMPLE)!r}}} or a "
      f"{cls.PATH}; got {value!r}"
    )

  def token_ids(self, tokenizer: Any) -> tuple[int, int]:
    """The ids of the two answers; each must be one token as
    ``tokenizer.encode(answer, add_special_tokens=False)`` gives it."""
    ids = []
    for answer in self.answers:
      encoded = list(tokenizer.encode(answer, add_special_tokens=False))
      if len(encoded) != 1:
        pieces = tokenizer.convert_ids_to_tokens(encoded)
        raise ConfigError(
          f"the {self.WORD}'s answer {answer!r} is {len(encoded)} tokens for this tokenizer "
          f"({', '.join(map(repr, pieces)) or 'none'}); each answer must be one token: choose "
          f"others (reward.{self.WORD}_answers, or {self.WORD}={{'answers': [...]}})"
        )
      ids.append(int(encoded[0]))
    return ids[0], ids[1]


def read_record(directory: str | os.PathLike) -> dict[str, Any] | None:
  """What an export in ``directory`` records in :data:`FILE` (an asker's ``to_json``: a verifier's
  question and answers, or a pairwise judge's with its ``"task"``), or None when it has none."""
  path = os.path.join(os.fspath(directory), FILE)
  if not os.path.isfile(path):
    return None
  try:
    with open(path) as f:
      saved = json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{path}: not a verifier's or a judge's question and answers ({e})") from None
  if not isinstance(saved, dict):
    raise CheckpointError(f"{path}: not a verifier's or a judge's question and answers (a JSON object)")
  return saved
