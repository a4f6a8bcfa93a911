"""Writes a model as a Hugging Face checkpoint directory that transformers loads.

* ``config.json``: the ``*ForSequenceClassification`` / ``*ForTokenClassification`` architecture
  (a verifier's or a pairwise judge's: ``*ForCausalLM``, what it asks in a ``jaxrm_verifier.json``
  beside it),
  ``num_labels``, ``pad_token_id`` (a regression model: ``problem_type="regression"`` and its
  attribute names as ``id2label``; a process reward model's two classes named by
  :data:`STEP_LABELS`), and any ``extra_config`` entries the caller records (transformers
  ignores unknown keys; :mod:`jaxrm.scoring.loading` records what scoring needs there);
* ``model.safetensors``: every tensor named by the family's weight map;
* the tokenizer files, chat template included.

A model with LoRA adapters is written with the adapters merged into its weights (a plain
checkpoint, no peft needed), or, by :func:`save_peft_adapters`, as a peft adapter directory
(``adapter_config.json`` + ``adapter_model.safetensors``) to apply over its base checkpoint.

An export lists the files it wrote in ``jaxrm_export.json`` (:data:`MANIFEST`). Exporting again
into that directory replaces them, and removes those of the earlier export that this one does not
rewrite, so that no loader reads stale shards beside the new weights; it removes nothing else. A
directory holding any file that no manifest there lists (another tool's checkpoint, notes, a link)
is refused before anything is written, the files named. The files are written beside the
directory's entries and then renamed over them: a link in the directory is replaced, never written
through.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from typing import Any

import ml_dtypes
import numpy as np
from flax import nnx

from jaxrm.errors import CheckpointError, ConfigError
from jaxrm.hf.safetensors_io import save_safetensors
from jaxrm.hf.weight_map import PEFT_HEAD, gather, peft_names, peft_targets, to_hf_names
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
  return gather(params, names, DTYPES[dtype])


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
    **peft_targets(cfg),  # target_modules, rank_pattern, alpha_pattern
    "bias": "none",
    "modules_to_save": None if cfg.head == "lm" else [PEFT_HEAD],
    "fan_in_fan_out": False,
    "inference_mode": True,
    "init_lora_weights": True,
    "use_rslora": False,
    "use_dora": False,
    "layers_to_transform": None,
    "layers_pattern": None,
  }


# The files an HF export writes (jaxrm's, or transformers' and peft's save_pretrained): those a
# manifest may list, and those named when a directory without one is refused as a model's.
EXPORT_FILES = re.compile(
  r"config\.json|generation_config\.json"
  r"|(model|adapter_model)\.safetensors|model\.safetensors\.index\.json"
  r"|model-\d{5}-of-\d{5}\.safetensors|adapter_config\.json"
  r"|(pytorch_model|adapter_model)\.bin|pytorch_model\.bin\.index\.json|pytorch_model-\d{5}-of-\d{5}\.bin"
  r"|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|added_tokens\.json"
  r"|vocab\.json|vocab\.txt|merges\.txt|tokenizer\.model|spiece\.model|sentencepiece\.bpe\.model"
  r"|chat_template\.jinja|chat_template\.json"
  r"|jaxrm_[a-z_]+\.json"  # jaxrm's own files beside the model (extra_files)
)
# The list of the files an export wrote, beside them: the only files a later export removes.
MANIFEST = "jaxrm_export.json"
_STAGING = ".jaxrm_export_"  # prefix of the folder an export writes into before renaming


def _earlier_export(out_dir: str) -> list[str]:
  """The files an earlier export in ``out_dir`` (created if missing) lists; any other entry in it
  is refused, named, before anything is written."""
  os.makedirs(out_dir, exist_ok=True)
  for name in os.listdir(out_dir):  # what an interrupted export left of its own
    path = os.path.join(out_dir, name)
    if name.startswith(_STAGING):
      shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
  listed = _read_manifest(out_dir)
  names = sorted(n for n in os.listdir(out_dir) if n != MANIFEST)
  # A listed file that is now a link is the export's to replace (the link, not its target).
  other = [n for n in names if n not in listed or os.path.isdir(os.path.join(out_dir, n))]
  if other:
    raise CheckpointError(_refusal(out_dir, other, manifest=bool(listed)))
  return names


def _plain_file(path: str) -> bool:
  return os.path.isfile(path) and not os.path.islink(path)


def _refusal(out_dir: str, other: list[str], *, manifest: bool) -> str:
  named = ", ".join(n + (" (a link)" if os.path.islink(os.path.join(out_dir, n)) else "") for n in other)
  models = [n for n in other if EXPORT_FILES.fullmatch(n)]
  if models and not manifest:
    why = (
      f"a model's files that no jaxrm export wrote (no {MANIFEST} lists them): an export replaces "
      "only the files of an earlier export"
    )
  else:
    why = f"which no earlier export there wrote ({MANIFEST} lists the files an export replaces)"
  return f"{out_dir} holds {named}, {why}; export into a new or empty directory, or move them out of it"


def _read_manifest(out_dir: str) -> set[str]:
  """The file names the manifest in ``out_dir`` lists; none without one."""
  path = os.path.join(out_dir, MANIFEST)
  if not os.path.lexists(path):
    return set()
  try:
    if not _plain_file(path):
      raise ValueError("it is not a plain file")
    with open(path) as f:
      files = json.load(f)["files"]
    if not all(isinstance(n, str) and _plain_name(n) and n != MANIFEST for n in files):
      raise ValueError("it lists names that are not files of the directory")
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointError(
      f"{path} is damaged ({e}): export into a new or empty directory, or remove {out_dir}'s "
      "files of the earlier export and the manifest"
    ) from None
  return set(files)


def _plain_name(name: str) -> bool:
  return bool(name) and os.path.basename(name) == name and not name.startswith(".") and "\\" not in name


def _write_manifest(out_dir: str, names: Iterable[str]) -> None:
  """Writes the manifest whole or not at all (renamed over the earlier one, never written through)."""
  fd, tmp = tempfile.mkstemp(prefix=_STAGING, dir=out_dir)
  with os.fdopen(fd, "w") as f:
    json.dump({"files": sorted(set(names))}, f, indent=2)
  os.replace(tmp, os.path.join(out_dir, MANIFEST))


@contextlib.contextmanager
def _staged(out_dir: str, earlier: list[str]):
  """A folder in ``out_dir`` to write the export into; published (:func:`_published`) when the
  block ends, removed if it fails."""
  staging = tempfile.mkdtemp(prefix=_STAGING, dir=out_dir)
  try:
    yield staging
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  _published(out_dir, staging, earlier)


def _published(out_dir: str, staging: str, earlier: list[str]) -> None:
  """Moves the files written into ``staging`` into ``out_dir``, removes the earlier export's files
  that were not rewritten, and lists the new ones in the manifest.

  The manifest lists both exports' files while the files move, so that an export stopped part way
  leaves no file unlisted; each file is renamed over the entry of its name, which replaces a link
  instead of writing through it.
  """
  written = sorted(os.listdir(staging))
  _write_manifest(out_dir, [*earlier, *written])
  for name in written:
    os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
  stale = sorted(set(earlier) - set(written))
  for name in stale:
    os.remove(os.path.join(out_dir, name))
  _write_manifest(out_dir, written)
  os.rmdir(staging)
  if stale:
    log.info("removed the files of an earlier export in %s: %s", out_dir, ", ".join(stale))


def _save_tokenizer(out_dir: str, tokenizer: Any) -> None:
  """The tokenizer's files written into ``out_dir`` (none without a tokenizer)."""
  if tokenizer is not None:
    tokenizer.save_pretrained(out_dir)


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
      model (a verifier's or a judge's question and answers, :mod:`jaxrm.tasks.verifier`), or None.

  Raises:
    CheckpointError: ``out_dir`` holds files that no earlier export there lists.
  """
  out_dir = os.fspath(out_dir)
  dtype = _check_dtype(dtype or model.config.param_dtype)
  extra_files = _checked_extra_files(extra_files)
  earlier = _earlier_export(out_dir)
  config = hf_config(
    model.config, dtype, tokenizer=tokenizer, attributes=attributes, extra_config=extra_config
  )
  with _staged(out_dir, earlier) as staging:
    save_safetensors(os.path.join(staging, "model.safetensors"), hf_tensors(model, dtype))
    with open(os.path.join(staging, "config.json"), "w") as f:
      json.dump(config, f, indent=2)
    _save_tokenizer(staging, tokenizer)
    _write_extra_files(staging, extra_files)
  if tokenizer is None:
    log.warning("the model has no tokenizer: %s holds no tokenizer files", out_dir)


def _checked_extra_files(extra_files: dict[str, Any] | None) -> dict[str, Any]:
  extra_files = dict(extra_files or {})
  for name in extra_files:
    if not re.fullmatch(r"jaxrm_[a-z_]+\.json", name) or name == MANIFEST:
      raise ValueError(f"extra file {name!r}: jaxrm's own files beside an export are jaxrm_<name>.json")
  return extra_files


def _write_extra_files(out_dir: str, extra_files: dict[str, Any]) -> None:
  for name, content in extra_files.items():
    with open(os.path.join(out_dir, name), "w") as f:
      json.dump(content, f, indent=2)


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
  with _staged(out_dir, _earlier_export(out_dir)) as staging:
    save_safetensors(os.path.join(staging, "adapter_model.safetensors"), tensors)
    with open(os.path.join(staging, "adapter_config.json"), "w") as f:
      json.dump(peft_config(model.config, base_model_name_or_path), f, indent=2)
    _save_tokenizer(staging, tokenizer)
    _write_extra_files(staging, extra_files)
  if model.config.lora.base_dtype is not None:
    log.warning(
      "the adapters were trained over a %s base; peft applies them over the base checkpoint "
      "as it loads it, so its scores differ from jaxrm's by the base's rounding (a merged export "
      "keeps jaxrm's)",
      model.config.lora.base_dtype,
    )
