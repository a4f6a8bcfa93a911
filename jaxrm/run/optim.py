"""AdamW with linear warmup, a learning-rate schedule, decoupled weight decay and clipping."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

# Schedule names as transformers' ``get_scheduler`` (TRL's ``lr_scheduler_type``) spells them.
SCHEDULERS = ("cosine", "cosine_with_min_lr", "linear", "constant", "constant_with_warmup", "inverse_sqrt")
# The schedules that decay after their warmup, and so need steps past it.
DECAYING = ("cosine", "cosine_with_min_lr", "linear")
# Other spellings users bring: NeMo RL's Megatron ``lr_decay_style`` values.
SCHEDULER_ALIASES = {"inverse-square-root": "inverse_sqrt"}

# Parameters whose path has a key containing one of these are never weight-decayed.
NO_DECAY_KEYS = ("norm", "bias")


def scheduler_name(name: str) -> str:
  """The :data:`SCHEDULERS` entry ``name`` means (an alias is resolved); ValueError if none."""
  name = SCHEDULER_ALIASES.get(name, name)
  if name not in SCHEDULERS:
    raise ValueError(
      f"lr_scheduler={name!r} is not one of {', '.join(SCHEDULERS)} (or {', '.join(SCHEDULER_ALIASES)})"
    )
  return name


def make_schedule(
  *,
  learning_rate: float,
  warmup_steps: int,
  total_steps: int,
  scheduler: str = "cosine",
  min_lr_ratio: float = 0.0,
) -> optax.Schedule:
  """Learning rate per optimizer step, as transformers' ``get_scheduler(scheduler)`` gives it.

  Warmup rises linearly from 0 at step 0 to ``learning_rate`` at ``warmup_steps``. Then
  ``cosine`` / ``linear`` decay to ``learning_rate * min_lr_ratio`` at ``total_steps`` and stay
  there (``cosine_with_min_lr`` is ``cosine`` with ``min_lr_ratio > 0``); ``constant_with_warmup``
  holds ``learning_rate``; ``inverse_sqrt`` scales it by ``sqrt(warmup_steps / step)``.
  ``constant`` has no warmup at all.
  """
  scheduler = scheduler_name(scheduler)
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps={warmup_steps} must be 0 or more")
  if scheduler == "cosine_with_min_lr" and min_lr_ratio <= 0:
    raise ValueError(
      "scheduler='cosine_with_min_lr' needs min_lr_ratio > 0 (the floor as a fraction of "
      "learning_rate); use 'cosine' to decay to 0"
    )
  if scheduler == "constant":
    return optax.constant_schedule(learning_rate)
  if scheduler in DECAYING and total_steps <= warmup_steps:
    raise ValueError(
      f"total_steps={total_steps} leaves no steps to decay after warmup_steps={warmup_steps};"
      f" raise total_steps, lower warmup_steps or use scheduler='constant_with_warmup'"
    )
  after_warmup = _after_warmup(
    scheduler, learning_rate, warmup_steps, total_steps - warmup_steps, min_lr_ratio
  )
  if warmup_steps == 0:
    return after_warmup
  warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
  return optax.join_schedules([warmup, after_warmup], [warmup_steps])


def _after_warmup(
  scheduler: str, learning_rate: float, warmup_steps: int, decay_steps: int, min_lr_ratio: float
) -> optax.Schedule:
  """The schedule from the end of warmup on; its step 0 is step ``warmup_steps`` of the run."""
  if scheduler in ("cosine", "cosine_with_min_lr"):
    return optax.cosine_decay_schedule(learning_rate, decay_steps, alpha=min_lr_ratio)
  if scheduler == "linear":
    return optax.linear_schedule(learning_rate, learning_rate * min_lr_ratio, decay_steps)
  if scheduler == "inverse_sqrt":
    # transformers' timescale: warmup_steps, or 10_000 without warmup. Run step s = count +
    # warmup_steps gets learning_rate / sqrt((s + timescale - warmup_steps) / timescale).
    timescale = warmup_steps or 10_000
    return lambda count: learning_rate / jnp.sqrt((count + timescale) / timescale)
  return optax.constant_schedule(learning_rate)


def weight_decay_mask(params: Any) -> Any:
  """``True`` for each parameter that is decayed: all but those under a norm or bias key.

  Decided by name, not by rank, because stacked layers give norm scales a layer axis
  (``layers/input_norm/scale`` is ``[L, D]``).
  """

  def decays(path, _):
    names = [_key_name(entry).lower() for entry in path]
    return not any(word in name for name in names for word in NO_DECAY_KEYS)

  return jax.tree_util.tree_map_with_path(decays, params)


def _key_name(entry) -> str:
  for attribute in ("key", "name", "idx"):
    if hasattr(entry, attribute):
      return str(getattr(entry, attribute))
  return str(entry)


def make_optimizer(
  schedule: optax.Schedule,
  *,
  weight_decay: float = 0.0,
  max_grad_norm: float = 1.0,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
) -> optax.GradientTransformation:
  """AdamW following ``schedule`` (see :func:`make_schedule`), after clipping the global gradient norm.

  ``b1``, ``b2`` and ``eps`` are PyTorch's ``betas`` and ``eps`` (TRL's ``adam_beta1``,
  ``adam_beta2``, ``adam_epsilon``); eps is added to ``sqrt(v_hat)``, as there. Weight decay is decoupled (scaled by the learning rate, as in PyTorch's AdamW) and skips norm
  and bias parameters (:func:`weight_decay_mask`). ``max_grad_norm <= 0`` disables clipping.
  """
  adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=weight_decay_mask)
  if max_grad_norm <= 0:
    return adamw
  return optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)
