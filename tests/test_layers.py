"""Building blocks of jaxrm.models.layers not covered by the model parity tests on their own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrm.models import layers as L


def silu_grads_f64(g, u, d):
  """Hand derivative of silu(g) * u in float64: d/dg = d u s (1 + g (1 - s)), d/du = d g s."""
  s = 1 / (1 + np.exp(-g))
  return d * u * s * (1 + g * (1 - s)), d * g * s


@pytest.mark.parametrize("name", ["silu", "gelu_pytorch_tanh"])
def test_gated_mlp_keeps_values_and_gradients(name):
  act = L.activation(name)
  rng = np.random.default_rng(0)
  g, u, d = (rng.normal(scale=3.0, size=(64, 48)).astype(np.float32) for _ in range(3))
  plain = lambda g, u: act(g) * u
  out, vjp = jax.vjp(lambda g, u: L.gated(act, g, u), g, u)
  ref_out, ref_vjp = jax.vjp(plain, g, u)
  np.testing.assert_array_equal(out, ref_out)  # the same operations forward
  # The backward multiplies the same factors in another order than autodiff of act(g) * u: float32
  # results a few ulps apart (values O(10), so 1e-5 absolute is ~10 ulps).
  for got, want in zip(vjp(jnp.asarray(d)), ref_vjp(jnp.asarray(d))):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
  if name == "silu":  # and against a float64 hand derivative (float32 rounding of O(10) values)
    for got, want in zip(vjp(jnp.asarray(d)), silu_grads_f64(g.astype(np.float64), u.astype(np.float64), d)):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_gated_mlp_keeps_only_its_inputs_for_the_backward():
  """A scan of gated MLP layers stacks what each layer keeps for the backward pass: gate and up
  only, not the activation's intermediates too, so the gradient's temporary memory is smaller."""
  act = L.activation("silu")

  def temp_bytes(hidden):
    def loss(w, x):
      layer = lambda x, w: (hidden(x @ w[0], x @ w[1]) @ w[2].T, None)
      return jnp.sum(jax.lax.scan(layer, x, w)[0] ** 2)
    w = jax.ShapeDtypeStruct((4, 3, 64, 256), jnp.float32)
    x = jax.ShapeDtypeStruct((512, 64), jnp.float32)
    return jax.jit(jax.grad(loss)).lower(w, x).compile().memory_analysis().temp_size_in_bytes

  kept, plain = temp_bytes(lambda g, u: L.gated(act, g, u)), temp_bytes(lambda g, u: act(g) * u)
  assert kept < plain, (kept, plain)
