"""The one place where logical axis names meet mesh axes.

Parameters and activations carry logical names (``embed``, ``heads``, ``mlp``, ``batch``...). The
mesh has three axes: ``data`` (pure data parallelism), ``fsdp`` (data parallelism that also shards
parameters and optimizer state) and ``tensor`` (splits heads and the MLP). :data:`DEFAULT_RULES`
maps the former to the latter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical name -> mesh axis (or tuple of axes, or None for replicated)
DEFAULT_RULES: dict[str, Any] = {
    "batch": ("data", "fsdp"),
    "length": None,
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
  """Sizes of the mesh axes (``mesh.data``, ``mesh.fsdp``, ``mesh.tensor``); -1 takes the rest."""

  data: int = 1
  fsdp: int = -1
  tensor: int = 1


def make_mesh(cfg: MeshConfig = MeshConfig(), devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ``(data, fsdp, tensor)`` mesh; one size may be -1 for the remaining devices."""
  devices = list(devices if devices is not None else jax.devices())
  sizes = [cfg.data, cfg.fsdp, cfg.tensor]
  if sizes.count(-1) > 1:
    raise ValueError(f"mesh: at most one axis may be -1, got data={cfg.data} fsdp={cfg.fsdp} tensor={cfg.tensor}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f"mesh: {len(devices)} devices are not divisible by the fixed axes' product {known}")
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ValueError(
        f"mesh: data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} = {math.prod(sizes)} devices, "
        f"but {len(devices)} are available; set the sizes so their product matches (or use -1 for one axis)")
  return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def data_parallel_size(mesh: Mesh) -> int:
  """How many ways a batch is split: the product of the mesh axes that ``batch`` maps to."""
  axes = DEFAULT_RULES["batch"]
  return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def logical_to_spec(logical_axes: Sequence[str | None], rules: dict[str, Any] = DEFAULT_RULES) -> P:
  """PartitionSpec for a tensor whose dimensions carry ``logical_axes``; a mesh axis is used once."""
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
  """NamedShardings for an nnx state whose Variables carry ``logical_axes`` metadata."""

  def one(var):
    value = var.get_value() if hasattr(var, "get_value") else var.value
    axes = var.get_metadata().get("logical_axes") or (None,) * len(value.shape)
    return NamedSharding(mesh, _fits(value.shape, logical_to_spec(axes, rules), mesh))

  return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, ndim: int, rules: dict[str, Any] = DEFAULT_RULES, *,
                   stacked: bool = False) -> NamedSharding:
  """Sharding of a batch array: rows over the data-parallel axes.

  Rows are the leading dimension, or with ``stacked`` (micro-batches stacked for gradient
  accumulation, ``[n_micro, rows, ...]``) the second.
  """
  lead = (None, "batch") if stacked else ("batch",)
  return NamedSharding(mesh, logical_to_spec(lead + (None,) * (ndim - len(lead)), rules))


def replicated(mesh: Mesh) -> NamedSharding:
  """A whole copy on every device of ``mesh`` (scalars, counters, RNG keys)."""
  return NamedSharding(mesh, P())


_ACTIVE: list[tuple[Mesh, dict[str, Any]]] = []


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: dict[str, Any] = DEFAULT_RULES):
  """Within this context (at trace time), :func:`constrain` pins activations to the mesh."""
  _ACTIVE.append((mesh, rules))
  try:
    yield
  finally:
    _ACTIVE.pop()


def active_mesh() -> Mesh | None:
  """The mesh of the innermost :func:`activation_sharding` context; None outside one."""
  return _ACTIVE[-1][0] if _ACTIVE else None


def activation_spec(shape: Sequence[int], logical_axes: Sequence[str | None]) -> P:
  """The PartitionSpec that :func:`constrain` would give an activation of ``shape`` (inside
  :func:`activation_sharding`), e.g. for a ``shard_map`` around a kernel XLA cannot split."""
  mesh, rules = _ACTIVE[-1]
  return _fits(shape, logical_to_spec(logical_axes, rules), mesh)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """``with_sharding_constraint`` by logical names; a no-op outside :func:`activation_sharding`."""
  if not _ACTIVE:
    return x
  mesh, rules = _ACTIVE[-1]
  spec = _fits(x.shape, logical_to_spec(logical_axes, rules), mesh)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
