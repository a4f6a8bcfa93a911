"""Mistral (``MistralForCausalLM``...): a sliding window on every layer, or none."""

from jaxrm.models.families import base
from jaxrm.models.families.base import Family


def _write(cfg) -> dict:
  # transformers' MistralConfig defaults to a window of 4096: no window must be said.
  return {} if cfg.sliding_window is not None else {"sliding_window": None}


FAMILY = Family(
  name="mistral",
  model_type="mistral",
  architecture="Mistral",
  rules=base.DECODER_RULES + base.PRE_MLP_NORM,
  read=base.sliding,
  write=_write,
  tiny_hf_config={"cls": "MistralConfig", "kw": {"sliding_window": 8}},
)
