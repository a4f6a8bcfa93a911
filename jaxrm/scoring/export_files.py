"""Writing an export: an HF checkpoint directory (:mod:`jaxrm.hf.export` writes the model) with
what scoring needs besides the weights (:class:`jaxrm.scoring.loading.ScoringInfo`) recorded in it, or a
peft adapter directory; never into a training output directory or a directory the model is read from.
"""

from __future__ import annotations

import os
from typing import Any

from jaxrm.errors import CheckpointError
from jaxrm.hf import export as hf_export
from jaxrm.models.decoder import Decoder
from jaxrm.run.run_files import is_run_dir
from jaxrm.scoring.loading import SCORING_KEY, HFSource, RunSource, ScoringInfo, Source
from jaxrm.tasks import asker as askers


def save_export(
  out_dir: str | os.PathLike, model: Decoder, tokenizer: Any, info: ScoringInfo, *, dtype: str | None = None
) -> None:
  """Writes an HF checkpoint directory (:func:`jaxrm.hf.export.save_pretrained`) that records
  ``info`` for scoring; never into a training output directory."""
  check_export_dir(out_dir)
  hf_export.save_pretrained(
    out_dir,
    model,
    tokenizer,
    dtype=dtype,
    attributes=info.attributes,
    extra_config={SCORING_KEY: info.export_entry()},
    extra_files=_extra_files(info),
  )


def save_adapters_export(
  out_dir: str | os.PathLike,
  model: Decoder,
  tokenizer: Any,
  info: ScoringInfo,
  *,
  base_model_name_or_path: str | None,
  dtype: str | None = None,
) -> None:
  """Writes a peft adapter directory (:func:`jaxrm.hf.export.save_peft_adapters`) with jaxrm's
  own files for scoring (a verifier's or a judge's question and answers); never into a training output directory."""
  check_export_dir(out_dir)
  hf_export.save_peft_adapters(
    out_dir,
    model,
    tokenizer,
    base_model_name_or_path=base_model_name_or_path,
    dtype=dtype,
    extra_files=_extra_files(info),
  )


def _extra_files(info: ScoringInfo) -> dict[str, Any] | None:
  """What an LM head asks (a verifier's question and answers; a judge's, with its task's name and
  template), in :data:`jaxrm.tasks.asker.FILE`; None for other heads."""
  return None if info.verifier is None else {askers.FILE: info.verifier.to_json()}


def check_export_dir(out_dir: str | os.PathLike, source: Source | None = None) -> None:
  """Refuses an export into a training output directory, or into a directory ``source`` reads:
  its own (an HF directory), or the base a LoRA run's adapters are loaded over, which the export
  would change under the run."""
  out_dir = os.fspath(out_dir)
  if is_run_dir(out_dir):
    raise CheckpointError(f"{out_dir} is a training output directory; export into another directory")
  if isinstance(source, HFSource) and _same_dir(out_dir, source.path):
    raise CheckpointError(f"{out_dir} is the directory the model is read from; export into another directory")
  base = source.files.base_model if isinstance(source, RunSource) else None
  if base and _same_dir(out_dir, base):
    raise CheckpointError(
      f"{out_dir} holds the base model that {source.files.run_dir} loads its LoRA adapters over; "
      "exporting into it would change that run's scores: export into another directory"
    )


def _same_dir(a: str, b: str) -> bool:
  return os.path.isdir(a) and os.path.isdir(b) and os.path.samefile(a, b)
