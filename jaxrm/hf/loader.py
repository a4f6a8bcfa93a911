"""Places checkpoint tensors into an abstract model, parameter by parameter, already sharded.

The model is built with ``nnx.eval_shape`` (no random weights are materialised just to be
overwritten); each parameter is assembled on the host from its checkpoint tensors, checked, and
handed to ``jax.make_array_from_callback`` with its target sharding, so only the shards a process
owns are transferred and the host holds one parameter at a time. LoRA adapters are never in a
checkpoint: they are initialised here, as the decoder would initialise them. A base stored as
codes (``cfg.lora.base_dtype`` int8 or nf4) is quantized layer by layer as it is read, so the
host never holds the float weights of more than one layer of one projection.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxrm import sharding
from jaxrm.errors import CheckpointError
from jaxrm.hf.weight_map import HEAD_PARAMS, Slot, plan
from jaxrm.models import lora, quantize
from jaxrm.models.config import ModelConfig
from jaxrm.models.decoder import Decoder
from jaxrm.models.heads import head_init

log = logging.getLogger(__name__)


class TensorSource(Protocol):
  config: dict[str, Any]

  def keys(self) -> list[str]: ...

  def get_tensor(self, key: str) -> np.ndarray: ...


def abstract_model(cfg: ModelConfig, seed: int = 0) -> Decoder:
  return nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(seed)))


def placed_abstract_model(cfg: ModelConfig, mesh: Mesh | None = None) -> Decoder:
  """An abstract :class:`Decoder` whose parameters are ``jax.ShapeDtypeStruct``s with target shardings.

  Over ``mesh`` as :func:`jaxrm.sharding.param_shardings` places them, else on the first device:
  where :func:`load_model` would put them. Nothing is allocated; it is, for instance, the restore
  target of an Orbax checkpoint.
  """
  graphdef, state = nnx.split(abstract_model(cfg))
  if mesh is None:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets = {path: device for path, _ in nnx.to_flat_state(state)}
  else:
    targets = dict(nnx.to_flat_state(sharding.param_shardings(state, mesh)))
  for path, var in nnx.to_flat_state(state):
    value = var.get_value()
    var.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=targets[path]))
  return nnx.merge(graphdef, state)


def _tensor(name: str, want, slot: Slot, source: TensorSource) -> np.ndarray:
  """The checkpoint tensor of ``slot`` (its part of a fused tensor), transposed as the parameter
  holds it, its shape checked."""
  t = slot.take(source.get_tensor(slot.key))
  if slot.transpose:
    t = t.T
  if tuple(t.shape) != tuple(want):
    raw = tuple(t.T.shape) if slot.transpose else tuple(t.shape)
    part = "" if slot.part is None else " as its part"
    raise CheckpointError(
      f"tensor {slot.key!r} has shape {raw}{part}, but parameter {name} expects "
      f"{tuple(want[::-1]) if slot.transpose else tuple(want)} (check config.json against the weights)"
    )
  return t


def _assemble(name: str, shape, dtype, slots, source: TensorSource) -> np.ndarray:
  stacked = slots[0].layer is not None
  buf = np.empty(shape, dtype)
  for slot in slots:
    t = _tensor(name, shape[1:] if stacked else shape, slot, source)
    if stacked:
      buf[slot.layer] = t
    else:
      buf[...] = t
  return buf


def _assemble_coded(name: str, codes_var, scale_var, fmt: str, slots, source: TensorSource):
  """(codes, scales) of a stacked weight stored in ``fmt``, each layer quantized as it is read:
  the host holds one layer in float, never the whole weight."""
  codes = np.empty(codes_var.get_value().shape, codes_var.get_value().dtype)
  scale = np.empty(scale_var.get_value().shape, scale_var.get_value().dtype)
  d_in, d_out = codes.shape[1] * (2 if fmt == "nf4" else 1), codes.shape[2]  # nf4: two rows a byte
  for slot in slots:
    codes[slot.layer], scale[slot.layer] = quantize.quantize(
      np.asarray(_tensor(name, (d_in, d_out), slot, source), np.float32), fmt
    )
  return codes, scale


def _place(host: np.ndarray, target: NamedSharding | None) -> jax.Array:
  if target is None:
    return jnp.asarray(host)
  return jax.make_array_from_callback(host.shape, target, lambda idx: host[idx])


def load_model(
  cfg: ModelConfig, source: TensorSource, *, mesh: Mesh | None = None, seed: int = 0, new_head: bool = False
) -> Decoder:
  """A :class:`Decoder` holding ``source``'s weights.

  The head is new (normal, seeded) when the checkpoint has none or when ``new_head`` is set;
  LoRA adapters (``cfg.lora``) are always new (seeded; B is zero, so the model scores as the
  checkpoint does).
  """
  graphdef, state = nnx.split(abstract_model(cfg, seed))
  targets = sharding.param_shardings(state, mesh) if mesh is not None else None
  slots = plan(cfg, source.keys(), new_head=new_head)
  key = jax.random.key(seed)
  flat_targets = dict(nnx.to_flat_state(targets)) if targets is not None else {}
  if cfg.lora.enabled:
    log.info(
      "initialising LoRA adapters of rank %d (alpha %g) on %s (seed %d)",
      cfg.lora.rank,
      cfg.lora.alpha,
      ", ".join(cfg.lora.targets),
      seed,
    )
  if cfg.lora.base_dtype is not None:
    log.info(
      "storing the frozen base's projection weights (%s) in %s",
      ", ".join(quantize.WEIGHTS),
      cfg.lora.base_dtype,
    )
  flat = dict(nnx.to_flat_state(state))
  # Scales are placed with their codes; leaving them out of the count keeps each adapter's seed
  # what it is over a base in the parameter dtype.
  entries = [
    (path, var)
    for path, var in flat.items()
    if not (isinstance(var, quantize.QuantizedWeight) and path[-1].endswith(quantize.SCALE))
  ]
  for i, (path, var) in enumerate(entries):
    name = ".".join(str(p) for p in path)
    shape, dtype = var.get_value().shape, var.get_value().dtype
    target = flat_targets.get(path)
    if isinstance(var, quantize.QuantizedWeight):
      scale_path = path[:-1] + (path[-1] + quantize.SCALE,)
      codes, scale = _assemble_coded(name, var, flat[scale_path], cfg.lora.base_dtype, slots[name], source)
      var.set_value(_place(codes, target))
      flat[scale_path].set_value(_place(scale, flat_targets.get(scale_path)))
      del codes, scale
      continue
    if name in slots:
      host = _assemble(name, shape, dtype, slots[name], source)
    elif isinstance(var, lora.LoraParam):
      host = np.asarray(lora.adapter_init(name)(jax.random.fold_in(key, i), shape, dtype))
    elif name in HEAD_PARAMS:
      log.info("checkpoint has no reward head: initialising %s (seed %d)", name, seed)
      init = head_init(cfg) if name == "score" else jax.nn.initializers.zeros
      host = np.asarray(init(key, shape, dtype))
    else:  # plan() has already named the missing key; this is a table bug
      raise CheckpointError(f"parameter {name} has no rule in the {cfg.family} weight map")
    var.set_value(_place(host, target))
    del host
  return nnx.merge(graphdef, state)
