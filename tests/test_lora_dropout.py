"""LoRA dropout (peft's ``lora_dropout``): each adapter's input is dropped in training only, with
a draw of its own per adapter, layer and step, fixed by the run's seed."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import demo_batches, flat_params, padded_tokens

from jaxrm import sharding
from jaxrm.config import RewardSpec
from jaxrm.data import pipeline
from jaxrm.errors import ConfigError
from jaxrm.models import lora
from jaxrm.models.lora import LoraConfig, LoraParam
from jaxrm.run import steps
from jaxrm.scoring.reward_model import RewardModel

DROPPED = LoraConfig(rank=4, dropout=0.5, targets="all-linear")


@pytest.mark.parametrize("dropout", [1.0, -0.1, "0.1", True])
def test_dropout_must_be_a_probability_below_one(dropout):
  with pytest.raises(ConfigError, match=r"LoRA dropout=.*; use a probability in \[0, 1\)"):
    LoraConfig(rank=4, dropout=dropout)


def test_dropout_zeroes_inputs_at_its_rate_and_scales_the_kept_ones():
  # With A = B = I and scale 1 the adapter returns dropout(x) itself: as torch.nn.Dropout, each
  # element is 0 with probability p, else x / (1 - p).
  p, n, d = 0.25, 2000, 32
  x = jnp.ones((n, d), jnp.float32)
  eye = jnp.eye(d, dtype=jnp.float32)
  y = np.asarray(lora.delta(x, eye, eye, 1.0, dropout=p, key=jax.random.key(3)))
  assert set(np.unique(y)) == {0.0, np.float32(1 / (1 - p))}
  dropped = (y == 0).mean()
  # 64,000 draws: the fraction's standard deviation is sqrt(p (1 - p) / 64000) = 0.0017.
  assert abs(dropped - p) < 4 * np.sqrt(p * (1 - p) / y.size), dropped
  np.testing.assert_array_equal(lora.delta(x, eye, eye, 1.0, dropout=p), x)  # no key: nothing dropped


def _with_random_b(rm: RewardModel) -> RewardModel:
  """``rm`` with every adapter's B drawn at random (new adapters have B = 0, which no dropout
  could change)."""
  state = nnx.state(rm.model)
  for i, (path, var) in enumerate(nnx.to_flat_state(state)):
    if isinstance(var, LoraParam) and path[-1].endswith("_lora_b"):
      var.set_value(0.1 * jax.random.normal(jax.random.key(i), var.get_value().shape))
  nnx.update(rm.model, state)
  return rm


def test_scoring_drops_nothing_and_training_draws_from_its_key(model_dir):
  dropped = _with_random_b(RewardModel.from_pretrained(model_dir, lora=DROPPED))
  kept = _with_random_b(
    RewardModel.from_pretrained(model_dir, lora=dataclasses.replace(DROPPED, dropout=0.0))
  )
  ids, mask = padded_tokens(dropped.config.vocab_size)
  scores = dropped.score_tokens(ids, mask)
  np.testing.assert_array_equal(scores, kept.score_tokens(ids, mask))

  forward = nnx.jit(lambda model, key: model(ids, mask, dropout_rng=key))
  first, again, other = (np.asarray(forward(dropped.model, jax.random.key(k))) for k in (1, 1, 2))
  np.testing.assert_array_equal(first, again)
  assert np.abs(first - scores).min() > 0 and np.abs(first - other).min() > 0
  # A key changes nothing where the rate is 0.
  np.testing.assert_array_equal(forward(kept.model, jax.random.key(1)), kept.score_tokens(ids, mask))


def test_train_step_draws_a_mask_per_step_from_the_state_seed(model_dir):
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), devices=jax.devices()[:1])
  tx = optax.sgd(1.0)
  batch = pipeline.to_global_batch(demo_batches(RewardModel.from_pretrained(model_dir).tokenizer, 1)[0], mesh)

  def first_update(cfg: LoraConfig, seed: int = 0):
    rm = RewardModel.from_pretrained(model_dir, lora=cfg)
    before = flat_params(nnx.state(rm.model))
    state, shardings = steps.init_state(
      nnx.state(rm.model), tx, seed=seed, mesh=mesh, trainable=lora.trainable_filter(cfg)
    )
    step = steps.make_train_step(
      steps.make_loss_fn(rm.model, RewardSpec()),
      tx,
      lambda _: 1.0,
      grad_accum_steps=2,
      state_shardings=shardings,
    )
    state, (metrics, _) = step(state, batch)
    after = flat_params(state["params"])
    return float(metrics["loss"].total), {k: after[k] - before[k] for k in after}

  loss, update = first_update(DROPPED)
  loss_again, update_again = first_update(DROPPED)
  plain_loss, plain_update = first_update(dataclasses.replace(DROPPED, dropout=0.0))
  _, other_seed = first_update(DROPPED, seed=1)
  # B = 0 at the first step: the forward pass is the base model's whatever is dropped, but B's
  # gradient, scale * (dropout(x) @ A)^T dL/dy, sees the mask.
  assert loss == loss_again == plain_loss
  for name in update:
    np.testing.assert_array_equal(update[name], update_again[name], err_msg=name)
  b = "layers.q_lora_b"
  assert np.abs(update[b]).max() > 0
  assert np.abs(update[b] - plain_update[b]).max() > 0.1 * np.abs(plain_update[b]).max()
  assert np.abs(update[b] - other_seed[b]).max() > 0.1 * np.abs(plain_update[b]).max()
