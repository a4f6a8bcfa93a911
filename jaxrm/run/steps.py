"""The jitted train and eval steps, the train state, and their compilation per batch shape.

State is a plain dict ``{"params", "opt_state", "step", "rng"}``; ``params`` is the model's
``nnx.State`` (float32 master weights; the model computes in its own compute dtype). With LoRA,
``params`` holds only what is trained (adapters and head) and ``frozen`` the rest, which has no
gradient and no optimizer state (:func:`model_params` joins them). Optimizer moments are sharded
like their parameters; counters, step and RNG are replicated. Batches are the
classes of :mod:`jaxrm.data.batches`; the loss is the one the reward type's task gives
(:func:`jaxrm.tasks.batch_loss`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxrm import sharding, tasks
from jaxrm.config import RewardSpec
from jaxrm.data.batches import Batch
from jaxrm.models.decoder import Decoder
from jaxrm.planning.memory import ProgramMemory
from jaxrm.run.metrics import accumulate, empty

log = logging.getLogger("jaxrm.run.steps")


def make_loss_fn(
  model: Decoder, spec: RewardSpec, *, samples: bool = False, placement: sharding.Placement | None = None
) -> Callable:
  """``loss_fn(params, batch, frozen=None, rng=None) -> (loss_total, metrics)``; loss_total is a
  sum, metrics["loss"].count its count.

  ``batch`` is any class of :mod:`jaxrm.data.batches`; packed and unpacked layouts give the same losses
  and metrics, counted per group or sequence. ``frozen`` is the part of the model's state that
  ``params`` leaves out (``state["frozen"]``, see :func:`init_state`). ``rng`` (a PRNG key, in
  training) drives the adapters' dropout; without it nothing is dropped. ``samples`` (validation)
  adds the per-example :class:`~jaxrm.run.metrics.Samples` that rank-based metrics need. With
  ``placement``, the model's activations are pinned to its mesh at block boundaries (and rows
  split over its context axis).
  """
  graphdef = nnx.graphdef(model)
  batch_loss = tasks.batch_loss(spec, samples=samples)

  def loss_fn(params, batch: Batch, frozen=None, rng=None):
    model = nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)
    forward = functools.partial(model, dropout_rng=rng, placement=placement)
    _, metrics = batch_loss(batch.outputs(forward), batch)
    return metrics["loss"].total, metrics

  return loss_fn


def _microbatches(batch: Batch, n: int) -> Batch:
  """An unpacked batch's [G*k, ...] arrays -> [n, G/n*k, ...], keeping each group's rows together.

  Micro-batch m takes groups m, m+n, m+2n...: each micro-batch stays spread over every
  data-parallel shard instead of living on one.
  """
  groups = batch.example_mask.shape[0]

  def split(x):
    per_group = x.shape[0] // groups
    x = x.reshape(groups // n, n, per_group, *x.shape[1:])
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape(n, groups // n * per_group, *x.shape[3:])

  return jax.tree.map(split, batch)


def abstract_state(
  params: nnx.State, tx: optax.GradientTransformation, *, mesh: Mesh, trainable: nnx.filterlib.Filter = ...
) -> tuple[dict[str, Any], dict[str, Any]]:
  """The train state :func:`init_state` builds, as ``jax.ShapeDtypeStruct``s with their shardings,
  and the shardings. ``params`` may be abstract: nothing is allocated (the memory plan compiles
  the step on it).

  Optimizer moments are sharded like their parameters; counters, step and RNG are replicated.
  """
  replicated = sharding.replicated(mesh)
  frozen = {}  # {"frozen": the parameters not trained}, or nothing when all are
  if trainable is not ...:
    params, frozen["frozen"] = nnx.split_state(params, trainable, ...)
  param_shardings = jax.tree.map(lambda x: x.sharding, params)
  opt_state = jax.eval_shape(tx.init, params)
  opt_shardings = optax.tree_map_params(
    tx, lambda _, s: s, opt_state, param_shardings, transform_non_params=lambda _: replicated
  )
  shardings = {
    "params": param_shardings,
    "opt_state": opt_shardings,
    "step": replicated,
    "rng": replicated,
    **jax.tree.map(lambda x: x.sharding, frozen),
  }
  shapes = {
    "params": params,
    "opt_state": opt_state,
    "step": jax.ShapeDtypeStruct((), jnp.int32),
    "rng": jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))),
    **frozen,
  }
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
  return state, shardings


def init_state(
  params: nnx.State,
  tx: optax.GradientTransformation,
  *,
  seed: int,
  mesh: Mesh,
  trainable: nnx.filterlib.Filter = ...,
) -> tuple[dict[str, Any], dict[str, Any]]:
  """The initial train state, every leaf placed on ``mesh``, and its shardings.

  Args:
    params: the model's parameters, already sharded (see ``sharding.param_shardings``).
    tx: the optimizer.
    seed: seed of the state's RNG key.
    mesh: the device mesh.
    trainable: an nnx filter of the parameters to train (``lora.trainable_filter``). Unless it is
      ``...`` (all of them), the others go to ``state["frozen"]``.
  """
  _, shardings = abstract_state(params, tx, mesh=mesh, trainable=trainable)
  frozen = {}
  if trainable is not ...:
    params, frozen["frozen"] = nnx.split_state(params, trainable, ...)
  replicated = shardings["step"]
  step_and_rng = jax.jit(
    lambda: {"step": jnp.zeros((), jnp.int32), "rng": jax.random.key_data(jax.random.key(seed))},
    out_shardings={"step": replicated, "rng": replicated},
  )()
  state = {
    "params": params,
    "opt_state": jax.jit(tx.init, out_shardings=shardings["opt_state"])(params),
    **step_and_rng,
    **frozen,
  }
  return state, shardings


def model_params(state: dict[str, Any]) -> nnx.State:
  """The whole model's parameters of a train state: ``params``, joined with ``frozen`` if any."""
  if "frozen" not in state:
    return state["params"]
  return nnx.merge_state(state["params"], state["frozen"])


def set_step_and_rng(state: dict[str, Any], step: int, rng: Sequence[int]) -> dict[str, Any]:
  """``state`` with its step counter and RNG key data replaced (on resume), placed as before."""

  def put(value, like):
    host = np.asarray(value, like.dtype)
    return jax.make_array_from_callback(host.shape, like.sharding, lambda idx: host[idx])

  return dict(state, step=put(step, state["step"]), rng=put(rng, state["rng"]))


def make_train_step(
  loss_fn: Callable,
  tx: optax.GradientTransformation,
  schedule: Callable,
  *,
  grad_accum_steps: int = 1,
  max_grad_norm: float = 0.0,
  state_shardings: Any = None,
) -> Callable:
  """One jitted ``(state, batch) -> (state, (metrics, extra))`` with the state donated.

  Only ``state["params"]`` is differentiated and updated; ``state["frozen"]`` (LoRA's base, see
  :func:`init_state`) passes through. Gradients of summed losses are accumulated over
  ``grad_accum_steps`` micro-batches and divided by the total count, so the update follows the
  mean loss over the whole global batch; their global norm is then clipped to ``max_grad_norm``
  (``<= 0``: not clipped), here rather than in ``tx`` (see :func:`_update`). An unpacked batch is
  split here; a packed one comes split, each array with a leading ``[grad_accum_steps]`` axis
  (see ``packing.PackedCollator``). ``metrics`` are the loss's sums and counts (see
  ``metrics.finalize_metrics``); ``extra`` holds ``grad_norm`` (before clipping) and
  ``learning_rate``. Where activations live is ``loss_fn``'s (:func:`make_loss_fn`).
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def step(state, batch):
    params, frozen = state["params"], state.get("frozen")
    rng = _step_key(state)
    if grad_accum_steps == 1:
      (_, metrics), grads = grad_fn(params, batch, frozen, rng)
    else:
      micro = batch if batch.packed else _microbatches(batch, grad_accum_steps)
      first = jax.tree.map(lambda x: x[0], micro)
      zero_metrics = empty(jax.eval_shape(lambda: loss_fn(params, first, frozen)[1]))
      zero_grads = jax.tree.map(jnp.zeros_like, params)

      def body(carry, mb_and_index):
        (g_acc, m_acc), (mb, i) = carry, mb_and_index
        (_, m), g = grad_fn(params, mb, frozen, jax.random.fold_in(rng, i))
        return (jax.tree.map(jnp.add, g_acc, g), accumulate(m_acc, m)), None

      (grads, metrics), _ = jax.lax.scan(
        body, (zero_grads, zero_metrics), (micro, jnp.arange(grad_accum_steps))
      )
    return _update(tx, schedule, max_grad_norm, state, grads, metrics)

  if state_shardings is None:
    return jax.jit(step, donate_argnums=0)
  return jax.jit(
    step, donate_argnums=0, in_shardings=(state_shardings, None), out_shardings=(state_shardings, None)
  )


def _step_key(state) -> jax.Array:
  """This step's PRNG key (adapter dropout), from the state's seed and step: a resumed run
  draws what an uninterrupted one would. Micro-batch i folds in i."""
  return jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])


def _update(
  tx: optax.GradientTransformation, schedule: Callable, max_grad_norm: float, state, grads, metrics
):
  """The optimizer's update of ``state`` by summed ``grads`` over the count of the summed loss,
  clipped to a global norm of ``max_grad_norm`` (``<= 0``: not clipped).

  The mean and the clipping are one scalar factor on the sums, and the only norm is the sums':
  XLA then fuses the scaling into the optimizer's reads of each gradient. Dividing the sums
  first, or clipping inside ``tx`` (which takes the norm of what it is given), made XLA keep the
  scaled gradients as a second parameter-sized buffer beside the sums.
  """
  params = state["params"]
  count = jnp.maximum(metrics["loss"].count, 1.0)
  summed_norm = optax.tree.norm(grads)
  grad_norm = summed_norm / count  # the mean gradient's
  scale = 1.0 / count
  if max_grad_norm > 0:
    # Clipped, (g / count) * max_grad_norm / grad_norm is g * max_grad_norm / summed_norm.
    scale = jnp.where(grad_norm < max_grad_norm, scale, max_grad_norm / summed_norm)
  updates, opt_state = tx.update(jax.tree.map(lambda g: g * scale, grads), state["opt_state"], params)
  new_state = dict(
    state, params=optax.apply_updates(params, updates), opt_state=opt_state, step=state["step"] + 1
  )
  extra = {"grad_norm": grad_norm, "learning_rate": schedule(state["step"])}
  return new_state, (metrics, extra)


class MicroBatchedStep:
  """``(state, micro_batches) -> (state, (metrics, extra))``: gradient accumulation over
  micro-batches that each keep their own shape (padded to their own length bucket), where
  :func:`make_train_step` takes one array per field, every micro-batch padded alike.

  The gradient of each micro-batch is one jitted call, compiled once per micro-batch shape (so
  the compiled programs stay as few as the buckets); the sums are added on device and the
  update is a last jitted call that donates the state (clipped to ``max_grad_norm``, as
  :func:`make_train_step` clips). The update equals
  :func:`make_train_step`'s on the same groups up to float32 summation order, and the dropout
  draws are the same (micro-batch i folds in i).
  """

  def __init__(
    self,
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    schedule: Callable,
    *,
    max_grad_norm: float = 0.0,
    state_shardings: Any = None,
  ):
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def grads_of(state, index, batch):
      rng = jax.random.fold_in(_step_key(state), index)
      (_, metrics), grads = grad_fn(state["params"], batch, state.get("frozen"), rng)
      return grads, metrics

    def add(total, new):
      return jax.tree.map(jnp.add, total[0], new[0]), accumulate(total[1], new[1])

    update = functools.partial(_update, tx, schedule, max_grad_norm)
    if state_shardings is None:
      self._grads = jax.jit(grads_of)
      self._update = jax.jit(update, donate_argnums=0)
    else:
      self._grads = jax.jit(
        grads_of, in_shardings=(state_shardings, None, None), out_shardings=(state_shardings["params"], None)
      )
      self._update = jax.jit(
        update,
        donate_argnums=0,
        in_shardings=(state_shardings, state_shardings["params"], None),
        out_shardings=(state_shardings, None),
      )
    self._add = jax.jit(add, donate_argnums=0)
    self.grads = CompiledPerShape("micro-batch gradient", self._grads)

  def __call__(self, state, micro_batches: Sequence[Batch]):
    total = None
    for i, batch in enumerate(micro_batches):
      new = self.grads(state, np.int32(i), batch)
      total = new if total is None else self._add(total, new)
    return self._update(state, *total)

  def compile_programs(self, state, micro_batch: Batch) -> dict[str, Any]:
    """The gradient program for ``micro_batch``'s shape and the update program, compiled ahead of
    time (``state`` and ``micro_batch`` may be abstract): ``{"gradient": ..., "update": ...}``,
    whose memory analyses size the step (the memory plan)."""
    index = np.int32(0)
    sums = jax.eval_shape(self._grads, state, index, micro_batch)  # the gradient and metric sums
    return {
      "gradient": self.grads.compile(state, index, micro_batch),
      "update": self._update.lower(state, *sums).compile(),
    }


def make_eval_step(loss_fn: Callable) -> Callable:
  """Jitted ``(params, batch) -> metrics`` (sums and counts; accumulate over batches); ``params``
  are the whole model's (:func:`model_params` of a train state)."""

  def step(params, batch):
    return loss_fn(params, batch)[1]

  return jax.jit(step)


class CompiledPerShape:
  """A jitted step compiled ahead of time once per batch shape, logging its memory use.

  Called as ``jitted`` is, with the batch last; a batch of another class or other array shapes
  compiles anew.
  """

  def __init__(self, name: str, jitted: Callable):
    self.name = name
    self._jitted = jitted
    self._compiled: dict[Any, Any] = {}

  def compile(self, *args):
    """The step compiled for ``args`` (the batch last), compiling it if their shapes are new."""
    batch = args[-1]
    key = (type(batch), tuple(x.shape for x in jax.tree.leaves(batch)))
    compiled = self._compiled.get(key)
    if compiled is None:
      t0 = time.time()
      compiled = self._compiled[key] = self._jitted.lower(*args).compile()
      log.info(
        "%s compiled for input_ids %s in %.1fs; %s",
        self.name,
        batch.input_ids.shape,
        time.time() - t0,
        _memory(compiled),
      )
    return compiled

  def __call__(self, *args):
    return self.compile(*args)(*args)


def _memory(compiled) -> str:
  program = ProgramMemory.of(compiled)
  return "no memory analysis on this backend" if program is None else "memory: " + program.line()
