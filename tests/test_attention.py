"""The attention routes: the reference einsum, ``jax.nn.dot_product_attention`` (cuDNN on GPUs) and
the Pallas flash kernel (tests/test_flash_attention.py checks its arithmetic).

Which route a config takes is asserted for every backend on any machine; cuDNN's kernel itself only
runs where there is a GPU (``@pytest.mark.gpu``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REORDERED_ATOL, jitted, pref, random_groups, tiny_decoder_config, tiny_model

from jaxrm.data import packing
from jaxrm.errors import ConfigError
from jaxrm.models import decoder
from jaxrm.models import layers as L
from jaxrm.models.decoder import attention_fn, attention_route, attention_summary
from jaxrm.models.flash_attention import flash_attention


def tree_mask():
  """Two rows: a shared prompt with two branches beside a plain sequence, and padding."""
  segment = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 0, 0], [1, 1, 1, 1, 2, 2, 2, 2, 2, 2]])
  branch = np.array([[0, 0, 1, 1, 2, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1, 1, 2, 2, 2]])
  positions = np.array([[0, 1, 2, 3, 2, 0, 1, 2, 0, 0], [0, 1, 2, 3, 0, 1, 2, 1, 2, 3]])
  real = (segment > 0).astype(np.int32)
  return L.attention_mask(real, positions, segment, branch_ids_bt=branch)


def test_tree_mask_hides_sibling_branches():
  # Row 0's branch 2 token sees the prompt and itself, not branch 1: exactly 3 keys.
  np.testing.assert_array_equal(np.asarray(tree_mask())[0, 4], [1, 1, 0, 0, 1, 0, 0, 0, 0, 0])


def long_rows(seed=0):
  """q [B, T, 4, 8], k and v [B, T, 2, 8], and the mask of shared-prompt rows of T = 300 tokens:
  longer than two query blocks, with padding at the end of the rows."""
  rng = np.random.default_rng(seed)
  groups = []
  for _ in range(5):
    prompt = list(rng.integers(3, 100, rng.integers(20, 80)))
    groups.append(pref(*(prompt + list(rng.integers(3, 100, rng.integers(5, 50))) for _ in range(3))))
  batch = packing.pack_preference(groups, packing.PackSpec(300, shared_prompt=True))
  b = batch.input_ids.shape[0]
  mask = L.attention_mask(
    batch.attention_mask, batch.positions, batch.segment_ids, branch_ids_bt=batch.branch_ids
  )
  assert 2 * L.CHUNK < 300 and not batch.attention_mask.all()
  q = rng.standard_normal((b, 300, 4, 8), np.float32)
  k, v = rng.standard_normal((2, b, 300, 2, 8), np.float32)
  return q, k, v, mask


def test_fused_xla_call_matches_einsum_with_gqa_and_a_tree_mask():
  q, k, v, mask = long_rows()
  einsum = L.dot_product_attention(q, k, v, mask, scale=0.3, softcap=None)
  fused = L.fused_attention(q, k, v, mask, scale=0.3, implementation="xla")
  assert np.isfinite(einsum).all() and np.isfinite(fused).all()  # padding queries too
  attends = np.asarray(mask).any(-1)
  # One float32 softmax-weighted mean of v (|v| < 5) computed two ways: a few float32 spacings
  # (2.4e-7 at 2-4) apart.
  np.testing.assert_allclose(np.asarray(fused)[attends], np.asarray(einsum)[attends], atol=1e-6, rtol=0)


def reference_attention(q, k, v, mask, scale, softcap):
  """Plain attention, differentiated by JAX: what the hand-written backward pass must equal."""
  b, t, h, d = q.shape
  q = q.reshape(b, t, k.shape[2], h // k.shape[2], d)
  logits = jnp.einsum("btkgd,bskd->bkgts", q, k) * scale
  if softcap is not None:
    logits = jnp.tanh(logits / softcap) * softcap
  probs = jax.nn.softmax(jnp.where(mask[:, None, None], logits, L.NEG_INF), axis=-1)
  return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, d)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_attention_gradients_equal_autodiff(softcap):
  q, k, v, mask = long_rows(1)
  # A loss that weighs every output of a query that sees a key (padding's outputs are unused).
  w = np.random.default_rng(2).standard_normal(q.shape).astype(np.float32)
  w *= np.asarray(mask).any(-1)[..., None, None]

  def loss(fn):
    return lambda q, k, v: jnp.sum(fn(q, k, v, mask, 0.3, softcap) * w)

  got = jax.grad(loss(L.dot_product_attention), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss(reference_attention), argnums=(0, 1, 2))(q, k, v)
  # float32 sums over up to 300 keys (and over the query blocks, for dk and dv) in other orders;
  # the gradients reach ~6, where float32's spacing is 4.8e-7.
  for g, e in zip(got, want):
    assert np.abs(e).max() > 0.1
    np.testing.assert_allclose(g, e, atol=1e-5, rtol=0)


def test_backward_keeps_no_weights_and_ignores_queries_that_see_no_key():
  q, k, v, mask = long_rows(3)
  sees_nothing = ~np.asarray(mask).any(-1)  # the padding queries
  assert sees_nothing.any()
  out, vjp = jax.vjp(lambda q, k, v: L.dot_product_attention(q, k, v, mask, 0.3, None), q, k, v)
  # What is kept for the backward pass: q, k, v, the output and a log-sum-exp per query (and the
  # mask, an input), never the [B, H, T, S] weights.
  floats = [x for x in jax.tree.leaves(vjp) if jnp.issubdtype(x.dtype, jnp.floating)]
  assert max(x.size for x in floats) == q.size and sum(x.size for x in floats) < 4 * q.size
  assert np.isfinite(out).all()
  # A query that sees no key has no weights to differentiate: whatever reaches its output moves
  # nothing, exactly (plain autodiff would spread it over the hidden keys).
  d_out = np.random.default_rng(4).standard_normal(q.shape).astype(np.float32)
  d_out *= sees_nothing[..., None, None]
  for g in vjp(jnp.asarray(d_out)):
    np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize("backend, fused", [("gpu", "cudnn"), ("cpu", "xla"), ("tpu", "xla")])
def test_attention_route_per_config(backend, fused):
  for dtype in ("bfloat16", "float16"):
    route = attention_fn(tiny_decoder_config(attention_impl="cudnn", dtype=dtype), backend)
    assert route.func is L.fused_attention
    assert route.keywords["implementation"] == fused
  for dtype in ("float32", "bfloat16"):
    assert (
      attention_fn(tiny_decoder_config(attention_impl="reference", dtype=dtype), backend).func
      is L.dot_product_attention
    )
    # jax.nn.dot_product_attention has no soft-capping: Gemma 2 keeps the einsum path.
    capped = attention_fn(
      tiny_decoder_config(attention_impl="cudnn", dtype=dtype, attn_logit_softcapping=50.0), backend
    )
    assert capped.func is L.dot_product_attention and capped.keywords["softcap"] == 50.0


@pytest.mark.parametrize("backend", ["gpu", "cpu", "tpu"])
def test_auto_takes_the_pallas_kernel_on_a_gpu_only(backend):
  for softcap in (None, 50.0):  # the kernel soft-caps: Gemma 2 takes it too
    cfg = tiny_decoder_config(dtype="bfloat16", attn_logit_softcapping=softcap)
    route = attention_fn(cfg, backend)
    if backend == "gpu":
      assert attention_route(cfg, backend) == "pallas"
      assert route.func is flash_attention and route.keywords["softcap"] == softcap
      assert not route.keywords["interpret"]
    else:
      assert attention_route(cfg, backend) == "reference" and route.func is L.dot_product_attention


@pytest.mark.parametrize("backend", ["gpu", "cpu"])
def test_pallas_setting_interprets_the_kernel_off_a_gpu(backend):
  route = attention_fn(tiny_decoder_config(attention_impl="pallas"), backend)
  assert route.func is flash_attention and route.keywords["interpret"] == (backend != "gpu")
  assert route.keywords["scale"] == tiny_decoder_config().attn_scale


def test_attention_route_on_this_machine():
  route = attention_fn(tiny_decoder_config(attention_impl="cudnn", dtype="bfloat16"))
  assert route.func is L.fused_attention
  assert route.keywords["implementation"] == ("cudnn" if jax.default_backend() == "gpu" else "xla")


@pytest.mark.parametrize("backend", ["gpu", "cpu"])
def test_float32_never_takes_cudnn(backend):
  route = attention_fn(tiny_decoder_config(attention_impl="cudnn", dtype="float32"), backend)
  assert route.func is L.fused_attention and route.keywords["implementation"] == "xla"


def test_attention_summary_names_the_route_and_its_features():
  gemma = tiny_decoder_config(attn_logit_softcapping=50.0)  # and tiny_decoder_config's window on layer 0 of 2
  assert attention_summary(gemma, "gpu") == (
    "attention: pallas flash kernel on all 2 layers; sliding window of 6 positions on 1 of them; "
    "logit soft-capping at 50"
  )
  assert attention_summary(gemma.replace(attention_impl="pallas"), "cpu").startswith(
    "attention: pallas flash kernel in interpret mode (no GPU; slow) on all 2 layers"
  )
  assert attention_summary(gemma.replace(attention_impl="cudnn"), "gpu").startswith(
    "attention: reference einsum (cudnn has no logit soft-capping) on all 2 layers"
  )
  plain = tiny_decoder_config(sliding_window=None, layer_types=())
  assert attention_summary(plain, "cpu") == (
    "attention: reference einsum (auto: the pallas kernel needs a GPU; these devices are cpu) on all 2 layers"
  )
  assert attention_summary(plain.replace(attention_impl="cudnn", dtype="bfloat16"), "gpu") == (
    "attention: cuDNN (jax.nn.dot_product_attention) on all 2 layers"
  )


def long_packed_batch(rng, length):
  """Shared-prompt rows of ``length`` tokens holding groups of 60-270 tokens (segments, branches,
  padding at the rows' ends)."""
  groups = []
  for _ in range(14):
    prompt = list(rng.integers(3, 100, rng.integers(20, 120)))
    groups.append(pref(*(prompt + list(rng.integers(3, 100, rng.integers(10, 50))) for _ in range(3))))
  return packing.pack_preference(groups, packing.PackSpec(length, shared_prompt=True))


def rewards_and_grads(model, batch):
  """The rewards and the parameter gradients of a fixed weighted sum of the real ones, and whether
  the compiled program branches (the block loops' skips)."""
  from flax import nnx

  graphdef, state = nnx.split(model)
  real = np.asarray(batch.ranks) >= 0
  w = jnp.asarray(np.random.default_rng(7).standard_normal(real.shape) * real, jnp.float32)

  def weighted(s):
    out = batch.outputs(nnx.merge(graphdef, s))
    return jnp.sum(out * w), out

  step = jax.jit(jax.grad(weighted, has_aux=True)).lower(state).compile()
  grads, out = step(state)
  return (
    np.asarray(out)[real],
    np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)]),
    "conditional" in step.as_text(),
  )


def test_long_rows_on_a_cpu_take_the_block_loops_and_equal_the_dense_mask(monkeypatch):
  """Rows of LOOP_MIN_TOKENS tokens or more take the block loops on a CPU (blocks of 256: padding,
  other segments' and sibling branches' blocks skipped), with the window on one layer of two: the
  rewards and parameter gradients of the dense mask's chunks, up to float32 sums taken in other
  blocks (the gradients ~10-40, float32 spacing ~4e-6: a key seen or hidden wrongly, or a block
  skipped that holds a visible key, moves them by O(1))."""
  batch = long_packed_batch(np.random.default_rng(4), decoder.LOOP_MIN_TOKENS)
  assert batch.input_ids.shape[0] >= 2 and not np.asarray(batch.attention_mask).all()
  model = tiny_model(tiny_decoder_config(attention_impl="reference"))
  got, got_grads, looped = rewards_and_grads(model, batch)
  monkeypatch.setattr(decoder, "LOOP_MIN_TOKENS", decoder.LOOP_MIN_TOKENS + 1)
  want, want_grads, dense_looped = rewards_and_grads(model, batch)
  assert looped and not dense_looped
  assert np.ptp(want) > 0.1 and np.abs(want_grads).max() > 1
  np.testing.assert_allclose(got, want, rtol=0, atol=REORDERED_ATOL * np.abs(want).max())
  np.testing.assert_allclose(got_grads, want_grads, rtol=0, atol=2e-5 * np.abs(want_grads).max())


def test_cudnn_setting_equals_xla_setting_on_packed_rows():
  """In float32 the cudnn setting takes ``jax.nn.dot_product_attention``'s XLA lowering on every
  backend (test_float32_never_takes_cudnn): this checks that call's mask and head layout inside the
  model, on any machine. cuDNN's kernel itself is test_cudnn_kernel_matches_einsum."""
  groups = random_groups(np.random.default_rng(5), 3, 3)
  batch = packing.pack_preference(groups, packing.PackSpec(64, shared_prompt=True))
  xla = jitted(tiny_model(tiny_decoder_config(attention_impl="reference")))(batch)
  fused = jitted(tiny_model(tiny_decoder_config(attention_impl="cudnn")))(batch)
  real = batch.ranks >= 0
  np.testing.assert_allclose(np.asarray(fused)[real], np.asarray(xla)[real], atol=REORDERED_ATOL, rtol=0)


@pytest.mark.gpu
def test_cudnn_kernel_matches_einsum():
  """cuDNN's fused kernel in bfloat16, with GQA and a tree mask, against the float32 einsum on the
  same bfloat16-rounded inputs."""
  q, k, v, mask = long_rows(3)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  fused = L.fused_attention(q, k, v, mask, scale=0.3, implementation="cudnn")
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
  einsum = L.dot_product_attention(q32, k32, v32, mask, scale=0.3, softcap=None)
  attends = np.asarray(mask).any(-1)
  # cuDNN rounds the softmax weights to bfloat16 before they weigh v, and then its output: each a
  # relative 2**-9, so the output is off by at most about 2**-8 of max |v|.
  np.testing.assert_allclose(
    np.asarray(fused, np.float32)[attends],
    np.asarray(einsum)[attends],
    atol=2.0**-8 * float(np.abs(v32).max()),
    rtol=0,
  )


def test_unknown_attention_impl_is_an_error():
  with pytest.raises(ConfigError, match=r"attention_impl='flash'; use one of auto, reference, pallas, cudnn"):
    tiny_decoder_config(attention_impl="flash")


def test_reward_positions_need_a_sequence_head():
  model = tiny_model(tiny_decoder_config(head="token", num_labels=2))
  ids = np.ones((1, 4), np.int32)
  with pytest.raises(ValueError, match="reward_positions needs a sequence head"):
    model(ids, ids, reward_positions=np.zeros((1, 1), np.int32))
