"""A training run's settings: frozen dataclasses, one per config section, and their defaults.

The library takes a :class:`RunConfig`; config files and the command line use the
``ml_collections.ConfigDict`` that :func:`base_config` builds from the same dataclasses, so every
key, its default and its type are written once, here. Keys follow NeMo RL's names where it has one
(``data.dataset_name``, ``data.train_data_path``, ``data.val_data_paths``,
``checkpointing.metric_name``...). From a notebook::

  from jaxrm.config import RunConfig, TrainSpec
  config = RunConfig(output_dir="runs/nb", train=TrainSpec(max_steps=20, warmup_steps=2))
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxrm import tasks
from jaxrm.data import demo, registry
from jaxrm.data.adapters import HELPSTEER2_ATTRIBUTES
from jaxrm.data.cache import DEFAULT_CACHE_DIR
from jaxrm.data.tokenize import TokenizeOptions
from jaxrm.errors import ConfigError, UserError, did_you_mean
from jaxrm.models.config import ATTENTION_IMPLS, REMAT_POLICIES
from jaxrm.models.lora import ALL_LINEAR, LoraConfig
from jaxrm.run import metrics_writer, optim, report
from jaxrm.run.metrics import finalize_metrics, normalize_metric_name
from jaxrm.sharding import MeshConfig
from jaxrm.tasks import asker as askers

log = logging.getLogger(__name__)

EMBEDDED_MODEL = "embedded:SmolLM2-135M-Instruct"
PACKING_MODES = ("none", "packed", "shared_prompt")
CHANGED_SETTINGS = ("refuse", "start_fresh_keep_old", "start_fresh_remove_old")
REWARD_TYPES = tasks.REWARD_TYPES
RANKING_LOSSES = ("plackett_luce", "all_pairs")
VERIFIER_LOSSES = ("bradley_terry", *RANKING_LOSSES)
# Attribute names stand in metric names such as ``validation-default_mse_helpfulness``.
_ATTRIBUTE_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# What a regression run on these datasets trains on when reward.attributes is not given: all
# that the dataset rates, in the order its adapter reads them.
DEFAULT_ATTRIBUTES = {"HelpSteer2": HELPSTEER2_ATTRIBUTES}
# The demo's validation split; a run on own files without validation leaves it out.
DEFAULT_VAL_DATA_PATHS = {"default": "validation"}
DEFAULT_METRIC_NAME = "validation-default_loss"


# A field annotated with one of these names takes these types (a bool is no number here).
_SIMPLE_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def _check_types(spec, where: str) -> None:
  """Refuses a value of another type than its field's, naming the key: what a notebook may pass
  (a section as a dict, ``max_steps=2.5``, a learning rate as a string); sections are checked
  through."""
  for field in dataclasses.fields(spec):
    value, key = getattr(spec, field.name), f"{where}{field.name}"
    if dataclasses.is_dataclass(field.default):
      section = type(field.default)
      if not isinstance(value, section):
        raise ConfigError(
          f"{key}: a {section.__name__} section, not {type(value).__name__} {value!r:.60}; give "
          f"{section.__name__}(...), or build the whole config with RunConfig.from_dict(...)"
        )
      _check_types(value, f"{key}.")
      continue
    types = _SIMPLE_TYPES.get(field.type)
    if types and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
      raise ConfigError(f"{key}={value!r}: expected {field.type}, got {type(value).__name__}")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """``model.lora``: low-rank adapters trained over a frozen base (peft's key names)."""

  rank: int = 0  # 0: no adapters, the whole model trains
  alpha: float = 16.0  # the update is scaled by alpha / rank
  dropout: float = 0.0  # dropout on each adapter's input, in training only (peft's lora_dropout)
  # peft's module names, comma-separated ("q_proj,v_proj"), or "all-linear"
  target_modules: str = ALL_LINEAR
  base_dtype: str = ""  # the frozen base's storage: "" (model.param_dtype) | bfloat16 | int8 | nf4

  def __post_init__(self):
    if not isinstance(self.target_modules, str):  # a notebook may pass a list of names
      object.__setattr__(self, "target_modules", ",".join(self.target_modules))
    _check_types(self, "model.lora.")
    # LoraConfig checks the values; each message is put under the key it is about.
    for key, kwargs in (
      ("rank", dict(rank=self.rank)),
      ("alpha", dict(alpha=self.alpha)),
      ("dropout", dict(dropout=self.dropout)),
      ("target_modules", dict(targets=self.targets)),
      ("target_modules", dict(rank=self.rank, targets=self.targets)),
      ("base_dtype", None),  # all of them: the model's LoraConfig, kept for later reads
    ):
      try:
        _ = LoraConfig(**kwargs) if kwargs else self.lora_config
      except ConfigError as e:
        raise ConfigError(f"model.lora.{key}={getattr(self, key)!r}: {e}") from None

  @property
  def targets(self) -> tuple[str, ...]:
    return tuple(t.strip() for t in self.target_modules.split(",") if t.strip())

  @functools.cached_property
  def lora_config(self) -> LoraConfig:
    """The model's :class:`~jaxrm.models.lora.LoraConfig`, built once (by the checks)."""
    return LoraConfig(
      rank=self.rank,
      alpha=self.alpha,
      dropout=self.dropout,
      targets=self.targets,
      base_dtype=self.base_dtype or None,
    )


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  name_or_path: str = EMBEDDED_MODEL  # HF dir, .gguf file, hub name, or a jaxrm run/checkpoint dir
  dtype: str = "float32"  # compute dtype: float32 | bfloat16
  param_dtype: str = "float32"  # master weights (and optimizer state)
  # What the backward pass recomputes: none | elementwise (norms, rope, activations from the kept
  # products' outputs; with cuDNN's kernel or context parallelism, as none) | dots | full
  remat: str = "elementwise"
  # True: the layers are one lax.scan (one layer compiled); False: written out one by one (longer
  # compiles, no stacking of each layer's activations for the backward pass)
  scan_layers: bool = True
  # auto (a fused flash kernel on GPU, the reference path elsewhere) | reference | pallas | cudnn
  attention: str = "auto"
  seed: int = 0  # seed of a new reward head
  lora: LoraSpec = LoraSpec()
  # A Jinja chat template replacing the tokenizer's own (empty: the tokenizer's); saved with the
  # run's tokenizer, so scoring and exports lay chats out as training did.
  chat_template: str = ""

  def __post_init__(self):
    _check_types(self, "model.")
    if self.attention not in ATTENTION_IMPLS:
      raise ConfigError(
        f"model.attention must be one of {', '.join(ATTENTION_IMPLS)}; got {self.attention!r}"
      )
    if self.remat not in REMAT_POLICIES:
      raise ConfigError(f"model.remat must be one of {', '.join(REMAT_POLICIES)}; got {self.remat!r}")


def _task_keys() -> dict[str, tasks.Task]:
  """Each task's own reward keys (:attr:`jaxrm.tasks.Task.settings`: a verifier's question and
  answers, a judge's) -> the task; a key two tasks declare stops the import."""
  owners: dict[str, tasks.Task] = {}
  for task in tasks.TASKS.values():
    for key in task.settings:
      if key in owners:
        raise TypeError(f"the {owners[key].name} and {task.name} tasks both declare reward.{key}")
      owners[key] = task
  return owners


_TASK_KEYS = _task_keys()


def _with_task_keys(cls):
  """The reward section ``cls`` with each task's own keys (:data:`_TASK_KEYS`) as fields after its
  own, each meaning kept in its field's metadata (``"help"``) for the config reference."""
  for key, task in _TASK_KEYS.items():
    if key in cls.__annotations__:
      raise TypeError(f"the {task.name} task declares reward.{key}, a key the reward section has already")
    default, meaning = task.settings[key]
    cls.__annotations__[key] = type(default).__name__
    setattr(cls, key, dataclasses.field(default=default, metadata={"help": meaning}))
  return cls


@dataclasses.dataclass(frozen=True)
@_with_task_keys
class RewardSpec:
  """``reward``: which loss trains the model.

  The comma-separated keys are parsed once; the parsed values are cached beside the fields, not
  in them, so they stay out of ``to_dict()``, equality and the repr. Besides the keys below, it
  holds each task's own (:attr:`jaxrm.tasks.Task.settings`: ``verifier_question``,
  ``verifier_answers``, ``judge_question``, ``judge_answers``).
  """

  # the loss and task: one of tasks.REWARD_TYPES (each task lists the values that train it)
  type: str = dataclasses.field(default="bradley_terry", metadata={"help": " | ".join(tasks.REWARD_TYPES)})
  ranking_loss: str = "plackett_luce"  # for type=ranking: plackett_luce | all_pairs
  center_rewards_coefficient: float = 0.0  # TRL's: adds coef * mean((r_chosen + r_rejected)^2) to the loss
  # bradley_terry: weight each pair's loss by its annotated preference strength (scaled BT)
  preference_strength_scaling: bool = False
  # regression: the rated attributes, comma-separated, in the order of the head's outputs
  attributes: str = ""
  # regression: each attribute's weight in the loss, comma-separated ("": all 1)
  attribute_weights: str = ""
  # regression: "low,high"; a rating outside is refused ("": any finite number)
  attribute_range: str = ""
  # regression: what validation's pairwise_accuracy ranks by: an attribute, or
  # "name=weight,..." ("": the first attribute)
  combine: str = ""
  # verifier: the loss on its log-odds: bradley_terry | plackett_luce | all_pairs
  verifier_loss: str = "bradley_terry"

  def __post_init__(self):
    _check_types(self, "reward.")
    _ = self.task  # refuses an unknown type, naming the known ones
    if self.ranking_loss not in RANKING_LOSSES:
      raise ValueError(
        f"reward.ranking_loss must be one of {', '.join(RANKING_LOSSES)}; got {self.ranking_loss!r}"
      )
    if self.verifier_loss not in VERIFIER_LOSSES:
      raise ValueError(
        f"reward.verifier_loss must be one of {', '.join(VERIFIER_LOSSES)}; got {self.verifier_loss!r}"
      )
    if self.preference_strength_scaling and self.type != "bradley_terry":
      raise ValueError(
        f"reward.preference_strength_scaling applies to reward.type='bradley_terry', not {self.type!r}"
      )
    for key, task in _TASK_KEYS.items():
      if task is not self.task and getattr(self, key) != task.settings[key][0]:
        types = " or ".join(map(repr, task.reward_types))
        raise ValueError(f"reward.{key} applies to reward.type={types}, not {self.type!r}")
    _ = self.verifier  # refuses a bad question or answers
    if self.task.per_attribute:
      # Parsed here, once: each property refuses a bad value of its key (attributes through all
      # three), and keeps what it parsed for later reads.
      _ = self.weights, self.value_range, self.combination

  @functools.cached_property
  def task(self) -> tasks.Task:
    """The task this reward type trains (:mod:`jaxrm.tasks`), found once (by the checks)."""
    return tasks.of_reward_type(self.type)

  @functools.cached_property
  def verifier(self) -> askers.Asker | None:
    """What a run of an LM-head task asks (its task's ``asker``: a verifier's question and answers,
    ``reward.type='verifier'``; a pairwise judge's, ``pairwise``); None for others."""
    return None if self.task.asker is None else self.task.asker.of_spec(self)

  @functools.cached_property
  def attribute_names(self) -> tuple[str, ...]:
    """``attributes`` as a tuple; refused when empty, repeated or unfit for metric names."""
    names = tuple(a.strip() for a in self.attributes.split(",") if a.strip())
    if not names:
      raise ValueError(
        "reward.attributes is empty: reward.type='regression' needs the rated attributes, "
        "e.g. reward.attributes='helpfulness,correctness,coherence,complexity,verbosity'"
      )
    for name in names:
      if not _ATTRIBUTE_NAME.fullmatch(name):
        raise ValueError(
          f"reward.attributes: {name!r} cannot stand in metric names; use letters, digits, '_', '-' and '.'"
        )
    if len(set(names)) < len(names):
      raise ValueError(f"reward.attributes={self.attributes!r} names an attribute twice")
    return names

  @functools.cached_property
  def weights(self) -> tuple[float, ...]:
    """One loss weight per attribute."""
    names = self.attribute_names
    if not self.attribute_weights.strip():
      return (1.0,) * len(names)
    try:
      weights = tuple(float(w) for w in self.attribute_weights.split(","))
    except ValueError:
      raise ValueError(
        f"reward.attribute_weights={self.attribute_weights!r}: give comma-separated numbers, "
        f"one per attribute ({', '.join(names)})"
      ) from None
    if len(weights) != len(names):
      raise ValueError(
        f"reward.attribute_weights has {len(weights)} weights for the {len(names)} attributes "
        f"({', '.join(names)}); give one per attribute"
      )
    if not all(math.isfinite(w) and w >= 0 for w in weights) or not any(weights):
      raise ValueError(
        f"reward.attribute_weights={self.attribute_weights!r}: weights must be >= 0, not all 0"
      )
    return weights

  @functools.cached_property
  def value_range(self) -> tuple[float, float] | None:
    """``attribute_range`` as (low, high), or None."""
    if not self.attribute_range.strip():
      return None
    try:
      low, high = (float(x) for x in self.attribute_range.split(","))
    except ValueError:
      raise ValueError(
        f"reward.attribute_range={self.attribute_range!r}: give 'low,high', e.g. '0,4'"
      ) from None
    if not low < high:
      raise ValueError(f"reward.attribute_range={self.attribute_range!r}: low must be below high")
    return low, high

  @functools.cached_property
  def combination(self) -> tuple[float, ...]:
    """One weight per attribute: how validation's pairwise accuracy combines them."""
    names = self.attribute_names
    return combination_weights(self.combine or names[0], names, where="reward.combine")

  @property
  def loss_key(self) -> tuple[str, str | None]:
    """This spec's key in its task's losses: ``ranking_loss`` matters to ``ranking`` only,
    ``verifier_loss`` to ``verifier`` only (the task's ``loss_choice``)."""
    choice = self.task.loss_choice
    return self.task.loss_key(self.type, getattr(self, choice) if choice else None)


def combination_weights(
  combine: str | Mapping[str, float] | Sequence[float], attributes: Sequence[str], where: str = "combine"
) -> tuple[float, ...]:
  """One weight per attribute of a combination of them.

  ``combine`` is an attribute's name (``"helpfulness"``), ``"name=weight,..."`` (attributes left
  out weigh 0), a mapping of names to weights, or one weight per attribute.
  """
  if isinstance(combine, str):
    entries = [e.strip() for e in combine.split(",") if e.strip()]
    if not entries:
      raise ValueError(
        f"{where} is empty; name an attribute (one of {', '.join(attributes)}) or give name=weight pairs"
      )
    combine = dict(_weight_entry(e, where) for e in entries)
  if isinstance(combine, Mapping):
    unknown = sorted(set(combine) - set(attributes))
    if unknown:
      raise ValueError(
        f"{where} names {', '.join(map(repr, unknown))}, not among the model's attributes "
        f"{', '.join(attributes)}"
      )
    weights = tuple(float(combine.get(a, 0.0)) for a in attributes)
  else:
    weights = tuple(float(w) for w in combine)
    if len(weights) != len(attributes):
      raise ValueError(
        f"{where} has {len(weights)} weights for {len(attributes)} attributes "
        f"({', '.join(attributes)}); give one per attribute"
      )
  if not all(math.isfinite(w) for w in weights) or not any(weights):
    raise ValueError(f"{where}={combine!r}: weights must be finite and not all 0")
  return weights


def _weight_entry(entry: str, where: str) -> tuple[str, float]:
  name, _, weight = entry.partition("=")
  try:
    return name.strip(), float(weight) if weight else 1.0
  except ValueError:
    raise ValueError(f"{where}: {entry!r} is not 'name' or 'name=weight' (weight a number)") from None


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """``data``: what is trained and validated on, and how it is tokenized and batched.

  Own data needs only ``train_data_path``: a demo ``dataset_name`` then reads it in the file format
  of its rows (``PreferenceDataset`` for ``demo_arithmetic``), and the demo's validation split
  (``val_data_paths={"default": "validation"}``) is left out, as is any set whose path is empty or
  a split name, which a file format has none of. ``val_data_paths`` maps set names to paths; on the
  command line ``--config.data.val_data_paths.<name>=<path>`` sets or adds one.
  """

  dataset_name: str = "demo_arithmetic"  # the data format or named set (docs: Reward tasks and data)
  train_data_path: str = ""  # empty: the dataset's default (demo sets: made on the spot)
  # validation set name -> path; each set's metrics are validation-<name>_<metric>
  val_data_paths: dict[str, str] = dataclasses.field(default_factory=lambda: dict(DEFAULT_VAL_DATA_PATHS))
  max_length: int = 256  # tokens per sequence (prompt + completion); longer rows: see truncation
  truncation: str = "drop"  # over-long rows: drop (counted) | left (lose their oldest context)
  step_separator: str = "\n"  # written after each step of a stepwise row; its label sits on it
  train_on_last_step_only: bool = False  # stepwise: only the last step of each row is labelled
  bucket_multiple: int = 64  # batch lengths are multiples of this (one compiled step per length)
  # none | packed (several sequences per row) | shared_prompt (packed, a group's prompt written once)
  packing: str = "none"
  # Tokens per packed row; 0: each batch's rows as long as its longest group (at most
  # max_length x completions per group), rounded up to bucket_multiple.
  packed_row_length: int = 0
  # > 0: each batch's packed rows fitted, their length (a multiple of this, at most the rows'
  # length above) and count chosen together for the fewest fed token slots; more compiled shapes.
  packed_fit_multiple: int = 0
  num_workers: int = 0  # Grain worker processes reading batches (0: in the training process)
  shuffle_seed: int = 0  # seed of the order of training rows, reshuffled every epoch
  max_train_rows: int = 0  # 0: all
  max_val_rows: int = 0  # per validation set; 0: all
  # Tokenized sets are kept in cache_dir ("": ~/.cache/jaxrm/tokenized), keyed by everything that
  # changes them, and read back by later starts; False: tokenize at every start.
  cache: bool = True
  cache_dir: str = ""  # where tokenized sets are kept ("": ~/.cache/jaxrm/tokenized)
  num_proc: int = 1  # tokenizer processes when a set is tokenized (datasets' num_proc); 0: one per CPU
  # Train in Hugging Face's group_by_length order (shuffle, then sort by length within mega-batches
  # of 50 batches): less padding in unpacked batches, at the cost of batches of similar lengths.
  group_by_length: bool = False

  def __post_init__(self):
    _check_types(self, "data.")
    _own_data(self)
    for name in self.val_data_paths:
      registry.check_val_set_name(name)  # it stands in metric names
    if self.packing not in PACKING_MODES:
      raise ConfigError(f"data.packing must be one of {', '.join(PACKING_MODES)}; got {self.packing!r}")
    if self.packed_row_length < 0:
      raise ConfigError(
        f"data.packed_row_length={self.packed_row_length}: use a number of tokens per "
        "row, or 0 to size rows from each batch's longest group"
      )
    if self.packed_fit_multiple < 0:
      raise ConfigError(
        f"data.packed_fit_multiple={self.packed_fit_multiple}: use a number of tokens that fitted "
        "row lengths are multiples of (512 on a GPU), or 0 for rows of one length per batch"
      )
    if self.group_by_length and self.packing != "none":
      # Packed rows are filled from many groups and carry no per-batch padding to save.
      raise ConfigError(
        f"data.group_by_length=True orders unpacked batches; data.packing={self.packing!r} "
        "already fills rows: set data.packing='none' or data.group_by_length=False"
      )
    if self.num_proc < 0:
      raise ConfigError(f"data.num_proc={self.num_proc}: use a number of processes, or 0 for one per CPU")
    if self.cache_dir and not self.cache:
      log.warning("data.cache_dir=%r is not used: data.cache is False", self.cache_dir)

  @property
  def cache_directory(self) -> str | None:
    """Where tokenized sets are cached; None when ``data.cache`` is off."""
    return os.path.expanduser(self.cache_dir or DEFAULT_CACHE_DIR) if self.cache else None

  @property
  def tokenizer_processes(self) -> int:
    return self.num_proc or os.cpu_count() or 1

  @property
  def tokenize_options(self) -> TokenizeOptions:
    return TokenizeOptions(
      max_length=self.max_length,
      truncation=self.truncation,
      step_separator=self.step_separator,
      train_on_last_step_only=self.train_on_last_step_only,
    )


def _own_data(spec: DataSpec) -> None:
  """Reads ``train_data_path`` in its rows' file format where ``dataset_name`` is a demo set (which
  makes its own rows), and keeps only the validation sets a file format can read."""
  if not isinstance(spec.dataset_name, str):
    raise ConfigError(
      f"data.dataset_name={spec.dataset_name!r}: use one of {', '.join(registry.DATASET_NAMES)}"
    )
  known = spec.dataset_name in registry.DATASET_NAMES  # an unknown name is refused with the data's checks
  path = spec.train_data_path
  if known and path and path not in demo.SPLITS and registry.is_demo(spec.dataset_name):
    own = registry.FILE_FORMATS[registry.rows_of(spec.dataset_name)]
    log.info(
      "data.train_data_path=%r is read as %s rows (data.dataset_name=%r makes its own rows)",
      path,
      own,
      spec.dataset_name,
    )
    object.__setattr__(spec, "dataset_name", own)
  if not known or not registry.reads_paths_only(spec.dataset_name):
    return
  kept = {}
  for name, val_path in dict(spec.val_data_paths).items():
    if val_path and val_path not in registry.SPLIT_NAMES:
      kept[name] = val_path
    elif (name, val_path) not in DEFAULT_VAL_DATA_PATHS.items():
      log.warning(
        "data.val_data_paths.%s=%r is left out: %s reads only the files it is given; set it to "
        "a file to validate on",
        name,
        val_path,
        spec.dataset_name,
      )
  if not kept and spec.val_data_paths:
    log.info(
      "no validation set: %s has none unless data.val_data_paths names its files "
      "(--config.data.val_data_paths.default=val.jsonl)",
      spec.dataset_name,
    )
  object.__setattr__(spec, "val_data_paths", kept)


@dataclasses.dataclass(frozen=True)
class TrainSpec:
  global_batch_size: int = 16  # groups (pairs, ranked lists or stepwise rows) per update
  micro_batch_size: int = 16  # groups per device per forward pass (gradient accumulation)
  max_steps: int = 100  # optimizer updates, the data repeated as needed (as TRL's max_steps)
  max_epochs: int = 0  # 0: max_steps alone ends the run; else whichever of the two comes first (NeMo RL)
  learning_rate: float = 1e-5  # peak learning rate, after warmup
  # transformers' get_scheduler names (TRL's lr_scheduler_type): cosine | cosine_with_min_lr | linear
  # | constant (no warmup) | constant_with_warmup | inverse_sqrt ("inverse-square-root" too)
  lr_scheduler: str = "cosine"
  min_lr_ratio: float = 0.0  # where cosine and linear end, as a fraction of learning_rate
  warmup_steps: int = 10  # steps of linear warmup from 0 to learning_rate
  weight_decay: float = 0.0  # AdamW's decoupled weight decay
  max_grad_norm: float = 1.0  # gradients clipped to this global norm (0: no clipping)
  # AdamW's betas and eps, under TRL's names (NeMo RL: optimizer.kwargs.betas / eps, or Megatron's
  # adam_beta1 / adam_beta2 / adam_eps); NeMo RL's RM recipe uses 0.9, 0.98 and 1e-5.
  adam_beta1: float = 0.9
  adam_beta2: float = 0.999  # see adam_beta1
  adam_epsilon: float = 1e-8  # see adam_beta1
  seed: int = 0  # seed of the training randomness (LoRA dropout)
  log_period: int = 5  # steps between training-metric rows (and console lines off a terminal)

  def __post_init__(self):
    _check_types(self, "train.")
    try:
      object.__setattr__(self, "lr_scheduler", optim.scheduler_name(self.lr_scheduler))
    except ValueError as e:
      raise ConfigError(f"train.{e}") from None
    # NaN and infinities fail every one of these.
    for key, positive, example in (
      ("learning_rate", True, "1e-5 (TRL's --learning_rate, NeMo RL's optimizer.kwargs.lr)"),
      ("weight_decay", False, "0.0 or 0.01 (TRL's --weight_decay)"),
      ("max_grad_norm", False, "1.0, or 0 for no clipping (TRL's --max_grad_norm)"),
    ):
      value = getattr(self, key)
      number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
      if not number or value < 0 or (positive and value == 0):
        raise ConfigError(
          f"train.{key}={value!r}: use a {'positive' if positive else 'non-negative'} finite number, "
          f"e.g. {example}"
        )
    for key in ("adam_beta1", "adam_beta2"):
      if not 0.0 <= getattr(self, key) < 1.0:
        raise ConfigError(
          f"train.{key}={getattr(self, key)!r}: use a number in [0, 1), e.g. 0.9 for "
          "adam_beta1 and 0.999 (or NeMo RL's 0.98) for adam_beta2"
        )
    if not 0.0 < self.adam_epsilon < math.inf:
      raise ConfigError(
        f"train.adam_epsilon={self.adam_epsilon!r}: use a small positive number, e.g. 1e-8 "
        "(NeMo RL's RM recipe: 1e-5)"
      )
    if not 0.0 <= self.min_lr_ratio <= 1.0:
      raise ConfigError(
        f"train.min_lr_ratio={self.min_lr_ratio!r}: use a fraction of learning_rate in [0, 1]"
      )
    if self.lr_scheduler == "cosine_with_min_lr" and self.min_lr_ratio == 0.0:
      raise ConfigError(
        "train.lr_scheduler='cosine_with_min_lr' needs train.min_lr_ratio > 0 (e.g. 0.1); "
        "use 'cosine' to decay to 0"
      )
    if self.warmup_steps < 0:
      raise ConfigError(f"train.warmup_steps={self.warmup_steps}: use a number of steps, or 0 for no warmup")
    if self.max_steps < 1:
      raise ConfigError(f"train.max_steps={self.max_steps}: use a positive number of optimizer updates")
    if self.max_epochs < 0:
      raise ConfigError(
        f"train.max_epochs={self.max_epochs}: use a number of epochs, or 0 for train.max_steps alone"
      )
    self.check_steps(self.max_steps, f"train.max_steps={self.max_steps}")
    if self.lr_scheduler == "constant" and self.warmup_steps:
      log.warning(
        "train.warmup_steps=%d is ignored: train.lr_scheduler='constant' has no warmup (as in "
        "transformers); use 'constant_with_warmup' to keep it",
        self.warmup_steps,
      )

  def check_steps(self, total_steps: int, why: str) -> None:
    """Raises ConfigError if a run of ``total_steps`` (set as ``why`` says) leaves this schedule no
    steps to decay after warmup."""
    if self.lr_scheduler in optim.DECAYING and total_steps <= self.warmup_steps:
      raise ConfigError(
        f"{why} ends the run within train.warmup_steps={self.warmup_steps}, leaving "
        f"train.lr_scheduler={self.lr_scheduler!r} no steps to decay: lower train.warmup_steps (e.g. "
        f"--config.train.warmup_steps={max(total_steps // 4, 1) if total_steps > 1 else 0}), or use "
        "--config.train.lr_scheduler=constant_with_warmup"
      )


@dataclasses.dataclass(frozen=True)
class EvalSpec:
  val_period: int = 50  # steps between validation rounds (0: none during training)
  val_at_start: bool = False  # validate before the first step
  val_at_end: bool = True  # validate after the last step
  val_batches: int = 0  # 0: the whole validation set
  batch_size: int = 32  # groups per validation batch


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
  enabled: bool = True  # save checkpoints (False: the run keeps none and cannot resume)
  checkpoint_dir: str = ""  # empty: <output_dir>/checkpoints
  # NeMo RL's "val:" prefix is accepted; "": checkpoints kept by recency (the default when no
  # validation set is left, as on own files without data.val_data_paths)
  metric_name: str = DEFAULT_METRIC_NAME
  higher_is_better: bool = False  # whether a larger metric_name is a better checkpoint
  keep_top_k: int = 2  # best checkpoints kept by metric_name (the latest is kept too, for resuming)
  save_period: int = 50  # steps between checkpoints

  @property
  def metric(self) -> str | None:
    """``metric_name`` without NeMo RL's ``val:`` prefix; None when checkpoints are not ranked."""
    return normalize_metric_name(self.metric_name)


@dataclasses.dataclass(frozen=True)
class WandbSpec:
  """Weights & Biases run settings, as NeMo RL's ``logger.wandb`` names them."""

  project: str = "jaxrm"  # the W&B project
  name: str = ""  # empty: the output directory's name


@dataclasses.dataclass(frozen=True)
class MlflowSpec:
  """MLflow run settings, as NeMo RL's ``logger.mlflow`` names them."""

  experiment_name: str = "jaxrm"  # the MLflow experiment
  run_name: str = ""  # empty: the output directory's name
  tracking_uri: str = ""  # empty: MLFLOW_TRACKING_URI, else <output_dir>/mlruns


@dataclasses.dataclass(frozen=True)
class LoggerSpec:
  """Where metrics go besides ``metrics.jsonl``. ``wandb_enabled``, ``mlflow_enabled`` and
  ``monitor_gpus`` are NeMo RL's names for the same settings."""

  tensorboard: bool = True  # write TensorBoard events into log_dir
  log_dir: str = ""  # empty: <output_dir>/tensorboard
  # A progress bar on a terminal; elsewhere (a log file) a plain line every train.log_period steps
  progress_bar: bool = True
  wandb_enabled: bool = False  # log to Weights & Biases (pip install 'jaxrm[wandb]')
  wandb: WandbSpec = WandbSpec()
  mlflow_enabled: bool = False  # log to MLflow (pip install 'jaxrm[mlflow]')
  mlflow: MlflowSpec = MlflowSpec()
  monitor_gpus: bool = False  # device memory per step (GPUs)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything a training run is told; each field is one section of the config."""

  output_dir: str = "runs/rm"  # the run directory: checkpoints, metrics, config, tokenizer
  # When output_dir holds a run trained with other settings: refuse (say which differ), or start
  # afresh there, the old run's files moved into output_dir/old-<time>/ or removed.
  changed_settings: str = "refuse"
  model: ModelSpec = ModelSpec()
  reward: RewardSpec = RewardSpec()
  data: DataSpec = DataSpec()
  train: TrainSpec = TrainSpec()
  eval: EvalSpec = EvalSpec()
  checkpointing: CheckpointSpec = CheckpointSpec()
  mesh: MeshConfig = MeshConfig()
  logger: LoggerSpec = LoggerSpec()

  def __post_init__(self):
    _check_types(self, "")
    if not isinstance(self.output_dir, str) or not self.output_dir.strip():
      raise ConfigError(
        f"output_dir={self.output_dir!r}: name the folder the run writes into (output_dir='runs/rm'; "
        "on the command line --config.output_dir=runs/rm)"
      )
    if self.changed_settings not in CHANGED_SETTINGS:
      raise ConfigError(
        f"changed_settings={self.changed_settings!r}; expected one of {', '.join(CHANGED_SETTINGS)}"
      )
    task = self.reward.task
    if self.data.packing not in task.batches:
      raise ConfigError(task.packing_refused.format(packing=self.data.packing))
    if self.data.packing == "none" and self.data.packed_row_length:
      log.warning("data.packed_row_length=%d is ignored: data.packing is 'none'", self.data.packed_row_length)
    if self.data.packing == "none" and self.data.packed_fit_multiple:
      log.warning(
        "data.packed_fit_multiple=%d is ignored: data.packing is 'none'", self.data.packed_fit_multiple
      )
    _check_context_lengths(self)
    if self.checkpointing.metric == DEFAULT_METRIC_NAME and "default" not in self.data.val_data_paths:
      _rank_by_first_set(self)
    if self.checkpointing.enabled:
      _check_checkpoint_metric(self)
      _warn_of_unranked_saves(self)

  @property
  def stepwise(self) -> bool:
    return self.reward.task.scores == "steps"

  @property
  def tokenize_options(self) -> TokenizeOptions:
    """How the run's records are tokenized: ``data``'s options, as the task's asker reads them (a verifier's
    question after each completion, a judge's pairs in both orders)."""
    asker = self.reward.verifier
    return self.data.tokenize_options if asker is None else asker.tokenize_options(self.data.tokenize_options)

  def to_dict(self) -> dict[str, Any]:
    """The nested dict of every key (what ``config.json`` holds)."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> RunConfig:
    """Inverse of :meth:`to_dict`; sections or keys left out keep their defaults.

    A regression run on a dataset of :data:`DEFAULT_ATTRIBUTES` without ``reward.attributes``
    trains on all that the dataset rates.
    """
    kwargs = {}
    for name, value in _with_default_attributes(d).items():
      section = _SECTIONS.get(name)
      if section is None and name not in _TOP_KEYS:
        raise ConfigError(f"the config has no key {name!r}; it has {', '.join([*_TOP_KEYS, *_SECTIONS])}")
      kwargs[name] = value if section is None else _section(section, name, value)
    return cls(**kwargs)


_TOP_KEYS = ("output_dir", "changed_settings")
_SECTIONS = {
  "model": ModelSpec,
  "reward": RewardSpec,
  "data": DataSpec,
  "train": TrainSpec,
  "eval": EvalSpec,
  "checkpointing": CheckpointSpec,
  "mesh": MeshConfig,
  "logger": LoggerSpec,
}


def _rates_attributes(reward_type: Any) -> bool:
  """Whether ``reward_type`` trains one output per rated attribute; False for a type no task trains
  (RewardSpec refuses it, naming the known ones)."""
  return any(t.per_attribute for t in tasks.TASKS.values() if reward_type in t.reward_types)


def _with_default_attributes(d: dict[str, Any]) -> dict[str, Any]:
  """``d`` with ``reward.attributes`` filled in from its dataset's, where it has none and may."""
  reward, data = d.get("reward"), d.get("data")
  if (
    not isinstance(reward, dict)
    or not _rates_attributes(reward.get("type", RewardSpec.type))
    or str(reward.get("attributes", "")).strip()
  ):
    return d
  dataset = (
    data.get("dataset_name", DataSpec.dataset_name) if isinstance(data, dict) else DataSpec.dataset_name
  )
  if dataset not in DEFAULT_ATTRIBUTES:
    return d  # RewardSpec refuses the empty attributes, saying what to give
  return {**d, "reward": {**reward, "attributes": ",".join(DEFAULT_ATTRIBUTES[dataset])}}


def from_config_dict(config) -> RunConfig:
  """The :class:`RunConfig` of an ``ml_collections.ConfigDict`` (a config file's ``get_config()``).

  Raises:
    ConfigError: a value that cannot work, named by its key.
    DataError: a validation set name that cannot stand in metric names.
  """
  try:
    return RunConfig.from_dict(config.to_dict())
  except UserError:
    raise
  except ValueError as e:  # a section's own check (e.g. RewardSpec, MeshConfig)
    raise ConfigError(str(e)) from None


def base_config():
  """Every config key with its default, as the ``ConfigDict`` config files start from.

  Overriding a key that does not exist, or with a value of the wrong type, fails when the
  command line is parsed.
  """
  import ml_collections

  return ml_collections.ConfigDict(RunConfig().to_dict())


def _section(section_type, name: str, values: dict[str, Any]):
  """``section_type`` from a dict; a field whose default is a dataclass is a nested section."""
  fields = {f.name: f for f in dataclasses.fields(section_type)}
  unknown = sorted(set(values) - set(fields))
  if unknown:
    raise ConfigError(f"config.{name} has no key {unknown[0]!r}; it has {', '.join(sorted(fields))}")
  kwargs = {}
  for key, value in values.items():
    nested = type(fields[key].default)
    if dataclasses.is_dataclass(nested) and not isinstance(value, nested):
      if not isinstance(value, dict):
        raise ConfigError(
          f"config.{name}.{key} is a section ({', '.join(f.name for f in dataclasses.fields(nested))}); "
          f"got {value!r}"
        )
      value = _section(nested, f"{name}.{key}", value)
    kwargs[key] = value
  return section_type(**kwargs)


def _rank_by_first_set(config: RunConfig) -> None:
  """The default ``checkpointing.metric_name`` (also in NeMo RL's spelling, ``val:`` first) where no
  set is named "default": the first set's loss, or none (checkpoints kept by recency) without a
  validation set."""
  sets = list(config.data.val_data_paths)
  metric = f"validation-{sets[0]}_loss" if sets else ""
  if sets:
    log.info("checkpoints are ranked by %s (checkpointing.metric_name)", metric)
  else:
    log.info("checkpoints are kept by recency: there is no validation set to rank them by")
  object.__setattr__(config, "checkpointing", dataclasses.replace(config.checkpointing, metric_name=metric))


def _check_context_lengths(config: RunConfig) -> None:
  """Rows must split into mesh.context's equal chunks (2 per shard with zigzag balance)."""
  mesh, data = config.mesh, config.data
  if mesh.context == 1:
    return
  if mesh.context == -1:
    raise ConfigError(
      "mesh.context=-1: give the number of devices that split each row (rows must "
      "be sized to it); -1 suits data or fsdp"
    )
  chunks = mesh.context * (2 if mesh.context_balance == "zigzag" else 1)
  why = (
    f"mesh.context={mesh.context} with mesh.context_balance={mesh.context_balance!r} splits each "
    f"row into {chunks} chunks"
  )
  lengths = {"data.bucket_multiple": data.bucket_multiple}
  if data.packing == "none":
    lengths["data.max_length"] = data.max_length  # the longest bucket
  elif data.packed_row_length:
    lengths["data.packed_row_length"] = data.packed_row_length
  for key, value in lengths.items():
    if value % chunks:
      raise ConfigError(f"{key}={value}: {why}; set {key} to a multiple of {chunks}")


def check_run_settings(config: RunConfig) -> None:
  """Checks the settings that parsing ``config`` leaves to the run, as they cost a trace or an
  import, so that a run that cannot work stops before its model loads: that
  ``checkpointing.metric_name`` is a metric validation reports, the loggers' packages and MLflow's URI.

  Raises:
    ConfigError: a metric validation does not report, a logger that cannot start.
  """
  _check_checkpoint_metric(config, validation_metrics(config.reward))
  metrics_writer.check_loggers(config.logger)


def validation_metrics(reward: RewardSpec) -> tuple[str, ...]:
  """The metrics validation reports for each set of a run trained with ``reward`` (the ``<name>``
  of ``validation-<set>_<name>``): what ``checkpointing.metric_name`` can rank by.

  Read from the loss itself, traced on a tiny batch of its task (nothing is computed on a device),
  and named as :func:`jaxrm.run.metrics.finalize_metrics` names them.
  """
  outputs, batch = reward.task.example(reward)
  _, shapes = jax.eval_shape(tasks.batch_loss(reward, samples=True), outputs, batch)
  return tuple(finalize_metrics(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)))


def _check_checkpoint_metric(config: RunConfig, reported: Sequence[str] | None = None) -> None:
  """``checkpointing.metric_name`` names a validation set and, given the metrics validation
  ``reported`` (:func:`validation_metrics`), one of those."""
  metric = config.checkpointing.metric
  if not (config.checkpointing.enabled and metric):
    return
  sets = list(config.data.val_data_paths)
  per_set = report.split_validation_metrics({metric: 0.0}, sets)
  if not per_set:
    raise ConfigError(
      f"checkpointing.metric_name={config.checkpointing.metric_name!r} names no validation set; use "
      f"'validation-<set>_<metric>' with <set> one of {', '.join(sets) or '(none: data.val_data_paths is empty)'}, "
      "e.g. 'validation-default_loss' (or set it to '' to keep the latest checkpoints)"
    )
  for val_set, metrics in per_set.items():  # one set: the longest name the metric starts with
    (name,) = metrics
    if reported is not None and name not in reported:
      full = lambda n, val_set=val_set: f"validation-{val_set}_{n}"
      raise ConfigError(
        f"checkpointing.metric_name={config.checkpointing.metric_name!r} is not a validation metric; "
        f"available: {', '.join(map(full, report.metric_order(reported)))}"
        f"{did_you_mean([name], reported, spelled=full)}"
      )


def _warn_of_unranked_saves(config: RunConfig) -> None:
  """Checkpoints saved between validations have no metric to rank them by."""
  if not config.checkpointing.metric:
    return
  val_period, save_period = config.eval.val_period, config.checkpointing.save_period
  if save_period and (not val_period or save_period % val_period):
    log.warning(
      "checkpointing.save_period=%d is not a multiple of eval.val_period=%d: checkpoints saved "
      "without a validation are kept only while they are the latest",
      save_period,
      val_period,
    )
