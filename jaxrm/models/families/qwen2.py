"""Qwen2 (``Qwen2ForCausalLM``...): q/k/v biases; a sliding window, when switched on, on the layers
from ``max_window_layers`` on."""

from jaxrm.models.families import base
from jaxrm.models.families.base import Family


def _window_from_max_window_layers(hf: dict) -> list[str]:
  n = hf["num_hidden_layers"]
  first = hf.get("max_window_layers", n)
  return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]


def read_sliding(hf: dict) -> dict:
  """Qwen's window: only where ``use_sliding_window`` switches it on."""
  if not hf.get("use_sliding_window", False):
    return dict(base.NO_WINDOW)
  return base.sliding(hf, _window_from_max_window_layers)


def write_sliding(cfg) -> dict:
  return {"use_sliding_window": True} if cfg.sliding_window is not None else {"sliding_window": None}


FAMILY = Family(
  name="qwen2",
  model_type="qwen2",
  architecture="Qwen2",
  rules=base.DECODER_RULES + base.PRE_MLP_NORM,
  read=lambda hf: {"qkv_bias": True, **read_sliding(hf)},
  write=write_sliding,
  tiny_hf_config={"cls": "Qwen2Config", "kw": {}},
)
