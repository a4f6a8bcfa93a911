"""Gemma 3, text (``Gemma3ForCausalLM``, ``Gemma3TextForSequenceClassification``), and the text
decoder of a vision-language ``Gemma3ForConditionalGeneration`` checkpoint.

Gemma 2's norms and embedding scale, plus (1 + w) q/k RMSNorms; sliding and full layers, every
``sliding_window_pattern``-th layer full, the sliding ones with their own rotary base
(``rope_local_base_freq``), the full ones with ``rope_theta`` and its scaling; attention logits
scaled by ``query_pre_attn_scalar`` and soft-capped only if configured.
"""

from jaxrm.errors import UnsupportedModelError
from jaxrm.models.families import base
from jaxrm.models.families.base import Family

# transformers' Gemma3TextConfig defaults, for config.json files that leave them out.
_WINDOW = 4096
_PATTERN = 6
_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def _layer_types(hf: dict) -> list[str]:
  """Older config.json files give a period instead: every ``sliding_window_pattern``-th layer is full."""
  return base.alternating_layer_types(hf, hf.get("sliding_window_pattern", _PATTERN))


def _ropes(hf: dict) -> dict:
  """The full and sliding layers' rope parameters: transformers' per-layer-type ``rope_parameters``,
  or the older ``rope_theta`` + ``rope_scaling`` and ``rope_local_base_freq``."""
  params = hf.get("rope_parameters") or {}
  full = params.get("full_attention") or params or hf.get("rope_scaling") or {}
  local = params.get("sliding_attention") or {"rope_theta": hf.get("rope_local_base_freq")}
  return {
    "rope": {
      **full,
      "rope_theta": full.get("rope_theta") or hf.get("rope_theta") or _THETA["full_attention"],
    },
    "sliding_rope": {**local, "rope_theta": local.get("rope_theta") or _THETA["sliding_attention"]},
  }


def _read(hf: dict) -> dict:
  if hf.get("use_bidirectional_attention"):
    raise UnsupportedModelError(
      "use_bidirectional_attention=true (an embedding model, e.g. EmbeddingGemma) is not supported: "
      "jaxrm's decoder attends causally"
    )
  bias = bool(hf.get("attention_bias", False))
  return {
    "qkv_bias": bias,
    "o_bias": bias,
    "qk_norm": True,
    "gemma_norms": True,
    "attn_logit_softcapping": hf.get("attn_logit_softcapping"),
    "final_logit_softcapping": hf.get("final_logit_softcapping"),
    "query_pre_attn_scalar": hf.get("query_pre_attn_scalar", 256),
    **base.sliding({"sliding_window": _WINDOW, **hf}, _layer_types),
    **_ropes(hf),
  }


def _write(cfg) -> dict:
  local = cfg.sliding_rope or cfg.rope
  return {
    "attention_bias": cfg.qkv_bias,
    "attn_logit_softcapping": cfg.attn_logit_softcapping,
    "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
    # the LM head's: a verifier reads it; transformers' classifiers ignore it
    "final_logit_softcapping": cfg.final_logit_softcapping,
    "use_bidirectional_attention": False,
    # transformers builds the sliding layers' mask even when no layer uses it: a window must be set.
    "sliding_window": cfg.sliding_window or _WINDOW,
    "layer_types": ["sliding_attention" if s else "full_attention" for s in cfg.sliding_layers],
    "rope_parameters": {"full_attention": cfg.rope.to_hf(), "sliding_attention": local.to_hf()},
    "rope_local_base_freq": local.theta,  # what transformers before 5 and vLLM read
  }


FAMILY = Family(
  name="gemma3",
  model_type="gemma3_text",
  architecture="Gemma3Text",
  rules=base.DECODER_RULES + base.SANDWICH_NORMS + base.QK_NORMS,
  read=_read,
  write=_write,
  tiny_hf_config={
    "cls": "Gemma3TextConfig",
    "kw": {
      "head_dim": 16,
      "query_pre_attn_scalar": 24,
      "sliding_window": 8,
      "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
      # Bases far apart, so that a layer given the other layer type's rotary embedding shows.
      "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
      },
    },
  },
  tie_word_embeddings=True,
  activation_field="hidden_activation",
  default_activation="gelu_pytorch_tanh",
  multimodal_model_type="gemma3",
  # Gemma3ForConditionalGeneration's tensors: transformers writes the first layout, and reads the
  # second (its own modules' names) too.
  multimodal_prefixes=(
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("vision_tower.", None),
    ("multi_modal_projector.", None),
    ("model.vision_tower.", None),
    ("model.multi_modal_projector.", None),
  ),
)
