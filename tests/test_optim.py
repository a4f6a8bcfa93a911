"""Learning-rate schedules, the weight-decay mask and the optimizer's first update."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrm.run import optim

LR, MIN = 1e-3, 1e-4  # min_lr_ratio 0.1
# optax evaluates schedules in float32: LR itself is 4.7e-8 (relative) off there, and a cosine or an
# interpolation adds a few roundings; a schedule a step off moves the rate by over 1%.
SCHEDULE_RTOL = 1e-5


def lr_at(schedule, *steps):
  return [float(schedule(step)) for step in steps]


def test_cosine_schedule_at_warmup_middle_and_end():
  schedule = optim.make_schedule(
    learning_rate=LR, warmup_steps=10, total_steps=110, scheduler="cosine", min_lr_ratio=0.1
  )
  quarter = MIN + (LR - MIN) * 0.5 * (1 + math.cos(math.pi / 4))
  np.testing.assert_allclose(
    lr_at(schedule, 0, 5, 10, 35, 60, 110, 500),
    [0.0, LR / 2, LR, quarter, (LR + MIN) / 2, MIN, MIN],
    rtol=SCHEDULE_RTOL,
  )


def test_linear_schedule_at_warmup_middle_and_end():
  schedule = optim.make_schedule(
    learning_rate=LR, warmup_steps=10, total_steps=110, scheduler="linear", min_lr_ratio=0.1
  )
  np.testing.assert_allclose(
    lr_at(schedule, 0, 5, 10, 35, 60, 110, 500),
    [0.0, LR / 2, LR, LR - 0.25 * (LR - MIN), (LR + MIN) / 2, MIN, MIN],
    rtol=SCHEDULE_RTOL,
  )


def test_constant_schedule_and_no_warmup():
  constant = optim.make_schedule(
    learning_rate=LR, warmup_steps=4, total_steps=0, scheduler="constant_with_warmup"
  )
  # No cosine here: LR's own float32 rounding (4.7e-8) and an exact warmup fraction (2 / 4).
  np.testing.assert_allclose(lr_at(constant, 0, 2, 4, 1000), [0.0, LR / 2, LR, LR], rtol=1e-6)
  cosine = optim.make_schedule(learning_rate=LR, warmup_steps=0, total_steps=100)
  # atol: the final 0 has no scale for rtol; 1e-12 (1e-9 of LR) allows a float32 cos(pi) that
  # misses -1 by a rounding.
  np.testing.assert_allclose(lr_at(cosine, 0, 50, 100), [LR, LR / 2, 0.0], rtol=SCHEDULE_RTOL, atol=1e-12)


def test_schedule_errors_say_what_to_change():
  with pytest.raises(ValueError, match="leaves no steps to decay.*use scheduler='constant_with_warmup'"):
    optim.make_schedule(learning_rate=LR, warmup_steps=100, total_steps=100)
  with pytest.raises(ValueError, match="lr_scheduler='polynomial' is not one of cosine, "):
    optim.make_schedule(learning_rate=LR, warmup_steps=0, total_steps=10, scheduler="polynomial")
  with pytest.raises(ValueError, match="'cosine_with_min_lr' needs min_lr_ratio > 0"):
    optim.make_schedule(learning_rate=LR, warmup_steps=0, total_steps=10, scheduler="cosine_with_min_lr")


# (scheduler, min_lr_ratio, transformers' get_scheduler name and scheduler_specific_kwargs)
HF_SCHEDULES = [
  ("linear", 0.0, "linear", {}),
  ("cosine", 0.0, "cosine", {}),
  ("cosine_with_min_lr", 0.1, "cosine_with_min_lr", {"min_lr_rate": 0.1}),
  ("constant", 0.0, "constant", {}),
  ("constant_with_warmup", 0.0, "constant_with_warmup", {}),
  ("inverse_sqrt", 0.0, "inverse_sqrt", {}),
  ("inverse-square-root", 0.0, "inverse_sqrt", {}),  # NeMo RL's Megatron spelling
]


@pytest.mark.parametrize("warmup", [0, 7])
@pytest.mark.parametrize("scheduler, min_lr_ratio, hf_name, hf_kwargs", HF_SCHEDULES)
def test_schedules_equal_transformers_get_scheduler(scheduler, min_lr_ratio, hf_name, hf_kwargs, warmup):
  """Every step's rate equals the one transformers gives the optimizer for that update."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  total = 40
  hf_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
  hf = transformers.get_scheduler(
    hf_name, hf_opt, num_warmup_steps=warmup, num_training_steps=total, scheduler_specific_kwargs=hf_kwargs
  )
  expected = []
  for _ in range(total + 1):  # step `total` too: the last update's rate was read at total - 1
    expected.append(hf_opt.param_groups[0]["lr"])
    hf_opt.step()
    hf.step()
  ours = optim.make_schedule(
    learning_rate=LR, warmup_steps=warmup, total_steps=total, scheduler=scheduler, min_lr_ratio=min_lr_ratio
  )
  # atol: near the end of a decay to 0 the rate is small, but its float32 roundings are those of a
  # value of LR's size (1e-7 of LR is a few of them); a step off there still moves it by ~1e-6.
  np.testing.assert_allclose(lr_at(ours, *range(total + 1)), expected, rtol=SCHEDULE_RTOL, atol=1e-10)


def params_tree():
  """Parameter names as the model uses them; stacked layers give norms a layer axis."""
  layers, dim = 2, 4
  return {
    "embed": {"embedding": jnp.ones((8, dim))},
    "layers": {
      "input_norm": {"scale": jnp.ones((layers, dim))},
      "q_proj": {"kernel": jnp.ones((layers, dim, dim))},
      "q_bias": jnp.ones((layers, dim)),
    },
    "final_norm": {"scale": jnp.ones(dim)},
    "score": {"kernel": jnp.ones((dim, 1)), "bias": jnp.ones(1)},
  }


EXPECTED_MASK = {
  "embed": {"embedding": True},
  "layers": {"input_norm": {"scale": False}, "q_proj": {"kernel": True}, "q_bias": False},
  "final_norm": {"scale": False},
  "score": {"kernel": True, "bias": False},
}


def test_decay_mask_excludes_norm_and_bias_by_name():
  assert optim.weight_decay_mask(params_tree()) == EXPECTED_MASK


def test_decay_mask_on_nnx_state():

  class Tiny(nnx.Module):
    def __init__(self):
      self.input_norm = nnx.RMSNorm(4, rngs=nnx.Rngs(0))
      self.proj = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

  mask = optim.weight_decay_mask(nnx.state(Tiny(), nnx.Param))
  assert nnx.to_pure_dict(mask) == {
    "input_norm": {"scale": False},
    "proj": {"kernel": True, "bias": False},
  }


def test_first_update_decays_matrices_only_and_clips():
  params = params_tree()
  # With zero gradients Adam's step is 0, so the update is the decoupled decay alone:
  # -lr * weight_decay * param on decayed parameters, nothing elsewhere.
  tx = optim.make_optimizer(optax.constant_schedule(0.1), weight_decay=0.5)
  updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  expected = jax.tree.map(lambda decays: -0.05 if decays else 0.0, EXPECTED_MASK)
  # -0.1 * 0.5 * 1.0 in float32: a rounding or two from -0.05.
  jax.tree.map(lambda u, e: np.testing.assert_allclose(u, e, rtol=1e-6), updates, expected)

  # A large eps makes Adam's first step -lr * g / (|g| + eps), so it shows whether the gradient
  # [6, 8] (norm 10) was clipped to [0.6, 0.8].
  params = {"w": jnp.zeros(2)}
  grads = {"w": jnp.array([6.0, 8.0])}
  for max_grad_norm, g in ((1.0, np.array([0.6, 0.8])), (0.0, np.array([6.0, 8.0]))):
    tx = optim.make_optimizer(optax.constant_schedule(0.1), max_grad_norm=max_grad_norm, eps=1.0)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    # optax computes Adam's bias correction 1 - b2**t in float32, where 0.999 is not exact: at t = 1
    # it is 1.3e-5 (relative) below 1e-3, so sqrt(v_hat) is ~6.5e-6 high and the step ~6e-6 short.
    np.testing.assert_allclose(updates["w"], -0.1 * g / (np.abs(g) + 1.0), rtol=1e-5)


def test_adamw_betas_and_eps_reach_the_update():
  """Two AdamW steps with NeMo RL's RM settings (betas 0.9, 0.98, eps 1e-5) against the update
  computed by hand in float64."""
  b1, b2, eps, lr, wd = 0.9, 0.98, 1e-5, 0.1, 0.01
  tx = optim.make_optimizer(
    optax.constant_schedule(lr), weight_decay=wd, max_grad_norm=0.0, b1=b1, b2=b2, eps=eps
  )
  params = {"w": jnp.array([0.5, -1.0, 2.0])}
  grads = [np.array([1e-4, -3e-5, 2e-5]), np.array([-2e-4, 1e-5, 4e-5])]  # small: eps matters
  state = tx.init(params)
  w, m, v = np.array(params["w"], np.float64), 0.0, 0.0
  for t, g in enumerate(grads, start=1):
    updates, state = jax.jit(tx.update)({"w": jnp.asarray(g, jnp.float32)}, state, params)
    params = optax.apply_updates(params, updates)
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
    w = w - lr * (m_hat / (np.sqrt(v_hat) + eps) + wd * w)
    # float32 state and a float32 bias correction: a few roundings of O(1) values. With the default
    # eps 1e-8 or beta2 0.999 the step would differ by over 10%.
    np.testing.assert_allclose(params["w"], w, rtol=1e-5)
  default = optim.make_optimizer(optax.constant_schedule(lr), weight_decay=wd, max_grad_norm=0.0)
  updates, _ = default.update({"w": jnp.asarray(grads[0], jnp.float32)}, default.init(params), params)
  mine, _ = tx.update({"w": jnp.asarray(grads[0], jnp.float32)}, tx.init(params), params)
  assert np.max(np.abs(np.asarray(updates["w"]) - np.asarray(mine["w"]))) > 1e-3
