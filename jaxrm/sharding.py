"""The one place where logical axis names meet mesh axes.

Parameters and activations carry logical names (``embed``, ``heads``, ``mlp``, ``batch``...). The
mesh has four axes: ``data`` (pure data parallelism), ``fsdp`` (data parallelism that also shards
parameters and optimizer state), ``context`` (splits each row's tokens: context parallelism, see
:mod:`jaxrm.models.context_parallel`) and ``tensor`` (splits heads and the MLP; innermost, so that
its shards are the closest devices). :data:`DEFAULT_RULES` maps the former to the latter.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "context", "tensor")
CONTEXT_AXIS = "context"  # the axis that splits a row's tokens (``length``)
CONTEXT_BALANCES = ("zigzag", "none")

# logical name -> mesh axis (or tuple of axes, or None for replicated)
DEFAULT_RULES: dict[str, Any] = {
  "batch": ("data", "fsdp"),
  "length": CONTEXT_AXIS,  # batches arrive whole over it; the decoder's first constraint splits them
  "embed": "fsdp",
  "vocab": "tensor",
  "heads": "tensor",
  "kv_heads": "tensor",
  "head_dim": None,
  "mlp": "tensor",
  "layers": None,
  "labels": None,
  "act_embed": None,  # activations' feature dim stays whole between blocks
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Sizes of the mesh axes (``mesh.data``, ``mesh.fsdp``, ``mesh.tensor``, ``mesh.context``); -1
  takes the rest. ``mesh.context_balance``: how a row's tokens are dealt to the context shards
  ("zigzag": shard i of c holds chunks i and 2c-1-i of 2c, so that causal attention costs each
  shard alike; "none": contiguous quarters, halves...)."""

  data: int = 1  # devices holding whole copies of the weights, each on its own rows
  fsdp: int = -1  # devices sharding weights and optimizer state (and the rows); -1: the rest
  tensor: int = 1  # devices splitting attention heads and the MLP
  context: int = 1  # devices splitting each row's tokens (long rows)
  context_balance: str = "zigzag"  # zigzag | none: how a row's tokens are dealt to context shards

  def __post_init__(self):
    for name in ("data", "fsdp", "tensor", "context"):
      size = getattr(self, name)
      if not isinstance(size, int) or (size < 1 and size != -1):
        raise ValueError(f"mesh.{name}={size!r}: use a number of devices (1 or more), or -1 for the rest")
    if self.context_balance not in CONTEXT_BALANCES:
      raise ValueError(
        f"mesh.context_balance={self.context_balance!r}: use one of "
        f"{', '.join(CONTEXT_BALANCES)} (how mesh.context splits a row's tokens)"
      )


def make_mesh(cfg: MeshConfig = MeshConfig(), devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ``(data, fsdp, context, tensor)`` mesh; one size may be -1 for the remaining devices."""
  devices = list(devices if devices is not None else jax.devices())
  names = ("data", "fsdp", "context", "tensor")
  sizes = [cfg.data, cfg.fsdp, cfg.context, cfg.tensor]
  shown = [i for i, n in enumerate(names) if n != "context" or cfg.context != 1]  # context only when used
  said = lambda values, sep: sep.join(f"{names[i]}={values[i]}" for i in shown)
  if sizes.count(-1) > 1:
    raise ValueError(f"mesh: at most one axis may be -1, got {said(sizes, ' ')}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      fixed = " x ".join(f"{names[i]}={sizes[i]}" for i in shown if sizes[i] != -1)
      raise ValueError(
        f"mesh: {len(devices)} devices are not divisible by the fixed axes' product {known} "
        f"({fixed}); set mesh.* to sizes whose product divides the devices"
      )
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ValueError(
      f"mesh: {said(sizes, ' x ')} = {math.prod(sizes)} devices, "
      f"but {len(devices)} are available; set the sizes so their product matches (or use -1 for one axis)"
    )
  return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def platform(where: Mesh | Placement | None = None) -> str:
  """Where a computation over ``where`` (a mesh, or a placement's mesh) runs: ``"gpu"`` (CUDA or
  ROCm), ``"cpu"``, ``"tpu"``. It follows the mesh's devices, which may be compile-only GPUs in a
  CPU process (:mod:`jaxrm.planning.gpu_targets`); without a mesh, the default device's (where jit places
  it)."""
  mesh = where.mesh if isinstance(where, Placement) else where
  devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
  kinds = {"gpu" if d.platform in ("cuda", "rocm", "gpu") else d.platform for d in devices}
  if len(kinds) != 1:
    raise ValueError(f"a mesh over devices of several platforms: {sorted(kinds)}")
  return kinds.pop()


def context_size(mesh: Mesh | None) -> int:
  """How many devices split each row's tokens (``mesh.context``); 1 without a mesh."""
  return 1 if mesh is None else dict(mesh.shape).get(CONTEXT_AXIS, 1)


def logged_shape(mesh: Mesh) -> dict[str, int]:
  """The mesh's axis sizes as the run's log shows them: ``context`` only where it splits rows."""
  return {a: n for a, n in mesh.shape.items() if a != CONTEXT_AXIS or n != 1}


def data_parallel_size(mesh: Mesh) -> int:
  """How many ways a batch is split: the product of the mesh axes that ``batch`` maps to."""
  axes = DEFAULT_RULES["batch"]
  return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def logical_to_spec(logical_axes: Sequence[str | None], rules: dict[str, Any] = DEFAULT_RULES) -> P:
  """PartitionSpec for a tensor whose dimensions carry ``logical_axes``; a mesh axis is used once.
  A name ``rules`` does not know is an error (a typo would otherwise replicate the tensor)."""
  unknown = [name for name in logical_axes if name is not None and name not in rules]
  if unknown:
    raise ValueError(
      f"logical axes {unknown} have no sharding rule; the rules name {', '.join(rules)} (sharding.py)"
    )
  used: set[str] = set()
  spec = []
  for name in logical_axes:
    axes = rules.get(name) if name else None
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    axes = tuple(a for a in axes if a not in used)
    used.update(axes)
    spec.append(axes[0] if len(axes) == 1 else (axes or None))
  return P(*spec)


def _fits(shape, spec: P, mesh: Mesh) -> P:
  """Drops mesh axes from dimensions they don't divide (e.g. 3 kv heads on 2 tensor shards)."""
  out = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    size = math.prod(mesh.shape[a] for a in names)
    out.append(axes if names and dim % size == 0 else None)
  return P(*out)


def param_shardings(abstract_state, mesh: Mesh, rules: dict[str, Any] = DEFAULT_RULES):
  """NamedShardings for an nnx state whose Variables carry ``logical_axes`` metadata.

  With ``mesh.context`` > 1 the ``fsdp`` dimension of each parameter (and so of its optimizer
  state) is split over ``fsdp`` x ``context``: the devices that share a row's tokens share its
  weights' shards too, gathered layer by layer as fsdp's are, instead of each holding a whole
  fsdp shard (on 8 devices at context 8, an eighth of the weights per device instead of all).
  A dimension that the product does not divide keeps the fsdp split alone.
  """
  spread = _over_context(rules) if context_size(mesh) > 1 else None

  def one(var):
    value = var.get_value() if hasattr(var, "get_value") else var.value
    axes = var.get_metadata().get("logical_axes") or (None,) * len(value.shape)
    spec = _fits(value.shape, logical_to_spec(axes, rules), mesh)
    if spread is not None:
      wide = _fits(value.shape, logical_to_spec(axes, spread), mesh)
      spec = wide if _shards(wide, mesh) > _shards(spec, mesh) else spec
    return NamedSharding(mesh, spec)

  return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _over_context(rules: dict[str, Any]) -> dict[str, Any]:
  """``rules`` with every parameter axis that maps to fsdp mapped to (fsdp, context)."""
  return {k: ("fsdp", CONTEXT_AXIS) if v == "fsdp" else v for k, v in rules.items()}


def _shards(spec: P, mesh: Mesh) -> int:
  """Into how many pieces ``spec`` cuts a tensor on ``mesh``."""
  names = [a for axes in spec for a in ((axes,) if isinstance(axes, str) else tuple(axes or ()))]
  return math.prod(mesh.shape[a] for a in names)


def batch_sharding(
  mesh: Mesh, ndim: int, rules: dict[str, Any] = DEFAULT_RULES, *, stacked: bool = False
) -> NamedSharding:
  """Sharding of a batch array: rows over the data-parallel axes.

  Rows are the leading dimension, or with ``stacked`` (micro-batches stacked for gradient
  accumulation, ``[n_micro, rows, ...]``) the second.
  """
  lead = (None, "batch") if stacked else ("batch",)
  return NamedSharding(mesh, logical_to_spec(lead + (None,) * (ndim - len(lead)), rules))


def replicated(mesh: Mesh) -> NamedSharding:
  """A whole copy on every device of ``mesh`` (scalars, counters, RNG keys)."""
  return NamedSharding(mesh, P())


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a forward pass puts its activations: the ``mesh``, how ``mesh.context`` deals each row's
  tokens to its shards (``context_balance``, as :class:`MeshConfig` names it) and the logical-axis
  ``rules``. The model and the loss take one explicitly (``placement=``); without one, no
  activation is constrained and no row is split."""

  mesh: Mesh
  context_balance: str = "zigzag"
  rules: dict[str, Any] = dataclasses.field(default_factory=lambda: DEFAULT_RULES)

  def __post_init__(self):
    if self.context_balance not in CONTEXT_BALANCES:
      raise ValueError(f"context_balance={self.context_balance!r}: use one of {', '.join(CONTEXT_BALANCES)}")

  @classmethod
  def of(cls, mesh: Mesh, cfg: MeshConfig) -> Placement:
    """The placement of a run whose ``mesh`` was made from ``cfg``."""
    return cls(mesh, cfg.context_balance)

  @property
  def context(self) -> int:
    """How many devices split each row's tokens."""
    return context_size(self.mesh)

  @property
  def platform(self) -> str:
    return platform(self.mesh)

  def spec(self, shape: Sequence[int], logical_axes: Sequence[str | None]) -> P:
    """The PartitionSpec of an activation of ``shape`` whose dimensions carry ``logical_axes``, e.g.
    for a ``shard_map`` around a kernel XLA cannot split."""
    return _fits(shape, logical_to_spec(logical_axes, self.rules), self.mesh)

  def attention_specs(self, q_shape: Sequence[int], k_shape: Sequence[int]) -> tuple[P, P]:
    """The PartitionSpecs of queries [B, T, H, Dh] and keys/values [B, S, K, Dh] for a ``shard_map``
    around attention: rows, tokens and heads as :meth:`constrain` splits them. Heads are split only
    where the key heads split alike, so that each device holds every query head of its key heads."""
    q_spec = self.spec(q_shape, ("batch", "length", "heads", "head_dim"))
    k_spec = self.spec(k_shape, ("batch", "length", "kv_heads", "head_dim"))
    if q_spec[2] != k_spec[2]:
      q_spec, k_spec = (P(x[0], x[1], None, x[3]) for x in (q_spec, k_spec))
    return q_spec, k_spec

  def constrain(self, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` by logical names."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self.spec(x.shape, logical_axes)))


def constrain(x: jax.Array, logical_axes: Sequence[str | None], placement: Placement | None) -> jax.Array:
  """``placement.constrain(x, logical_axes)``; ``x`` itself without a placement."""
  return x if placement is None else placement.constrain(x, logical_axes)
