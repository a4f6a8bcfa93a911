r"""Exports a reward model as a Hugging Face checkpoint directory.

  python -m jaxrm.export --checkpoint=runs/rm --out=exported/rm [--dtype=bfloat16] [--step=200]

``--checkpoint`` is a training output directory (its best checkpoint unless ``--step``), one
training checkpoint (``runs/rm/checkpoints/200``), an HF directory or a ``.gguf`` file. The output
loads with transformers' ``AutoModelForSequenceClassification`` (sequence heads) or
``AutoModelForTokenClassification`` (token heads, process reward models); what it holds is
described in :mod:`jaxrm.hf.export`.
"""

from __future__ import annotations

import logging

from absl import app, flags

from jaxrm import cli
from jaxrm.hf.export import DTYPES
from jaxrm.models.config import to_hf_config
from jaxrm.reward_model import RewardModel


def export(checkpoint: str, out_dir: str, *, dtype: str = "float32", step: int | None = None) -> RewardModel:
  """Loads ``checkpoint`` (any path ``RewardModel.from_pretrained`` takes) and exports it."""
  rm = RewardModel.from_pretrained(checkpoint, dtype=dtype, step=step)
  rm.save_pretrained(out_dir, dtype=dtype)
  return rm


FLAGS = flags.FLAGS


def define_flags() -> None:
  """The CLI's flags; defined only when run as a program, so importing this module defines none."""
  flags.DEFINE_string("checkpoint", None, "Training output dir, training checkpoint, HF dir or .gguf file.")
  flags.DEFINE_string("out", None, "Directory to write the HF checkpoint into.")
  flags.DEFINE_enum("dtype", "float32", list(DTYPES), "Dtype of the exported tensors.")
  flags.DEFINE_integer("step", None, "Checkpoint step of a training output dir (default: the best).")


def main() -> None:
  if not FLAGS.checkpoint or not FLAGS.out:
    raise app.UsageError("--checkpoint and --out are required")
  cli.setup_logging(logging.WARNING)
  rm = export(FLAGS.checkpoint, FLAGS.out, dtype=FLAGS.dtype, step=FLAGS.step)
  print(f"exported {FLAGS.checkpoint} ({rm.config.family}, {rm.config.head} head) to {FLAGS.out} "
        f"as {to_hf_config(rm.config)['architectures'][0]} in {FLAGS.dtype}")


if __name__ == "__main__":
  cli.run(main, define_flags=define_flags)
