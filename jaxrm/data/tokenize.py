"""Turns preference and stepwise records into token ids with a Hugging Face tokenizer.

Layouts:

* **Preference.** Each completion becomes one sequence, prompt + completion. A conversation is
  rendered once by the tokenizer's chat template (``context + completion`` messages, no generation
  prompt) and the rendered text is tokenized without adding special tokens (the template already
  writes them). Plain text is ``context + completion`` tokenized with the tokenizer's own BOS/EOS.
  Each sequence simply ends where the completion ends: the reward is read at the last position of
  the attention mask, so an end-of-turn token equal to the pad token (SmolLM2, Llama 3) is never
  mistaken for padding.
* **Verifier** (``TokenizeOptions.verifier_question``). A preference row as a generative verifier
  reads it: each completion followed by a user turn holding the question, rendered by the chat
  template with the generation prompt, so that the sequence ends where the answer's token would
  come (:mod:`jaxrm.tasks.verifier`). Plain text is made a conversation first: the context a user turn,
  the completion an assistant turn. Truncation cuts the context only; the question stays.
* **Labelled** (a verifier's unpaired items). Prompt + completion, laid out as one preference
  completion is, and its label.
* **Rated.** Prompt + response, laid out (and truncated) as one preference completion is.
* **Stepwise.** ``prompt, step_1, sep, step_2, sep, ...`` where ``sep`` is the tokenized
  ``step_separator``. Step ``i``'s label (1 correct, 0 not) sits on the last token of the separator
  after it; every other position is -100. A conversation prompt is rendered by the chat template
  with the generation prompt, so the steps are the assistant's reply (the turn is left open: no
  token after the last separator). A plain-text prompt is tokenized with the tokenizer's own
  special tokens and followed by one unlabelled separator. Each step and the separator are
  tokenized on their own, so a label always lands on a separator token.

  Differences from TRL's ``PRMTrainer``: TRL never applies a chat template, always prepends
  ``bos_token_id`` (here the tokenizer decides, as for any plain text), and puts the first step
  directly after the prompt with no separator between them. The step/separator/label part is the
  same.

Over-length rows (``max_length`` counts every token):

* ``truncation="drop"`` drops and counts them.
* ``truncation="left"``, preference: drops the oldest context turns (a leading system message and
  the last turn are kept), then the oldest context tokens (a leading BOS is kept); every completion
  stays whole and all completions of a row keep the same context.
* ``truncation="left"``, stepwise: drops the oldest prompt turns, then whole trailing steps with
  their labels, so no label points at a cut step. The last prompt turn is never cut: a PRM label
  without its question means nothing.

Rows that cannot be made to fit, or whose completions tokenize identically, are dropped and counted
in the :class:`~jaxrm.data.drops.DropReport` under the reasons below.
"""

from __future__ import annotations

import dataclasses
import json
import re
import weakref
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import jinja2
import numpy as np

from jaxrm.data.batches import IGNORE_INDEX
from jaxrm.data.drops import DropReport, row_error
from jaxrm.data.records import LabelledRecord, Message, PreferenceRecord, RatedRecord, StepwiseRecord, Text

# Drop reasons, as counted in the DropReport.
PROMPT_TOO_LONG = "prompt alone is max_length tokens or longer"
PAIR_TOO_LONG = "prompt + completion longer than max_length (truncation='drop')"
COMPLETION_TOO_LONG = "a completion alone does not fit in max_length"
IDENTICAL_COMPLETIONS = "completions identical after tokenization"
STEPS_TOO_LONG = "prompt + steps longer than max_length (truncation='drop')"
NO_STEP_FITS = "no step fits in max_length after the prompt"
LAST_STEP_CUT = "last step cut by truncation (train_on_last_step_only)"

T = TypeVar("T")

# How a row's texts become one sequence: a conversation rendered by the tokenizer's chat template,
# or strings joined as they are (as TRL joins a string prompt and completion).
CHAT_TEMPLATE = "chat_template"
PLAIN_TEXT = "plain_text"
RENDERINGS = (CHAT_TEMPLATE, PLAIN_TEXT)


def asked_conversation(messages: Sequence[Mapping[str, Any]], question: str) -> list[Mapping[str, Any]]:
  """``messages`` followed by the user turn that asks ``question``: what a verifier reads
  (:meth:`jaxrm.tasks.verifier.Verifier.render` renders it)."""
  return [*messages, {"role": "user", "content": question}]


@dataclasses.dataclass(frozen=True)
class TokenizeOptions:
  """How records become token ids.

  Attributes:
    max_length: the longest sequence kept, in tokens.
    truncation: "drop" (over-length rows are dropped and counted) or "left" (drop the oldest
      context; see the module docstring).
    step_separator: text after every step of a stepwise row; its last token carries the label.
    train_on_last_step_only: keep only the last step's label (outcome supervision).
    verifier_question: a verifier's question (:mod:`jaxrm.tasks.verifier`): each preference completion
      is then followed by a user turn holding it and the generation prompt; None: no question.
    rendering: render every preference, rated or labelled row this way (:data:`RENDERINGS`,
      see :func:`rendered_as`) whatever form it is given in; None: each as its form says
      (:func:`rendering`), as training does.
    reads: a task's own reading of preference rows (a pairwise judge's,
      :class:`jaxrm.tasks.pairwise.Judge`): an object whose ``examples(record, tokenizer,
      options, drops)`` gives the examples of one row (several, or none when it drops it); None:
      each row is one example, read as above.
  """

  max_length: int = 1024
  truncation: str = "drop"
  step_separator: str = "\n"
  train_on_last_step_only: bool = False
  verifier_question: str | None = None
  rendering: str | None = None
  reads: Any = None

  def __post_init__(self):
    if self.rendering not in (None, *RENDERINGS):
      raise ValueError(f"rendering={self.rendering!r}; use one of {', '.join(RENDERINGS)} or None")
    if self.truncation not in ("drop", "left"):
      raise ValueError(f"truncation={self.truncation!r}; use 'drop' or 'left'")
    if self.max_length < 2:
      raise ValueError(f"max_length={self.max_length}; it must be at least 2")


@dataclasses.dataclass(frozen=True)
class PreferenceExample:
  """A tokenized preference row: one full sequence per completion, best first."""

  input_ids: tuple[np.ndarray, ...]  # per completion, int32 [T_i]: prompt + completion
  ranks: tuple[int, ...]  # ascending; ranks[i] belongs to input_ids[i]
  margin: float  # 0.0 when the row has none
  source: str
  meta: dict[str, Any]
  strength: float | None = None  # the annotated preference strength, if the row has one


@dataclasses.dataclass(frozen=True)
class RatedExample:
  """A tokenized rated row: prompt + response, and its ratings."""

  input_ids: np.ndarray  # int32 [T]
  labels: np.ndarray  # float32 [A]: the ratings, 0 where not rated
  label_mask: np.ndarray  # float32 [A]: 1 where rated
  group: int  # the same for every response to the same prompt
  source: str
  meta: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class LabelledExample:
  """A tokenized labelled item: prompt + completion (laid out as one preference completion), and
  whether the completion is good."""

  input_ids: np.ndarray  # int32 [T]
  label: bool
  source: str
  meta: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class StepwiseExample:
  """A tokenized stepwise row."""

  input_ids: np.ndarray  # int32 [T]
  labels: np.ndarray  # int32 [T]: 1/0 on the last separator token of each step, -100 elsewhere
  source: str
  meta: dict[str, Any]


def rendering(text: Text) -> str:
  """How training renders ``text``: a conversation by the chat template, a string as it is."""
  return CHAT_TEMPLATE if isinstance(text, list) else PLAIN_TEXT


def record_rendering(record: PreferenceRecord | RatedRecord | LabelledRecord | StepwiseRecord) -> str:
  """How training renders ``record``: as its (first) completion's form says, a stepwise row as its
  prompt's."""
  return rendering(_RENDERED[type(record)](record))


# The text of each kind of row whose form says how it is rendered.
_RENDERED = {
  PreferenceRecord: lambda record: record.completions[0],
  RatedRecord: lambda record: record.completion,
  LabelledRecord: lambda record: record.completion,
  StepwiseRecord: lambda record: record.prompt,
}


def rendered_as(context: Text, completion: Text, how: str | None) -> tuple[Text, Text]:
  """``context`` and ``completion`` in the form that renders ``how`` (:data:`RENDERINGS`).

  For plain text a conversation becomes its turns' contents, one turn per line, and the completion
  is joined to the context as it is, as TRL joins a string prompt and completion. Strings stay as
  they are for the chat template too: they may be texts the template already rendered (as
  OpenRLHF sends them), and no turn says who wrote them. ``how`` None: as they are.
  """
  if how == PLAIN_TEXT:
    return _plain(context), _plain(completion)
  return context, completion


def _plain(text: Text) -> str:
  return text if isinstance(text, str) else "\n".join(str(m.get("content", "")) for m in text)


def _rendered(record: PreferenceRecord, completions: list[Text], how: str | None):
  """``record`` and its ``completions`` (best first) rendered ``how`` (:func:`rendered_as`)."""
  if how is None:
    return record, completions
  pairs = [rendered_as(record.context, c, how) for c in completions]
  context = pairs[0][0] if pairs else record.context
  return dataclasses.replace(record, context=context), [c for _, c in pairs]


def tokenize_preference(
  record: PreferenceRecord, tokenizer, opts: TokenizeOptions, drops: DropReport
) -> PreferenceExample | None:
  """Tokenizes one preference row, or returns None after counting it in ``drops``."""
  order = sorted(range(len(record.ranks)), key=lambda i: record.ranks[i])
  completions = [record.completions[i] for i in order]
  record, completions = _rendered(record, completions, opts.rendering)
  if opts.verifier_question is not None:
    record, completions = _asked(tokenizer, record, completions, opts.verifier_question)
  asks = opts.verifier_question is not None
  encoded = _encode_group(tokenizer, record.context, completions, record.source, asks)
  if _longest(encoded) > opts.max_length:
    if opts.truncation == "drop":
      reason = PROMPT_TOO_LONG if _prompt_len(encoded) >= opts.max_length else PAIR_TOO_LONG
      drops.drop(reason, record.source)
      return None
    encoded = _truncate_group_left(tokenizer, record, completions, encoded, opts.max_length, asks)
    if encoded is None:
      drops.drop(COMPLETION_TOO_LONG, record.source)
      return None
    drops.cut += 1
  if len({tuple(ids) for ids, _ in encoded}) < len(encoded):
    drops.drop(IDENTICAL_COMPLETIONS, record.source)
    return None
  return PreferenceExample(
    input_ids=tuple(np.asarray(ids, np.int32) for ids, _ in encoded),
    ranks=tuple(record.ranks[i] for i in order),
    margin=float(record.margin or 0.0),
    source=record.source,
    meta=dict(record.meta),
    strength=record.strength,
  )


def tokenize_rated(
  record: RatedRecord, tokenizer, opts: TokenizeOptions, drops: DropReport
) -> RatedExample | None:
  """Tokenizes one rated row as a one-completion preference row, or returns None after counting
  it in ``drops``."""
  single = PreferenceRecord(
    context=record.context, completions=(record.completion,), ranks=(0,), source=record.source
  )
  example = tokenize_preference(single, tokenizer, opts, drops)
  if example is None:
    return None
  rated = np.array([r is not None for r in record.ratings])
  return RatedExample(
    input_ids=example.input_ids[0],
    labels=np.array([r or 0.0 for r in record.ratings], np.float32),
    label_mask=rated.astype(np.float32),
    group=prompt_group(record.context),
    source=record.source,
    meta=dict(record.meta),
  )


def tokenize_labelled(
  record: LabelledRecord, tokenizer, opts: TokenizeOptions, drops: DropReport
) -> LabelledExample | None:
  """Tokenizes one labelled item as a one-completion preference row, or returns None after
  counting it in ``drops``."""
  single = PreferenceRecord(
    context=record.context, completions=(record.completion,), ranks=(0,), source=record.source
  )
  example = tokenize_preference(single, tokenizer, opts, drops)
  if example is None:
    return None
  return LabelledExample(example.input_ids[0], bool(record.label), record.source, dict(record.meta))


def prompt_group(context: Text) -> int:
  """A non-negative int32 that responses to one prompt share (a hash of its text)."""
  return zlib.crc32(json.dumps(context, sort_keys=True).encode("utf-8")) & 0x7FFFFFFF


def tokenize_stepwise(
  record: StepwiseRecord, tokenizer, opts: TokenizeOptions, drops: DropReport
) -> StepwiseExample | None:
  """Tokenizes one stepwise row, or returns None after counting it in ``drops``."""
  sep = text_ids(tokenizer, opts.step_separator, special=False)
  if not sep:
    raise ValueError(
      f"step_separator={opts.step_separator!r} tokenizes to no tokens; "
      "choose a separator that is at least one token"
    )
  steps = [text_ids(tokenizer, s, special=False) + sep for s in record.steps]
  prefix = _stepwise_prefix(tokenizer, record.prompt, sep, record.source)
  if len(prefix) + sum(map(len, steps)) > opts.max_length:
    if opts.truncation == "drop":
      drops.drop(PROMPT_TOO_LONG if len(prefix) >= opts.max_length else STEPS_TOO_LONG, record.source)
      return None
    if isinstance(record.prompt, list):
      room = opts.max_length - sum(map(len, steps))
      prefix = _fewest_turns_cut(
        record.prompt,
        prefix,
        lambda shorter: _stepwise_prefix(tokenizer, shorter, sep, record.source),
        lambda prefix: len(prefix) <= room,
      )
  kept, reason = _steps_kept(len(prefix), steps, opts)
  if reason:
    drops.drop(reason, record.source)
    return None
  input_ids = prefix + [t for s in steps[:kept] for t in s]
  labels = np.full(len(input_ids), IGNORE_INDEX, np.int32)
  ends = len(prefix) + np.cumsum([len(s) for s in steps[:kept]]) - 1  # last separator tokens
  first = kept - 1 if opts.train_on_last_step_only else 0
  labels[ends[first:]] = np.asarray(record.labels[first:kept], np.int32)
  return StepwiseExample(
    input_ids=np.asarray(input_ids, np.int32),
    labels=labels,
    source=record.source,
    meta=dict(record.meta),
  )


def pad_id(tokenizer, model_pad_token_id: int | None = None) -> int:
  """The token id written into padding: the tokenizer's pad token, else the model's, else 0.

  Padding is never attended to, so any valid id works; these keep batches readable.
  """
  for candidate in (getattr(tokenizer, "pad_token_id", None), model_pad_token_id):
    if candidate is not None:
      return int(candidate)
  return 0


def tokenize_all(
  records: Iterable[PreferenceRecord | StepwiseRecord | RatedRecord | LabelledRecord],
  tokenizer,
  opts: TokenizeOptions,
  drops: DropReport,
) -> list[PreferenceExample | StepwiseExample | RatedExample | LabelledExample]:
  """Tokenizes every record; dropped rows are counted in ``drops`` and left out."""
  out = []
  for record in records:
    if isinstance(record, PreferenceRecord) and opts.reads is not None:
      out += opts.reads.examples(record, tokenizer, opts, drops)
      continue
    example = _TOKENIZERS[type(record)](record, tokenizer, opts, drops)
    if example is not None:
      out.append(example)
  return out


# Each kind of row's tokenizer: record -> example, or None once it is counted as dropped.
_TOKENIZERS = {
  PreferenceRecord: tokenize_preference,
  RatedRecord: tokenize_rated,
  LabelledRecord: tokenize_labelled,
  StepwiseRecord: tokenize_stepwise,
}


# A completion's encoding: (full sequence ids, number of leading ids that are the prompt's).
_Encoded = tuple[list[int], int]


def _encode_group(
  tokenizer, context: Text, completions: Sequence[Text], source: str, asks: bool = False
) -> list[_Encoded]:
  """Encodes prompt + completion for every completion; the prompt is tokenized once. With
  ``asks`` (a verifier's, each completion ending with its question), conversations end with the
  generation prompt."""
  if isinstance(context, list):
    prompt_text = _chat_text(tokenizer, context, False, source, "context") if context else ""
    prompt = text_ids(tokenizer, prompt_text, special=False) if context else []
  else:
    prompt = text_ids(tokenizer, context, special=True) if context else []
  encoded = []
  for i, completion in enumerate(completions):
    field = f"completions[{i}]"
    if context and isinstance(context, list) != isinstance(completion, list):
      kinds = ("a conversation", "plain text")
      raise row_error(
        source,
        field,
        f"is {kinds[isinstance(completion, str)]} but the context is "
        f"{kinds[isinstance(context, str)]}; give both as message lists or both as "
        "strings",
      )
    if isinstance(completion, list):
      text = _chat_text(tokenizer, list(context or []) + completion, asks, source, field)
      full = continued_ids(tokenizer, prompt_text if context else "", prompt, text)
    else:
      full = text_ids(tokenizer, (context or "") + completion, special=True)
    # A template or BPE merge may change tokens at the boundary; what is shared is the prompt.
    encoded.append((full, _common_prefix(full, prompt)))
  return encoded


def _asked(
  tokenizer, record: PreferenceRecord, completions: list[Text], question: str
) -> tuple[PreferenceRecord, list[list[Message]]]:
  """``record`` and its ``completions`` as a verifier reads them: conversations, each completion
  followed by a user turn holding ``question`` (:func:`_encode_group` then renders it with the
  generation prompt). Plain text becomes a user turn (the context, if any) and an assistant turn
  (the completion)."""
  if not getattr(tokenizer, "chat_template", None):
    raise row_error(
      record.source,
      "completions",
      "a verifier asks its question in a chat turn, and the tokenizer has no chat template; give "
      "one (model.chat_template)",
    )
  context = record.context
  if isinstance(context, str):
    context = [{"role": "user", "content": context}] if context else []
  asked = []
  for i, completion in enumerate(completions):
    if record.context and isinstance(record.context, list) != isinstance(completion, list):
      kinds = ("a conversation", "plain text")
      raise row_error(
        record.source,
        f"completions[{i}]",
        f"is {kinds[isinstance(completion, str)]} but the context is {kinds[isinstance(record.context, str)]}; "
        "give both as message lists or both as strings",
      )
    if isinstance(completion, str):
      completion = [{"role": "assistant", "content": completion}]
    asked.append(asked_conversation(completion, question))
  return dataclasses.replace(record, context=context), asked


def continued_ids(tokenizer, prefix_text: str, prefix_ids: list[int], text: str) -> list[int]:
  """``text``'s ids (no special tokens added), reusing ``prefix_ids`` (``prefix_text``'s) where
  ``text`` continues ``prefix_text`` at a boundary the tokenizer provably splits at.

  The rest is then encoded alone: the ids equal the whole text's, and the prompt's BPE is not
  paid again for every completion.
  """
  if prefix_text and text.startswith(prefix_text):
    rest = text[len(prefix_text) :]
    if splits_at(tokenizer, prefix_text, rest):
      return prefix_ids + text_ids(tokenizer, rest, special=False)
  return text_ids(tokenizer, text, special=False)


@dataclasses.dataclass(frozen=True)
class _AddedTokens:
  """A fast tokenizer's added tokens, as far as splitting a text in two depends on them."""

  size: int  # len(tokenizer) when read: a token added since makes these stale
  openers: tuple[str, ...]  # tokens a second half may start with (see splits_at)
  any_token: re.Pattern | None  # every added token, longest first, as a lookahead
  longest: int


_ADDED_TOKENS: weakref.WeakKeyDictionary[Any, _AddedTokens] = weakref.WeakKeyDictionary()


def splits_at(tokenizer, prefix: str, rest: str) -> bool:
  """Whether encoding ``prefix + rest`` gives ``prefix``'s ids followed by ``rest``'s.

  A fast (``tokenizers``) tokenizer first cuts a text at its added tokens, then normalizes,
  pre-tokenizes and encodes every piece on its own (a piece sees only its own text, and whether it
  starts the whole text, which Metaspace's "first" prepend scheme asks). So when ``rest`` starts
  with an added token that the full text also cuts at exactly there, both halves are made of the
  same pieces as the whole. That holds when the token is matched on raw text
  (``normalized=False``), does not take the whitespace before it (``lstrip``) nor depend on its
  left neighbour (``single_word``), does not start with whitespace (an ``rstrip`` token ending
  ``prefix`` would take it), and no added token straddles the boundary (the matcher, taking the
  leftmost match, would prefer it). Anything else, or a slow tokenizer, is encoded whole.
  """
  if not getattr(tokenizer, "is_fast", False) or getattr(tokenizer, "split_special_tokens", False):
    return False
  added = _added_tokens(tokenizer)
  if not rest.startswith(added.openers):
    return False
  reach = added.longest - 1  # a straddling token starts within this many characters before
  head, tail = prefix[max(0, len(prefix) - reach) :], rest[:reach]
  window, cut = head + tail, len(head)
  for pos in range(cut):
    match = added.any_token.match(window, pos)
    if match and pos + len(match.group(1)) > cut:
      return False
  return True


def _added_tokens(tokenizer) -> _AddedTokens:
  known = _ADDED_TOKENS.get(tokenizer)
  if known is not None and known.size == len(tokenizer):
    return known
  tokens = list(tokenizer.added_tokens_decoder.values())
  openers = tuple(
    t.content
    for t in tokens
    if t.content and not t.content[0].isspace() and not (t.normalized or t.lstrip or t.single_word)
  )
  contents = sorted({t.content for t in tokens if t.content}, key=len, reverse=True)
  pattern = re.compile("(?=(" + "|".join(map(re.escape, contents)) + "))") if contents else None
  known = _AddedTokens(
    size=len(tokenizer), openers=openers, any_token=pattern, longest=max(map(len, contents), default=0)
  )
  _ADDED_TOKENS[tokenizer] = known
  return known


def _truncate_group_left(
  tokenizer,
  record: PreferenceRecord,
  completions: Sequence[Text],
  encoded: list[_Encoded],
  max_length: int,
  asks: bool = False,
) -> list[_Encoded] | None:
  """Fits a group into ``max_length`` by cutting its context; None when no context cut is enough."""
  if isinstance(record.context, list):
    encoded = _fewest_turns_cut(
      record.context,
      encoded,
      lambda shorter: _encode_group(tokenizer, shorter, completions, record.source, asks),
      lambda encoded: _longest(encoded) <= max_length,
    )
  cut = _longest(encoded) - max_length
  if cut <= 0:
    return encoded
  out = []
  for ids, n_prompt in encoded:
    keep = 1 if ids and ids[0] == tokenizer.bos_token_id else 0
    if n_prompt - keep < cut:
      return None
    out.append((ids[:keep] + ids[keep + cut :], n_prompt - cut))
  return out


def _fewest_turns_cut(
  messages: list[Message], whole: T, encode: Callable[[list[Message]], T], fits: Callable[[T], bool]
) -> T:
  """``encode(shorter)`` of the conversation with the fewest oldest turns cut for ``fits`` to hold
  (see :func:`turn_starts`), else with every turn but the last cut; ``whole`` (the whole
  conversation's encoding, which does not fit) when there is no turn to cut.

  Cutting a turn never lengthens a conversation, so the first cut that fits is found by galloping
  back from the last turn (keeping 1, 2, 4... more turns) until a cut does not fit, then bisecting:
  O(log n) encodings, each at most about twice as long as what is kept, where trying one cut more
  at a time was quadratic in the conversation. The result is the same.
  """
  head, starts = turn_starts(messages)
  if not starts:
    return whole
  done: dict[int, T] = {}

  def encoded(k: int) -> T:  # the conversation from turn starts[k] on
    if k not in done:
      done[k] = encode(messages[:head] + messages[starts[k] :])
    return done[k]

  fit = len(starts) - 1
  if not fits(encoded(fit)):
    return encoded(fit)
  unfit, step = -1, 1  # -1: the whole conversation
  while fit - step > unfit:
    if not fits(encoded(fit - step)):
      unfit = fit - step
      break
    fit, step = fit - step, 2 * step
  while fit - unfit > 1:
    mid = (fit + unfit) // 2
    if fits(encoded(mid)):
      fit = mid
    else:
      unfit = mid
  return encoded(fit)


def turn_starts(messages: list[Message]) -> tuple[int, list[int]]:
  """(messages always kept at the start, where each later turn starts): the conversation with its
  oldest turns cut, one turn more each time, is ``messages[:head] + messages[start:]`` for each
  start, in order.

  A turn starts at a user message. A leading system message and the last turn are always kept.
  """
  head = 1 if messages and messages[0].get("role") == "system" else 0
  return head, [i for i in range(head + 1, len(messages)) if messages[i].get("role") == "user"]


def _stepwise_prefix(tokenizer, prompt: Text, sep: list[int], source: str) -> list[int]:
  if isinstance(prompt, list):
    return _chat_ids(tokenizer, prompt, True, source, "prompt")
  return text_ids(tokenizer, prompt, special=True) + sep


def _steps_kept(prefix_len: int, steps: list[list[int]], opts: TokenizeOptions) -> tuple[int, str | None]:
  """How many leading steps fit after the prompt, or a drop reason."""
  if prefix_len >= opts.max_length:
    return 0, PROMPT_TOO_LONG
  room, kept = opts.max_length - prefix_len, 0
  while kept < len(steps) and len(steps[kept]) <= room:
    room -= len(steps[kept])
    kept += 1
  if not kept:
    return 0, NO_STEP_FITS
  if opts.train_on_last_step_only and kept < len(steps):
    return kept, LAST_STEP_CUT
  return kept, None


def _chat_ids(
  tokenizer, messages: list[Message], add_generation_prompt: bool, source: str, field: str
) -> list[int]:
  text = _chat_text(tokenizer, messages, add_generation_prompt, source, field)
  # The template writes its own special tokens (BOS included); adding them again would double BOS.
  return text_ids(tokenizer, text, special=False)


def _chat_text(
  tokenizer, messages: list[Message], add_generation_prompt: bool, source: str, field: str
) -> str:
  try:
    return tokenizer.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
  except jinja2.TemplateError as e:
    raise row_error(source, field, f"the tokenizer's chat template rejected it: {e}") from e


def text_ids(tokenizer, text: str, *, special: bool) -> list[int]:
  """``text``'s ids, with the tokenizer's special tokens added when ``special``."""
  return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _common_prefix(a: list[int], b: list[int]) -> int:
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


def _longest(encoded: list[_Encoded]) -> int:
  return max(len(ids) for ids, _ in encoded)


def _prompt_len(encoded: list[_Encoded]) -> int:
  return max(n for _, n in encoded)
