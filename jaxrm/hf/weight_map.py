"""Hugging Face tensor names <-> jaxrm parameters, through each family's table of rules.

A family's rules (:class:`jaxrm.models.families.base.Rule`, in its module of
:mod:`jaxrm.models.families`) map each ``(hf_template, param, transpose)``: ``{i}`` in a template
is the layer index, and the parameter is then one slice of a stacked ``layers.<name>`` array.
Linear weights are stored ``[out, in]`` by transformers and ``[in, out]`` here, hence the
transpose. The same table serves loading (:func:`plan`) and export (:func:`to_hf_names`,
:func:`gather`); :func:`peft_names` derives peft's adapter-file names from it. A rule may take one
part of a tensor that holds several parameters side by side (``Rule.fused``, Phi-3's ``qkv_proj``):
loading splits it by the parameters' sizes, export concatenates them again, and a peft adapter of
such a module stacks its parts' adapters. HF key names appear only in these tables.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import numpy as np

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
VERIFIER_HEAD = "lm_head"  # a verifier reads its answers' logits from it (jaxrm.tasks.verifier)


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
class Part:
  """The rows ``start:stop`` along ``axis`` of a fused checkpoint tensor, whose size there is
  ``size``: that of the ``params`` it holds side by side."""

  axis: int
  start: int
  stop: int
  size: int
  params: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Slot:
  key: str  # checkpoint key
  layer: int | None
  transpose: bool
  part: Part | None = None  # a fused tensor's: the parameter's share of it

  def take(self, t: np.ndarray) -> np.ndarray:
    """The parameter's share of checkpoint tensor ``t`` (HF layout): all of it, or its part."""
    if self.part is None:
      return t
    p = self.part
    if t.ndim <= p.axis or t.shape[p.axis] != p.size:
      raise CheckpointError(
        f"tensor {self.key!r} has shape {tuple(t.shape)}, but it should hold {p.size} along axis "
        f"{p.axis}: the parameters {', '.join(p.params)} side by side (check config.json "
        "against the weights)"
      )
    return t[(slice(None),) * p.axis + (slice(p.start, p.stop),)]


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
    for param, slot in _slots(cfg, rules, key, name):
      _add(slots, param, slot)
  _check_complete(cfg, rules, slots)
  return slots


def _add(slots: dict[str, list[Slot]], param: str, slot: Slot) -> None:
  twin = next((s for s in slots.get(param, []) if s.layer == slot.layer), None)
  if twin is not None:
    layer = "" if slot.layer is None else f" of layer {slot.layer}"
    raise CheckpointError(f"tensors {twin.key!r} and {slot.key!r} both hold {param}{layer}; keep one of them")
  slots.setdefault(param, []).append(slot)


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


def _slots(cfg: ModelConfig, rules: list[Rule], key: str, name: str) -> list[tuple[str, Slot]]:
  """(parameter, slot) of each parameter that checkpoint tensor ``key`` (``name`` to the decoder)
  fills: one, or each part of a fused tensor; none for a tensor deliberately not loaded."""
  hits = [(r, m) for r in rules if (m := r.pattern.match(name))]
  if not hits:
    if any(p.match(name) for p in SKIPPED):
      log.debug("skipping checkpoint tensor %s", key)
      return []
    raise CheckpointError(
      f"unexpected tensor {key!r} in the checkpoint: no {cfg.family} parameter takes it "
      f"(is the config.json architecture right? qkv_bias={cfg.qkv_bias}, mlp_bias={cfg.mlp_bias})"
    )
  if len({r.hf for r, _ in hits}) > 1:
    raise CheckpointError(f"tensor {key!r} matches several rules: {[r.hf for r, _ in hits]}")
  m = hits[0][1]
  layer = int(m.group(1)) if m.groups() else None
  if layer is not None and layer >= cfg.num_layers:
    raise CheckpointError(f"tensor {key!r} is for layer {layer}, but the config has {cfg.num_layers} layers")
  return [(r.param, Slot(key, layer, r.transpose, _part(cfg, r))) for r, _ in hits]


def _hf_size(cfg: ModelConfig, param: str, transpose: bool, axis: int) -> int:
  """Size of ``param`` (one layer of it) along ``axis`` of its HF tensor."""
  shapes = layer_param_shapes(cfg)
  name = param.removeprefix("layers.")
  if name == param or name not in shapes:
    raise CheckpointError(f"a fused tensor holds {param}, which is not a layer parameter of {cfg.family}")
  shape = shapes[name][0][1:]
  return (shape[::-1] if transpose else shape)[axis]


def _part(cfg: ModelConfig, rule: Rule) -> Part | None:
  """``rule``'s share of its fused tensor, by the sizes of the parameters the tensor holds."""
  if not rule.fused:
    return None
  sizes = [_hf_size(cfg, p, rule.transpose, rule.axis) for p in rule.fused]
  i = rule.fused.index(rule.param)
  start = sum(sizes[:i])
  return Part(rule.axis, start, start + sizes[i], sum(sizes), rule.fused)


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
          ": a verifier or a pairwise judge reads its answers' logits from the LM head, and "
          "config.json does not tie it to the embedding (tie_word_embeddings); load a causal LM "
          "(*ForCausalLM)"
        )
      raise CheckpointError(f"missing tensor {rule.hf.format(i=layer)!r} in the checkpoint{why}")


class Named(NamedTuple):
  """One parameter's share of an exported tensor. Entries of one key are joined in order: by
  ``concat`` along ``axis`` (a fused tensor), or by ``block``, block-diagonally (a fused module's
  LoRA B: each part's own rows and rank columns; a ``zero`` part, not adapted, adds zero rows of
  its weight's output size and no columns)."""

  key: str
  param: str
  layer: int | None
  transpose: bool
  join: str = ""  # "" (the tensor is this one parameter) | "concat" | "block"
  axis: int = 0
  zero: bool = False


def to_hf_names(cfg: ModelConfig) -> list[Named]:
  """The entries of every tensor an export writes (:func:`gather` makes them tensors)."""
  out = []
  for rule in active_rules(cfg):
    layers = range(cfg.num_layers) if "{i}" in rule.hf else [None]
    join = "concat" if rule.fused else ""
    out.extend(Named(rule.hf.format(i=i), rule.param, i, rule.transpose, join, rule.axis) for i in layers)
  return out


def gather(params: Mapping[str, np.ndarray], names: Iterable[Named], dtype) -> dict[str, np.ndarray]:
  """HF (or peft) key -> host array in ``dtype``, from jaxrm's parameters (name -> stacked array):
  each entry's layer, transposed to HF's layout, the parts of a fused tensor joined."""
  parts: dict[str, tuple[Named, list[np.ndarray]]] = {}
  for n in names:
    host = params[n.param] if n.layer is None else params[n.param][n.layer]  # un-stacks the layers
    host = host.T if n.transpose else host
    if n.zero:
      host = np.zeros((host.shape[0], 0), host.dtype)
    parts.setdefault(n.key, (n, []))[1].append(host)
  out = {}
  for key, (n, hosts) in parts.items():
    if n.join == "concat":
      t = np.concatenate(hosts, axis=n.axis)
    elif n.join == "block":
      t = _block_diagonal(hosts)
    else:
      (t,) = hosts
    out[key] = np.ascontiguousarray(t.astype(dtype, copy=False))
  return out


def _block_diagonal(blocks: list[np.ndarray]) -> np.ndarray:
  out = np.zeros((sum(b.shape[0] for b in blocks), sum(b.shape[1] for b in blocks)), blocks[0].dtype)
  r = c = 0
  for b in blocks:
    out[r : r + b.shape[0], c : c + b.shape[1]] = b
    r, c = r + b.shape[0], c + b.shape[1]
  return out


# peft's PeftModel holds the HF model as ``base_model.model``, so its keys start with this.
PEFT_PREFIX = "base_model.model."
PEFT_HEAD = "score"  # the head module peft saves in full (its ``modules_to_save``)


def _adapted(cfg: ModelConfig) -> set[str]:
  return {f"layers.{name}" for name in cfg.lora.params} if cfg.lora.enabled else set()


def peft_names(cfg: ModelConfig) -> list[Named]:
  """The entries of every tensor of a peft LoRA adapter file (:func:`gather` makes them tensors).

  Each adapted projection ``<module>.weight`` gives ``<module>.lora_A.weight`` [r, in] and
  ``<module>.lora_B.weight`` [out, r] (jaxrm keeps A [in, r] and B [r, out]: both transposed); the
  trained head keeps its HF name. All under :data:`PEFT_PREFIX`, as
  ``peft.get_peft_model_state_dict`` names them. A fused module's adapter is its adapted parts'
  adapters stacked: A's rows one part's after another, B block-diagonal, of rank r times the
  number of adapted parts (:func:`peft_targets` gives peft that rank).
  """
  adapted = _adapted(cfg)
  fused_adapted = {n.key for n in to_hf_names(cfg) if n.join and n.param in adapted}
  out = []
  for n in to_hf_names(cfg):
    module = PEFT_PREFIX + n.key.removesuffix(".weight")
    if n.key in fused_adapted:
      if n.param in adapted:
        out.append(Named(f"{module}.lora_A.weight", f"{n.param}_lora_a", n.layer, True, "concat"))
      zero = n.param not in adapted
      b = f"{n.param}_lora_b" if not zero else n.param
      out.append(Named(f"{module}.lora_B.weight", b, n.layer, True, "block", zero=zero))
    elif n.param in adapted:
      out.append(Named(f"{module}.lora_A.weight", f"{n.param}_lora_a", n.layer, True))
      out.append(Named(f"{module}.lora_B.weight", f"{n.param}_lora_b", n.layer, True))
    elif n.param in HEAD_PARAMS:
      out.append(n._replace(key=PEFT_PREFIX + n.key))
  return out


def peft_targets(cfg: ModelConfig) -> dict[str, list[str] | dict[str, float]]:
  """adapter_config.json's ``target_modules``, ``rank_pattern`` and ``alpha_pattern``: the HF
  modules of the adapted projections, and for a fused module adapted in k of its parts, rank and
  alpha k times the adapters' (the same alpha / r scale)."""
  adapted = _adapted(cfg)
  counts: dict[str, int] = {}
  for n in to_hf_names(cfg):
    if n.param in adapted and n.layer in (None, 0):
      module = n.key.removesuffix(".weight").rpartition(".")[2]
      counts[module] = counts.get(module, 0) + 1
  stacked = {m: k for m, k in counts.items() if k > 1}
  alpha = cfg.lora.alpha
  return {
    "target_modules": list(counts),
    "rank_pattern": {m: k * cfg.lora.rank for m, k in stacked.items()},
    "alpha_pattern": {
      m: k * (int(alpha) if float(alpha).is_integer() else alpha) for m, k in stacked.items()
    },
  }
