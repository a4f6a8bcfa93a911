r"""Exports a reward model as a Hugging Face checkpoint directory.

  python -m jaxrm.export --checkpoint=runs/rm --out=exported/rm [--dtype=bfloat16] [--step=200]

``--checkpoint`` is a training output directory (its best checkpoint unless ``--step``), one
training checkpoint (``runs/rm/checkpoints/200``), an HF directory or a ``.gguf`` file. The output
loads with transformers' ``AutoModelForSequenceClassification`` (sequence heads) or
``AutoModelForTokenClassification`` (token heads, process reward models):

* ``config.json``: the ``*ForSequenceClassification`` / ``*ForTokenClassification`` architecture,
  ``num_labels``, ``pad_token_id``, and under ``"jaxrm"`` what scoring needs besides (validation
  reward statistics, the step separator), which transformers ignores and jaxrm reads back;
* ``model.safetensors``: every tensor named by the family's weight map;
* the tokenizer files, chat template included.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import ml_dtypes
import numpy as np
from absl import app, flags
from absl import logging as absl_logging
from flax import nnx

from jaxrm.checkpointing import RUN_MODEL_CONFIG
from jaxrm.hf.safetensors_io import save_safetensors
from jaxrm.hf.weight_map import to_hf_names
from jaxrm.errors import CheckpointError
from jaxrm.models.config import to_hf_config
from jaxrm.errors import UnsupportedModelError
from jaxrm.reward_model import SCORING_KEY, RewardModel

log = logging.getLogger(__name__)

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def hf_tensors(rm: RewardModel, dtype: str = "float32") -> dict[str, np.ndarray]:
  """HF name -> host array [out, in] for linear weights, one entry per layer, in ``dtype``."""
  params = {".".join(map(str, path)): np.asarray(var.get_value())
            for path, var in nnx.to_flat_state(nnx.state(rm.model, nnx.Param))}
  out = {}
  for key, param, layer, transpose in to_hf_names(rm.config):
    host = params[param] if layer is None else params[param][layer]  # un-stacks the layers
    out[key] = np.ascontiguousarray((host.T if transpose else host).astype(DTYPES[dtype], copy=False))
  return out


def hf_config(rm: RewardModel, dtype: str = "float32") -> dict:
  """config.json of the export: the classification architecture plus jaxrm's scoring metadata."""
  cfg = rm.config
  pad = cfg.pad_token_id
  if pad is None and rm.tokenizer is not None:
    pad = rm.tokenizer.pad_token_id
  if pad is None:
    log.warning("no pad token id: transformers' %s scores such a model one row at a time",
                to_hf_config(cfg)["architectures"][0])
  hf = to_hf_config(cfg.replace(param_dtype=dtype, pad_token_id=pad))
  hf[SCORING_KEY] = {"reward_stats": rm.reward_stats, "step_separator": rm.step_separator}
  return hf


def save_pretrained(rm: RewardModel, out_dir: str | os.PathLike, *, dtype: str | None = None) -> None:
  """Writes ``rm`` to ``out_dir`` as an HF checkpoint directory.

  Args:
    rm: the model; its parameters must be addressable from this process.
    out_dir: created if missing; existing export files in it are replaced.
    dtype: tensor dtype, "float32" or "bfloat16" (default: the model's parameter dtype).
  """
  out_dir = os.fspath(out_dir)
  dtype = dtype or rm.config.param_dtype
  if dtype not in DTYPES:
    raise ValueError(f"dtype={dtype!r}; export writes {' or '.join(DTYPES)}")
  if os.path.isfile(os.path.join(out_dir, RUN_MODEL_CONFIG)):
    raise CheckpointError(f"{out_dir} is a training output directory; export into another directory")
  os.makedirs(out_dir, exist_ok=True)
  save_safetensors(os.path.join(out_dir, "model.safetensors"), hf_tensors(rm, dtype))
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config(rm, dtype), f, indent=2)
  if rm.tokenizer is not None:
    rm.tokenizer.save_pretrained(out_dir)
  else:
    log.warning("the model has no tokenizer: %s holds no tokenizer files", out_dir)


def export(checkpoint: str, out_dir: str, *, dtype: str = "float32", step: int | None = None) -> RewardModel:
  """Loads ``checkpoint`` (any path ``RewardModel.from_pretrained`` takes) and exports it."""
  rm = RewardModel.from_pretrained(checkpoint, dtype=dtype, step=step)
  save_pretrained(rm, out_dir, dtype=dtype)
  return rm


FLAGS = flags.FLAGS


def define_flags() -> None:
  """The CLI's flags; defined only when run as a program, so importing this module defines none."""
  flags.DEFINE_string("checkpoint", None, "Training output dir, training checkpoint, HF dir or .gguf file.")
  flags.DEFINE_string("out", None, "Directory to write the HF checkpoint into.")
  flags.DEFINE_enum("dtype", "float32", list(DTYPES), "Dtype of the exported tensors.")
  flags.DEFINE_integer("step", None, "Checkpoint step of a training output dir (default: the best).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if not FLAGS.checkpoint or not FLAGS.out:
    raise app.UsageError("--checkpoint and --out are required")
  logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
  absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every restore at INFO through absl
  try:
    rm = export(FLAGS.checkpoint, FLAGS.out, dtype=FLAGS.dtype, step=FLAGS.step)
  except (CheckpointError, UnsupportedModelError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  print(f"exported {FLAGS.checkpoint} ({rm.config.family}, {rm.config.head} head) to {FLAGS.out} "
        f"as {to_hf_config(rm.config)['architectures'][0]} in {FLAGS.dtype}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
