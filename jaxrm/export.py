r"""Exports a reward model as a Hugging Face checkpoint directory.

  python -m jaxrm.export --model=runs/rm --out=exported/rm [--dtype=bfloat16] [--step=200]
  python -m jaxrm.export --model=runs/rm-lora --out=exported/adapters --adapters_only

``--model`` (as ``evaluate`` and ``serve`` name it) is a training output directory (its best
checkpoint unless ``--step``; the step taken and why is printed first), one training checkpoint (``runs/rm/checkpoints/200``), an HF
directory or a ``.gguf`` file. The output loads with transformers'
``AutoModelForSequenceClassification`` (sequence heads) or ``AutoModelForTokenClassification``
(token heads, process reward models), a verifier's or a pairwise judge's with
``AutoModelForCausalLM`` (its question, answers and, for a judge, its task and template in
``jaxrm_verifier.json``, so that jaxrm loads it back as what it is); what it holds is described in
:mod:`jaxrm.hf.export`. A
model trained with LoRA is exported with its adapters merged into the weights, or with
``--adapters_only`` as a peft adapter directory over its base checkpoint (``--base_model``;
default: the base the run trained over, as its ``model_config.json`` names it).
"""

from __future__ import annotations

import logging

from absl import app, flags

from jaxrm import cli
from jaxrm.hf.export import DTYPES
from jaxrm.models.config import to_hf_config
from jaxrm.scoring import export_files, loading
from jaxrm.scoring.reward_model import RewardModel

log = logging.getLogger(__name__)


def export(
  checkpoint: str | loading.Source,
  out_dir: str,
  *,
  dtype: str = "float32",
  step: int | None = None,
  adapters_only: bool = False,
  base_model: str | None = None,
) -> RewardModel:
  """Loads ``checkpoint`` (any path ``RewardModel.from_pretrained`` takes, or a located source)
  and exports it; never into a training output directory, the directory it reads, or a LoRA run's
  base (:func:`jaxrm.scoring.export_files.check_export_dir`).

  ``adapters_only`` writes its LoRA adapters and head as a peft adapter directory instead, naming
  ``base_model`` (default: the base the training run trained over, a local path made absolute)
  as their base.
  """
  source = loading.as_source(checkpoint, step)
  export_files.check_export_dir(out_dir, source)
  rm = RewardModel.from_pretrained(source, dtype=dtype)
  if not adapters_only:
    rm.save_pretrained(out_dir, dtype=dtype)
    return rm
  base = base_model or (source.files.base_model if isinstance(source, loading.RunSource) else None)
  export_files.save_adapters_export(
    out_dir, rm.model, rm.tokenizer, rm.info, base_model_name_or_path=base, dtype=dtype
  )
  if base is None or loading.names_gguf(base):
    log.warning(
      "peft loads adapters over an HF checkpoint, and their base is %s: export the base with "
      "`python -m jaxrm.export --model=<base> --out=<dir>`, load the adapters over <dir>, "
      "and pass --base_model=<dir> to record it in adapter_config.json",
      base or "not known",
    )
  return rm


FLAGS = flags.FLAGS


def define_flags() -> None:
  """The CLI's flags; defined only when run as a program, so importing this module defines none."""
  flags.DEFINE_string("model", None, "Training output dir, training checkpoint, HF dir or .gguf file.")
  flags.DEFINE_string("out", None, "Directory to write the HF checkpoint into.")
  flags.DEFINE_enum("dtype", "float32", list(DTYPES), "Dtype of the exported tensors.")
  cli.define_step_flag()
  flags.DEFINE_bool(
    "adapters_only",
    False,
    "Write the LoRA adapters and head as a peft adapter directory instead of a merged checkpoint.",
  )
  flags.DEFINE_string(
    "base_model",
    None,
    "With --adapters_only: the base checkpoint recorded in "
    "adapter_config.json (default: the base the run trained over).",
  )


def main() -> None:
  if not FLAGS.model or not FLAGS.out:
    raise app.UsageError("--model and --out are required")
  cli.setup_logging(logging.WARNING)
  rm = export(
    cli.located_model(FLAGS.model, FLAGS.step),
    FLAGS.out,
    dtype=FLAGS.dtype,
    adapters_only=FLAGS.adapters_only,
    base_model=FLAGS.base_model,
  )
  what = (
    f"peft LoRA adapters (rank {rm.config.lora.rank})"
    if FLAGS.adapters_only
    else to_hf_config(rm.config)["architectures"][0]
  )
  print(
    f"exported {FLAGS.model} ({rm.config.family}, {rm.config.head} head) to {FLAGS.out} "
    f"as {what} in {FLAGS.dtype}"
  )


if __name__ == "__main__":
  cli.run(main, define_flags=define_flags)
