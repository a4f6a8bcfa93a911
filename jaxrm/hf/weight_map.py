"""Hugging Face tensor names <-> jaxrm parameters, one table per family.

Each rule is ``(hf_template, param, transpose)``: ``{i}`` in a template is the layer index, and
the parameter is then one slice of a stacked ``layers.<name>`` array. Linear weights are stored
``[out, in]`` by transformers and ``[in, out]`` here, hence the transpose. The same table serves
loading and export. :func:`peft_names` derives peft's adapter-file names from the same table.
:data:`GGUF_TO_HF` names llama.cpp's tensors by their HF names, so a GGUF
file loads through the same table. HF key names appear nowhere else.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable

from jaxrm.errors import CheckpointError
from jaxrm.models.config import ModelConfig
from jaxrm.models.decoder import layer_param_shapes

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Rule:
  hf: str  # e.g. "model.layers.{i}.self_attn.q_proj.weight"
  param: str  # e.g. "layers.q"
  transpose: bool = False

  @property
  def pattern(self) -> re.Pattern:
    return _template_pattern(self.hf)


def _template_pattern(template: str) -> re.Pattern:
  """``model.layers.{i}.x`` -> a pattern matching it for any layer, the index as group 1."""
  return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")


_ATTN = "model.layers.{i}.self_attn."
_MLP = "model.layers.{i}.mlp."

_COMMON = [
  Rule("model.embed_tokens.weight", "embed"),
  Rule("model.norm.weight", "final_norm"),
  Rule("model.layers.{i}.input_layernorm.weight", "layers.input_norm"),
  *(Rule(f"{_ATTN}{p}_proj.weight", f"layers.{p}", True) for p in "qkvo"),
  *(Rule(f"{_ATTN}{p}_proj.bias", f"layers.{p}_bias") for p in "qkvo"),
  *(Rule(f"{_MLP}{p}_proj.weight", f"layers.{p}", True) for p in ("gate", "up", "down")),
  *(Rule(f"{_MLP}{p}_proj.bias", f"layers.{p}_bias") for p in ("gate", "up", "down")),
  Rule("score.weight", "score", True),
  Rule("score.bias", "score_bias"),
]

_LLAMA = _COMMON + [Rule("model.layers.{i}.post_attention_layernorm.weight", "layers.mlp_norm")]

RULES: dict[str, list[Rule]] = {
  "llama": _LLAMA,
  "mistral": _LLAMA,
  "qwen2": _LLAMA,
  "qwen3": _LLAMA
  + [
    Rule(_ATTN + "q_norm.weight", "layers.q_norm"),
    Rule(_ATTN + "k_norm.weight", "layers.k_norm"),
  ],
  "gemma2": _COMMON
  + [
    Rule("model.layers.{i}.post_attention_layernorm.weight", "layers.post_attn_norm"),
    Rule("model.layers.{i}.pre_feedforward_layernorm.weight", "layers.mlp_norm"),
    Rule("model.layers.{i}.post_feedforward_layernorm.weight", "layers.post_mlp_norm"),
  ],
}

LM_HEAD = "lm_head.weight"  # absent when tied to the embedding

# Present in causal-LM checkpoints and deliberately not loaded.
SKIPPED = (re.compile("^" + re.escape(LM_HEAD) + "$"), re.compile(r".*rotary_emb\.inv_freq$"))

HEAD_PARAMS = ("score", "score_bias")


def param_names(cfg: ModelConfig) -> list[str]:
  names = ["embed", "final_norm", "score"] + (["score_bias"] if cfg.head_bias else [])
  return names + [f"layers.{n}" for n in layer_param_shapes(cfg)]


def active_rules(cfg: ModelConfig) -> list[Rule]:
  """The family's rules whose parameter exists in this configuration."""
  names = set(param_names(cfg))
  return [r for r in RULES[cfg.family] if r.param in names]


@dataclasses.dataclass(frozen=True)
class Slot:
  key: str  # checkpoint key
  layer: int | None
  transpose: bool


def plan(cfg: ModelConfig, keys: Iterable[str], *, new_head: bool = False) -> dict[str, list[Slot]]:
  """Maps each parameter to the checkpoint keys that fill it; raises on any mismatch.

  Unexpected keys, keys matching two rules, missing keys and out-of-range layers are errors naming
  the key. The head may be absent altogether (a base or causal-LM checkpoint): the caller then
  initialises a new one. ``new_head`` ignores the checkpoint's head (e.g. a process reward model
  started from a sequence classifier).
  """
  if new_head:
    head_keys = {r.hf for r in RULES[cfg.family] if r.param in HEAD_PARAMS}
    dropped = [k for k in keys if k in head_keys]
    if dropped:
      log.info("replacing the checkpoint's reward head (%s) with a new %s head", ", ".join(dropped), cfg.head)
    keys = [k for k in keys if k not in head_keys]
  rules = active_rules(cfg)
  slots: dict[str, list[Slot]] = {}
  for key in keys:
    hits = [(r, m) for r in rules if (m := r.pattern.match(key))]
    if not hits:
      if any(p.match(key) for p in SKIPPED):
        log.debug("skipping checkpoint tensor %s", key)
        continue
      raise CheckpointError(
        f"unexpected tensor {key!r} in the checkpoint: no {cfg.family} parameter takes it "
        f"(is the config.json architecture right? qkv_bias={cfg.qkv_bias}, mlp_bias={cfg.mlp_bias})"
      )
    if len(hits) > 1:
      raise CheckpointError(f"tensor {key!r} matches several rules: {[r.hf for r, _ in hits]}")
    rule, m = hits[0]
    layer = int(m.group(1)) if m.groups() else None
    if layer is not None and layer >= cfg.num_layers:
      raise CheckpointError(
        f"tensor {key!r} is for layer {layer}, but the config has {cfg.num_layers} layers"
      )
    slots.setdefault(rule.param, []).append(Slot(key, layer, rule.transpose))

  has_head = any(p in slots for p in HEAD_PARAMS)
  for rule in rules:
    if rule.param in HEAD_PARAMS and not has_head:
      continue
    filled = {s.layer for s in slots.get(rule.param, [])}
    wanted = set(range(cfg.num_layers)) if "{i}" in rule.hf else {None}
    for layer in sorted(wanted - filled, key=lambda x: -1 if x is None else x):
      raise CheckpointError(f"missing tensor {rule.hf.format(i=layer)!r} in the checkpoint")
  return slots


def to_hf_names(cfg: ModelConfig) -> list[tuple[str, str, int | None, bool]]:
  """(hf key, param, layer, transpose) for every tensor an export writes."""
  out = []
  for rule in active_rules(cfg):
    layers = range(cfg.num_layers) if "{i}" in rule.hf else [None]
    out.extend((rule.hf.format(i=i), rule.param, i, rule.transpose) for i in layers)
  return out


# peft's PeftModel holds the HF model as ``base_model.model``, so its keys start with this.
PEFT_PREFIX = "base_model.model."
PEFT_HEAD = "score"  # the head module peft saves in full (its ``modules_to_save``)


def peft_names(cfg: ModelConfig) -> list[tuple[str, str, int | None, bool]]:
  """(peft key, param, layer, transpose) for every tensor of a peft LoRA adapter file.

  Each adapted projection ``<module>.weight`` gives ``<module>.lora_A.weight`` [r, in] and
  ``<module>.lora_B.weight`` [out, r] (jaxrm keeps A [in, r] and B [r, out]: both transposed); the
  trained head keeps its HF name. All under :data:`PEFT_PREFIX`, as
  ``peft.get_peft_model_state_dict`` names them.
  """
  adapted = {f"layers.{name}" for name in cfg.lora.params} if cfg.lora.enabled else set()
  out = []
  for key, param, layer, transpose in to_hf_names(cfg):
    if param in adapted:
      module = PEFT_PREFIX + key.removesuffix(".weight")
      out.append((f"{module}.lora_A.weight", f"{param}_lora_a", layer, True))
      out.append((f"{module}.lora_B.weight", f"{param}_lora_b", layer, True))
    elif param in HEAD_PARAMS:
      out.append((PEFT_PREFIX + key, param, layer, transpose))
  return out


# GGUF tensor name (without ".weight") -> HF tensor name (without ".weight"), Llama layout.
GGUF_TO_HF = (
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
)

# llama.cpp interleaves the rotary pairs of q and k rows; HF tensor -> the config.json field
# holding that projection's number of heads, which undoing the permutation needs.
GGUF_PERMUTED_ROWS = {
  _ATTN + "q_proj.weight": "num_attention_heads",
  _ATTN + "k_proj.weight": "num_key_value_heads",
}


def hf_name_of_gguf(gguf_name: str) -> str | None:
  """HF name of a GGUF ".weight" tensor, or None if :data:`GGUF_TO_HF` has no rule for it."""
  base, dot, suffix = gguf_name.rpartition(".")
  if suffix != "weight":
    return None
  for pattern, replacement in GGUF_TO_HF:
    if re.fullmatch(pattern, base):
      return re.sub(pattern, replacement, base) + dot + suffix
  return None


def gguf_permuted_heads(hf_key: str) -> str | None:
  """The config.json field with the head count of a tensor whose GGUF rows are permuted, else None."""
  for template, field in GGUF_PERMUTED_ROWS.items():
    if _template_pattern(template).match(hf_key):
      return field
  return None
