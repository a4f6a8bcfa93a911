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


def id_rows(seed=0):
  """q [2, 74, 4, 8], k and v [2, 74, 2, 8] and the ids of two rows of 74 tokens: two packed
  segments whose positions restart; a shared prompt with two branches, then 9 tokens of padding."""
  rng = np.random.default_rng(seed)
  s = 74
  real = np.ones((2, s), np.int32)
  real[1, 65:] = 0
  segment = np.ones((2, s), np.int32)
  segment[0, 31:] = 2
  segment[1, 65:] = 0
  branch = np.zeros((2, s), np.int32)
  branch[1, 30:52], branch[1, 52:65] = 1, 2
  positions = np.stack(
    [np.r_[np.arange(31), np.arange(43)], np.r_[np.arange(52), np.arange(30, 43), np.zeros(9)]]
  ).astype(np.int32)
  q = rng.standard_normal((2, s, 4, 8), np.float32)
  k, v = rng.standard_normal((2, 2, s, 2, 8), np.float32)
  return q, k, v, L.token_ids(real, positions, segment, branch)


# The loop form sums the same float32 terms as the dense path in other blocks and, through its
# online softmax, rescales partial sums by exp(peak differences): outputs, lse and gradients up to
# ~5, whose float32 spacing is ~5e-7, move by a step or two (measured <= 1e-6). A key seen or
# hidden wrongly, or a key block skipped, moves them by O(0.1).
LOOP_ATOL = 1e-5


@pytest.mark.parametrize("keys_in_row_order", [True, False])
def test_loop_form_id_mask_attention_equals_the_dense_mask(keys_in_row_order):
  """Queries 29..73 of each row against all 74 keys, in blocks of 8 queries and 16 keys (6 query
  blocks and 5 key blocks, both padded; the causal offset 29 cuts blocks), with a window of 7
  positions and soft-capping: the output, lse and q/k/v gradients of the dense mask's path. With
  the keys permuted (no offset) every block is computed."""
  q, k, v, ids = id_rows()
  first, window, scale, softcap = 29, jnp.int32(7), 0.4, 3.0
  dense = L.mask_from_ids(ids, ids, window)
  perm = np.arange(74) if keys_in_row_order else np.random.default_rng(1).permutation(74)
  keys = L.TokenIds(*(x[:, perm] for x in ids))
  mask = L.IdMask(
    L.TokenIds(*(x[:, first:] for x in ids)),
    keys,
    window,
    offset=first if keys_in_row_order else None,
    blocks=(8, 16),
  )

  want, want_vjp = jax.vjp(
    lambda q, k, v: L.dot_product_attention(q, k, v, dense, scale, softcap)[:, first:], q, k, v
  )
  got, got_vjp = jax.vjp(
    lambda q, k, v: L.dot_product_attention(q[:, first:], k[:, perm], v[:, perm], mask, scale, softcap),
    q,
    k,
    v,
  )
  sees = np.asarray(dense[:, first:].any(-1))  # a query that sees no key has an unused output
  assert not sees.all() and sees.sum() > 60
  np.testing.assert_allclose(np.asarray(got)[sees], np.asarray(want)[sees], rtol=0, atol=LOOP_ATOL)
  # lse rows are token-major, 2 query heads per key head
  want_lse = L.attention_forward(q, k, v, dense, scale, softcap)[1][:, :, first * 2 :]
  got_lse = L.attention_forward(q[:, first:], k[:, perm], v[:, perm], mask, scale, softcap)[1]
  assert np.isinf(got_lse).sum() == 2 * 2 * (~sees).sum()  # +inf exactly where a query sees no key
  np.testing.assert_allclose(got_lse, want_lse, rtol=0, atol=LOOP_ATOL)
  d_out = jnp.asarray(np.random.default_rng(2).standard_normal(want.shape), jnp.float32)
  for name, g, w in zip("qkv", got_vjp(d_out), want_vjp(d_out)):
    assert np.abs(w).max() > 1, name  # the gradients are not vanishingly small: the check has teeth
    np.testing.assert_allclose(g, w, rtol=0, atol=LOOP_ATOL, err_msg=name)


@pytest.mark.parametrize("rows", [2, 1])
@pytest.mark.parametrize("keys_in_row_order", [True, False])
def test_loop_form_never_multiplies_a_block_the_mask_hides(keys_in_row_order, rows):
  """Two rows (or the first alone) of two packed segments of 32 tokens (the second row's second is
  padding), blocks of 16: NaN in the first segment's q, k and v reaches none of the second segment's outputs or
  gradients, because no block that mixes the two is multiplied (a multiplied hidden block adds
  0 * NaN = NaN, as the dense path does). Those outputs and gradients equal the dense path's on
  the same rows with the NaNs replaced."""
  rng = np.random.default_rng(3)
  q = rng.standard_normal((2, 64, 4, 8)).astype(np.float32)
  k, v = rng.standard_normal((2, 2, 64, 2, 8)).astype(np.float32)
  segment = np.repeat([[1, 2], [1, 2]], 32, axis=1).astype(np.int32)
  real = np.ones((2, 64), np.int32)
  real[1, 32:] = 0
  q, k, v, segment, real = (x[:rows] for x in (q, k, v, segment, real))
  ids = L.token_ids(real, np.tile(np.arange(32), 2)[None].repeat(rows, 0), segment)
  first = segment == 1
  poisoned = [np.where(first[:, :, None, None], np.nan, x).astype(np.float32) for x in (q, k, v)]
  perm = np.arange(64)
  if (
    not keys_in_row_order
  ):  # key blocks in another order, keys shuffled within each: none skipped by causality
    shuffle = np.random.default_rng(1).permutation
    perm = np.concatenate([shuffle(np.arange(16 * i, 16 * i + 16)) for i in (2, 0, 3, 1)])
  keys = L.TokenIds(*(x[:, perm] for x in ids))
  mask = L.IdMask(ids, keys, offset=0 if keys_in_row_order else None, blocks=(16, 16))
  d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

  def run(mask, q, k, v, perm):
    out, vjp = jax.vjp(
      lambda q, k, v: L.dot_product_attention(q, k[:, perm], v[:, perm], mask, 0.5, None), q, k, v
    )
    return out, *vjp(d_out)

  got = run(mask, *map(jnp.asarray, poisoned), perm)
  want = run(L.mask_from_ids(ids, ids), *map(jnp.asarray, (q, k, v)), np.arange(64))
  second = ~first & (real > 0)
  # Padding sees no key, so all of its blocks are skipped: its output is 0, finite, as the keys and
  # values that a next layer makes of it must be (hidden there, but multiplied by 0 in a block).
  assert (np.asarray(got[0])[real == 0] == 0).all()
  for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
    assert np.isnan(np.asarray(g)[first]).any(), name  # the poison is there
    np.testing.assert_allclose(
      np.asarray(g)[second], np.asarray(w)[second], rtol=0, atol=LOOP_ATOL, err_msg=name
    )


def test_loop_form_compiles_one_block_body_whatever_the_length():
  """The IdMask path's forward and backward hold the same products at 64 and 256 tokens (its
  loops' bodies), where the dense mask's unrolled blocks grow with the length."""

  def products(mask_of, t):
    q = jax.ShapeDtypeStruct((1, t, 4, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, 2, 8), jnp.float32)

    def step(q, k, v):
      ids = L.token_ids(jnp.ones((1, t)), jnp.arange(t)[None])
      out, vjp = jax.vjp(lambda q, k, v: L.dot_product_attention(q, k, v, mask_of(ids), 0.3, None), q, k, v)
      return vjp(out)

    return jax.jit(step).lower(q, kv, kv).as_text().count("dot_general")

  id_mask = lambda ids: L.IdMask(ids, ids, offset=0, blocks=(16, 16))
  dense = lambda ids: L.mask_from_ids(ids, ids)
  assert products(id_mask, 64) == products(id_mask, 256) == 7  # 2 forward, 5 backward
  assert products(dense, 256) > products(dense, 64)
