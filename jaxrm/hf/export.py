"""Writes a model as a Hugging Face checkpoint directory that transformers loads.

* ``config.json``: the ``*ForSequenceClassification`` / ``*ForTokenClassification`` architecture,
  ``num_labels``, ``pad_token_id``, and under :data:`SCORING_KEY` what scoring needs besides
  (validation reward statistics, the step separator), which transformers ignores and jaxrm reads back;
* ``model.safetensors``: every tensor named by the family's weight map;
* the tokenizer files, chat template included.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import ml_dtypes
import numpy as np
from flax import nnx

from jaxrm.checkpointing import is_run_dir
from jaxrm.errors import CheckpointError
from jaxrm.hf.safetensors_io import save_safetensors
from jaxrm.hf.weight_map import to_hf_names
from jaxrm.models.config import ModelConfig, to_hf_config
from jaxrm.models.decoder import Decoder

log = logging.getLogger(__name__)

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
# Key of config.json holding what scoring needs beyond the architecture.
SCORING_KEY = "jaxrm"


def hf_tensors(model: Decoder, dtype: str = "float32") -> dict[str, np.ndarray]:
  """HF name -> host array ([out, in] for linear weights), one entry per layer, in ``dtype``."""
  params = {".".join(map(str, path)): np.asarray(var.get_value())
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  out = {}
  for key, param, layer, transpose in to_hf_names(model.config):
    host = params[param] if layer is None else params[param][layer]  # un-stacks the layers
    out[key] = np.ascontiguousarray((host.T if transpose else host).astype(DTYPES[dtype], copy=False))
  return out


def hf_config(cfg: ModelConfig, dtype: str = "float32", *, tokenizer: Any = None,
              reward_stats: dict | None = None, step_separator: str) -> dict:
  """config.json of the export: the classification architecture plus jaxrm's scoring metadata.

  Args:
    cfg: the model's config; its ``pad_token_id``, else the tokenizer's, becomes the export's.
    dtype: the tensors' dtype (``torch_dtype``).
    tokenizer: the model's tokenizer, or None.
    reward_stats: {"mean", "std", "from"} recorded at validation, or None.
    step_separator: the text ending every step in step scoring.
  """
  pad = cfg.pad_token_id
  if pad is None and tokenizer is not None:
    pad = tokenizer.pad_token_id
  if pad is None:
    log.warning("no pad token id: transformers' %s scores such a model one row at a time",
                to_hf_config(cfg)["architectures"][0])
  hf = to_hf_config(cfg.replace(param_dtype=dtype, pad_token_id=pad))
  hf[SCORING_KEY] = {"reward_stats": reward_stats, "step_separator": step_separator}
  return hf


def save_pretrained(out_dir: str | os.PathLike, model: Decoder, tokenizer: Any = None, *,
                    reward_stats: dict | None = None, step_separator: str, dtype: str | None = None) -> None:
  """Writes ``model`` (and ``tokenizer``) to ``out_dir`` as an HF checkpoint directory.

  Args:
    out_dir: created if missing; existing export files in it are replaced.
    model: its parameters must be addressable from this process.
    tokenizer: saved beside the weights; None writes no tokenizer files.
    reward_stats, step_separator: scoring metadata, see :func:`hf_config`.
    dtype: tensor dtype, "float32" or "bfloat16" (default: the model's parameter dtype).
  """
  out_dir = os.fspath(out_dir)
  dtype = dtype or model.config.param_dtype
  if dtype not in DTYPES:
    raise ValueError(f"dtype={dtype!r}; export writes {' or '.join(DTYPES)}")
  if is_run_dir(out_dir):
    raise CheckpointError(f"{out_dir} is a training output directory; export into another directory")
  os.makedirs(out_dir, exist_ok=True)
  save_safetensors(os.path.join(out_dir, "model.safetensors"), hf_tensors(model, dtype))
  config = hf_config(model.config, dtype, tokenizer=tokenizer, reward_stats=reward_stats,
                     step_separator=step_separator)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  if tokenizer is not None:
    tokenizer.save_pretrained(out_dir)
  else:
    log.warning("the model has no tokenizer: %s holds no tokenizer files", out_dir)
