"""Model configuration: one frozen dataclass for every supported decoder family.

The families differ in a handful of switches (biases, q/k norms, sliding windows, soft-capping,
Gemma-style norms); :func:`from_hf_config` reads them from a transformers ``config.json`` dict and
:func:`to_hf_config` writes one back, each asking the family's spec (:mod:`jaxrm.models.families`)
for what differs between families. :func:`config_from_dict` reads back what
``dataclasses.asdict`` wrote (a training run's ``model_config.json``). LoRA adapters (``lora``,
:class:`jaxrm.models.lora.LoraConfig`) are not in transformers' config: they come from overrides.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jaxrm.errors import CheckpointError, ConfigError, UnsupportedModelError
from jaxrm.models import families
from jaxrm.models.lora import LoraConfig

HEADS = ("sequence", "token", "lm")
ROPE_TYPES = ("default", "linear", "llama3")
# What a layer's backward pass recomputes, least first: nothing; what only adds or scales (norms,
# rope, activations) from the kept products' outputs; all but the projections; all but its input.
REMAT_POLICIES = ("none", "elementwise", "dots", "full")
# auto: the Pallas flash kernel on a GPU, the reference einsum elsewhere (see decoder.attention_route)
ATTENTION_IMPLS = ("auto", "reference", "pallas", "cudnn")


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

  @classmethod
  def from_hf(cls, params: dict[str, Any], theta: float = 10000.0) -> RopeConfig:
    """From transformers' rope parameters (``rope_parameters``, or the older ``rope_scaling``);
    ``theta`` where they hold no ``rope_theta``."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
      raise UnsupportedModelError(
        f"rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
      )
    return cls(
      theta=float(params.get("rope_theta", theta)),
      type=rope_type,
      factor=float(params.get("factor", 1.0)),
      low_freq_factor=float(params.get("low_freq_factor", 1.0)),
      high_freq_factor=float(params.get("high_freq_factor", 4.0)),
      original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )

  def to_hf(self) -> dict[str, Any]:
    """transformers' rope parameters: the inverse of :meth:`from_hf`."""
    params = {"rope_type": self.type, "rope_theta": self.theta}
    if self.type != "default":
      params.update(factor=self.factor)
    if self.type == "llama3":
      params.update(
        low_freq_factor=self.low_freq_factor,
        high_freq_factor=self.high_freq_factor,
        original_max_position_embeddings=self.original_max_position_embeddings,
      )
    return params


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
  sliding_rope: RopeConfig | None = None  # the sliding layers' own rotary embedding; None: rope's
  attn_logit_softcapping: float | None = None
  final_logit_softcapping: float | None = None  # the LM head's (Gemma 2): read by a verifier head
  query_pre_attn_scalar: float | None = None
  # (1 + w) RMSNorms (the q/k norms' too), sqrt(hidden) embedding scale, post-attn/post-mlp norms
  gemma_norms: bool = False
  # sequence: one reward per row | token: num_labels logits per token | lm: a verifier's, one reward
  # per row, the LM head's log-odds of two answer tokens (jaxrm.tasks.verifier)
  head: str = "sequence"
  num_labels: int = 1
  verifier_tokens: tuple[int, ...] = ()  # head "lm": the ids of its answers (yes, no)
  head_bias: bool = False  # *ForTokenClassification heads have a bias, *ForSequenceClassification not
  pad_token_id: int | None = None
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"
  remat: str = "elementwise"  # none | elementwise | dots | full (REMAT_POLICIES)
  # True: the layers run as one lax.scan over stacked weights (one compiled layer, fast compiles);
  # False: written out one after another (no per-step stacking of activations; compiles L layers).
  scan_layers: bool = True
  attention_impl: str = "auto"  # auto | reference | pallas | cudnn
  lora: LoraConfig = LoraConfig()  # rank 0: no adapters, the whole model trains

  def __post_init__(self):
    families.get(self.family)  # an unknown family is an error naming the supported ones
    if self.head not in HEADS:
      raise ConfigError(f"head must be one of {HEADS}, got {self.head!r}")
    self._check_verifier()
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

  def _check_verifier(self) -> None:
    if self.head != "lm":
      if self.verifier_tokens:
        raise ConfigError(f"verifier_tokens={self.verifier_tokens} belong to head='lm', not {self.head!r}")
      return
    tokens = self.verifier_tokens
    if len(tokens) != 2 or tokens[0] == tokens[1] or not all(0 <= t < self.vocab_size for t in tokens):
      raise ConfigError(
        f"head='lm' needs verifier_tokens: the ids of its two different answers (yes, no), "
        f"each below vocab_size={self.vocab_size}; got {tokens!r}"
      )
    if self.num_labels != 1:
      raise ConfigError(f"head='lm' gives one reward per row; num_labels={self.num_labels}")

  @property
  def sliding_layers(self) -> np.ndarray:
    """bool [num_layers]: which layers use the sliding window."""
    if self.sliding_window is None:
      return np.zeros(self.num_layers, bool)
    if not self.layer_types:
      return np.ones(self.num_layers, bool)
    return np.array([t == "sliding_attention" for t in self.layer_types])

  @property
  def per_token(self) -> bool:
    """Whether the head gives outputs at every token (a token head), not one per row."""
    return self.head == "token"

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
  if d.get("sliding_rope") is not None:
    kwargs["sliding_rope"] = RopeConfig(**d["sliding_rope"])
  kwargs["lora"] = LoraConfig(**d.get("lora", {}))
  return ModelConfig(**kwargs)


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  return RopeConfig.from_hf(params, hf.get("rope_theta", 10000.0))


def _head_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
  """``head`` and ``num_labels`` of the architecture config.json names (a new sequence head for none)."""
  archs = hf.get("architectures") or []
  labels = hf.get("num_labels") or len(hf.get("id2label") or {})
  if any(a.endswith("ForTokenClassification") for a in archs):
    return {"head": "token", "num_labels": int(labels or 2), "head_bias": True}
  if any(a.endswith("ForSequenceClassification") for a in archs):
    return {"head": "sequence", "num_labels": int(labels or 1)}
  return {"head": "sequence", "num_labels": 1}


# What a vision-language config.json's top level says of the model's head.
_HEAD_FIELDS = ("architectures", "num_labels", "id2label", "label2id")


def _decoder_config(hf: dict[str, Any], family: families.Family) -> dict[str, Any]:
  """The decoder's config.json: a vision-language checkpoint's ``text_config``, with the head its top
  level names; ``hf`` itself otherwise."""
  if hf.get("model_type") != family.multimodal_model_type:
    return hf
  if not isinstance(hf.get("text_config"), dict):
    raise UnsupportedModelError(
      f"config.json of model_type {hf['model_type']!r} has no text_config; jaxrm reads its text decoder from it"
    )
  return {**hf["text_config"], **{k: hf[k] for k in _HEAD_FIELDS if k in hf}}


def _family_ropes(switches: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
  """A family's own rotary embeddings (``Family.read``) as RopeConfigs; a sliding rope that no layer
  uses, or that equals the others', is None."""
  out = {k: RopeConfig.from_hf(v) for k, v in switches.items() if k in ("rope", "sliding_rope")}
  unused = kwargs.get("sliding_window") is None or out.get("sliding_rope") == out.get("rope", kwargs["rope"])
  if "sliding_rope" in out and unused:
    out["sliding_rope"] = None
  return out


def from_hf_config(hf: dict[str, Any], **overrides) -> ModelConfig:
  """Builds a :class:`ModelConfig` from a transformers config dict (``config.json``); of a
  vision-language checkpoint, the text decoder's."""
  family = families.of_config(hf)
  hf = _decoder_config(hf, family)
  num_heads = hf["num_attention_heads"]
  eos = hf.get("eos_token_id")
  kwargs = dict(
    family=family.name,
    vocab_size=hf["vocab_size"],
    hidden_size=hf["hidden_size"],
    intermediate_size=hf["intermediate_size"],
    num_layers=hf["num_hidden_layers"],
    num_heads=num_heads,
    num_kv_heads=hf.get("num_key_value_heads") or num_heads,
    head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
    rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    rope=_rope_from_hf(hf),
    max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
    tie_word_embeddings=bool(hf.get("tie_word_embeddings", family.tie_word_embeddings)),
    hidden_act=hf.get(family.activation_field) or family.default_activation,
    pad_token_id=hf.get("pad_token_id"),
    bos_token_id=hf.get("bos_token_id"),
    eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
    **_head_from_hf(hf),
  )
  switches = family.read(hf)
  kwargs.update(switches)
  kwargs.update(_family_ropes(switches, kwargs))
  if kwargs["hidden_act"] not in ("silu", "gelu_pytorch_tanh"):
    raise UnsupportedModelError(f"hidden activation {kwargs['hidden_act']!r} is not supported")
  kwargs.update(overrides)
  return ModelConfig(**kwargs)


_ARCHITECTURE_SUFFIXES = {
  "sequence": "ForSequenceClassification",
  "token": "ForTokenClassification",
  "lm": "ForCausalLM",
}


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  """A transformers config dict for ``cfg`` with the matching classification architecture (a
  verifier's: the causal LM)."""
  family = families.get(cfg.family)
  suffix = _ARCHITECTURE_SUFFIXES[cfg.head]
  rope = cfg.rope.to_hf()
  hf = {
    "model_type": family.model_type,
    "architectures": [family.architecture + suffix],
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
    family.activation_field: cfg.hidden_act,
    "pad_token_id": cfg.pad_token_id,
    "bos_token_id": cfg.bos_token_id,
    "eos_token_id": list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id,
    "torch_dtype": cfg.param_dtype,
  }
  if cfg.head != "lm":  # a causal LM has no labels
    hf.update(
      num_labels=cfg.num_labels,
      id2label={str(i): f"LABEL_{i}" for i in range(cfg.num_labels)},
      label2id={f"LABEL_{i}": i for i in range(cfg.num_labels)},
    )
  if cfg.sliding_window is not None:
    hf["sliding_window"] = cfg.sliding_window
    if cfg.layer_types:
      hf["layer_types"] = list(cfg.layer_types)
  hf.update(family.write(cfg))
  return hf
