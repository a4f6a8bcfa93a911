"""Qwen3 (``Qwen3ForCausalLM``...): Qwen2's window, q/k RMSNorms, q/k/v biases only if configured."""

from jaxrm.models.families import base, qwen2
from jaxrm.models.families.base import Family


def _read(hf: dict) -> dict:
  return {"qkv_bias": bool(hf.get("attention_bias", False)), "qk_norm": True, **qwen2.read_sliding(hf)}


def _write(cfg) -> dict:
  return {"attention_bias": cfg.qkv_bias, **qwen2.write_sliding(cfg)}


FAMILY = Family(
  name="qwen3",
  model_type="qwen3",
  architecture="Qwen3",
  rules=base.DECODER_RULES + base.PRE_MLP_NORM + base.QK_NORMS,
  read=_read,
  write=_write,
  tiny_hf_config={"cls": "Qwen3Config", "kw": {"head_dim": 24}},
)
