"""Model configuration: one frozen dataclass for every supported decoder family.

The families differ in a handful of switches (biases, q/k norms, sliding windows, soft-capping,
Gemma-style norms); :func:`from_hf_config` reads them from a transformers ``config.json`` dict and
:func:`to_hf_config` writes one back. :func:`config_from_dict` reads back what
``dataclasses.asdict`` wrote (a training run's ``model_config.json``). LoRA adapters (``lora``,
:class:`jaxrm.models.lora.LoraConfig`) are not in transformers' config: they come from overrides.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jaxrm.errors import CheckpointError, ConfigError, UnsupportedModelError
from jaxrm.models.lora import LoraConfig

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2")
HEADS = ("sequence", "token")
ROPE_TYPES = ("default", "linear", "llama3")
REMAT_POLICIES = ("none", "full", "dots")
# auto: the Pallas flash kernel on a GPU, the reference einsum elsewhere (see decoder.attention_route)
ATTENTION_IMPLS = ("auto", "reference", "pallas", "cudnn")
LEGACY_ATTENTION_IMPLS = {"xla": "reference"}  # what older runs' model_config.json may hold


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  theta: float = 10000.0
  type: str = "default"  # default | linear | llama3
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def inv_freq(self, head_dim: int) -> np.ndarray:
    """Rotary inverse frequencies, float32 [head_dim // 2], as transformers computes them."""
    inv = 1.0 / (self.theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    if self.type == "linear":
      inv = inv / self.factor
    elif self.type == "llama3":
      old = self.original_max_position_embeddings
      low_wavelen = old / self.low_freq_factor
      high_wavelen = old / self.high_freq_factor
      wavelen = 2 * math.pi / inv
      scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
      smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
      smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
      medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
      inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a decoder-only reward model, plus its head and dtypes."""

  family: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope: RopeConfig = RopeConfig()
  max_position_embeddings: int = 4096
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False
  hidden_act: str = "silu"  # silu | gelu_pytorch_tanh
  sliding_window: int | None = None
  layer_types: tuple[str, ...] = ()  # per layer: "full_attention" | "sliding_attention"
  attn_logit_softcapping: float | None = None
  query_pre_attn_scalar: float | None = None
  gemma_norms: bool = False  # (1 + w) RMSNorm, sqrt(hidden) embedding scale, post-attn/post-mlp norms
  head: str = "sequence"  # sequence: one reward per row | token: num_labels logits per token
  num_labels: int = 1
  head_bias: bool = False  # *ForTokenClassification heads have a bias, *ForSequenceClassification not
  pad_token_id: int | None = None
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"
  remat: str = "none"  # none | full | dots
  # True: the layers run as one lax.scan over stacked weights (one compiled layer, fast compiles);
  # False: written out one after another (no per-step stacking of activations; compiles L layers).
  scan_layers: bool = True
  attention_impl: str = "auto"  # auto | reference | pallas | cudnn
  lora: LoraConfig = LoraConfig()  # rank 0: no adapters, the whole model trains

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise UnsupportedModelError(
        f"model family {self.family!r} is not supported; supported: {', '.join(FAMILIES)}"
      )
    if self.head not in HEADS:
      raise ConfigError(f"head must be one of {HEADS}, got {self.head!r}")
    if self.remat not in REMAT_POLICIES:
      raise ConfigError(f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ConfigError(f"attention_impl={self.attention_impl!r}; use one of {', '.join(ATTENTION_IMPLS)}")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
        f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
      )
    if self.layer_types and len(self.layer_types) != self.num_layers:
      raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
    if self.lora.base_dtype == "nf4":  # two codes per byte along each projection's input
      inputs = {
        "hidden_size": self.hidden_size,
        "num_heads * head_dim": self.num_heads * self.head_dim,
        "intermediate_size": self.intermediate_size,
      }
      odd = [f"{k}={v}" for k, v in inputs.items() if v % 2]
      if odd:
        raise ConfigError(
          f"LoRA base_dtype='nf4' packs two codes per byte along a projection's input, "
          f"but {', '.join(odd)} is odd; use base_dtype='int8' or 'bfloat16'"
        )

  @property
  def sliding_layers(self) -> np.ndarray:
    """bool [num_layers]: which layers use the sliding window."""
    if self.sliding_window is None:
      return np.zeros(self.num_layers, bool)
    if not self.layer_types:
      return np.ones(self.num_layers, bool)
    return np.array([t == "sliding_attention" for t in self.layer_types])

  @property
  def attn_scale(self) -> float:
    return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)


def config_from_dict(d: dict[str, Any], where: str) -> ModelConfig:
  """Inverse of ``dataclasses.asdict(ModelConfig)`` (JSON turned tuples into lists).

  Args:
    d: the dict, e.g. ``json.load(...)["jaxrm"]`` of a run's ``model_config.json``.
    where: the file it came from, for error messages.
  """
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(d) - known)
  if unknown:
    raise CheckpointError(f"{where}: unknown model config fields {unknown}; was it written by a newer jaxrm?")
  kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
  kwargs["rope"] = RopeConfig(**d.get("rope", {}))
  kwargs["lora"] = LoraConfig(**d.get("lora", {}))
  if "attention_impl" in kwargs:
    kwargs["attention_impl"] = LEGACY_ATTENTION_IMPLS.get(kwargs["attention_impl"], kwargs["attention_impl"])
  return ModelConfig(**kwargs)


# Architectures transformers saves in config.json, per family and head.
ARCHITECTURES = {
  "llama": "Llama",
  "mistral": "Mistral",
  "qwen2": "Qwen2",
  "qwen3": "Qwen3",
  "gemma2": "Gemma2",
}


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
  params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in ROPE_TYPES:
    raise UnsupportedModelError(
      f"rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
    )
  return RopeConfig(
    theta=float(theta),
    type=rope_type,
    factor=float(params.get("factor", 1.0)),
    low_freq_factor=float(params.get("low_freq_factor", 1.0)),
    high_freq_factor=float(params.get("high_freq_factor", 4.0)),
    original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
  )


def _sliding(hf: dict[str, Any], family: str, num_layers: int):
  window = hf.get("sliding_window")
  layer_types = tuple(hf.get("layer_types") or ())
  if family in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
    return None, ()
  if window is None or (layer_types and "sliding_attention" not in layer_types):
    return None, ()
  if family == "gemma2" and not layer_types:
    layer_types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers))
  if family in ("qwen2", "qwen3") and not layer_types:
    first_full = hf.get("max_window_layers", num_layers)
    layer_types = tuple(
      "sliding_attention" if i >= first_full else "full_attention" for i in range(num_layers)
    )
  return int(window), layer_types


def from_hf_config(hf: dict[str, Any], **overrides) -> ModelConfig:
  """Builds a :class:`ModelConfig` from a transformers config dict (``config.json``)."""
  family = hf.get("model_type")
  if family not in FAMILIES:
    archs = ", ".join(hf.get("architectures") or []) or "unknown"
    raise UnsupportedModelError(
      f"model_type {family!r} (architectures: {archs}) is not supported; "
      f"jaxrm supports: {', '.join(FAMILIES)}"
    )
  num_layers = hf["num_hidden_layers"]
  num_heads = hf["num_attention_heads"]
  head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
  window, layer_types = _sliding(hf, family, num_layers)
  archs = hf.get("architectures") or []
  token_head = any(a.endswith("ForTokenClassification") for a in archs)
  seq_head = any(a.endswith("ForSequenceClassification") for a in archs)
  if token_head:
    head, num_labels = "token", int(hf.get("num_labels") or len(hf.get("id2label") or {}) or 2)
  elif seq_head:
    head, num_labels = "sequence", int(hf.get("num_labels") or len(hf.get("id2label") or {}) or 1)
  else:
    head, num_labels = "sequence", 1
  bias = bool(hf.get("attention_bias", False))
  kwargs = dict(
    family=family,
    vocab_size=hf["vocab_size"],
    hidden_size=hf["hidden_size"],
    intermediate_size=hf["intermediate_size"],
    num_layers=num_layers,
    num_heads=num_heads,
    num_kv_heads=hf.get("num_key_value_heads") or num_heads,
    head_dim=head_dim,
    rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    rope=_rope_from_hf(hf),
    max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
    tie_word_embeddings=bool(hf.get("tie_word_embeddings", family == "gemma2")),
    qkv_bias=family == "qwen2" or (family in ("llama", "qwen3") and bias),
    o_bias=family == "llama" and bias,
    mlp_bias=family == "llama" and bool(hf.get("mlp_bias", False)),
    qk_norm=family == "qwen3",
    hidden_act=hf.get("hidden_activation") or hf.get("hidden_act", "silu"),
    sliding_window=window,
    layer_types=layer_types,
    attn_logit_softcapping=hf.get("attn_logit_softcapping") if family == "gemma2" else None,
    query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if family == "gemma2" else None,
    gemma_norms=family == "gemma2",
    head=head,
    num_labels=num_labels,
    head_bias=head == "token",
    pad_token_id=hf.get("pad_token_id"),
    bos_token_id=hf.get("bos_token_id"),
    eos_token_id=tuple(eos) if isinstance(eos := hf.get("eos_token_id"), list) else eos,
  )
  if kwargs["hidden_act"] not in ("silu", "gelu_pytorch_tanh"):
    raise UnsupportedModelError(f"hidden activation {kwargs['hidden_act']!r} is not supported")
  kwargs.update(overrides)
  return ModelConfig(**kwargs)


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  """A transformers config dict for ``cfg`` with the matching classification architecture."""
  suffix = "ForTokenClassification" if cfg.head == "token" else "ForSequenceClassification"
  rope = {"rope_type": cfg.rope.type, "rope_theta": cfg.rope.theta}
  if cfg.rope.type != "default":
    rope.update(factor=cfg.rope.factor)
  if cfg.rope.type == "llama3":
    rope.update(
      low_freq_factor=cfg.rope.low_freq_factor,
      high_freq_factor=cfg.rope.high_freq_factor,
      original_max_position_embeddings=cfg.rope.original_max_position_embeddings,
    )
  hf = {
    "model_type": cfg.family,
    "architectures": [ARCHITECTURES[cfg.family] + suffix],
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.hidden_size,
    "intermediate_size": cfg.intermediate_size,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "head_dim": cfg.head_dim,
    "rms_norm_eps": cfg.rms_norm_eps,
    "rope_theta": cfg.rope.theta,
    "rope_parameters": rope,
    "rope_scaling": None if cfg.rope.type == "default" else dict(rope),
    "max_position_embeddings": cfg.max_position_embeddings,
    "tie_word_embeddings": cfg.tie_word_embeddings,
    "num_labels": cfg.num_labels,
    "id2label": {str(i): f"LABEL_{i}" for i in range(cfg.num_labels)},
    "label2id": {f"LABEL_{i}": i for i in range(cfg.num_labels)},
    "pad_token_id": cfg.pad_token_id,
    "bos_token_id": cfg.bos_token_id,
    "eos_token_id": list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id,
    "torch_dtype": cfg.param_dtype,
  }
  if cfg.family == "gemma2":
    hf["hidden_activation"] = cfg.hidden_act
  else:
    hf["hidden_act"] = cfg.hidden_act
  if cfg.family == "llama":
    hf.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
  if cfg.family == "qwen3":
    hf["attention_bias"] = cfg.qkv_bias
  if cfg.sliding_window is not None:
    hf["sliding_window"] = cfg.sliding_window
    if cfg.layer_types:
      hf["layer_types"] = list(cfg.layer_types)
    if cfg.family in ("qwen2", "qwen3"):
      hf["use_sliding_window"] = True
  elif cfg.family in ("mistral", "qwen2", "qwen3"):
    hf["sliding_window"] = None
  if cfg.family == "gemma2":
    hf.update(
      attn_logit_softcapping=cfg.attn_logit_softcapping,
      query_pre_attn_scalar=cfg.query_pre_attn_scalar,
      final_logit_softcapping=None,
    )
  return hf
