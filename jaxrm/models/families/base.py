"""What a model family is to jaxrm: one frozen :class:`Family`, and the pieces families share.

A family spec holds everything jaxrm knows of one Hugging Face decoder family: its ``model_type``
and class names, how the decoder's switches are read from a transformers ``config.json`` dict and
written back, its weight rules (HF tensor name <-> jaxrm parameter), its GGUF tensor names where
jaxrm reads GGUF files of it, and the tiny config the parity tests build. The decoder itself is one
for all families: a family only sets :class:`jaxrm.models.config.ModelConfig`'s switches.

Specs are data and dict-to-dict functions: this package imports nothing of jaxrm's model code, so
that :mod:`jaxrm.models.config` can ask it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Rule:
  """One HF tensor <-> one jaxrm parameter; ``{i}`` in ``hf`` is the layer index, and the parameter
  is then one slice of a stacked ``layers.<name>`` array. Linear weights are ``[out, in]`` in
  transformers and ``[in, out]`` in jaxrm: ``transpose``."""

  hf: str  # e.g. "model.layers.{i}.self_attn.q_proj.weight"
  param: str  # e.g. "layers.q"
  transpose: bool = False
  # A tensor that holds several parameters side by side (Phi-3's qkv_proj): all of them, in the
  # tensor's order, concatenated along ``axis`` of the HF tensor. Loading splits it, export fuses.
  fused: tuple[str, ...] = ()
  axis: int = 0

  @property
  def pattern(self) -> re.Pattern:
    return template_pattern(self.hf)


def fused(hf: str, params: tuple[str, ...], transpose: bool = False, axis: int = 0) -> tuple[Rule, ...]:
  """The rules of one HF tensor that concatenates ``params`` along its ``axis`` (each parameter's
  size is its own shape's, so the table holds no sizes)."""
  return tuple(Rule(hf, p, transpose, fused=params, axis=axis) for p in params)


def replacing(rules: tuple[Rule, ...], *new: Rule) -> tuple[Rule, ...]:
  """``rules`` with those of the parameters ``new`` covers dropped, then ``new``."""
  covered = {r.param for r in new}
  return tuple(r for r in rules if r.param not in covered) + new


def template_pattern(template: str) -> re.Pattern:
  """``model.layers.{i}.x`` -> a pattern matching it for any layer, the index as group 1."""
  return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")


@dataclasses.dataclass(frozen=True)
class GgufLayout:
  """How llama.cpp names a family's tensors, so that a GGUF file reads as an HF checkpoint."""

  architecture: str  # the file's general.architecture, e.g. "llama"
  tensors: tuple[tuple[str, str], ...]  # GGUF name pattern -> HF name, both without ".weight"
  # llama.cpp interleaves the rotary pairs of these rows; HF tensor -> the config.json field with
  # that projection's number of heads, which undoing the permutation needs.
  permuted_rows: tuple[tuple[str, str], ...] = ()

  def hf_name(self, gguf_name: str) -> str | None:
    """HF name of a GGUF ".weight" tensor, or None if no pattern takes it."""
    base, dot, suffix = gguf_name.rpartition(".")
    if suffix != "weight":
      return None
    for pattern, replacement in self.tensors:
      if re.fullmatch(pattern, base):
        return re.sub(pattern, replacement, base) + dot + suffix
    return None

  def permuted_heads(self, hf_key: str) -> str | None:
    """The config.json field with the head count of a tensor whose GGUF rows are permuted, else None."""
    for template, field in self.permuted_rows:
      if template_pattern(template).match(hf_key):
        return field
    return None


@dataclasses.dataclass(frozen=True)
class Family:
  """One decoder family: its transformers names, config mapping, weight rules and test config.

  ``read`` and ``write`` hold what differs between families; the fields every family has in common
  (sizes, heads, norms' epsilon, rotary embedding, head, token ids) are read and written by
  :func:`jaxrm.models.config.from_hf_config` and :func:`~jaxrm.models.config.to_hf_config`.
  """

  name: str  # ModelConfig.family, e.g. "llama"
  model_type: str  # config.json "model_type" of the decoder, e.g. "llama"
  architecture: str  # transformers' class names: <architecture>ForSequenceClassification...
  rules: tuple[Rule, ...]  # the weight table, for loading and export alike
  # config.json dict -> the ModelConfig fields this family sets (biases, norms, windows...).
  # Rotary embeddings it reads itself ("rope", "sliding_rope") are transformers' rope-parameter
  # dicts ({"rope_type": ..., "rope_theta": ...}); ModelConfig's defaults fill what it leaves out.
  read: Callable[[dict[str, Any]], dict[str, Any]]
  # ModelConfig -> the config.json fields this family writes beyond the common ones.
  write: Callable[[Any], dict[str, Any]]
  # The parity tests' tiny random model: {"cls": transformers config class, "kw": its arguments}.
  tiny_hf_config: dict[str, Any]
  tie_word_embeddings: bool = False  # transformers' default when config.json omits it
  activation_field: str = "hidden_act"  # the config.json field naming the MLP's activation
  default_activation: str = "silu"  # transformers' default when config.json omits it
  gguf: GgufLayout | None = None  # None: jaxrm reads no GGUF file of this family
  # A vision-language checkpoint that holds this decoder as its config.json's "text_config" (jaxrm
  # reads the text decoder, not the vision tower): its model_type, and the prefixes of its tensor
  # names -> the decoder's own prefix, or None for tensors that are not the decoder's.
  multimodal_model_type: str | None = None
  multimodal_prefixes: tuple[tuple[str, str | None], ...] = ()

  def checkpoint_name(self, key: str) -> str | None:
    """The decoder's own name of checkpoint tensor ``key`` (a vision-language checkpoint's prefix
    replaced), or None for a tensor that is not the decoder's."""
    for prefix, replacement in self.multimodal_prefixes:
      if key.startswith(prefix):
        return None if replacement is None else replacement + key[len(prefix) :]
    return key


# ------------------------------------------------------------------ weight rules families share

LAYER = "model.layers.{i}."
ATTN = LAYER + "self_attn."
MLP = LAYER + "mlp."

# Embedding, final norm, projections (biases where the config has them), the reward head and the LM
# head (a verifier's).
DECODER_RULES = (
  Rule("model.embed_tokens.weight", "embed"),
  Rule("model.norm.weight", "final_norm"),
  Rule(LAYER + "input_layernorm.weight", "layers.input_norm"),
  *(Rule(f"{ATTN}{p}_proj.weight", f"layers.{p}", True) for p in "qkvo"),
  *(Rule(f"{ATTN}{p}_proj.bias", f"layers.{p}_bias") for p in "qkvo"),
  *(Rule(f"{MLP}{p}_proj.weight", f"layers.{p}", True) for p in ("gate", "up", "down")),
  *(Rule(f"{MLP}{p}_proj.bias", f"layers.{p}_bias") for p in ("gate", "up", "down")),
  Rule("score.weight", "score", True),
  Rule("score.bias", "score_bias"),
  Rule("lm_head.weight", "lm_head", True),  # a verifier's, unless tied to the embedding
)
# Llama's name for the norm before the MLP.
PRE_MLP_NORM = (Rule(LAYER + "post_attention_layernorm.weight", "layers.mlp_norm"),)
QK_NORMS = (Rule(ATTN + "q_norm.weight", "layers.q_norm"), Rule(ATTN + "k_norm.weight", "layers.k_norm"))
# Gemma's norms before and after each of attention and MLP (``ModelConfig.gemma_norms``).
SANDWICH_NORMS = (
  Rule(LAYER + "post_attention_layernorm.weight", "layers.post_attn_norm"),
  Rule(LAYER + "pre_feedforward_layernorm.weight", "layers.mlp_norm"),
  Rule(LAYER + "post_feedforward_layernorm.weight", "layers.post_mlp_norm"),
)


# ------------------------------------------------------------------ config pieces families share

NO_WINDOW = {"sliding_window": None, "layer_types": ()}


def sliding(hf: dict[str, Any], default_layer_types: Callable[[dict], list[str]] | None = None) -> dict:
  """``sliding_window`` and ``layer_types`` of config.json ``hf``: none when it sets no window or no
  layer slides; where it lists no layer types, ``default_layer_types(hf)`` (None: every layer slides)."""
  window = hf.get("sliding_window")
  layer_types = tuple(hf.get("layer_types") or ())
  if window is None or (layer_types and "sliding_attention" not in layer_types):
    return dict(NO_WINDOW)
  if not layer_types and default_layer_types is not None:
    layer_types = tuple(default_layer_types(hf))
  return {"sliding_window": int(window), "layer_types": layer_types}


def alternating_layer_types(hf: dict[str, Any], period: int = 2) -> list[str]:
  """Every ``period``-th layer full, the others sliding: layer ``period - 1`` is the first full one."""
  n = hf["num_hidden_layers"]
  return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)]
