"""Llama (``LlamaForCausalLM``...): optional attention and MLP biases, rotary scaling, GGUF files."""

from jaxrm.models.families import base
from jaxrm.models.families.base import ATTN, Family, GgufLayout


def _read(hf: dict) -> dict:
  bias = bool(hf.get("attention_bias", False))
  return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(hf.get("mlp_bias", False))}


def _write(cfg) -> dict:
  return {"attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias}


# llama.cpp's tensor names (without ".weight") -> HF's.
GGUF = GgufLayout(
  architecture="llama",
  tensors=(
    (r"token_embd", r"model.embed_tokens"),
    (r"blk\.(\d+)\.attn_q", r"model.layers.\1.self_attn.q_proj"),
    (r"blk\.(\d+)\.attn_k", r"model.layers.\1.self_attn.k_proj"),
    (r"blk\.(\d+)\.attn_v", r"model.layers.\1.self_attn.v_proj"),
    (r"blk\.(\d+)\.attn_output", r"model.layers.\1.self_attn.o_proj"),
    (r"blk\.(\d+)\.ffn_gate", r"model.layers.\1.mlp.gate_proj"),
    (r"blk\.(\d+)\.ffn_up", r"model.layers.\1.mlp.up_proj"),
    (r"blk\.(\d+)\.ffn_down", r"model.layers.\1.mlp.down_proj"),
    (r"blk\.(\d+)\.attn_norm", r"model.layers.\1.input_layernorm"),
    (r"blk\.(\d+)\.ffn_norm", r"model.layers.\1.post_attention_layernorm"),
    (r"output_norm", r"model.norm"),
    (r"output", r"lm_head"),
  ),
  permuted_rows=(
    (ATTN + "q_proj.weight", "num_attention_heads"),
    (ATTN + "k_proj.weight", "num_key_value_heads"),
  ),
)

FAMILY = Family(
  name="llama",
  model_type="llama",
  architecture="Llama",
  rules=base.DECODER_RULES + base.PRE_MLP_NORM,
  read=_read,
  write=_write,
  tiny_hf_config={
    "cls": "LlamaConfig",
    "kw": {
      "attention_bias": True,
      "mlp_bias": True,
      "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
      },
    },
  },
  gguf=GGUF,
)
