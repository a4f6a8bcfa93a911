r"""NeMo RL's reward-model recipe (its ``examples/configs/rm.yaml``), run as it is.

  python -m jaxrm.train --nemo_config=rm.yaml policy.model_name=/models/llama data.train_data_path=t.jsonl

The YAML is read as NeMo RL reads it (``nemo_rl.utils.config.load_config_with_inheritance``):
OmegaConf, a ``defaults:`` file (or list of files) underneath, each an absolute path or one
relative to the directory of the file naming it, merged in order (a section marked
``_override_: true`` replaces the inherited one instead of merging into it), then the
``section.key=value`` overrides (``+key=value`` adds a key the YAML lacks, as Hydra's grammar has
it), then every ``${...}`` interpolation resolved. Only YAML files (``.yaml``, ``.yml``) are read,
each a mapping of sections; an error names the file, never what it holds. A numeric key holding
anything but a number is refused, naming the key and where it was set. :func:`translate` then
maps each key onto jaxrm's config or says why it changes nothing; a setting jaxrm cannot honour
and that would change the result is refused, naming the key.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxrm import compat
from jaxrm.compat import Translation, refuse
from jaxrm.data.formats import json_type
from jaxrm.errors import ConfigError

# NeMo RL's preference datasets that jaxrm reads under the same name.
_SAME_DATASETS = ("HelpSteer3", "PreferenceDataset")
_BINARY_KEYS = {"prompt_key": "prompt", "chosen_key": "chosen", "rejected_key": "rejected"}
_PRECISIONS = {"bfloat16": ("bfloat16", "float32"), "float32": ("float32", "float32")}
YAML_SUFFIXES = (".yaml", ".yml")
# NeMo RL's numeric keys, as the YAML spells them: each must hold a number (an integer where NeMo
# RL's config types say int); null only where NeMo RL allows it.
_INTEGER_KEYS = (
  *(f"rm.{k}" for k in ("max_num_epochs", "max_num_steps", "val_period", "val_batches", "seed")),
  "rm.val_global_batch_size",
  "rm.val_micro_batch_size",
  "checkpointing.keep_top_k",
  "checkpointing.save_period",
  "policy.train_global_batch_size",
  "policy.train_micro_batch_size",
  "policy.max_total_sequence_length",
  "policy.dtensor_cfg.tensor_parallel_size",
  "policy.dtensor_cfg.context_parallel_size",
  "data.max_input_seq_length",
  "data.num_workers",
  "cluster.gpus_per_node",
  "cluster.num_nodes",
)
_NUMBER_KEYS = (
  "policy.max_grad_norm",
  *(f"policy.optimizer.kwargs.{k}" for k in ("lr", "weight_decay", "eps", "betas[0]", "betas[1]")),
)
_NULLABLE_KEYS = ("checkpointing.keep_top_k", "policy.max_grad_norm")


# ------------------------------------------------------------------ reading


def load(path: str, overrides: list[str] = ()) -> dict[str, Any]:
  """The YAML at ``path`` with its ``defaults``, the ``overrides`` and interpolations applied.

  Raises:
    ConfigError: a missing file, YAML that does not parse, a malformed override or one naming a
      key the YAML lacks (without ``+``), an interpolation that does not resolve.
  """
  from omegaconf import OmegaConf
  from omegaconf.errors import OmegaConfBaseException

  files: list[tuple[str, Any]] = []  # (file, its own keys), in merge order
  try:
    config = _with_defaults(path, seen=(), files=files)
    for override in overrides:
      config = _override(config, override)
    resolved = OmegaConf.to_container(config, resolve=True)
  except OmegaConfBaseException as e:
    raise ConfigError(f"--nemo_config={path}: {_first_line(e)}") from None
  if not isinstance(resolved, dict):
    raise ConfigError(f"--nemo_config={path}: the YAML is not a mapping of sections")
  _check_numbers(resolved, files, overrides)
  return resolved


def _with_defaults(path: str, seen: tuple[str, ...], files: list):
  """``path``'s YAML over the files its ``defaults`` key names (NeMo RL's config inheritance);
  each file read is appended to ``files`` with its own keys, in merge order."""
  from omegaconf import DictConfig, OmegaConf

  path = os.path.abspath(path)
  named_by = f"{seen[-1]}: defaults names {path!r}, which" if seen else f"--nemo_config={path}:"
  if not path.endswith(YAML_SUFFIXES):
    raise ConfigError(
      f"{named_by} is not a YAML file; NeMo RL configs are {' or '.join(YAML_SUFFIXES)} files"
    )
  if not os.path.isfile(path):
    raise ConfigError(f"{named_by} does not exist" if seen else f"--nemo_config: no such file {path!r}")
  if path in seen:
    raise ConfigError(f"{path}: 'defaults' comes back to this file ({' -> '.join(seen + (path,))})")
  config = _read_yaml(path)
  if not isinstance(config, DictConfig):
    raise ConfigError(f"{path}: not a mapping of sections (NeMo RL reads a YAML mapping)")
  parents = config.pop("defaults", None)
  own = config
  if parents is not None:
    parents = (
      [parents] if isinstance(parents, str) else list(parents) if isinstance(parents, Sequence) else None
    )
    if parents is None or not all(isinstance(p, str) for p in parents):
      raise ConfigError(f"{path}: defaults is a YAML file's path, or a list of them")
    # NeMo RL's resolve_path: an absolute path as it is, another relative to this file's directory.
    base = OmegaConf.create({})
    for parent in parents:
      base = _merge_with_override(
        base, _with_defaults(os.path.join(os.path.dirname(path), parent), (*seen, path), files)
      )
    config = _merge_with_override(base, config)
  files.append((path, own))
  return config


def _read_yaml(path: str):
  """The file's YAML; an error names the file and where it fails, never what it holds."""
  import yaml
  from omegaconf import OmegaConf

  try:
    return OmegaConf.load(path)
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    raise ConfigError(f"{path}: not valid YAML{where}") from None
  except UnicodeDecodeError:
    raise ConfigError(f"{path}: not a text file (YAML is UTF-8 text)") from None


def _merge_with_override(base, config):
  """NeMo RL's ``merge_with_override``: ``config`` over ``base``, a section of ``config`` marked
  ``_override_: true`` replacing ``base``'s instead of merging into it."""
  from omegaconf import DictConfig, OmegaConf

  for key in list(config.keys()):
    section = config[key]
    if isinstance(section, DictConfig) and section.get("_override_", False):
      section.pop("_override_")
      if key in base:
        base.pop(key)
  return OmegaConf.merge(base, config)


def _override(config, override: str):
  """``config`` with one ``key=value`` (``+key=value``, ``++key=value``) applied; values are YAML."""
  from omegaconf import OmegaConf

  key, sep, _ = override.partition("=")
  if not sep or not key.lstrip("+"):
    raise ConfigError(
      f"{override!r}: a NeMo RL override is section.key=value, e.g. policy.model_name=/models/x"
    )
  adds = key.startswith("+")
  name = key.lstrip("+")
  if not adds and OmegaConf.select(config, name, default=_MISSING) is _MISSING:
    raise ConfigError(
      f"{override!r}: the YAML has no key {name!r}; check its spelling, or write +{name}=... to add it"
    )
  dotted = override.lstrip("+")
  return OmegaConf.merge(config, OmegaConf.from_dotlist([dotted]))


_MISSING = object()


def _check_numbers(config: dict, files: list[tuple[str, Any]], overrides: list[str]) -> None:
  """Refuses a numeric key holding anything but a number, naming it and where it was set."""
  from omegaconf import OmegaConf

  for key in (*_INTEGER_KEYS, *_NUMBER_KEYS):
    value = _lookup(config, key)
    if value is _MISSING or (value is None and key in _NULLABLE_KEYS):
      continue
    integer = key in _INTEGER_KEYS
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
      name = key.partition("[")[0]
      override = next((o for o in reversed(overrides) if o.partition("=")[0].lstrip("+") == name), None)
      if override is not None:
        where = f"the override {override!r}"
      else:
        where = next(
          (f for f, own in reversed(files) if OmegaConf.select(own, name, default=_MISSING) is not _MISSING),
          files[-1][0],
        )
      raise ConfigError(
        f"{key}={value!r} (in {where}): expected {'an integer' if integer else 'a number'}, got {json_type(value)}"
      )


def _lookup(config: dict, key: str) -> Any:
  """``config``'s value at a dotted ``key`` (``a.b[1]`` indexes a list), or _MISSING."""
  node: Any = config
  for part in key.replace("[", ".[").split("."):
    if part.startswith("["):
      index = int(part[1:-1])
      if not isinstance(node, list) or index >= len(node):
        return _MISSING
      node = node[index]
    elif isinstance(node, dict) and part in node:
      node = node[part]
    else:
      return _MISSING
  return node


def _first_line(error: Exception) -> str:
  return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


# ------------------------------------------------------------------ mapping


def translate(config: Mapping[str, Any], *, device_count: int) -> Translation:
  """Maps a resolved NeMo RL RM config (:func:`load`) onto jaxrm's keys.

  ``device_count`` is checked against ``cluster.gpus_per_node`` x ``cluster.num_nodes``.

  Raises:
    ConfigError: a key jaxrm does not know, or a setting it cannot honour, named.
  """
  if not isinstance(config, Mapping):
    raise ConfigError(f"a NeMo RL config is a mapping of sections; got {type(config).__name__}")
  tr = Translation("NeMo RL")
  # What NeMo RL does where the YAML says nothing: no lr scheduler (a constant learning rate), and
  # training metrics logged at every step.
  tr.keys.update({"train.lr_scheduler": "constant", "train.warmup_steps": 0, "train.log_period": 1})
  for section, handler in SECTIONS.items():
    values = config.get(section)
    if values is None:
      continue
    if not isinstance(values, Mapping):
      raise ConfigError(f"{section}: a NeMo RL section (a mapping of keys); got {values!r}")
    handler(dict(values), tr, config)
  for section in config:
    if section not in SECTIONS:
      raise ConfigError(
        f"{section}: not a section of NeMo RL's RM config that jaxrm knows ({', '.join(SECTIONS)}); remove it"
      )
  if config.get("cluster"):
    _check_cluster(config["cluster"], device_count)
  return tr


def _take(values: dict, section: str, rules: Mapping[str, Callable[[str, Any], None]]) -> None:
  """Applies ``rules[key](dotted key, value)`` to each key of a section; an unknown key is refused."""
  for key, value in values.items():
    rule = rules.get(key)
    if rule is None:
      raise ConfigError(
        f"{section}.{key}: not a key of NeMo RL's RM config that jaxrm knows (its "
        f"{section} has {', '.join(rules)}); remove it"
      )
    rule(f"{section}.{key}", value)


def _rm(values: dict, tr: Translation, config) -> None:
  def max_num_steps(key, v):
    tr.set(key, train__max_steps=compat.UNTIL_EPOCHS if v == -1 else _positive(key, v))

  def val_batches(key, v):
    tr.set(key, eval__val_batches=0 if v <= 0 else v)  # NeMo RL: -1 (or 0) is every batch

  def seed(key, v):
    tr.set(key, train__seed=v, model__seed=v, data__shuffle_seed=v)

  _take(
    values,
    "rm",
    {
      "max_num_epochs": lambda k, v: tr.set(k, train__max_epochs=_positive(k, v)),
      "max_num_steps": max_num_steps,
      "val_period": lambda k, v: tr.set(k, eval__val_period=v),
      "val_batches": val_batches,
      "val_global_batch_size": lambda k, v: tr.set(k, eval__batch_size=_positive(k, v)),
      "val_micro_batch_size": lambda k, v: tr.ignore(
        k, "how validation batches are split for memory; the metrics are the same"
      ),
      "val_at_start": lambda k, v: tr.set(k, eval__val_at_start=bool(v)),
      "val_at_end": lambda k, v: tr.set(k, eval__val_at_end=bool(v)),
      "seed": seed,
    },
  )
  if "max_num_epochs" not in values:  # NeMo RL ends at whichever of its two limits comes first
    tr.set("rm.max_num_epochs (not given: NeMo RL's recipes' 1)", train__max_epochs=1)


def _checkpointing(values: dict, tr: Translation, config) -> None:
  def checkpoint_dir(key, v):
    # NeMo RL's results directory; jaxrm's run directory holds the checkpoints beside the run's files.
    tr.set(key, output_dir=v)

  def must_save_by(key, v):
    if v is not None:
      raise refuse(key, v, "jaxrm saves by step only (checkpointing.save_period); set it to null")
    tr.ignore(key, "null")

  _take(
    values,
    "checkpointing",
    {
      "enabled": lambda k, v: tr.set(k, checkpointing__enabled=bool(v)),
      "checkpoint_dir": checkpoint_dir,
      "metric_name": lambda k, v: tr.set(k, checkpointing__metric_name=v or ""),
      "higher_is_better": lambda k, v: tr.set(k, checkpointing__higher_is_better=bool(v)),
      "keep_top_k": lambda k, v: tr.set(k, checkpointing__keep_top_k=_positive(k, v)),
      "save_period": lambda k, v: tr.set(k, checkpointing__save_period=v),
      "checkpoint_must_save_by": must_save_by,
      "model_save_format": lambda k, v: tr.ignore(
        k, "jaxrm saves Orbax checkpoints; `python -m jaxrm.export` writes HF safetensors"
      ),
      "save_consolidated": lambda k, v: tr.ignore(k, "see model_save_format"),
    },
  )


def _policy(values: dict, tr: Translation, config) -> None:
  model_name = values.get("model_name")

  def precision(key, v):
    if v not in _PRECISIONS:
      raise refuse(key, v, f"jaxrm trains in {' or '.join(_PRECISIONS)} (float16 has no loss scaling here)")
    dtype, param_dtype = _PRECISIONS[v]  # DTensor's mixed precision: float32 master weights
    tr.set(key, model__dtype=dtype, model__param_dtype=param_dtype)

  def remat(key, v):
    if v:
      tr.set(key, model__remat="full")
    else:
      tr.ignore(key, "false")

  def max_length(key, v):
    tr.set(key, data__max_length=_positive(key, v), data__truncation="drop")

  _take(
    values,
    "policy",
    {
      "model_name": lambda k, v: tr.set(k, model__name_or_path=v),
      "tokenizer": lambda k, v: _tokenizer(k, v or {}, model_name, tr),
      "train_global_batch_size": lambda k, v: tr.set(k, train__global_batch_size=_positive(k, v)),
      "train_micro_batch_size": lambda k, v: tr.set(k, train__micro_batch_size=_positive(k, v)),
      "max_total_sequence_length": max_length,
      "precision": precision,
      "activation_checkpointing_enabled": remat,
      "offload_optimizer_for_logprob": lambda k, v: tr.ignore(k, "no logprob pass in reward-model training"),
      "reward_model_cfg": lambda k, v: _reward_model(k, v or {}, tr),
      "dtensor_cfg": lambda k, v: _dtensor(k, v or {}, tr, remat),
      "dynamic_batching": lambda k, v: tr.ignore(
        k,
        "how a global batch is cut into micro-batches; jaxrm sums "
        "the loss over the whole global batch either way",
      ),
      "sequence_packing": lambda k, v: _packing(k, v or {}, tr),
      "make_sequence_length_divisible_by": lambda k, v: tr.ignore(
        k, "padding only; padded tokens are masked"
      ),
      "max_grad_norm": lambda k, v: tr.set(k, train__max_grad_norm=float(v or 0.0)),
      "optimizer": lambda k, v: _optimizer(k, v or {}, tr),
      "scheduler": _scheduler,
      "megatron_cfg": lambda k, v: _megatron(k, v or {}, tr),
      "generation": lambda k, v: _unused_when_null(k, v, tr, "no generation in reward-model training"),
    },
  )


def _tokenizer(section: str, values: dict, model_name: str | None, tr: Translation) -> None:
  def name(key, v):
    if v not in (None, model_name):
      raise refuse(
        key,
        v,
        f"jaxrm reads the tokenizer saved with policy.model_name ({model_name!r}); "
        "set it to ${policy.model_name}",
      )
    tr.ignore(key, "the model's own tokenizer")

  def chat_template(key, v):
    if v in (None, "default"):
      tr.ignore(key, "the tokenizer's own template (NeMo RL's 'default')")
    elif not isinstance(v, str):
      raise refuse(key, _short(v), "a chat template is a Jinja string, or 'default' for the tokenizer's own")
    else:
      tr.set(key, model__chat_template=v)
      text = repr(v)  # the summary shows the template's start
      tr.fates[-1] = (key, f"model.chat_template={text if len(text) <= 60 else text[:57] + '...'}")

  def template_kwargs(key, v):
    if v:
      raise refuse(key, v, "jaxrm passes no arguments to the chat template; set it to null")
    tr.ignore(key, "null")

  _take(
    values, section, {"name": name, "chat_template": chat_template, "chat_template_kwargs": template_kwargs}
  )


def _reward_model(section: str, values: dict, tr: Translation) -> None:
  from jaxrm.config import REWARD_TYPES

  def enabled(key, v):
    if not v:
      raise refuse(key, v, "jaxrm trains reward models: set it to true")
    tr.ignore(key, "true (a reward model, as always in jaxrm)")

  def reward_type(key, v):
    if v not in REWARD_TYPES:
      raise refuse(key, v, f"jaxrm has reward model types {', '.join(REWARD_TYPES)}")
    tr.set(key, reward__type=v)

  _take(values, section, {"enabled": enabled, "reward_model_type": reward_type})


def _dtensor(section: str, values: dict, tr: Translation, remat: Callable) -> None:
  def enabled(key, v):
    tr.ignore(
      key, f"{bool(v)}: jaxrm shards with its own mesh (mesh.data, mesh.fsdp, mesh.context, mesh.tensor)"
    )

  def tensor(key, v):
    tr.set(key, mesh__tensor=_positive(key, v))

  def context(key, v):  # NeMo RL refuses it for reward models; jaxrm splits rows, packed or not
    tr.set(key, mesh__context=_positive(key, v))

  def parallel_plan(key, v):
    if v is not None:
      raise refuse(key, v, "jaxrm shards by its own logical-axis rules; set it to null")
    tr.ignore(key, "null")

  _take(
    values,
    section,
    {
      "enabled": enabled,
      "cpu_offload": lambda k, v: tr.ignore(k, "memory placement only"),
      "sequence_parallel": lambda k, v: tr.ignore(k, "the same arithmetic, placed differently"),
      "activation_checkpointing": remat,
      "tensor_parallel_size": tensor,
      "context_parallel_size": context,
      "custom_parallel_plan": parallel_plan,
      "clear_cache_every_n_steps": lambda k, v: tr.ignore(k, "memory housekeeping only"),
      "env_vars": lambda k, v: _unused_when_null(k, v, tr, "environment for NeMo RL's workers"),
    },
  )


def _packing(section: str, values: dict, tr: Translation) -> None:
  for key, value in values.items():
    if key == "enabled":
      tr.set(f"{section}.enabled", data__packing="packed" if value else "none")
    else:
      tr.ignore(f"{section}.{key}", "how rows are filled; jaxrm packs to data.packed_row_length")


def _optimizer(section: str, values: dict, tr: Translation) -> None:
  def name(key, v):
    if v != "torch.optim.AdamW":
      raise refuse(key, v, "jaxrm trains with AdamW (decoupled weight decay): use torch.optim.AdamW")
    tr.ignore(key, "AdamW, as jaxrm always trains")

  _take(values, section, {"name": name, "kwargs": lambda k, v: _adam_kwargs(k, v or {}, tr)})


def _adam_kwargs(section: str, values: dict, tr: Translation) -> None:
  def betas(key, v):
    if not isinstance(v, (list, tuple)) or len(v) != 2:
      raise refuse(key, v, "give two numbers, e.g. [0.9, 0.98]")
    tr.set(key, train__adam_beta1=float(v[0]), train__adam_beta2=float(v[1]))

  def off(key, v):
    if v:
      raise refuse(key, v, "jaxrm's AdamW has no such variant; set it to false")
    tr.ignore(key, "false")

  _take(
    values,
    section,
    {
      "lr": lambda k, v: tr.set(k, train__learning_rate=float(v)),
      "weight_decay": lambda k, v: tr.set(k, train__weight_decay=float(v)),
      "betas": betas,
      "eps": lambda k, v: tr.set(k, train__adam_epsilon=float(v)),
      "foreach": lambda k, v: tr.ignore(k, "a PyTorch kernel choice; the same update"),
      "fused": lambda k, v: tr.ignore(k, "a PyTorch kernel choice; the same update"),
      "amsgrad": off,
      "maximize": off,
    },
  )


def _scheduler(key: str, value: Any) -> None:
  raise refuse(
    key,
    value,
    "jaxrm does not read PyTorch lr_scheduler chains; remove policy.scheduler "
    "(a constant learning rate, NeMo RL's own default) and set jaxrm's train.lr_scheduler in a "
    "--config file instead",
  )


def _megatron(section: str, values: dict, tr: Translation) -> None:
  if values.get("enabled"):
    raise refuse(
      f"{section}.enabled",
      True,
      "jaxrm has no Megatron backend; set it to false (jaxrm shards through policy.dtensor_cfg's sizes)",
    )
  tr.ignore(section, "enabled is false: NeMo RL does not read this section either")


def _unused_when_null(key: str, value: Any, tr: Translation, why: str) -> None:
  if value not in (None, {}, []):
    raise refuse(key, _short(value), f"{why}; set it to null")
  tr.ignore(key, "null")


def _data(values: dict, tr: Translation, config) -> None:
  name = values.get("dataset_name", "HelpSteer3")
  binary = name == "BinaryPreferenceDataset"
  columns = dict(_BINARY_KEYS)  # BinaryPreferenceDataset's field -> the column it reads

  def dataset_name(key, v):
    if binary:
      tr.set(key, data__dataset_name="PreferenceDataset")
    elif v in _SAME_DATASETS:
      tr.set(key, data__dataset_name=v)
    else:
      raise refuse(
        key,
        v,
        f"jaxrm reads NeMo RL's preference datasets {', '.join(_SAME_DATASETS)} and "
        "BinaryPreferenceDataset (or give jaxrm's own dataset names in a --config file)",
      )

  def shuffle(key, v):
    if not v:
      raise refuse(key, v, "jaxrm always shuffles the training rows (seeded by rm.seed); set it to true")
    tr.ignore(key, "true, as jaxrm always does")

  def max_input(key, v):
    total = (config.get("policy") or {}).get("max_total_sequence_length")
    if total is not None and v != total:
      raise refuse(
        key,
        v,
        f"differs from policy.max_total_sequence_length={total}; jaxrm has one length "
        "(data.max_length): make them equal",
      )
    tr.set(key, data__max_length=_positive(key, v))

  def split(key, v):
    jaxrm_split = "train" if key.endswith("train_split") else "validation"
    if v not in (None, jaxrm_split):
      raise refuse(
        key,
        v,
        f"jaxrm reads the {jaxrm_split!r} split of a saved or hub dataset; set it to null "
        f"(or {jaxrm_split!r})",
      )
    tr.ignore(key, f"{v!r}: jaxrm reads the {jaxrm_split!r} split")

  def binary_key(key, v):
    field = key.rsplit(".", 1)[1]
    if not binary:
      tr.ignore(key, f"read by BinaryPreferenceDataset only (this is {name})")
    elif not isinstance(v, str) or not v:
      raise refuse(key, v, "a column name (a string)")
    else:
      columns[field] = v
      tr.ignore(key, f"{v!r}: the column the rows' {_BINARY_KEYS[field]} is read from")

  def val_data_path(key, v):
    tr.set(key, data__val_data_paths={"default": v} if v else {})

  _take(
    values,
    "data",
    {
      "dataset_name": dataset_name,
      "train_data_path": lambda k, v: tr.set(k, data__train_data_path=v or ""),
      "val_data_paths": lambda k, v: tr.set(k, data__val_data_paths=dict(v or {})),
      "val_data_path": val_data_path,
      "train_split": split,
      "val_split": split,
      "prompt_key": binary_key,
      "chosen_key": binary_key,
      "rejected_key": binary_key,
      "max_input_seq_length": max_input,
      "shuffle": shuffle,
      "num_workers": lambda k, v: tr.set(k, data__num_workers=int(v)),
    },
  )
  if binary:
    _binary_rows(tr, columns)


def _binary_rows(tr: Translation, columns: dict[str, str]) -> None:
  """BinaryPreferenceDataset's rows become NeMo RL preference rows, as its ``to_preference_data_format``
  makes them: a string prompt a user turn, the chosen and rejected texts assistant turns.

  The converted rows are written once to ``<output_dir>/nemo_data/`` and read from there.
  """
  out = os.path.join(os.path.abspath(tr.keys.get("output_dir", "runs/rm")), "nemo_data")
  train = tr.keys.get("data.train_data_path")
  if not train:
    raise ConfigError(
      "data.train_data_path: BinaryPreferenceDataset needs a file or dataset of prompt/chosen/rejected rows"
    )
  tr.keys["data.train_data_path"] = _convert(train, "train", os.path.join(out, "train.jsonl"), columns)
  tr.keys["data.val_data_paths"] = {
    name: _convert(
      path, "train", os.path.join(out, f"validation-{name}.jsonl"), columns
    )  # NeMo RL's val_split
    for name, path in tr.keys.get("data.val_data_paths", {}).items()
  }
  tr.ignore("data.dataset_name (rows)", f"converted as NeMo RL converts them, into {out}")


def _convert(path: str, split: str, out_path: str, columns: dict[str, str]) -> str:
  from jaxrm.data import sources
  from jaxrm.data.drops import row_error

  rows = []
  for source, row in sources.read_rows(path, split=split):
    try:
      prompt, chosen, rejected = (row[columns[k]] for k in ("prompt_key", "chosen_key", "rejected_key"))
    except KeyError as e:
      raise row_error(
        source,
        e.args[0],
        f"is missing; BinaryPreferenceDataset reads the columns "
        f"{', '.join(columns[k] for k in _BINARY_KEYS)} (data.prompt_key, chosen_key, "
        f"rejected_key); have {sorted(row)}",
      ) from None
    context = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    rows.append(
      {
        "context": context,
        "completions": [
          {"rank": 0, "completion": [{"role": "assistant", "content": chosen}]},
          {"rank": 1, "completion": [{"role": "assistant", "content": rejected}]},
        ],
      }
    )
  os.makedirs(os.path.dirname(out_path), exist_ok=True)
  tmp = f"{out_path}.tmp{os.getpid()}"  # each process writes the same rows; the last rename wins
  with open(tmp, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  os.replace(tmp, out_path)
  return out_path


def _logger(values: dict, tr: Translation, config) -> None:
  log_dir = values.get("log_dir") or "logs"

  def tensorboard_dir(key, v):
    sub = (v or {}).get("log_dir") or "tensorboard"
    tr.set(key, logger__log_dir=os.path.join(log_dir, sub))

  def wandb(key, v):
    v = dict(v or {})
    tr.set(
      key, logger__wandb={"project": v.pop("project", "jaxrm") or "jaxrm", "name": v.pop("name", "") or ""}
    )
    for extra in v:
      tr.ignore(f"{key}.{extra}", "not a W&B setting jaxrm passes on")

  def mlflow(key, v):
    v = dict(v or {})
    spec = {k: v.pop(k, "") or "" for k in ("experiment_name", "run_name", "tracking_uri")}
    tr.set(key, logger__mlflow={**spec, "experiment_name": spec["experiment_name"] or "jaxrm"})
    for extra in v:
      tr.ignore(f"{key}.{extra}", "not an MLflow setting jaxrm passes on")

  def swanlab(key, v):
    tr.ignore(key, f"{v}: jaxrm has no SwanLab logger (logging only; the run is the same)")

  _take(
    values,
    "logger",
    {
      "log_dir": lambda k, v: tr.ignore(k, "the base of logger.tensorboard.log_dir"),
      "wandb_enabled": lambda k, v: tr.set(k, logger__wandb_enabled=bool(v)),
      "tensorboard_enabled": lambda k, v: tr.set(k, logger__tensorboard=bool(v)),
      "mlflow_enabled": lambda k, v: tr.set(k, logger__mlflow_enabled=bool(v)),
      "swanlab_enabled": swanlab,
      "monitor_gpus": lambda k, v: tr.set(k, logger__monitor_gpus=bool(v)),
      "num_val_samples_to_print": lambda k, v: tr.ignore(k, "printing only"),
      "wandb": wandb,
      "mlflow": mlflow,
      "swanlab": lambda k, v: tr.ignore(k, "no SwanLab logger"),
      "tensorboard": tensorboard_dir,
      "gpu_monitoring": lambda k, v: tr.ignore(k, "jaxrm logs device memory with each step's metrics"),
    },
  )


def _cluster(values: dict, tr: Translation, config) -> None:
  _take(
    values,
    "cluster",
    {
      "gpus_per_node": lambda k, v: tr.ignore(k, f"{v}: checked against the devices jaxrm finds"),
      "num_nodes": lambda k, v: tr.ignore(k, f"{v}: checked against the devices jaxrm finds"),
    },
  )


def _check_cluster(cluster: Mapping[str, Any], device_count: int) -> None:
  per_node, nodes = cluster.get("gpus_per_node", 1), cluster.get("num_nodes", 1)
  if per_node * nodes != device_count:
    raise ConfigError(
      f"cluster.gpus_per_node={per_node} x cluster.num_nodes={nodes} = {per_node * nodes} "
      f"devices, but jaxrm finds {device_count}; set them to the devices this run has "
      "(multi-host: start one process per node, see python -m jaxrm.train --help)"
    )


SECTIONS = {
  "rm": _rm,
  "checkpointing": _checkpointing,
  "policy": _policy,
  "data": _data,
  "logger": _logger,
  "cluster": _cluster,
}


def _positive(key: str, value: Any) -> int:
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise refuse(key, value, "use a positive integer")
  return value


def _short(value: Any) -> Any:
  text = repr(value)
  return value if len(text) <= 60 else text[:57] + "..."
