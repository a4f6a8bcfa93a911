"""Phi-3 (``Phi3ForCausalLM``...): q, k and v in one ``qkv_proj`` tensor and gate and up in one
``gate_up_proj``, split on loading and fused again on export; a sliding window, when set, on every
layer. Partial rotary embeddings (Phi-4-mini's ``partial_rotary_factor``) and LongRoPE scaling are
refused."""

from jaxrm.errors import UnsupportedModelError
from jaxrm.models.families import base
from jaxrm.models.families.base import ATTN, MLP, Family, GgufLayout


def _read(hf: dict) -> dict:
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  factor = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
  if factor != 1.0:
    raise UnsupportedModelError(
      f"partial_rotary_factor {factor} is not supported: jaxrm's decoder rotates the whole head "
      "(Phi-3 models with partial_rotary_factor 1.0 load)"
    )
  return base.sliding(hf)


def _write(cfg) -> dict:
  return {"partial_rotary_factor": 1.0, "sliding_window": cfg.sliding_window}


# llama.cpp's tensor names (without ".weight") -> HF's; its Phi-3 files keep the fused tensors as
# they are (ffn_up holds gate_up_proj) and the rotary halves unpermuted.
GGUF = GgufLayout(
  architecture="phi3",
  tensors=(
    (r"token_embd", r"model.embed_tokens"),
    (r"blk\.(\d+)\.attn_qkv", r"model.layers.\1.self_attn.qkv_proj"),
    (r"blk\.(\d+)\.attn_output", r"model.layers.\1.self_attn.o_proj"),
    (r"blk\.(\d+)\.ffn_up", r"model.layers.\1.mlp.gate_up_proj"),
    (r"blk\.(\d+)\.ffn_down", r"model.layers.\1.mlp.down_proj"),
    (r"blk\.(\d+)\.attn_norm", r"model.layers.\1.input_layernorm"),
    (r"blk\.(\d+)\.ffn_norm", r"model.layers.\1.post_attention_layernorm"),
    (r"output_norm", r"model.norm"),
    (r"output", r"lm_head"),
  ),
)

FAMILY = Family(
  name="phi3",
  model_type="phi3",
  architecture="Phi3",
  rules=base.replacing(
    base.DECODER_RULES + base.PRE_MLP_NORM,
    *base.fused(ATTN + "qkv_proj.weight", ("layers.q", "layers.k", "layers.v"), transpose=True),
    *base.fused(MLP + "gate_up_proj.weight", ("layers.gate", "layers.up"), transpose=True),
  ),
  read=_read,
  write=_write,
  tiny_hf_config={"cls": "Phi3Config", "kw": {"sliding_window": 8}},
  gguf=GGUF,
)
