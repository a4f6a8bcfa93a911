"""Writes a model as a Hugging Face checkpoint directory that transformers loads.

* ``config.json``: the ``*ForSequenceClassification`` / ``*ForTokenClassification`` architecture
  (a verifier's: ``*ForCausalLM``, its question and answers in a ``jaxrm_verifier.json`` beside it),
  ``num_labels``, ``pad_token_id`` (a regression model: ``problem_type="regression"`` and its
  attribute names as ``id2label``; a process reward model's two classes named by
  :data:`STEP_LABELS`), and any ``extra_config`` entries the caller records (transformers
  ignores unknown keys; :mod:`jaxrm.loading` records what scoring needs there);
* ``model.safetensors``: every tensor named by the family's weight map;
* the tokenizer files, chat template included.

A model with LoRA adapters is written with the adapters merged into its weights (a plain
checkpoint, no peft needed), or, by :func:`save_peft_adapters`, as a peft adapter directory
(``adapter_config.json`` + ``adapter_model.safetensors``) to apply over its base checkpoint.

A directory that holds an earlier export (jaxrm's or transformers' ``save_pretrained``: weights,
shards and their index, config, tokenizer and adapter files) is written over, and the files of the
earlier export that this one does not rewrite are removed, so that no loader reads stale shards
beside the new weights. Any other file in it makes the export refuse before writing, naming it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from typing import Any

import ml_dtypes
import numpy as np
from flax import nnx

from jaxrm.errors import CheckpointError, ConfigError
from jaxrm.hf.safetensors_io import save_safetensors
from jaxrm.hf.weight_map import PEFT_HEAD, peft_names, to_hf_names
from jaxrm.models import lora
from jaxrm.models.config import ModelConfig, to_hf_config
from jaxrm.models.decoder import Decoder

log = logging.getLogger(__name__)

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
# id2label of a process reward model (a token head of 2 classes): class 1 is the probability that
# the step is correct (jaxrm.models.heads.correct_probability), class 0 that it is in error.
STEP_LABELS = ("incorrect", "correct")


def _host_params(model: Decoder, *, merge: bool) -> dict[str, np.ndarray]:
  """Dotted param name -> host array; with ``merge``, LoRA adapters are folded into their weights
  (a base stored lower, ``lora.base_dtype``, is decoded to the model's parameter dtype first)."""
  cfg = model.config
  if merge and cfg.lora.enabled:
    state = lora.merge(nnx.state(model), cfg.lora, dtype=cfg.param_dtype)
  else:
    state = nnx.state(model, nnx.Param)
  return {".".join(map(str, path)): np.asarray(var.get_value()) for path, var in nnx.to_flat_state(state)}


def _named_tensors(params: dict[str, np.ndarray], names, dtype: str) -> dict[str, np.ndarray]:
  out = {}
  for key, param, layer, transpose in names:
    host = params[param] if layer is None else params[param][layer]  # un-stacks the layers
    out[key] = np.ascontiguousarray((host.T if transpose else host).astype(DTYPES[dtype], copy=False))
  return out


def hf_tensors(model: Decoder, dtype: str = "float32") -> dict[str, np.ndarray]:
  """HF name -> host array ([out, in] for linear weights), one entry per layer, in ``dtype``.

  LoRA adapters are merged into the weights they adapt (``W + alpha/r * A @ B``).
  """
  return _named_tensors(_host_params(model, merge=True), to_hf_names(model.config), dtype)


def peft_tensors(model: Decoder, dtype: str = "float32") -> dict[str, np.ndarray]:
  """peft name -> host array: each layer's ``lora_A`` [r, in] and ``lora_B`` [out, r], and the
  reward head (a verifier's LM head is the base's, frozen: not among them)."""
  if not model.config.lora.enabled:
    raise ConfigError(
      "the model has no LoRA adapters (lora.rank is 0): export it whole (without "
      "adapters_only), or train it with LoRA (model.lora.rank > 0)"
    )
  return _named_tensors(_host_params(model, merge=False), peft_names(model.config), dtype)


def peft_config(cfg: ModelConfig, base_model_name_or_path: str | None) -> dict:
  """adapter_config.json: a peft ``LoraConfig`` for ``cfg.lora``, with the head saved in full."""
  alpha = cfg.lora.alpha
  return {
    "peft_type": "LORA",
    "task_type": {"token": "TOKEN_CLS", "lm": "CAUSAL_LM"}.get(cfg.head, "SEQ_CLS"),
    "base_model_name_or_path": base_model_name_or_path,
    "revision": None,
    "r": cfg.lora.rank,
    "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
    "lora_dropout": cfg.lora.dropout,
    "target_modules": list(cfg.lora.targets),
    "bias": "none",
    "modules_to_save": None if cfg.head == "lm" else [PEFT_HEAD],
    "fan_in_fan_out": False,
    "inference_mode": True,
    "init_lora_weights": True,
    "use_rslora": False,
    "use_dora": False,
    "layers_to_transform": None,
    "layers_pattern": None,
    "rank_pattern": {},
    "alpha_pattern": {},
  }


# The files an HF export writes (jaxrm's, or transformers' and peft's save_pretrained): an export
# removes those of an earlier one that it does not rewrite, and refuses a directory holding others.
EXPORT_FILES = re.compile(
  r"config\.json|generation_config\.json"
  r"|(model|adapter_model)\.safetensors(\.tmp)?|model\.safetensors\.index\.json"
  r"|model-\d{5}-of-\d{5}\.safetensors|adapter_config\.json"
  r"|(pytorch_model|adapter_model)\.bin|pytorch_model\.bin\.index\.json|pytorch_model-\d{5}-of-\d{5}\.bin"
  r"|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|added_tokens\.json"
  r"|vocab\.json|vocab\.txt|merges\.txt|tokenizer\.model|spiece\.model|sentencepiece\.bpe\.model"
  r"|chat_template\.jinja|chat_template\.json"
  r"|jaxrm_[a-z_]+\.json"  # jaxrm's own files beside the model (extra_files)
)


def _earlier_export(out_dir: str) -> list[str]:
  """The files of an earlier export in ``out_dir`` (created if missing); any other entry in it is
  refused, named, before anything is written."""
  os.makedirs(out_dir, exist_ok=True)
  names = sorted(os.listdir(out_dir))
  other = [n for n in names if not (EXPORT_FILES.fullmatch(n) and os.path.isfile(os.path.join(out_dir, n)))]
  if other:
    raise CheckpointError(
      f"{out_dir} holds {', '.join(other)}, which no export writes; export into a new or empty "
      "directory, or remove them (an earlier export's own files are replaced)"
    )
  return names


def _remove_unwritten(out_dir: str, earlier: Iterable[str], written: Iterable[str]) -> None:
  """Removes the files of the earlier export that this one did not rewrite."""
  stale = sorted(set(earlier) - {os.path.basename(w) for w in written})
  for name in stale:
    os.remove(os.path.join(out_dir, name))
  if stale:
    log.info("removed the files of an earlier export in %s: %s", out_dir, ", ".join(stale))


def _save_tokenizer(out_dir: str, tokenizer: Any) -> list[str]:
  """The tokenizer's files written into ``out_dir`` (none without a tokenizer)."""
  return [] if tokenizer is None else [os.fspath(p) for p in tokenizer.save_pretrained(out_dir)]


REGRESSION = "regression"  # transformers' problem_type of a regression head


def regression_attributes(hf: dict, cfg: ModelConfig) -> tuple[str, ...] | None:
  """A sequence head's attribute names (``id2label``) when config.json ``hf`` says it regresses
  (``problem_type="regression"``), else None."""
  labels = {str(k): str(v) for k, v in (hf.get("id2label") or {}).items()}
  if hf.get("problem_type") != REGRESSION or cfg.head != "sequence" or len(labels) != cfg.num_labels:
    return None  # not a regression head, or a new head in place of the saved one
  names = tuple(labels.get(str(i), f"LABEL_{i}") for i in range(cfg.num_labels))
  # transformers marks any one-output head trained through its own loss "regression"; a
  # Bradley-Terry model's LABEL_0 names no attribute.
  return None if names == ("LABEL_0",) else names


def hf_config(
  cfg: ModelConfig,
  dtype: str = "float32",
  *,
  tokenizer: Any = None,
  attributes: tuple[str, ...] | None = None,
  extra_config: dict[str, Any] | None = None,
) -> dict:
  """config.json of the export: the classification architecture, and ``extra_config``'s entries.

  Args:
    cfg: the model's config; its ``pad_token_id``, else the tokenizer's, becomes the export's.
    dtype: the tensors' dtype (``torch_dtype``).
    tokenizer: the model's tokenizer, or None.
    attributes: a regression model's attribute names, one per output, or None.
    extra_config: more top-level entries of config.json, or None.
  """
  pad = cfg.pad_token_id
  if pad is None and tokenizer is not None:
    pad = tokenizer.pad_token_id
  if pad is None:
    log.warning(
      "no pad token id: transformers' %s scores such a model one row at a time",
      to_hf_config(cfg)["architectures"][0],
    )
  hf = to_hf_config(cfg.replace(param_dtype=dtype, pad_token_id=pad, lora=lora.LoraConfig()))
  hf.update(extra_config or {})
  if attributes is not None:
    if len(attributes) != cfg.num_labels:
      raise ValueError(f"{len(attributes)} attribute names for a head of {cfg.num_labels} outputs")
    hf.update(
      problem_type=REGRESSION,
      id2label={str(i): a for i, a in enumerate(attributes)},
      label2id={a: i for i, a in enumerate(attributes)},
    )
  elif cfg.head == "token" and cfg.num_labels == len(STEP_LABELS):
    hf.update(
      id2label={str(i): a for i, a in enumerate(STEP_LABELS)},
      label2id={a: i for i, a in enumerate(STEP_LABELS)},
    )
  return hf


def _check_dtype(dtype: str) -> str:
  if dtype not in DTYPES:
    raise ValueError(f"dtype={dtype!r}; export writes {' or '.join(DTYPES)}")
  return dtype


def save_pretrained(
  out_dir: str | os.PathLike,
  model: Decoder,
  tokenizer: Any = None,
  *,
  dtype: str | None = None,
  attributes: tuple[str, ...] | None = None,
  extra_config: dict[str, Any] | None = None,
  extra_files: dict[str, Any] | None = None,
) -> None:
  """Writes ``model`` (and ``tokenizer``) to ``out_dir`` as an HF checkpoint directory; LoRA
  adapters are merged into the weights, and the config written is that of a model without them.

  Args:
    out_dir: created if missing; the files of an earlier export in it are replaced or removed,
      and any other file makes it refuse (see the module docstring).
    model: its parameters must be addressable from this process.
    tokenizer: saved beside the weights; None writes no tokenizer files.
    attributes, extra_config: see :func:`hf_config`.
    dtype: tensor dtype, "float32" or "bfloat16" (default: the model's parameter dtype).
    extra_files: ``jaxrm_<name>.json`` -> its JSON content: jaxrm's own files written beside the
      model (a verifier's question and answers, :mod:`jaxrm.verifier`), or None.

  Raises:
    CheckpointError: ``out_dir`` holds files that no export writes.
  """
  out_dir = os.fspath(out_dir)
  dtype = _check_dtype(dtype or model.config.param_dtype)
  extra_files = _checked_extra_files(extra_files)
  earlier = _earlier_export(out_dir)
  save_safetensors(os.path.join(out_dir, "model.safetensors"), hf_tensors(model, dtype))
  config = hf_config(
    model.config, dtype, tokenizer=tokenizer, attributes=attributes, extra_config=extra_config
  )
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  written = ["model.safetensors", "config.json", *_save_tokenizer(out_dir, tokenizer)]
  written += _write_extra_files(out_dir, extra_files)
  if tokenizer is None:
    log.warning("the model has no tokenizer: %s holds no tokenizer files", out_dir)
  _remove_unwritten(out_dir, earlier, written)


def _checked_extra_files(extra_files: dict[str, Any] | None) -> dict[str, Any]:
  extra_files = dict(extra_files or {})
  for name in extra_files:
    if not re.fullmatch(r"jaxrm_[a-z_]+\.json", name):
      raise ValueError(f"extra file {name!r}: jaxrm's own files beside an export are jaxrm_<name>.json")
  return extra_files


def _write_extra_files(out_dir: str, extra_files: dict[str, Any]) -> list[str]:
  for name, content in extra_files.items():
    with open(os.path.join(out_dir, name), "w") as f:
      json.dump(content, f, indent=2)
  return list(extra_files)


def save_peft_adapters(
  out_dir: str | os.PathLike,
  model: Decoder,
  tokenizer: Any = None,
  *,
  base_model_name_or_path: str | None,
  dtype: str | None = None,
  extra_files: dict[str, Any] | None = None,
) -> None:
  """Writes ``model``'s LoRA adapters and head to ``out_dir`` as a peft adapter directory.

  ``peft.PeftModel.from_pretrained(base, out_dir)`` then scores like ``model``, ``base`` being the
  checkpoint the adapters were trained over loaded as ``*ForSequenceClassification`` /
  ``*ForTokenClassification`` (its head, if any, is replaced by the saved one), or for a verifier
  as ``*ForCausalLM`` (its LM head kept: a verifier trains adapters only).

  Args:
    out_dir: created if missing; the files of an earlier export in it are replaced or removed,
      and any other file makes it refuse (see the module docstring).
    model: a model with LoRA adapters; its parameters must be addressable from this process.
    tokenizer: saved beside the adapters; None writes no tokenizer files.
    base_model_name_or_path: the base checkpoint (an HF directory or hub name), recorded in
      adapter_config.json for ``AutoPeftModel*`` loaders; None records none.
    dtype: tensor dtype, "float32" or "bfloat16" (default: the model's parameter dtype).
    extra_files: as :func:`save_pretrained`'s.
  """
  out_dir = os.fspath(out_dir)
  dtype = _check_dtype(dtype or model.config.param_dtype)
  extra_files = _checked_extra_files(extra_files)
  tensors = peft_tensors(model, dtype)
  earlier = _earlier_export(out_dir)
  save_safetensors(os.path.join(out_dir, "adapter_model.safetensors"), tensors)
  with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
    json.dump(peft_config(model.config, base_model_name_or_path), f, indent=2)
  if model.config.lora.base_dtype is not None:
    log.warning(
      "the adapters were trained over a %s base; peft applies them over the base checkpoint "
      "as it loads it, so its scores differ from jaxrm's by the base's rounding (a merged export "
      "keeps jaxrm's)",
      model.config.lora.base_dtype,
    )
  written = ["adapter_model.safetensors", "adapter_config.json", *_save_tokenizer(out_dir, tokenizer)]
  written += _write_extra_files(out_dir, extra_files)
  _remove_unwritten(out_dir, earlier, written)
