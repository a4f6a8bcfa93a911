"""Gemma 2 (``Gemma2ForCausalLM``...): Gemma's norms and embedding scale, attention logits
soft-capped and scaled by ``query_pre_attn_scalar``, sliding and full layers alternating."""

from jaxrm.models.families import base
from jaxrm.models.families.base import Family


def _read(hf: dict) -> dict:
  return {
    "attn_logit_softcapping": hf.get("attn_logit_softcapping"),
    "final_logit_softcapping": hf.get("final_logit_softcapping", 30.0),  # transformers' default
    "query_pre_attn_scalar": hf.get("query_pre_attn_scalar"),
    "gemma_norms": True,
    **base.sliding(hf, base.alternating_layer_types),
  }


def _write(cfg) -> dict:
  return {
    "attn_logit_softcapping": cfg.attn_logit_softcapping,
    "query_pre_attn_scalar": cfg.query_pre_attn_scalar,
    # the LM head's: a verifier reads it; transformers' classifiers ignore it
    "final_logit_softcapping": cfg.final_logit_softcapping,
  }


FAMILY = Family(
  name="gemma2",
  model_type="gemma2",
  architecture="Gemma2",
  rules=base.DECODER_RULES + base.SANDWICH_NORMS,
  read=_read,
  write=_write,
  tiny_hf_config={
    "cls": "Gemma2Config",
    "kw": {
      "sliding_window": 8,
      "attn_logit_softcapping": 2.0,
      "query_pre_attn_scalar": 20,
      "head_dim": 16,
      "hidden_activation": "gelu_pytorch_tanh",
      "final_logit_softcapping": None,
    },
  },
  tie_word_embeddings=True,
  activation_field="hidden_activation",
  default_activation="gelu_pytorch_tanh",
)
