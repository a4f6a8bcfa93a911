"""``RewardModel``: a loaded reward model with its tokenizer, ready to score.

It loads whatever :func:`jaxrm.scoring.loading.locate` finds: Hugging Face checkpoint directories,
``.gguf`` files, jaxrm training output directories and single training checkpoints. Text is
tokenized by the functions training uses (:mod:`jaxrm.data.tokenize`), so a conversation scores
exactly as it was laid out in training.
"""

from __future__ import annotations

import functools
import logging
import os
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrm import tasks
from jaxrm.config import combination_weights
from jaxrm.data.batches import IGNORE_INDEX
from jaxrm.data.drops import DropReport
from jaxrm.data.formats import json_type, parse_text, parse_texts
from jaxrm.data.pipeline import bucket_length, length_buckets, right_padded, scoring_rows
from jaxrm.data.records import PreferenceRecord, StepwiseRecord, Text
from jaxrm.data.tokenize import (
  PLAIN_TEXT,
  TokenizeOptions,
  pad_id,
  rendered_as,
  rendering,
  tokenize_preference,
  tokenize_stepwise,
)
from jaxrm.errors import ConfigError, DataError
from jaxrm.models.config import ModelConfig
from jaxrm.models.decoder import Decoder
from jaxrm.models.heads import correct_probability
from jaxrm.scoring import export_files, kinds, loading, reward_funcs, shared_prefix, step_rewards
from jaxrm.scoring.loading import ScoringInfo
from jaxrm.scoring.shared_prefix import Sharing
from jaxrm.tasks.asker import Asker

log = logging.getLogger(__name__)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, input_ids, attention_mask):
  # Module-level, keyed on the graphdef: models of one architecture (two checkpoints of a run)
  # share compiled programs.
  return nnx.merge(graphdef, state)(input_ids, attention_mask)


@functools.partial(jax.jit, static_argnums=0)
def _forward_packed(graphdef, state, rows, reward_positions):
  # rows: input_ids, attention_mask, positions, segment_ids, branch_ids of packed rows.
  return nnx.merge(graphdef, state)(*rows, reward_positions=reward_positions)


def packed_programs() -> int:
  """How many programs the packed forward has compiled in this process: one per shape of batch
  (the server compiles its shapes as it starts, and a request should compile none)."""
  return _forward_packed._cache_size()


def _steps(steps: Any, field: str, separator: str) -> tuple[str, ...]:
  """``steps`` checked as a list of step texts (:func:`jaxrm.scoring.step_rewards.check_steps`)."""
  try:
    return tuple(
      step_rewards.check_steps(
        steps,
        field,
        f"e.g. jaxrm.scoring.step_rewards.split_steps(text, rm.step_separator) cuts a solution at the step "
        f"separator {separator!r}",
      )
    )
  except ValueError as e:
    raise DataError(f"score_steps: {e}") from None


def _askers() -> list[type[Asker]]:
  """The askers of the LM-head tasks but the verifier's (from_pretrained's own ``verifier=``), each
  given to from_pretrained by its keyword (its ``WORD``: ``judge=``)."""
  verifier = tasks.first_asker().asker
  return [t.asker for t in tasks.TASKS.values() if t.asker not in (None, verifier)]


def _asked(
  asker: type[Asker], value: Any, head: str | None, others: list[tuple[type[Asker], Any]]
) -> tuple[str, type[Asker], Asker | None]:
  """(head, asker class, asker) of from_pretrained's keyword of ``asker`` given ``value`` (True: what
  an export or run of its task recorded, else its defaults; a dict or an ``asker``); ``others``, the
  other askers' keywords and values, must be left out."""
  given = [other for other, v in others if v not in (None, False)]
  if given:
    raise ConfigError(
      f"{given[0].WORD}= and {asker.WORD}= both given: a causal LM is loaded as {given[0].LOADED_AS} "
      f"or as {asker.LOADED_AS}; pass one"
    )
  if head not in (None, "lm"):
    raise ConfigError(
      f"{asker.WORD}= with head={head!r}: a {asker.WORD}'s head is the LM head ('lm'); leave head out"
    )
  return "lm", asker, None if value is True else asker.of(value)


class RewardModel:
  """A reward model (``model``: flax.nnx.Module), its ``config``, ``tokenizer`` and ``info``
  (:class:`jaxrm.scoring.loading.ScoringInfo`: what training recorded for scoring).

  Attributes (from ``info``):
    reward_stats: {"mean", "std", "from"} of the rewards on the validation set when the model was
      saved by training (used by ``score(normalize=True)``), else None.
    step_separator: the text that ends every step in ``score_steps`` (as in training).
    attributes: a regression model's attribute names, one per output of ``score``, else None.
    training_max_length: the training run's ``data.max_length`` (from the run, or recorded in an
      export of one), else None; the reward server's default limit per item.
    verifier: what an LM head asks: a verifier's question and answers
      (:class:`jaxrm.tasks.verifier.Verifier`), or a pairwise judge's (then also ``judge``), else None.
    task, kind: the model's task as its files record it (:attr:`task`), and its name.
    rendering: how training rendered its rows, and so how every input is scored.

  What a model of one task does beyond this class's methods comes from its task
  (:attr:`jaxrm.tasks.Task.verbs`), bound to the model: a pairwise judge's ``rm.compare``,
  ``rm.score_group``, ``rm.score_groups``, ``rm.judge_text`` and ``rm.judge``
  (:data:`jaxrm.tasks.pairwise.VERBS`). A verb of another task refuses the model, saying
  what it needs; ``rm.judge`` is None for any model but a judge.
  """

  def __init__(self, model: Decoder, tokenizer=None, info: ScoringInfo = ScoringInfo()):
    if not isinstance(info, ScoringInfo):
      raise TypeError(f"info must be a jaxrm.scoring.loading.ScoringInfo, got {type(info).__name__}")
    if (info.verifier is None) != (model.config.head != "lm"):
      raise ValueError(
        f"a {model.config.head} head with info.verifier={info.verifier!r}: an LM head (a verifier's, a "
        "judge's) needs its question and answers, and no other head has them"
      )
    if info.attributes is not None and len(info.attributes) != model.config.num_labels:
      raise ValueError(
        f"{len(info.attributes)} attribute names for a head of {model.config.num_labels} outputs"
      )
    self.model = model
    self.tokenizer = tokenizer
    self.info = info.with_task(model.config)
    self._told: set[str] = set()  # the forms of input already said to be rendered otherwise

  @property
  def config(self) -> ModelConfig:
    return self.model.config

  @property
  def reward_stats(self) -> dict | None:
    return self.info.reward_stats

  @property
  def step_separator(self) -> str:
    return self.info.step_separator

  @property
  def attributes(self) -> tuple[str, ...] | None:
    return self.info.attributes

  @property
  def training_max_length(self) -> int | None:
    return self.info.training_max_length

  @property
  def verifier(self) -> Asker | None:
    return self.info.verifier

  def __getattr__(self, name: str) -> Any:
    """A verb of the model's task (:attr:`jaxrm.tasks.Task.verbs`: a judge's ``compare``), bound to
    this model; a verb only another task has refuses this model in that task's words."""
    info = self.__dict__.get("info")  # not yet set while a copy is made
    verb = None if name.startswith("_") or info is None else tasks.verb(name, info.task)
    if verb is None:
      raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
    return verb.fget(self) if isinstance(verb, property) else types.MethodType(verb, self)

  def __dir__(self) -> list[str]:
    own = () if self.task is None else self.task.verbs
    return sorted({*super().__dir__(), *own})

  @property
  def task(self) -> tasks.Task | None:
    """The model's :mod:`jaxrm.tasks` task, as its files record it (told from its head only for a
    model saved before they did); None for a head of no task."""
    return None if self.info.task is None else tasks.TASKS[self.info.task]

  @property
  def kind(self) -> str:
    """``preference``, ``regression``, ``process``, ``verifier``, ``pairwise`` or ``other`` (see
    :mod:`jaxrm.scoring.kinds`)."""
    return self.info.task or kinds.OTHER

  @property
  def rendering(self) -> str | None:
    """How training rendered its rows, and so how every input is scored: ``"chat_template"`` or
    ``"plain_text"`` (:func:`jaxrm.data.tokenize.rendered_as`); None when the model does not
    record it (each input is rendered as its form says)."""
    return self.info.rendering

  def check_kind(self, *wanted: str, use: str, **kwargs) -> str:
    """This model's kind if it is one of ``wanted``, else a :class:`jaxrm.scoring.kinds.ModelKindError`
    saying what ``use`` needs (:func:`jaxrm.scoring.kinds.check_kind`)."""
    return kinds.check_kind(self, *wanted, use=use, **kwargs)

  @classmethod
  def from_pretrained(
    cls,
    path: str | os.PathLike | loading.Source,
    *,
    dtype: str = "float32",
    param_dtype: str | None = None,
    head: str | None = None,
    num_labels: int | None = None,
    mesh: Mesh | None = None,
    seed: int = 0,
    tokenizer: Any = None,
    step: int | None = None,
    load_weights: bool = True,
    verifier: bool | dict | Asker | None = None,
    **config_overrides,
  ) -> RewardModel:
    """Loads a checkpoint (through :func:`jaxrm.scoring.loading.locate` and :func:`jaxrm.scoring.loading.load`).

    Args:
      path: an HF checkpoint directory (config.json + safetensors), a .gguf file, a training
        output directory (its best checkpoint, or ``step``), or one training checkpoint
        (``<output_dir>/checkpoints/<step>``), or a source :func:`jaxrm.scoring.loading.locate` gave. A LoRA
        run's base is read from where it trained (``model_config.json`` names it), its adapters and
        head from the checkpoint.
      dtype: compute dtype ("float32" | "bfloat16"); parameters default to the same.
      head: "sequence" (one reward per row), "token" (per-token logits, for process reward
        models) or "lm" (a verifier's, as ``verifier=True``); default: whatever the checkpoint was
        saved as (a sequence head for base models).
      num_labels: labels of a new head (default 1 for sequence, 2 for token heads).
      mesh: place parameters sharded over this mesh (default: the first device).
      seed: seed of a newly initialised head.
      tokenizer: use this tokenizer instead of the checkpoint's.
      step: which checkpoint of a training output directory (default: the best one).
      load_weights: False reads no tensors: ``model`` is then abstract, its parameters
        ``jax.ShapeDtypeStruct``s with the shardings they would have on ``mesh`` (e.g. a restore
        target for a training checkpoint), and a training run's checkpoints are not opened
        (``reward_stats`` is None). Config and tokenizer load as usual.
      verifier: score with a causal LM (HF directory or .gguf file) as a generative verifier: True
        (the default question and answers of :mod:`jaxrm.tasks.verifier`), or ``{"question": ...,
        "answers": ["Yes", "No"]}``; the score of a conversation is then ``log p(yes) - log p(no)``
        of the answer to the question asked after it. An export of a verifier, or a training run
        of one, is a verifier without it (True keeps its question; a dict asks another).
      config_overrides: the model config's fields to change, and the keyword of another LM-head
        task's asker (its ``WORD``, :attr:`jaxrm.tasks.Task.asker`): ``judge=`` scores with a
        causal LM (HF directory or .gguf file) as a pairwise judge (:mod:`jaxrm.tasks.pairwise`):
        True (its default question and answers ``A``/``B``), a dict ``{"question": ...,
        "answers": ["A", "B"]}`` or a :class:`~jaxrm.tasks.pairwise.Judge`; it then compares
        responses (``rm.compare``, ``rm.score_group``) instead of scoring one. An export or
        training run of a judge is one without it (True keeps what it recorded).
    """
    asks, verifier_class = None, tasks.first_asker().asker
    asked = [(a, config_overrides.pop(a.WORD)) for a in _askers() if a.WORD in config_overrides]
    asked = [(a, value) for a, value in asked if value not in (None, False)]
    if asked:
      head, asks, verifier = _asked(*asked[0], head, [(verifier_class, verifier), *asked[1:]])
    elif verifier is True:  # a verifier asking what an export or run of one recorded, else the defaults
      if head not in (None, "lm"):
        raise ValueError(f"verifier=True with head={head!r}: a verifier's head is the LM head ('lm')")
      verifier, head, asks = None, "lm", verifier_class
    elif verifier is False:
      verifier = None
    elif verifier is not None:
      verifier = verifier_class.of(verifier)
    overrides = dict(dtype=dtype, param_dtype=param_dtype or dtype, **config_overrides)
    loaded = loading.load(
      loading.as_source(path, step),
      overrides,
      head=head,
      num_labels=num_labels,
      mesh=mesh,
      seed=seed,
      tokenizer=tokenizer,
      weights=load_weights,
      verifier=verifier,
      asks=asks,
    )
    return cls(loaded.model, loaded.tokenizer, loaded.info)

  def save_pretrained(self, out_dir: str | os.PathLike, *, dtype: str | None = None) -> None:
    """Writes an HF checkpoint directory that records this model's :class:`ScoringInfo`
    (see :func:`jaxrm.hf.export.save_pretrained`)."""
    export_files.save_export(out_dir, self.model, self.tokenizer, self.info, dtype=dtype)

  # ---------------------------------------------------------------- scoring

  def _apply(self, input_ids, attention_mask):
    graphdef, state = nnx.split(self.model)
    return _forward(graphdef, state, input_ids, attention_mask)

  def score_tokens(self, input_ids, attention_mask) -> np.ndarray:
    """Rewards float32 [B] at each row's last real token (token heads: logits [B, T, C]).

    Args:
      input_ids: [B, T] int, any padding side.
      attention_mask: [B, T], 1 for real tokens.
    """
    ids = jnp.asarray(np.asarray(input_ids, np.int32))
    mask = jnp.asarray(np.asarray(attention_mask, np.int32))
    return np.asarray(self._apply(ids, mask), np.float32)

  def _tokenizer(self):
    if self.tokenizer is None:
      raise ValueError("this model has no tokenizer; pass tokenizer= to from_pretrained or use score_tokens")
    return self.tokenizer

  def _max_length(self, max_length: int | None) -> int:
    return max_length or self.config.max_position_embeddings

  def encode(
    self,
    item: Text,
    completion: Text | None = None,
    *,
    max_length: int | None = None,
    where: str = "item",
    drops: DropReport | None = None,
  ) -> list[int]:
    """Token ids of a chat (message list) or plain text, laid out as in preference training.

    With ``completion``, ``item`` is its prompt: prompt + completion, as training joins them. A
    row longer than ``max_length`` (default: the model's context) loses its oldest context turns
    or tokens, as training's ``truncation="left"`` does. A verifier's row ends with its question
    and the generation prompt (:mod:`jaxrm.tasks.verifier`). Whatever form it is given in, the row is
    rendered as training rendered its rows (:attr:`rendering`): a conversation given to a model
    trained on plain text is scored as its turns' contents joined; strings given to a model trained
    on conversations are scored as sent (they may be texts the template rendered). The log says
    so the first time. ``drops``, if given, counts the row in ``drops.cut`` where it lost context.
    A pairwise judge lays out no row of one response: it compares two (``rm.judge_text``).
    """
    self._check_one_reward("encode()")
    item = parse_text(item, "encode", where)
    if completion is None:
      context, completion = (item[:-1], item[-1:]) if isinstance(item, list) else ("", item)
    else:
      completion = parse_text(completion, "encode", f"{where} (completion)")
      context = item
    if context and isinstance(context, list) != isinstance(completion, list):
      kinds = ("plain text", "a conversation")
      raise DataError(
        f"{where}: the prompt is {kinds[isinstance(context, list)]} but the completion is "
        f"{kinds[isinstance(completion, list)]}; give both as message lists or both as strings"
      )
    context, completion = self._rendered(context, completion)
    if isinstance(completion, list) and not self._tokenizer().chat_template:
      raise ValueError("the tokenizer has no chat template; score plain strings instead of message lists")
    record = PreferenceRecord(context=context, completions=(completion,), ranks=(0,), source=where)
    limit = self._max_length(max_length)
    question = None if self.verifier is None else self.verifier.question
    options = TokenizeOptions(limit, "left", verifier_question=question)
    example = tokenize_preference(
      record, self._tokenizer(), options, drops if drops is not None else DropReport()
    )
    if example is None:
      raise DataError(f"{where}: the completion alone is longer than max_length={limit} tokens")
    if not len(example.input_ids[0]):
      raise DataError(f"{where}: no tokens to score (empty text)")
    return example.input_ids[0].tolist()

  def _rendered(self, context: Text, completion: Text) -> tuple[Text, Text]:
    """``context`` and ``completion`` as training rendered its rows (:attr:`rendering`); the first
    input of each form rendered otherwise is said in the log."""
    given = rendering(completion)
    context, completion = rendered_as(context, completion, self.rendering)
    if self.rendering in (None, given) or given in self._told:
      return context, completion
    self._told.add(given)
    if self.rendering == PLAIN_TEXT:
      log.info(
        "this model was trained on plain-text rows: conversations are scored as their turns' "
        "contents joined, as training joined its rows"
      )
    else:
      log.info(
        "this model was trained on conversations rendered by the chat template; plain text is "
        "scored as sent: send conversations, or texts the template rendered, to score as training did"
      )
    return context, completion

  def score(
    self,
    items: Sequence[Text] | None = None,
    *,
    prompts: Sequence[Text] | None = None,
    completions: Sequence[Text] | None = None,
    normalize: bool = False,
    batch_size: int = 8,
    bucket: int = 64,
    max_length: int | None = None,
    combine: str | dict[str, float] | Sequence[float] | None = None,
    share_prefix: bool | Sharing = True,
  ) -> np.ndarray:
    """Rewards float32 [N] of chats (message lists) or plain strings; [N, num_labels] for a head
    with several outputs (a regression model: one per name of ``attributes``).

    Give either ``items`` (whole conversations or texts) or ``prompts`` and ``completions``
    (pairs, both message lists or both strings, joined as training joins them).

    Args:
      combine: a multi-output model's scores combined into one [N]: an attribute's name
        (``"helpfulness"``), ``"name=weight,..."``, a dict of names to weights (those left out
        weigh 0), or one weight per output. The weighted sum of the outputs is returned.
      normalize: return (reward - mean) / std with the statistics recorded at validation.
      batch_size: rows per forward pass. Rows are sorted by length, and each batch padded to a
        multiple of ``bucket`` tokens, so few programs compile and little padding is computed.
      max_length: longest row in tokens (default: the model's context); see :meth:`encode`.
      share_prefix: score rows that share a token prefix (completions of one prompt) together,
        the prefix once (:mod:`jaxrm.scoring.shared_prefix`): True (by ``Sharing()``'s rule), a
        :class:`jaxrm.scoring.shared_prefix.Sharing`, or False (every row alone). The rewards are the
        same either way, up to float rounding.
    """
    self._check_one_reward("score()")
    weights = None if combine is None else self.combination(combine)
    encoded = self._encode_items(items, prompts, completions, max_length)
    rewards = self.score_ids(
      encoded, batch_size=batch_size, bucket=bucket, max_length=max_length, share_prefix=share_prefix
    )
    return self.reduce(rewards, combine=weights, normalize=normalize)

  def _check_one_reward(self, use: str) -> None:
    """Refuses ``use``, one reward per row, of a model that gives none: one whose task scores
    otherwise (a process reward model's steps, a pairwise judge's comparisons), or a token head of
    no task. Any other sequence head gives one per output."""
    scores = tasks.scores_of(self.kind)
    gives_none = scores not in ("reward", "attributes") if scores else self.config.per_token
    if gives_none:
      self.check_kind(*tasks.scoring("reward", "attributes"), use=use)

  def reduce(
    self,
    rewards: np.ndarray,
    *,
    combine: str | dict[str, float] | Sequence[float] | None = None,
    normalize: bool = False,
  ) -> np.ndarray:
    """Outputs [N] or [N, C] as :meth:`score` returns them: combined into [N] by ``combine`` (see
    :meth:`score`; weights from :meth:`combination` too), then normalized if asked."""
    if combine is not None:
      weights = self.combination(combine)
      rewards = (np.asarray(rewards, np.float64).reshape(len(rewards), -1) @ weights).astype(np.float32)
    return self.normalized(rewards) if normalize else rewards

  def combination(self, combine: str | dict[str, float] | Sequence[float]) -> np.ndarray:
    """float64 [num_labels]: the weight of each output in ``combine`` (see :meth:`score`)."""
    if isinstance(combine, np.ndarray) and combine.shape == (self.config.num_labels,):
      return combine.astype(np.float64)  # already weights
    names = self.attributes or tuple(f"LABEL_{i}" for i in range(self.config.num_labels))
    try:
      return np.asarray(combination_weights(combine, names), np.float64)
    except ValueError as e:
      raise ValueError(f"score(combine=...): {e}") from None

  def _encode_items(self, items, prompts, completions, max_length) -> list[list[int]]:
    if (items is None) == (prompts is None and completions is None):
      raise ValueError("pass either items, or prompts and completions")
    if items is not None:
      items = parse_texts(items, "items", "score")
      return [self.encode(x, max_length=max_length, where=f"items[{i}]") for i, x in enumerate(items)]
    prompts = None if prompts is None else parse_texts(prompts, "prompts", "score")
    completions = None if completions is None else parse_texts(completions, "completions", "score")
    if prompts is None or completions is None or len(prompts) != len(completions):
      raise ValueError(
        f"prompts and completions must be given together, with as many entries each "
        f"(got {None if prompts is None else len(prompts)} and "
        f"{None if completions is None else len(completions)})"
      )
    return [
      self.encode(p, c, max_length=max_length, where=f"prompts[{i}] + completions[{i}]")
      for i, (p, c) in enumerate(zip(prompts, completions))
    ]

  def score_ids(
    self,
    encoded: Sequence[Sequence[int]],
    *,
    batch_size: int = 8,
    bucket: int = 64,
    max_length: int | None = None,
    share_prefix: bool | Sharing = True,
  ) -> np.ndarray:
    """Sequence-head rewards float32 [N] ([N, C] for several outputs) of rows already encoded
    (:meth:`encode`), batched and shared as :meth:`score` does."""
    out = self.outputs_of_ids(
      encoded, batch_size=batch_size, bucket=bucket, max_length=max_length, share_prefix=share_prefix
    )
    if not out:
      return np.zeros((0,) if self.config.num_labels == 1 else (0, self.config.num_labels), np.float32)
    return np.stack(out)

  def outputs_of_ids(
    self,
    encoded: Sequence[Sequence[int]],
    *,
    batch_size: int = 8,
    bucket: int = 64,
    max_length: int | None = None,
    share_prefix: bool | Sharing = True,
  ) -> list[np.ndarray]:
    """The model's output for each encoded row, in order: its reward(s) (sequence head) or its
    logits [T_i, C] (token head).

    Rows that share a token prefix are scored as shared-prompt packed rows, the prefix once
    (:mod:`jaxrm.scoring.shared_prefix`; ``share_prefix`` as in :meth:`score`); the others in
    right-padded batches of similar lengths (see :meth:`score`). A pass of packed rows holds
    no more tokens than the longest right-padded batch of these rows could.
    """
    out: list[np.ndarray | None] = [None] * len(encoded)
    buckets = self._buckets(bucket, max_length)
    max_tokens = self._max_tokens(encoded, batch_size, buckets)
    groups = shared_prefix.scoring_groups(
      encoded, shared_prefix.as_sharing(share_prefix), self.config, max_tokens
    )
    alone = [g[0] for g in groups if len(g) == 1]
    for rows, outputs in self._batched([encoded[i] for i in alone], batch_size, buckets):
      for j, r in zip(rows, outputs):
        out[alone[j]] = r[: len(encoded[alone[j]])] if self.config.per_token else r
    shared = [g for g in groups if len(g) > 1]
    for rows, outputs in self._shared(encoded, shared, batch_size, bucket, max_tokens):
      for i, r in zip(rows, outputs):
        out[i] = r
    return out

  def prefix_groups(
    self,
    encoded: Sequence[Sequence[int]],
    *,
    batch_size: int = 8,
    bucket: int = 64,
    max_length: int | None = None,
    share_prefix: bool | Sharing = True,
  ) -> list[list[int]]:
    """The indices of ``encoded`` in the groups :meth:`outputs_of_ids` scores together, each as
    one packed row (:func:`jaxrm.scoring.shared_prefix.scoring_groups`); a group of one scores alone."""
    max_tokens = self._max_tokens(encoded, batch_size, self._buckets(bucket, max_length))
    return shared_prefix.scoring_groups(
      encoded, shared_prefix.as_sharing(share_prefix), self.config, max_tokens
    )

  def _buckets(self, bucket: int, max_length: int | None) -> tuple[int, ...]:
    return length_buckets(max(self._max_length(max_length), bucket), bucket)

  @staticmethod
  def _max_tokens(encoded, batch_size: int, buckets: Sequence[int]) -> int:
    """Tokens in one forward pass, at most: as many as the widest right-padded batch of
    ``encoded`` holds."""
    return batch_size * bucket_length(max(map(len, encoded), default=1), buckets)

  def _batched(self, encoded, batch_size: int, buckets: Sequence[int]):
    """Yields (row indices, model outputs) over batches of similar lengths, right-padded.

    A batch holds ``batch_size`` rows, or the next power of two when fewer remain; filler rows
    attend to one token and their outputs are dropped.
    """
    pad = pad_id(self.tokenizer, self.config.pad_token_id)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    for start in range(0, len(order), batch_size):
      rows = order[start : start + batch_size]
      ids, mask = right_padded(
        [encoded[i] for i in rows],
        pad_id=pad,
        num_rows=scoring_rows(len(rows), batch_size),
        length=bucket_length(max(len(encoded[i]) for i in rows), buckets),
      )
      yield rows, self.score_tokens(ids, mask)[: len(rows)]

  def _shared(self, encoded, groups: list[list[int]], batch_size: int, bucket: int, max_tokens: int):
    """Yields (row indices, model outputs) of the rows of ``groups``, each group one packed row
    (see :func:`jaxrm.scoring.shared_prefix.shared_batches`)."""
    pad = pad_id(self.tokenizer, self.config.pad_token_id)
    for shared in shared_prefix.shared_batches(
      encoded,
      groups,
      batch_size=batch_size,
      pad_id=pad,
      buckets=length_buckets(max(max_tokens, bucket), bucket),
      max_tokens=max_tokens,
    ):
      yield shared.rows, self.score_shared(shared)

  def score_shared(self, shared: shared_prefix.SharedRows) -> np.ndarray | list[np.ndarray]:
    """The outputs of the rows packed in ``shared`` (:func:`jaxrm.scoring.shared_prefix.shared_batches`),
    in ``shared.rows`` order: rewards [N] ([N, C]) for a sequence head, each row's logits [T_i, C]
    for a token head."""
    b = shared.batch
    rows = tuple(
      jnp.asarray(x) for x in (b.input_ids, b.attention_mask, b.positions, b.segment_ids, b.branch_ids)
    )
    sequence = not self.config.per_token
    reward_positions = jnp.asarray(b.reward_positions) if sequence else None
    graphdef, state = nnx.split(self.model)
    out = np.asarray(_forward_packed(graphdef, state, rows, reward_positions), np.float32)
    return shared.rewards(out) if sequence else shared.logits(out)

  def normalized(self, rewards: np.ndarray) -> np.ndarray:
    """(rewards - mean) / std with the statistics recorded at validation, as
    ``score(normalize=True)`` returns them."""
    stats = self.reward_stats
    if rewards.ndim > 1:
      raise ValueError(
        "normalize=True applies to one reward per row; combine this model's "
        f"{rewards.shape[-1]} outputs into one (score(..., combine=...)) or score without it"
      )
    if not stats:
      raise ValueError(
        "normalize=True needs the reward mean/std recorded at validation, and this model has "
        "none: load a training output directory or checkpoint whose run validated "
        "(eval.val_period or eval.val_at_end), or an HF export of one"
      )
    if not stats["std"] > 0:
      raise ValueError(f"cannot normalize: the recorded reward std is {stats['std']} ({stats.get('from')})")
    return ((rewards - stats["mean"]) / stats["std"]).astype(np.float32)

  # ---------------------------------------------------------------- step scoring

  def encode_steps(
    self, prompt: Text, steps: Sequence[str], *, max_length: int | None = None, where: str = "prompt"
  ) -> tuple[list[int], list[int]]:
    """(token ids, positions of each step's label) laid out as in stepwise training."""
    opts = TokenizeOptions(self._max_length(max_length), "drop", self.step_separator)
    prompt = parse_text(prompt, "score_steps", where)
    steps = _steps(steps, f"the steps of {where}", self.step_separator)
    record = StepwiseRecord(prompt=prompt, steps=steps, labels=(True,) * len(steps), source=where)
    example = tokenize_stepwise(record, self._tokenizer(), opts, DropReport())
    if example is None:
      raise DataError(
        f"{where}: the prompt and its {len(steps)} steps are longer than max_length={opts.max_length} tokens"
      )
    return example.input_ids.tolist(), np.flatnonzero(example.labels != IGNORE_INDEX).tolist()

  def score_steps(self, prompt: Text, steps: Sequence[str], *, max_length: int | None = None) -> list[float]:
    """Probability that each step is correct (token-head models): class 1 at the step's label token.

    ``steps`` is a list of step texts, each followed by the run's step separator as in training;
    a solution written as one text is cut into them by
    ``jaxrm.scoring.step_rewards.split_steps(text, rm.step_separator)`` (one string is refused).
    """
    _steps(steps, "steps", self.step_separator)
    return self.score_steps_batch([prompt], [steps], max_length=max_length)[0]

  def score_steps_batch(
    self,
    prompts: Sequence[Text],
    steps_lists: Sequence[Sequence[str]],
    *,
    batch_size: int = 8,
    bucket: int = 64,
    max_length: int | None = None,
    share_prefix: bool | Sharing = True,
  ) -> list[list[float]]:
    """:meth:`score_steps` for many solutions, batched by length and shared (solutions of one
    problem share its tokens) like :meth:`score`."""
    self.check_kind(*tasks.scoring("steps"), use="score_steps")
    if (
      isinstance(prompts, str)
      or isinstance(steps_lists, str)
      or not (isinstance(prompts, (list, tuple)) and isinstance(steps_lists, (list, tuple)))
    ):
      raise DataError(
        "score_steps_batch takes a list of prompts and a list of step lists (one per prompt); "
        f"got {json_type(prompts)} and {json_type(steps_lists)}: for one solution use score_steps(prompt, steps)"
      )
    steps_lists = [_steps(s, f"steps_lists[{i}]", self.step_separator) for i, s in enumerate(steps_lists)]
    if len(prompts) != len(steps_lists):
      raise ValueError(f"{len(prompts)} prompts but {len(steps_lists)} step lists")
    out: list[list[float]] = [[] for _ in prompts]
    todo = [i for i, s in enumerate(steps_lists) if len(s)]
    encoded = [
      self.encode_steps(prompts[i], steps_lists[i], max_length=max_length, where=f"prompts[{i}]")
      for i in todo
    ]
    for i, p in zip(
      todo,
      self.step_probabilities(
        encoded, batch_size=batch_size, bucket=bucket, max_length=max_length, share_prefix=share_prefix
      ),
    ):
      out[i] = p
    return out

  def step_probabilities(
    self,
    encoded: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    batch_size: int = 8,
    bucket: int = 64,
    max_length: int | None = None,
    share_prefix: bool | Sharing = True,
  ) -> list[list[float]]:
    """P(step correct) of solutions already encoded (:meth:`encode_steps`: token ids and the
    positions of each step's label), batched and shared as :meth:`score_steps_batch` does."""
    logits = self.outputs_of_ids(
      [ids for ids, _ in encoded],
      batch_size=batch_size,
      bucket=bucket,
      max_length=max_length,
      share_prefix=share_prefix,
    )
    return [
      correct_probability(logits_tc[positions]).tolist()  # [steps, C] -> [steps]
      for logits_tc, (_, positions) in zip(logits, encoded)
    ]

  # ---------------------------------------------------------------- reward functions

  def as_reward_func(
    self,
    *,
    normalize: bool = False,
    batch_size: int = 8,
    name: str = "jaxrm_reward",
    combine=None,
    step_aggregation: str | None = None,
    strategy: str | None = None,
    aggregate: str | None = None,
  ) -> Callable[..., list[float | None]]:
    """A TRL GRPOTrainer reward function; see :func:`jaxrm.scoring.reward_funcs.as_reward_func` (a process
    model's steps made one reward by ``step_aggregation``, default min; a pairwise judge's group
    rewards by ``strategy`` and ``aggregate``, default round_robin and bradley_terry)."""
    return reward_funcs.as_reward_func(
      self,
      normalize=normalize,
      batch_size=batch_size,
      name=name,
      combine=combine,
      step_aggregation=step_aggregation,
      strategy=strategy,
      aggregate=aggregate,
    )

  def as_multi_agent_reward_func(
    self,
    formatter: Callable[..., Text],
    *,
    normalize: bool = False,
    batch_size: int = 8,
    name: str = "jaxrm_reward",
    combine=None,
    step_aggregation: str | None = None,
  ) -> Callable[..., list[float]]:
    """A CoMLRL-style multi-agent reward function; see :func:`jaxrm.scoring.reward_funcs.as_multi_agent_reward_func`."""
    return reward_funcs.as_multi_agent_reward_func(
      self,
      formatter,
      normalize=normalize,
      batch_size=batch_size,
      name=name,
      combine=combine,
      step_aggregation=step_aggregation,
    )
