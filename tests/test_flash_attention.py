"""The Pallas flash kernel against the reference einsum (``layers.dot_product_attention``).

On a CPU the kernels run in interpret mode: the same kernel code as on a GPU, lowered to XLA ops
instead of Triton. Checked: outputs and gradients on padded, packed and shared-prompt rows with
grouped-query heads, sliding windows and soft-capping, in float32 and bfloat16; that no token sees
another segment or branch; that padding stays finite and passes no gradient; the whole decoder on
each batch layout, and on a sharded mesh; and that the kernels lower to Triton for a GPU.
"""

import dataclasses
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_run
from flax import nnx
from helpers import REORDERED_ATOL, jitted, random_groups, right_padded, tiny_decoder_config, tiny_model

from jaxrm.data import packing
from jaxrm.data.pipeline import Collator
from jaxrm.models import flash_attention as F
from jaxrm.models import layers as L

T = 48  # three blocks of 16 (the defaults shrink to divide 48): softmax and skips cross blocks
ROWS = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
SCALE = 0.5

# float32 kernel against float32 einsum: the same softmax-weighted sums over up to 48 keys, taken
# block by block with running rescales instead of at once. Outputs and gradients are below ~10,
# where float32's spacing is ~1e-6; they agree to a few spacings (measured: <= 1.5e-6).
F32_ATOL = 1e-5


@dataclasses.dataclass
class Rows:
  """A batch's rows as attention sees them: each [B, T] int32; segment and branch ids are None
  for padded rows (one sequence per row)."""

  attention_mask: np.ndarray
  positions: np.ndarray
  segment_ids: np.ndarray | None = None
  branch_ids: np.ndarray | None = None

  def mask(self, window=None):
    """The reference's bool mask [B, T, T]."""
    return np.asarray(
      L.attention_mask(self.attention_mask, self.positions, self.segment_ids, window, self.branch_ids)
    )

  def sees_keys(self, window=None):
    """bool [B, T]: the real queries that see some key."""
    return self.mask(window).any(-1) & (self.attention_mask > 0)

  def layout(self):
    segments = self.attention_mask if self.segment_ids is None else self.segment_ids
    return F.layout(segments, self.branch_ids, self.positions)


def rows(kind, length=T, seed=0):
  """Four padded, packed or shared-prompt ("tree") rows of ``length`` tokens, the last all padding.
  The same shapes for every layout: one compilation of the kernel serves them all."""
  if kind == "padded":
    _, mask = right_padded([[1] * n for n in (length, 29, 5, 0)], 0, length)
    return Rows(mask, np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32))
  spec = packing.PackSpec(length, shared_prompt=kind == "tree")
  batch = packing.pack_preference(random_groups(np.random.default_rng(seed), 4, 3), spec, num_rows=ROWS)
  assert not batch.attention_mask[-1].any()
  return Rows(batch.attention_mask, batch.positions, batch.segment_ids, batch.branch_ids)


def qkv(r: Rows, dtype=jnp.float32, seed=1):
  rng = np.random.default_rng(seed)
  b, t = r.attention_mask.shape
  q = rng.standard_normal((b, t, HEADS, HEAD_DIM), np.float32)
  k, v = rng.standard_normal((2, b, t, KV_HEADS, HEAD_DIM), np.float32)
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


@functools.partial(jax.jit, static_argnames=("softcap", "blocks", "interpret"))
def fused(q, k, v, d_out, ids, window=None, softcap=None, blocks=F.BlockSizes(), interpret=True):
  """The kernel's outputs [B, T, H, Dh] and (dq, dk, dv) for the output cotangent ``d_out``
  (``interpret=False``: compiled by Triton, on a GPU)."""
  attend = lambda q, k, v: F.flash_attention(
    q, k, v, ids, window, scale=SCALE, softcap=softcap, interpret=interpret, blocks=blocks
  )
  out, vjp = jax.vjp(attend, q, k, v)
  return out, vjp(d_out)


@functools.partial(jax.jit, static_argnames=("softcap",))
def reference(q, k, v, d_out, mask, softcap=None):
  """The same from the reference einsum, with the bool mask [B, T, T]."""
  out, vjp = jax.vjp(lambda q, k, v: L.dot_product_attention(q, k, v, mask, SCALE, softcap), q, k, v)
  return out, vjp(d_out)


def as_numpy(out_and_grads):
  out, grads = out_and_grads
  return np.asarray(out, np.float32), [np.asarray(g, np.float32) for g in grads]


def cotangent(r: Rows, dtype=jnp.float32, seed=2):
  """Random output cotangents, 0 on the queries that see no key (padding, whose outputs are
  unused; the reference gives a padded row's padding the real keys before it)."""
  w = np.random.default_rng(seed).standard_normal((*r.attention_mask.shape, HEADS, HEAD_DIM))
  return jnp.asarray(w * r.sees_keys()[..., None, None], dtype)


def f32_atol(values):
  return F32_ATOL


def assert_matches(
  r,
  q,
  k,
  v,
  window=None,
  softcap=None,
  blocks=F.BlockSizes(),
  out_atol=f32_atol,
  grad_atol=f32_atol,
  interpret=True,
):
  """Kernel and reference outputs and gradients agree on the queries that see a key, to
  ``out_atol`` and ``grad_atol`` of the reference values; the kernel's outputs are finite
  everywhere and 0 where nothing is seen."""
  d_out = cotangent(r, q.dtype)
  traced_window = None if window is None else jnp.int32(window)
  got, got_grads = as_numpy(fused(q, k, v, d_out, r.layout(), traced_window, softcap, blocks, interpret))
  q32, k32, v32, d_out32 = (x.astype(jnp.float32) for x in (q, k, v, d_out))
  want, want_grads = as_numpy(reference(q32, k32, v32, d_out32, r.mask(window), softcap))
  seen = r.sees_keys(window)
  assert np.isfinite(got).all() and (got[~seen] == 0).all()
  np.testing.assert_allclose(got[seen], want[seen], atol=out_atol(want[seen]), rtol=0)
  for name, g, e in zip(("dq", "dk", "dv"), got_grads, want_grads):
    assert np.isfinite(g).all() and np.abs(e).max() > 0.1, name
    np.testing.assert_allclose(g, e, atol=grad_atol(e), rtol=0, err_msg=name)


LAYOUTS = ["padded", "packed", "tree"]


@pytest.mark.parametrize("kind", LAYOUTS)
def test_float32_equals_reference(kind):
  r = rows(kind)
  assert_matches(r, *qkv(r))


def bf16_out_atol(values):
  """The kernel rounds the attention weights to bfloat16 (relative 2**-9) before they weigh v,
  and then its output: two roundings, so 2**-8 of the largest value (measured: <= 1.3 * 2**-9)."""
  return 2.0**-8 * float(np.abs(values).max())


def bf16_grad_atol(values):
  """A gradient passes through three roundings to bfloat16: of the output, whose product with
  d_out is subtracted from every dS of its query (where the difference can cancel), of dS or the
  weights before a product, and of the result. 2**-6 of the largest value (measured: <= 3.95 *
  2**-9, on dq)."""
  return 2.0**-6 * float(np.abs(values).max())


@pytest.mark.parametrize("kind", LAYOUTS)
def test_bfloat16_equals_reference_on_the_same_inputs(kind):
  """bfloat16 q, k, v in the kernel; the reference computes in float32 from the same rounded
  values, so only the kernel's own roundings differ."""
  r = rows(kind)
  assert_matches(r, *qkv(r, jnp.bfloat16), out_atol=bf16_out_atol, grad_atol=bf16_grad_atol)


@pytest.mark.parametrize("window, softcap", [(5, None), (None, 2.0), (3, 2.0)])
def test_sliding_window_and_soft_capping(window, softcap):
  """On shared-prompt rows, where a branch's positions restart after its siblings', so that the
  window (by position) and causality (by index) disagree. The window is traced, as in the
  decoder's scan over sliding and full layers; a cap of 2 saturates tanh, so its slope matters."""
  r = rows("tree")
  assert_matches(r, *qkv(r), window=window, softcap=softcap)


def test_unequal_blocks_and_a_length_off_the_multiple():
  """Queries and keys in blocks of other sizes, forward and backward; and 40 tokens, which the
  kernel pads to 48 and cuts back."""
  r = rows("tree", length=64)
  assert_matches(r, *qkv(r), blocks=F.BlockSizes(q=32, k=16, q_dkv=16, k_dkv=32))
  short = rows("tree", length=40)
  assert short.layout().segment_ids.shape[1] == 48
  assert_matches(short, *qkv(short))


def test_padding_is_finite_and_passes_no_gradient():
  """A cotangent on every output, padding's too: queries that see no key (the padding of a row,
  a row of padding only) give zeros, and no gradient reaches them or the padding keys."""
  r = rows("padded")
  q, k, v = qkv(r)
  w = jnp.asarray(np.random.default_rng(3).standard_normal(q.shape), jnp.float32)
  out, (d_q, d_k, d_v) = as_numpy(fused(q, k, v, w, r.layout()))
  padding = r.attention_mask == 0
  assert padding[-1].all() and padding.sum() > T
  for x in (out, d_q, d_k, d_v):
    assert np.isfinite(x).all() and (x[padding] == 0).all()


@pytest.mark.parametrize("kind", ["packed", "tree"])
def test_no_token_sees_another_segment_or_branch(kind):
  """Keys of even segments and of odd branches carry values of 1e4; queries of odd segments in
  branch 0 or an even branch see none of them, and must equal the reference to F32_ATOL. A kernel
  that let a query see an earlier segment or a sibling branch would add ~1e4 times that key's
  weight: the reference with either rule dropped is shown to be that far off."""
  r = rows(kind, seed=4)
  q, k, v = qkv(r)
  seg, branch = r.segment_ids, r.branch_ids
  assert seg.max() >= 3 and (kind == "packed" or branch.max() >= 2)
  loud = (seg % 2 == 0) | (branch % 2 == 1)
  v = jnp.where(loud[:, :, None, None], 1e4, 1.0) * v
  quiet = r.sees_keys() & ~loud
  d_out = jnp.zeros(q.shape)
  forward = lambda fn, *args: np.asarray(fn(q, k, v, d_out, *args)[0])[quiet]
  want = forward(reference, r.mask())
  np.testing.assert_allclose(forward(fused, r.layout()), want, atol=F32_ATOL, rtol=0)
  leaks = {
    "segment": L.attention_mask(r.attention_mask, r.positions, None, None, branch),
    "branch": L.attention_mask(r.attention_mask, r.positions, seg, None, None),
  }
  if kind == "packed":
    del leaks["branch"]  # plain packing has no branches
  for rule, leaky_mask in leaks.items():
    off = np.abs(forward(reference, leaky_mask) - want).max()
    assert off > 1e3, f"dropping the {rule} rule moves the reference by only {off}"


def test_queries_past_the_keys_name_what_to_give():
  """Queries at an offset are a slice of the keys' row (context parallelism's runs; checked against
  the reference in tests/test_context_parallel.py), so they must end within the keys."""
  q, k = jnp.zeros((1, 16, HEADS, HEAD_DIM)), jnp.zeros((1, 16, KV_HEADS, HEAD_DIM))
  ids = F.layout(jnp.ones((1, 16), jnp.int32))
  with pytest.raises(ValueError, match=r"at offset 8, .*keys up to the last query"):
    F.flash_attention(q, k, k, ids, scale=SCALE, q_offset=8, interpret=True)


# ------------------------------------------------------------------ the whole decoder


def model_batches():
  """A padded, a packed and a shared-prompt preference batch of the same groups."""
  groups = random_groups(np.random.default_rng(5), 4, 3)
  padded = Collator(batch_size=4, buckets=(32,), num_completions=3)(groups)
  packed = {
    s: packing.pack_preference(groups, packing.PackSpec(64, shared_prompt=s), num_rows=3)
    for s in (False, True)
  }
  return {"padded": padded, "packed": packed[False], "tree": packed[True]}


@pytest.fixture(scope="module")
def batches():
  return model_batches()


@pytest.mark.parametrize("kind", LAYOUTS)
def test_decoder_with_the_kernel_equals_the_reference(batches, kind):
  """tiny_decoder_config's layers are one sliding (window 6) and one full: one traced window serves both."""
  batch = batches[kind]
  want = jitted(tiny_model(tiny_decoder_config(attention_impl="reference")))(batch)
  got = jitted(tiny_model(tiny_decoder_config(attention_impl="pallas")))(batch)
  real = batch.ranks >= 0
  assert np.ptp(np.asarray(want)[real]) > 0.1
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=REORDERED_ATOL, rtol=0)


def reward_grads(cfg, batch):
  """Gradients of the summed real rewards w.r.t. every parameter, flattened into one vector."""
  graphdef, state = nnx.split(tiny_model(cfg))
  real = jnp.asarray(batch.ranks >= 0, jnp.float32)
  loss = lambda s: jnp.sum(batch.outputs(nnx.merge(graphdef, s)) * real)
  return np.concatenate([np.ravel(g) for g in jax.tree.leaves(jax.jit(jax.grad(loss))(state))])


def test_decoder_gradients_with_the_kernel_equal_the_reference(batches):
  """Shared-prompt rows, Gemma-2 soft-capping, and rematerialised layers (the kernel's backward
  inside jax.checkpoint inside the layer scan)."""
  cfg = tiny_decoder_config(attn_logit_softcapping=3.0, remat="full")
  want = reward_grads(cfg.replace(attention_impl="reference"), batches["tree"])
  got = reward_grads(cfg.replace(attention_impl="pallas"), batches["tree"])
  # The float32 sums of two layers' backward passes, in other orders and summed over parameter
  # rows: the gradients reach ~18 (float32 spacing ~2e-6) and agree to ~1e-6 of the largest
  # (measured: 1.7e-5); 4e-6 of it leaves room for other seeds.
  np.testing.assert_allclose(got, want, atol=4e-6 * np.abs(want).max(), rtol=0)


def sharded_report():
  """(In a process with 4 CPU devices.) The decoder's rewards and gradients with the kernel on a
  mesh (fsdp 2, tensor 2: rows and heads split), against one device."""
  from jaxrm import sharding

  batch = packing.pack_preference(
    random_groups(np.random.default_rng(5), 4, 3), packing.PackSpec(64, shared_prompt=True), num_rows=4
  )
  graphdef, state = nnx.split(tiny_model(tiny_decoder_config(attention_impl="pallas")))
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=2, tensor=2))

  def loss(s, placement=None):
    forward = functools.partial(nnx.merge(graphdef, s), placement=placement)
    return jnp.sum(batch.outputs(forward) * (batch.ranks >= 0))

  def sharded_loss(s):
    return loss(s, sharding.Placement(mesh))

  one = jax.jit(jax.value_and_grad(loss))
  split = jax.jit(jax.value_and_grad(sharded_loss))
  (l1, g1), (l2, g2) = one(state), split(state)
  leaves = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
  return {
    "devices": jax.device_count(),
    "loss": [float(l1), float(l2)],
    "grad_max": float(np.abs(leaves(g1)).max()),
    "grad_diff": float(np.abs(leaves(g1) - leaves(g2)).max()),
    "per_shard": "manual_computation" in split.lower(state).as_text(),
  }


@pytest.mark.slow
def test_sharded_decoder_runs_the_kernel_per_shard():
  """A Pallas kernel is a custom call that XLA cannot split; the decoder maps it over each
  device's rows and heads. 4 fake CPU devices need a process of their own (see test_sharding)."""
  result = tiny_run.run([sys.executable, __file__, "sharded"])
  assert result.returncode == 0, tiny_run.describe(result)
  report = json.loads(result.stdout.split("SHARDED ", 1)[1].splitlines()[0])
  assert report["devices"] == 4 and report["per_shard"]
  # The same float32 sums split over devices and added in other orders: the loss (~7) to a few
  # float32 spacings; the gradients (up to ~20) differ by ~4e-6 of the largest (measured 8e-5),
  # as the reference einsum's do on this mesh.
  np.testing.assert_allclose(*report["loss"], atol=1e-5, rtol=0)
  assert report["grad_diff"] <= 1e-5 * report["grad_max"]


# ------------------------------------------------------------------ lowering for a GPU


@pytest.mark.parametrize(
  "heads, kv_heads, head_dim, dtype",
  [
    (14, 2, 64, jnp.bfloat16),  # Qwen2.5-0.5B: 7 query heads per key head
    (8, 4, 256, jnp.bfloat16),  # Gemma 2 2B
    (4, 2, 8, jnp.float32),  # the tiny test model: head dim padded to 16
  ],
)
def test_kernels_lower_to_triton(heads, kv_heads, head_dim, dtype):
  """Forward, dq and dk/dv kernels lower through Pallas' Triton path for CUDA, on any machine (the
  GPU compiles the Triton IR itself): tile shapes, loads and loops are ones Triton accepts."""
  b, t = 2, 200  # padded to 208: blocks of 16
  q = jax.ShapeDtypeStruct((b, t, heads, head_dim), dtype)
  k = jax.ShapeDtypeStruct((b, t, kv_heads, head_dim), dtype)
  row = jax.ShapeDtypeStruct((b, t), jnp.int32)

  def loss(q, k, v, segment_ids, branch_ids, positions, window):
    ids = F.layout(segment_ids, branch_ids, positions)
    out = F.flash_attention(q, k, v, ids, window, scale=0.1, softcap=50.0)
    return jnp.sum(out.astype(jnp.float32))

  triton = "__gpu$xla.gpu.triton"
  exported = jax.export.export(
    jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))),
    platforms=["cuda"],
    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)],
  )(q, k, k, row, row, row, jax.ShapeDtypeStruct((), jnp.int32))
  text = exported.mlir_module()
  assert text.count(triton) == 3
  assert all(f"jaxrm_flash_{name}" in text for name in ("forward", "dq", "dkv"))


if __name__ == "__main__" and sys.argv[1:] == ["sharded"]:
  jax.config.update("jax_num_cpu_devices", 4)
  print("SHARDED " + json.dumps(sharded_report()))


# ------------------------------------------------------------------ on a GPU (pytest -m gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", LAYOUTS)
def test_triton_kernel_in_bfloat16_equals_reference(kind):
  """The kernel as Triton compiles it, on the three packing modes, with the bounds of the
  interpret-mode bfloat16 test (its roundings are the same operations)."""
  r = rows(kind)
  assert_matches(r, *qkv(r, jnp.bfloat16), out_atol=bf16_out_atol, grad_atol=bf16_grad_atol, interpret=False)


@pytest.mark.gpu
def test_bf16_training_step_with_the_kernel_is_as_close_to_float32_as_the_reference(batches):
  """One bfloat16 Bradley-Terry step on shared-prompt rows. Two bfloat16 computations of a
  gradient differ by several per cent of its largest element (each rounds every activation to 8
  bits), so the kernel is held to the reference attention's own accuracy: its loss and gradient
  in bfloat16 are no further from the float32 step's than twice the reference path's in bfloat16
  (on CPU, in interpret mode: 0.95x and 0.90x)."""
  from jaxrm.tasks import losses

  def loss_and_grads(cfg):
    batch = batches["tree"]
    graphdef, state = nnx.split(tiny_model(cfg))

    def loss(s):
      rewards = batch.outputs(nnx.merge(graphdef, s))
      return losses.bradley_terry_loss(rewards, batch.ranks, batch.example_mask, batch.margin)[0]

    value, grads = jax.jit(jax.value_and_grad(loss))(state)
    return float(value), np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])

  exact_loss, exact = loss_and_grads(tiny_decoder_config(attention_impl="reference"))
  bf16 = tiny_decoder_config(dtype="bfloat16", param_dtype="float32")
  ref_loss, ref = loss_and_grads(bf16.replace(attention_impl="reference"))
  got_loss, got = loss_and_grads(bf16.replace(attention_impl="pallas"))
  assert abs(got_loss - exact_loss) <= 2 * abs(ref_loss - exact_loss) + 1e-6
  assert np.abs(got - exact).max() <= 2 * np.abs(ref - exact).max()
