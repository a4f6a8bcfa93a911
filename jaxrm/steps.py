"""The jitted train and eval steps, the train state, and the loss each reward type uses.

State is a plain dict ``{"params", "opt_state", "step", "rng"}``; ``params`` is the model's
``nnx.State`` (float32 master weights; the model computes in its own compute dtype). Optimizer
moments are sharded like their parameters; counters, step and RNG are replicated.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxrm import losses, sharding
from jaxrm.data.packing import group_logits, group_rewards
from jaxrm.models.decoder import Decoder

REWARD_TYPES = ("bradley_terry", "ranking", "stepwise")
RANKING_LOSSES = ("plackett_luce", "all_pairs")


@dataclasses.dataclass(frozen=True)
class RewardSpec:
  """Which loss trains the model."""

  type: str = "bradley_terry"  # bradley_terry | ranking | stepwise
  ranking_loss: str = "plackett_luce"  # for type=ranking: plackett_luce | all_pairs
  center_rewards_coefficient: float = 0.0

  def __post_init__(self):
    if self.type not in REWARD_TYPES:
      raise ValueError(f"reward.type must be one of {', '.join(REWARD_TYPES)}; got {self.type!r}")
    if self.ranking_loss not in RANKING_LOSSES:
      raise ValueError(f"reward.ranking_loss must be one of {', '.join(RANKING_LOSSES)}; got {self.ranking_loss!r}")


def _is_packed(batch: dict[str, Any]) -> bool:
  """Whether ``batch`` has the packed layout of ``jaxrm.data.packing``."""
  return "reward_index" in batch or "token_index" in batch


def _outputs(model: Decoder, batch: dict[str, jax.Array]) -> jax.Array:
  """Rewards [G, K] of a preference batch, or logits [G, T, C] of a stepwise one, packed or not."""
  if not _is_packed(batch):
    out = model(batch["input_ids"], batch["attention_mask"])
    return out if "labels" in batch else out.reshape(batch["ranks"].shape)
  rows = (batch["input_ids"], batch["attention_mask"], batch["positions"], batch["segment_ids"],
          batch["branch_ids"])
  if "token_index" in batch:
    return group_logits(model(*rows), batch["token_index"])
  return group_rewards(model(*rows, reward_positions=batch["reward_positions"]), batch["reward_index"])


def make_loss_fn(model: Decoder, spec: RewardSpec) -> Callable:
  """``loss_fn(params, batch) -> (loss_total, metrics)``; loss_total is a sum, metrics["loss"].count its count.

  ``batch`` is unpacked (``pipeline``'s layout) or packed (``packing``'s); both give the same
  losses and metrics, counted per group or sequence.
  """
  graphdef = nnx.graphdef(model)

  def loss_fn(params, batch):
    out = _outputs(nnx.merge(graphdef, params), batch)
    if spec.type == "stepwise":
      _, metrics = losses.stepwise_loss(out, batch["labels"], batch["example_mask"])
    elif spec.type == "ranking" and spec.ranking_loss == "plackett_luce":
      _, metrics = losses.plackett_luce_loss(out, batch["ranks"], batch["example_mask"])
    else:
      _, metrics = losses.bradley_terry_loss(
          out, batch["ranks"], batch["example_mask"], batch.get("margin"),
          center_rewards_coefficient=spec.center_rewards_coefficient,
          all_pairs=spec.type == "ranking")
    return metrics["loss"].total, metrics

  return loss_fn


def _microbatches(batch: dict[str, jax.Array], n: int) -> dict[str, jax.Array]:
  """[G*k, ...] arrays -> [n, G/n*k, ...], keeping each group's rows together.

  Micro-batch m takes groups m, m+n, m+2n...: each micro-batch stays spread over every
  data-parallel shard instead of living on one.
  """
  groups = batch["example_mask"].shape[0]

  def split(x):
    per_group = x.shape[0] // groups
    x = x.reshape(groups // n, n, per_group, *x.shape[1:])
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape(n, groups // n * per_group, *x.shape[3:])

  return {k: split(v) for k, v in batch.items()}


def init_state(params: nnx.State, tx: optax.GradientTransformation, *, seed: int,
               mesh: Mesh) -> tuple[dict[str, Any], dict[str, Any]]:
  """The initial train state, every leaf placed on ``mesh``, and its shardings.

  Args:
    params: the model's parameters, already sharded (see ``sharding.param_shardings``).
    tx: the optimizer.
    seed: seed of the state's RNG key.
    mesh: the device mesh.
  """
  replicated = sharding.replicated(mesh)
  param_shardings = jax.tree.map(lambda x: x.sharding, params)
  opt_shardings = optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, params), param_shardings,
                                        transform_non_params=lambda _: replicated)
  shardings = {"params": param_shardings, "opt_state": opt_shardings, "step": replicated, "rng": replicated}
  step_and_rng = jax.jit(
      lambda: {"step": jnp.zeros((), jnp.int32), "rng": jax.random.key_data(jax.random.key(seed))},
      out_shardings={"step": replicated, "rng": replicated})()
  state = {"params": params, "opt_state": jax.jit(tx.init, out_shardings=opt_shardings)(params),
           **step_and_rng}
  return state, shardings


def set_step_and_rng(state: dict[str, Any], step: int, rng: Sequence[int]) -> dict[str, Any]:
  """``state`` with its step counter and RNG key data replaced (on resume), placed as before."""

  def put(value, like):
    host = np.asarray(value, like.dtype)
    return jax.make_array_from_callback(host.shape, like.sharding, lambda idx: host[idx])

  return dict(state, step=put(step, state["step"]), rng=put(rng, state["rng"]))


def make_train_step(loss_fn: Callable, tx: optax.GradientTransformation, schedule: Callable,
                    *, grad_accum_steps: int = 1, state_shardings: Any = None,
                    mesh: Mesh | None = None) -> Callable:
  """One jitted ``(state, batch) -> (state, (metrics, extra))`` with the state donated.

  Gradients of summed losses are accumulated over ``grad_accum_steps`` micro-batches and divided
  by the total count, so the update follows the mean loss over the whole global batch. An
  unpacked batch is split here; a packed one comes split, each array with a leading
  ``[grad_accum_steps]`` axis (see ``packing.PackedCollator``).
  ``metrics`` are the loss's sums and counts (see ``losses.finalize_metrics``); ``extra`` holds
  ``grad_norm`` (before clipping) and ``learning_rate``. With ``mesh``, activations are pinned to
  it at block boundaries.
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def step(state, batch):
    with _activations_on(mesh):
      return _step(state, batch)

  def _step(state, batch):
    params = state["params"]
    if grad_accum_steps == 1:
      (_, metrics), grads = grad_fn(params, batch)
    else:
      micro = batch if _is_packed(batch) else _microbatches(batch, grad_accum_steps)
      first = jax.tree.map(lambda x: x[0], micro)
      zero_metrics = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: loss_fn(params, first)[1]))
      zero_grads = jax.tree.map(jnp.zeros_like, params)

      def body(carry, mb):
        g_acc, m_acc = carry
        (_, m), g = grad_fn(params, mb)
        return (jax.tree.map(jnp.add, g_acc, g), losses.accumulate(m_acc, m)), None

      (grads, metrics), _ = jax.lax.scan(body, (zero_grads, zero_metrics), micro)
    count = jnp.maximum(metrics["loss"].count, 1.0)
    grads = jax.tree.map(lambda g: g / count, grads)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    new_state = dict(state, params=optax.apply_updates(params, updates), opt_state=opt_state,
                     step=state["step"] + 1)
    extra = {"grad_norm": grad_norm, "learning_rate": schedule(state["step"])}
    return new_state, (metrics, extra)

  if state_shardings is None:
    return jax.jit(step, donate_argnums=0)
  return jax.jit(step, donate_argnums=0, in_shardings=(state_shardings, None),
                 out_shardings=(state_shardings, None))


def make_eval_step(loss_fn: Callable, *, mesh: Mesh | None = None) -> Callable:
  """Jitted ``(params, batch) -> metrics`` (sums and counts; accumulate over batches)."""

  def step(params, batch):
    with _activations_on(mesh):
      return loss_fn(params, batch)[1]

  return jax.jit(step)


def _activations_on(mesh: Mesh | None):
  return sharding.activation_sharding(mesh) if mesh is not None else contextlib.nullcontext()
