"""Hugging Face tensor names <-> jaxrm parameters, through each family's table of rules.

A family's rules (:class:`jaxrm.models.families.base.Rule`, in its module of
:mod:`jaxrm.models.families`) map each ``(hf_template, param, transpose)``: ``{i}`` in a template
is the layer index, and the parameter is then one slice of a stacked ``layers.<name>`` array.
Linear weights are stored ``[out, in]`` by transformers and ``[in, out]`` here, hence the
transpose. The same table serves loading (:func:`plan`) and export (:func:`to_hf_names`);
:func:`peft_names` derives peft's adapter-file names from it. HF key names appear only in these
tables.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable

from jaxrm.errors import CheckpointError
from jaxrm.models import families
from jaxrm.models.config import ModelConfig
from jaxrm.models.decoder import layer_param_shapes
from jaxrm.models.families.base import Rule

log = logging.getLogger(__name__)

LM_HEAD = "lm_head.weight"  # absent when tied to the embedding

# Present in causal-LM checkpoints and deliberately not loaded.
SKIPPED = (re.compile("^" + re.escape(LM_HEAD) + "$"), re.compile(r".*rotary_emb\.inv_freq$"))

HEAD_PARAMS = ("score", "score_bias")
VERIFIER_HEAD = "lm_head"  # a verifier reads its answers' logits from it (jaxrm.verifier)


def param_names(cfg: ModelConfig) -> list[str]:
  if cfg.head == "lm":  # the LM head, unless tied to the embedding
    head = [] if cfg.tie_word_embeddings else [VERIFIER_HEAD]
  else:
    head = ["score"] + (["score_bias"] if cfg.head_bias else [])
  return ["embed", "final_norm", *head] + [f"layers.{n}" for n in layer_param_shapes(cfg)]


def active_rules(cfg: ModelConfig) -> list[Rule]:
  """The family's rules whose parameter exists in this configuration."""
  names = set(param_names(cfg))
  return [r for r in families.get(cfg.family).rules if r.param in names]


@dataclasses.dataclass(frozen=True)
class Slot:
  key: str  # checkpoint key
  layer: int | None
  transpose: bool


def plan(cfg: ModelConfig, keys: Iterable[str], *, new_head: bool = False) -> dict[str, list[Slot]]:
  """Maps each parameter to the checkpoint keys that fill it; raises on any mismatch.

  Unexpected keys, keys matching two rules, two keys for one tensor, missing keys and out-of-range
  layers are errors naming the key. The head may be absent altogether (a base or causal-LM
  checkpoint): the caller then initialises a new one. ``new_head`` ignores the checkpoint's head
  (e.g. a process reward model started from a sequence classifier). A vision-language checkpoint's
  tensors are read by the decoder's names for them, its vision tower's skipped
  (``Family.checkpoint_name``).
  """
  named = _decoder_keys(cfg, keys)
  if new_head:
    head_names = {r.hf for r in families.get(cfg.family).rules if r.param in HEAD_PARAMS}
    dropped = [key for key, name in named if name in head_names]
    if dropped:
      log.info("replacing the checkpoint's reward head (%s) with a new %s head", ", ".join(dropped), cfg.head)
    named = [(key, name) for key, name in named if name not in head_names]
  rules = active_rules(cfg)
  slots: dict[str, list[Slot]] = {}
  for key, name in named:
    found = _slot(cfg, rules, key, name)
    if found is None:
      continue
    param, slot = found
    twin = next((s for s in slots.get(param, []) if s.layer == slot.layer), None)
    if twin is not None:
      layer = "" if slot.layer is None else f" of layer {slot.layer}"
      raise CheckpointError(f"tensors {twin.key!r} and {key!r} both hold {param}{layer}; keep one of them")
    slots.setdefault(param, []).append(slot)
  _check_complete(cfg, rules, slots)
  return slots


def _decoder_keys(cfg: ModelConfig, keys: Iterable[str]) -> list[tuple[str, str]]:
  """(checkpoint key, the decoder's name of it) of each tensor that is the decoder's."""
  family = families.get(cfg.family)
  out = []
  for key in keys:
    name = family.checkpoint_name(key)
    if name is None:
      log.debug("skipping checkpoint tensor %s: not the text decoder's", key)
    else:
      out.append((key, name))
  return out


def _slot(cfg: ModelConfig, rules: list[Rule], key: str, name: str) -> tuple[str, Slot] | None:
  """(parameter, slot) that checkpoint tensor ``key`` (``name`` to the decoder) fills; None for a
  tensor deliberately not loaded."""
  hits = [(r, m) for r in rules if (m := r.pattern.match(name))]
  if not hits:
    if any(p.match(name) for p in SKIPPED):
      log.debug("skipping checkpoint tensor %s", key)
      return None
    raise CheckpointError(
      f"unexpected tensor {key!r} in the checkpoint: no {cfg.family} parameter takes it "
      f"(is the config.json architecture right? qkv_bias={cfg.qkv_bias}, mlp_bias={cfg.mlp_bias})"
    )
  if len(hits) > 1:
    raise CheckpointError(f"tensor {key!r} matches several rules: {[r.hf for r, _ in hits]}")
  rule, m = hits[0]
  layer = int(m.group(1)) if m.groups() else None
  if layer is not None and layer >= cfg.num_layers:
    raise CheckpointError(f"tensor {key!r} is for layer {layer}, but the config has {cfg.num_layers} layers")
  return rule.param, Slot(key, layer, rule.transpose)


def _check_complete(cfg: ModelConfig, rules: list[Rule], slots: dict[str, list[Slot]]) -> None:
  """Every rule's tensors are there, each layer's; the head's only if the checkpoint has one."""
  has_head = any(p in slots for p in HEAD_PARAMS)
  for rule in rules:
    if rule.param in HEAD_PARAMS and not has_head:
      continue
    filled = {s.layer for s in slots.get(rule.param, [])}
    wanted = set(range(cfg.num_layers)) if "{i}" in rule.hf else {None}
    for layer in sorted(wanted - filled, key=lambda x: -1 if x is None else x):
      why = ""
      if rule.param == VERIFIER_HEAD:
        why = (
          ": a verifier reads its answers' logits from the LM head, and config.json does not tie it "
          "to the embedding (tie_word_embeddings); load a causal LM (*ForCausalLM) as a verifier"
        )
      raise CheckpointError(f"missing tensor {rule.hf.format(i=layer)!r} in the checkpoint{why}")


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
