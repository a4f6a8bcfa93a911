"""The update a run trains with: its schedule, optimizer, train state, loss and steps, built once.

:func:`build_update` is the one construction of them: the trainer calls it, and so do the
benchmark and memory-plan scripts, so that what they time or size is what a run trains.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxrm import sharding
from jaxrm.config import RewardSpec, TrainSpec
from jaxrm.errors import ConfigError
from jaxrm.models import lora
from jaxrm.models.decoder import Decoder
from jaxrm.run import optim, steps


@dataclasses.dataclass(frozen=True)
class Update:
  """What :func:`build_update` builds; ``train_step`` donates ``state``, so a caller keeps the
  state each step returns instead."""

  schedule: optax.Schedule
  tx: optax.GradientTransformation  # AdamW, unclipped: the train step clips (see _optimizer)
  state: dict[str, Any]  # the initial train state (see steps.init_state); abstract for an abstract model
  state_shardings: dict[str, Any]
  train_step: steps.CompiledPerShape | steps.MicroBatchedStep  # (state, batch) -> (state, (metrics, extra))
  eval_step: steps.CompiledPerShape  # (params, batch) -> metrics, with Samples for rank-based metrics


def build_update(
  model: Decoder,
  reward: RewardSpec,
  train: TrainSpec,
  *,
  total_steps: int,
  mesh: Mesh,
  context_balance: str = "zigzag",
  grad_accum: int = 1,
  micro_batched: bool = False,
) -> Update:
  """The schedule, optimizer, initial state and jitted steps that train ``model`` as ``train`` says.

  Args:
    model: the reward model, its parameters placed on ``mesh``. With LoRA on (its config's
      ``lora``), only the adapters and the head train. Abstract parameters
      (``jax.ShapeDtypeStruct``s, as ``hf.loader.placed_abstract_model`` gives) make an abstract
      state: nothing is allocated, and the steps can still be compiled (the memory plan).
    reward: the loss.
    train: the optimizer's settings and the state's seed.
    total_steps: the run's length, where the schedule ends.
    mesh: the device mesh.
    context_balance: how ``mesh``'s context axis deals each row's tokens to its shards
      (``MeshConfig.context_balance``).
    grad_accum: micro-batches per update when each batch holds them all (a packed batch stacks
      them on a leading axis; an unpacked one is split by the step).
    micro_batched: each batch is instead a tuple of micro-batches, each padded to its own length
      bucket (the unpacked pipeline's batches with accumulation): a
      :class:`~jaxrm.run.steps.MicroBatchedStep`, which counts them by the tuple.

  Raises:
    ConfigError: the schedule cannot follow ``train`` over ``total_steps``.
  """
  schedule = _schedule(train, total_steps)
  tx = _optimizer(schedule, train)
  state, shardings = _initial_state(model, tx, seed=train.seed, mesh=mesh)
  placement = sharding.Placement(mesh, context_balance)
  loss_fn = steps.make_loss_fn(model, reward, placement=placement)
  clip = train.max_grad_norm
  if micro_batched:
    # Each micro-batch keeps its own length bucket; one compiled gradient per bucket.
    train_step = steps.MicroBatchedStep(loss_fn, tx, schedule, max_grad_norm=clip, state_shardings=shardings)
  else:
    train_step = steps.CompiledPerShape(
      "train step",
      steps.make_train_step(
        loss_fn,
        tx,
        schedule,
        grad_accum_steps=grad_accum,
        max_grad_norm=clip,
        state_shardings=shardings,
      ),
    )
  eval_loss_fn = steps.make_loss_fn(model, reward, samples=True, placement=placement)
  eval_step = steps.CompiledPerShape("eval step", steps.make_eval_step(eval_loss_fn))
  return Update(schedule, tx, state, shardings, train_step, eval_step)


def _schedule(train: TrainSpec, total_steps: int) -> optax.Schedule:
  try:
    return optim.make_schedule(
      learning_rate=train.learning_rate,
      warmup_steps=train.warmup_steps,
      total_steps=total_steps,
      scheduler=train.lr_scheduler,
      min_lr_ratio=train.min_lr_ratio,
    )
  except ValueError as e:  # e.g. warmup longer than the run: the settings are the user's to fix
    raise ConfigError(str(e)) from None


def _optimizer(schedule: optax.Schedule, train: TrainSpec) -> optax.GradientTransformation:
  """``optim.make_optimizer``'s AdamW for ``train``, without its clipping, which the train step
  does (``steps.make_train_step``: clipping inside the optimizer made XLA keep the clipped
  gradients as a second parameter-sized buffer).

  Where ``train`` clips, a stateless identity holds the clip's place in the chain, so that the
  optimizer state keeps ``make_optimizer``'s layout and checkpoints restore either way.
  """
  adamw = optim.make_optimizer(
    schedule,
    weight_decay=train.weight_decay,
    max_grad_norm=0.0,
    b1=train.adam_beta1,
    b2=train.adam_beta2,
    eps=train.adam_epsilon,
  )
  if train.max_grad_norm <= 0:
    return adamw
  return optax.chain(optax.identity(), adamw)


def _initial_state(model: Decoder, tx: optax.GradientTransformation, *, seed: int, mesh: Mesh):
  params = nnx.state(model)
  trainable = lora.trainable_filter(model.config.lora)
  if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
    return steps.abstract_state(params, tx, mesh=mesh, trainable=trainable)
  return steps.init_state(params, tx, seed=seed, mesh=mesh, trainable=trainable)
