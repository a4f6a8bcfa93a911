"""Layers written out one after another (scan_layers=False) compute what the scanned layers do."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import padded_tokens

from jaxrm.models.decoder import Decoder
from jaxrm.models.lora import LoraConfig
from jaxrm.scoring.reward_model import RewardModel

# The same float32 operations in the same order, compiled as one program either way; XLA may
# fuse them differently (a loop body against straight-line code), which moves rewards and
# gradients by a few float32 ulps (measured: <= 3e-7 relative); 1e-5 bounds that, while a
# layer skipped or applied twice moves them by far more than 1e-2.
RTOL = 1e-5


@pytest.mark.parametrize("remat", ["none", "elementwise", "full"])
def test_unrolled_layers_equal_the_scan(model_dir, remat):
  rm = RewardModel.from_pretrained(model_dir, lora=LoraConfig(rank=4, dropout=0.5, targets="all-linear"))
  cfg = dataclasses.replace(rm.config, remat=remat)
  ids, mask = padded_tokens(cfg.vocab_size)
  state = nnx.state(rm.model)
  key = jax.random.key(0)

  def loss_and_grads(scan: bool):
    model = nnx.merge(
      nnx.graphdef(Decoder(dataclasses.replace(cfg, scan_layers=scan), rngs=nnx.Rngs(0))), state
    )
    graphdef, params = nnx.split(model)

    def loss(p):
      r = nnx.merge(graphdef, p)(ids, mask, dropout_rng=key)
      return jnp.sum(r * jnp.arange(1, r.size + 1))

    return jax.jit(jax.value_and_grad(loss))(params)

  (want, want_g), (got, got_g) = loss_and_grads(True), loss_and_grads(False)
  np.testing.assert_allclose(got, want, rtol=RTOL)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * np.abs(w).max(), err_msg=str(path))
