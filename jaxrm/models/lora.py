"""Low-rank adapters (LoRA) on the decoder's projections, trained over a frozen base.

An adapted projection computes ``x @ W + (alpha / r) * (x @ A) @ B`` with A [in, r] and B [r, out]
(Hu et al. 2021, as peft does). Like the base weights, the adapters are stacked along the
``layers`` axis (``layers.q_lora_a`` [L, D, r], ``layers.q_lora_b`` [L, r, H*Dh]) and sliced by
the decoder's scan; they are :data:`LoraParam` variables, so ``nnx.state(model, LoraParam)``
selects them, and the base stays ``nnx.Param``. The reward head (``score``, ``score_bias``) is
always trained in full (:func:`trainable_filter`).

Why not qwix (Flax's LoRA and quantization library, used by tunix): it intercepts
``dot_general``/``einsum`` calls made inside a Flax module's methods and recognises the weight
operand by finding the array among the calling module's own ``nnx.Param`` attributes, then
creates the adapters lazily beside it. The decoder's projections are plain functions
(``layers.linear``) applied inside ``lax.scan`` to per-layer slices of stacked arrays: the
operand is a slice traced by the scan, not a module attribute, so qwix finds no weight and adds
nothing; and adapters it did create would be per call, not stacked along ``layers``. The
adapters here take a dozen lines and keep the stacked, scanned layout.

Users name targets as peft does (``q_proj`` ... ``down_proj``, or ``all-linear``); :data:`TARGETS`
maps them to the decoder's parameter names.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrm.errors import ConfigError
from jaxrm.models import layers as L
from jaxrm.models import quantize

# flax's own Param subclass for adapters (nnx.LoRA and qwix use it too).
LoraParam = nnx.LoRAParam

# peft's module name -> the decoder's stacked parameter, in the decoder's order.
TARGETS = {
  "q_proj": "q",
  "k_proj": "k",
  "v_proj": "v",
  "o_proj": "o",
  "gate_proj": "gate",
  "up_proj": "up",
  "down_proj": "down",
}
ALL_LINEAR = "all-linear"  # peft's and OpenRLHF's name for every linear layer but the head

HEAD_PARAMS = ("score", "score_bias")  # the reward head of ``Decoder``, trained in full


def expand_targets(targets: str | Sequence[str]) -> tuple[str, ...]:
  """peft-style target names -> the same names, ``all-linear`` expanded, deduplicated, in
  :data:`TARGETS` order. A string is one name."""
  names = (targets,) if isinstance(targets, str) else tuple(targets)
  unknown = [n for n in names if n not in TARGETS and n != ALL_LINEAR]
  if unknown:
    raise ConfigError(
      f"LoRA targets {unknown} are not projections of the decoder; use any of "
      f"{', '.join(TARGETS)}, or {ALL_LINEAR!r} for all of them"
    )
  if ALL_LINEAR in names:
    return tuple(TARGETS)
  return tuple(t for t in TARGETS if t in names)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters of ``rank`` on the ``targets`` projections of every layer; rank 0 (the
  default) trains the whole model instead.

  ``alpha`` defaults to 16 (OpenRLHF's ``--lora_alpha``; peft's ``LoraConfig`` defaults to 8): the
  update is scaled by ``alpha / rank``, 2 at rank 8. ``dropout`` is peft's ``lora_dropout``: in
  training, each adapter's input is dropped at this rate (its own draw per adapter, layer and
  step); scoring never drops. ``targets`` takes peft's names, or
  ``all-linear`` (the default, as in OpenRLHF); it is stored expanded.

  ``base_dtype`` stores the frozen base's projection weights in lower precision (QLoRA):
  ``"bfloat16"``, ``"int8"`` or ``"nf4"`` (:mod:`jaxrm.models.quantize`); None keeps the model's
  parameter dtype. It needs adapters (rank > 0): a base that low is for training adapters over,
  and without any the whole model would train, codes included. To score with less memory, load
  in bfloat16 (``param_dtype``).
  """

  rank: int = 0
  alpha: float = 16.0
  dropout: float = 0.0
  targets: tuple[str, ...] = tuple(TARGETS)
  base_dtype: str | None = None

  def __post_init__(self):
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
      raise ConfigError(
        f"LoRA rank={self.rank!r}; use 0 (no adapters: train the whole model) or a "
        "positive integer such as 8 or 16"
      )
    if not self.alpha > 0:
      raise ConfigError(
        f"LoRA alpha={self.alpha!r}; use a positive number (the update is scaled by "
        "alpha / rank; 16 is the default)"
      )
    if (
      isinstance(self.dropout, bool)
      or not isinstance(self.dropout, (int, float))
      or not 0 <= self.dropout < 1
    ):
      raise ConfigError(
        f"LoRA dropout={self.dropout!r}; use a probability in [0, 1), such as 0.05 or 0.1 (0: no dropout)"
      )
    targets = expand_targets(self.targets)
    if self.rank and not targets:
      raise ConfigError(
        f"LoRA rank={self.rank} adapts no projection (targets is empty); name some of "
        f"{', '.join(TARGETS)}, or {ALL_LINEAR!r}"
      )
    if self.base_dtype is not None and self.base_dtype not in quantize.FORMATS:
      raise ConfigError(
        f"LoRA base_dtype={self.base_dtype!r}; use one of {', '.join(quantize.FORMATS)}, "
        "or None to keep the model's parameter dtype"
      )
    if self.base_dtype is not None and not self.rank:
      raise ConfigError(
        f"LoRA base_dtype={self.base_dtype!r} freezes a {self.base_dtype} base, but rank=0 "
        "trains no adapters over it; set a rank (e.g. 8), or drop base_dtype (to score in "
        "less memory, load with param_dtype='bfloat16')"
      )
    object.__setattr__(self, "alpha", float(self.alpha))
    object.__setattr__(self, "dropout", float(self.dropout))
    object.__setattr__(self, "targets", targets)

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    """The adapters' multiplier, ``alpha / rank``."""
    return self.alpha / self.rank

  @property
  def params(self) -> tuple[str, ...]:
    """The decoder's names of the adapted projections (``q``, ``v``...)."""
    return tuple(TARGETS[t] for t in self.targets)


def adapter_shapes(cfg: LoraConfig, base_shapes: dict) -> dict[str, tuple[tuple[int, ...], tuple]]:
  """Name -> (shape, logical axes) of each stacked adapter, from the decoder's layer shapes.

  A [L, in, r] shards like its weight's input dimension, B [L, r, out] like its output; the rank
  dimension stays whole. None at rank 0.
  """
  out = {}
  for name in cfg.params if cfg.enabled else ():
    (n, d_in, d_out), (layers_axis, in_axis, out_axis) = base_shapes[name]
    out[f"{name}_lora_a"] = ((n, d_in, cfg.rank), (layers_axis, in_axis, None))
    out[f"{name}_lora_b"] = ((n, cfg.rank, d_out), (layers_axis, None, out_axis))
  return out


def _kaiming_uniform_a(key, shape, dtype):
  # peft (src/peft/tuners/lora/layer.py, LoraLayer.reset_lora_parameters) draws lora_A with
  # torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5)): gain sqrt(2 / (1 + a^2)) = sqrt(1/3),
  # bound gain * sqrt(3 / fan_in) = 1 / sqrt(fan_in), fan_in being the input features (shape[-2]).
  bound = 1.0 / math.sqrt(shape[-2])
  return jax.random.uniform(key, shape, dtype, -bound, bound)


def adapter_init(name: str):
  """The initializer of adapter ``name`` (``..._lora_a``: peft's kaiming-uniform; ``..._lora_b``:
  zeros, so that a new adapter leaves the model unchanged)."""
  return _kaiming_uniform_a if name.endswith("_lora_a") else jax.nn.initializers.zeros


def delta(x_nd, a_dr, b_rf, scale: float, *, dropout: float = 0.0, key=None):
  """``scale * (dropout(x) @ A) @ B`` in ``x``'s dtype: what an adapter adds to ``x @ W``.

  As in peft, dropout (at rate ``dropout``, drawn from ``key``; none without a key) applies to
  the adapter's input only, kept values scaled by ``1 / (1 - dropout)``. The scale multiplies the
  [N, r] intermediate rather than the [N, out] result (r is small).
  """
  if key is not None and dropout > 0:
    keep = jax.random.bernoulli(key, 1.0 - dropout, x_nd.shape)
    x_nd = jnp.where(keep, x_nd / jnp.asarray(1.0 - dropout, x_nd.dtype), jnp.zeros((), x_nd.dtype))
  return L.linear(L.linear(x_nd, a_dr) * jnp.asarray(scale, x_nd.dtype), b_rf)


def trainable_filter(cfg: LoraConfig) -> nnx.filterlib.Filter:
  """An nnx filter of the trained parameters: the adapters and the reward head with LoRA on,
  everything (``...``) with it off."""
  if not cfg.enabled:
    return ...
  return nnx.Any(LoraParam, *(nnx.PathContains(name) for name in HEAD_PARAMS))


def merge(params: nnx.State, cfg: LoraConfig, dtype: str = "float32") -> nnx.State:
  """``params`` with every adapted weight replaced by ``W + scale * A @ B`` (per layer, in float32,
  cast back to W's dtype) and the adapters removed: the parameters of the same model without
  LoRA (``cfg.replace(lora=LoraConfig())``), e.g. for export.

  A base stored lower (``cfg.base_dtype``) is decoded first, and its merged projection weights
  are ``nnx.Param``s in ``dtype`` (pass the model's ``param_dtype``); the codes' scales go.

  Args:
    params: the whole model's state (base and adapters).
    cfg: the model's LoRA settings.
    dtype: the merged projection weights' dtype where ``cfg.base_dtype`` is set.
  """
  flat = dict(nnx.to_flat_state(params))
  merged = []
  for path, var in flat.items():
    if isinstance(var, LoraParam) or (
      isinstance(var, quantize.QuantizedWeight) and path[-1].endswith(quantize.SCALE)
    ):
      continue
    w = var.get_value()
    lowered = cfg.base_dtype is not None and path[-1] in quantize.WEIGHTS and len(path) > 1
    if isinstance(var, quantize.QuantizedWeight):
      w = quantize.dequantize(w, flat[path[:-1] + (path[-1] + quantize.SCALE,)].get_value(), cfg.base_dtype)
      var = nnx.Param(w, **var.get_metadata())
    out_dtype = jnp.dtype(dtype) if lowered else w.dtype
    a = flat.get(path[:-1] + (f"{path[-1]}_lora_a",))
    if a is not None:
      b = flat[path[:-1] + (f"{path[-1]}_lora_b",)]
      ab = jnp.einsum(
        "lir,lro->lio",
        a.get_value().astype(jnp.float32),
        b.get_value().astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
      )
      var = var.replace((w.astype(jnp.float32) + cfg.scale * ab).astype(out_dtype))
    elif lowered:
      var = var.replace(w.astype(out_dtype))
    merged.append((path, var))
  return nnx.from_flat_state(merged)
