"""The jitted train and eval steps, and the loss each reward type uses.

State is a plain dict ``{"params", "opt_state", "step", "rng"}``; ``params`` is the model's
``nnx.State`` (float32 master weights; the model computes in its own compute dtype).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrm import losses
from jaxrm.models.decoder import RewardModelModule

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


def make_loss_fn(model: RewardModelModule, spec: RewardSpec) -> Callable:
  """``loss_fn(params, batch) -> (loss_total, metrics)``; loss_total is a sum, metrics["loss"].count its count."""
  graphdef = nnx.graphdef(model)

  def apply(params, batch):
    m = nnx.merge(graphdef, params)
    return m(batch["input_ids"], batch["attention_mask"], batch.get("positions"), batch.get("segment_ids"))

  def loss_fn(params, batch):
    out = apply(params, batch)
    if spec.type == "stepwise":
      _, metrics = losses.stepwise_loss(out, batch["labels"], batch["example_mask"])
    else:
      b, k = batch["ranks"].shape
      rewards = out.reshape(b, k)
      if spec.type == "ranking" and spec.ranking_loss == "plackett_luce":
        _, metrics = losses.plackett_luce_loss(rewards, batch["ranks"], batch["example_mask"])
      else:
        _, metrics = losses.bradley_terry_loss(
            rewards, batch["ranks"], batch["example_mask"], batch.get("margin"),
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


def make_train_step(loss_fn: Callable, tx: optax.GradientTransformation, schedule: Callable,
                    *, grad_accum_steps: int = 1, state_shardings: Any = None) -> Callable:
  """One jitted ``(state, batch) -> (state, metrics)`` with the state donated.

  Gradients of summed losses are accumulated over ``grad_accum_steps`` micro-batches and divided
  by the total count, so the update follows the mean loss over the whole global batch.
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def step(state, batch):
    params = state["params"]
    if grad_accum_steps == 1:
      (_, metrics), grads = grad_fn(params, batch)
    else:
      micro = _microbatches(batch, grad_accum_steps)
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
    grad_norm = optax.global_norm(grads)
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    new_state = dict(state, params=optax.apply_updates(params, updates), opt_state=opt_state,
                     step=state["step"] + 1)
    extra = {"grad_norm": grad_norm, "learning_rate": schedule(state["step"])}
    return new_state, (metrics, extra)

  return jax.jit(step, donate_argnums=0,
                 out_shardings=(state_shardings, None) if state_shardings is not None else None)


def make_eval_step(loss_fn: Callable) -> Callable:
  """Jitted ``(params, batch) -> metrics`` (sums and counts; accumulate over batches)."""
  return jax.jit(lambda params, batch: loss_fn(params, batch)[1])
