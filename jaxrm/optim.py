"""AdamW with linear warmup, cosine/linear/constant decay, decoupled weight decay and clipping."""

from __future__ import annotations

from typing import Any

import jax
import optax

DECAYS = ("cosine", "linear", "constant")

# Parameters whose path has a key containing one of these are never weight-decayed.
NO_DECAY_KEYS = ("norm", "bias")


def make_schedule(
    *,
    learning_rate: float,
    warmup_steps: int,
    total_steps: int,
    decay: str = "cosine",
    min_lr_ratio: float = 0.0,
) -> optax.Schedule:
  """Learning rate per optimizer step.

  Rises linearly from 0 at step 0 to ``learning_rate`` at ``warmup_steps``, then decays to
  ``learning_rate * min_lr_ratio`` at ``total_steps`` (cosine or linear) and stays there;
  ``constant`` holds ``learning_rate`` after warmup.
  """
  if decay not in DECAYS:
    raise ValueError(f"decay={decay!r} is not one of {DECAYS}")
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps={warmup_steps} must be 0 or more")
  if decay != "constant" and total_steps <= warmup_steps:
    raise ValueError(
        f"total_steps={total_steps} leaves no steps to decay after warmup_steps={warmup_steps};"
        f" raise total_steps, lower warmup_steps or use decay='constant'")
  final_lr = learning_rate * min_lr_ratio
  decay_steps = total_steps - warmup_steps
  if decay == "cosine":
    after_warmup = optax.cosine_decay_schedule(learning_rate, decay_steps, alpha=min_lr_ratio)
  elif decay == "linear":
    after_warmup = optax.linear_schedule(learning_rate, final_lr, decay_steps)
  else:
    after_warmup = optax.constant_schedule(learning_rate)
  if warmup_steps == 0:
    return after_warmup
  warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
  return optax.join_schedules([warmup, after_warmup], [warmup_steps])


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

  Weight decay is decoupled (scaled by the learning rate, as in PyTorch's AdamW) and skips norm
  and bias parameters (:func:`weight_decay_mask`). ``max_grad_norm <= 0`` disables clipping.
  """
  adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                      mask=weight_decay_mask)
  if max_grad_norm <= 0:
    return adamw
  return optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)
