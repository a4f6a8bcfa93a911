"""Context parallelism (``mesh.context``): each row's tokens split over devices, equal to one device.

Checked on fake CPU devices, against the same model and batches without a mesh: rewards, logits
and parameter gradients on padded, packed and shared-prompt rows, a token head, grouped-query
heads, a sliding window that crosses shard boundaries and soft-capping, with zigzag balance on and
off, alone and with fsdp and tensor (2x2x2 on 8 devices); three training steps; that no token
sees a key it must not (other segment, sibling branch, outside the window, later, padding); the
attention's Pallas route (interpret mode) against its reference route and the one-device kernel;
the errors; and a run of ``python -m jaxrm.train`` with ``mesh.context=2`` that learns what one
device learns.

JAX fixes the CPU device count when its backend starts, and this process starts it with one device
(see tests/test_sharding.py): the sharded computations run in one subprocess, which reports its
numbers, and the tests below read them.
"""

import contextlib
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_run
from flax import nnx
from helpers import REORDERED_ATOL, random_groups, stepwise, tiny_decoder_config, tiny_model

from jaxrm import sharding
from jaxrm.config import RunConfig
from jaxrm.data import packing
from jaxrm.data.pipeline import Collator
from jaxrm.errors import ConfigError
from jaxrm.models import context_parallel as CP
from jaxrm.models import flash_attention as F
from jaxrm.models import layers as L

DEVICES = 8

# Parameter gradients, on one device and sharded, against the same gradients with every operation
# in float64 (in_float64), relative to the largest (~9-38). Each is a float32 sum over the batch's
# 128-256 tokens of products through two layers, whose roundings the sharded path adds in other
# orders (dK/dV reduce-scattered over the context axis, parameter gradients summed over tokens
# split across devices); one float32 sum of 256 terms may be off by 256 * 2^-24 = 1.5e-5 of its
# terms' magnitudes. Measured, both paths over the six cases: <= 6.6e-6 at the tests' XLA flags,
# <= 7.6e-6 at XLA's defaults (so the two paths may differ by more than either's error: 7.8e-6 at
# the defaults). A mask or ordering bug moves them by 0.66-1.5 of the largest (measured: a window
# one position wider in the sharded runs' masks, the gathered keys left in stored order, the Pallas
# runs' query offset one too far).
GRAD_RTOL = 2e-5
# Three SGD steps' losses (~0.7): the same sums in other orders, each step's update moving the
# weights by float32 roundings of ~1e-7; measured within 1e-6. A wrong gradient would move the
# second step's loss by far more than this.
STEP_LOSS_ATOL = 1e-5
# The Pallas route's attention outputs and dq, dk, dv (below ~10, float32 spacing ~1e-6) against
# the reference route's and the one-device kernel's: the same float32 softmax sums in other blocks,
# dK/dV summed per run, then over shards by the reduce-scatter, in other orders (measured: <= 1.1e-6).
# A mask or offset bug moves them by O(0.1) or more.
KERNEL_ATOL = 1e-5
# The leak test's outputs are float32 sums of values up to ~3 where no loud key is seen; float64
# reference. A leaked key of 1e4 moves an output by 1e4 times its weight (~1e-2 or more).
LEAK_ATOL = 1e-4

# name -> (batch layout, mesh, model overrides); every model has 4 query heads over 2 key heads
# and a window of 6 positions on its first layer (helpers.tiny_decoder_config).
CASES = {
  "padded_c2_zigzag": ("padded", dict(context=2), {}),
  "packed_c4_zigzag_softcap": ("packed", dict(context=4), dict(attn_logit_softcapping=3.0)),
  "tree_c2_fsdp2_tensor2": ("tree", dict(fsdp=2, tensor=2, context=2), {}),
  "tree_c4_none_softcap": ("tree", dict(context=4, context_balance="none"), dict(attn_logit_softcapping=3.0)),
  "token_head_c2_fsdp2_none_remat": (
    "stepwise",
    dict(fsdp=2, context=2, context_balance="none"),
    dict(head="token", num_labels=2, remat="full"),
  ),
  # The decoder's Pallas route (interpret mode here) against the same route on one device.
  "tree_c2_pallas": ("tree", dict(context=2), dict(attention_impl="pallas")),
}


# ------------------------------------------------------------------ batches and references


def batch_of(kind):
  """Rows of 32 (padded, stepwise) or 64 (packed) tokens: 2-4 zigzag chunks of 8 per shard."""
  rng = np.random.default_rng(5)
  if kind == "padded":
    return Collator(batch_size=4, buckets=(32,), num_completions=3)(random_groups(rng, 4, 3))
  if kind == "stepwise":
    seqs = []
    for n in (32, 19, 27, 9):
      labels = np.full(n, -100, np.int32)
      labels[rng.choice(n, 3, replace=False)] = rng.integers(0, 2, 3)
      seqs.append(stepwise(rng.integers(3, 128, n), labels))
    return Collator(batch_size=4, buckets=(32,))(seqs)
  return packing.pack_preference(
    random_groups(rng, 4, 3), packing.PackSpec(64, shared_prompt=kind == "tree"), num_rows=4
  )


def weights_of(batch, outputs):
  """Fixed random weights on the outputs a loss reads (real rewards, real tokens' logits)."""
  w = np.random.default_rng(7).standard_normal(outputs.shape).astype(np.float32)
  if outputs.ndim == 2:  # rewards [G, K]
    return w * (np.asarray(batch.ranks) >= 0)
  return w * np.asarray(batch.attention_mask)[..., None]


def outputs_and_grads(cfg, batch, placement=None):
  """The model's outputs, the gradient of a fixed weighted sum of them (flattened), and whether
  the compiled step all-gathers."""
  graphdef, state = nnx.split(tiny_model(cfg))

  def forward(s):
    return batch.outputs(functools.partial(nnx.merge(graphdef, s), placement=placement))

  w = jnp.asarray(weights_of(batch, np.zeros(jax.eval_shape(forward, state).shape)))
  weighted = lambda s: (lambda out: (jnp.sum(out * w), out))(forward(s))
  step = jax.jit(jax.grad(weighted, has_aux=True)).lower(state).compile()
  grads, out = step(state)
  grads = np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])
  return np.asarray(out), grads, "all-gather" in step.as_text()


@contextlib.contextmanager
def in_float64():
  """JAX's 64-bit types on, and ``jnp.float32`` read as float64 while a computation is traced: the
  decoder takes its norms, attention logits and heads in float32 by design, and this makes every
  one of its operations float64, for a reference of the same function."""
  float32 = jnp.float32
  with jax.enable_x64(True):
    jnp.float32 = jnp.float64
    try:
      yield
    finally:
      jnp.float32 = float32


def float64_grads(cfg, batch):
  """``outputs_and_grads``' gradients on one device, every operation in float64 (the float32
  weights widened, exactly), and the number of float32 values in the compiled program (0)."""
  _, state = nnx.split(tiny_model(cfg))
  with in_float64():
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: tiny_model(cfg.replace(dtype="float64"))))
    state = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), state)

    def forward(s):
      return batch.outputs(nnx.merge(graphdef, s))

    w = jnp.asarray(weights_of(batch, np.zeros(jax.eval_shape(forward, state).shape)), jnp.float64)
    step = jax.jit(jax.grad(lambda s: jnp.sum(forward(s) * w))).lower(state).compile()
    grads = np.concatenate([np.ravel(g) for g in jax.tree.leaves(step(state))])
  return grads, step.as_text().count("f32")


def placement_of(**sizes):
  """The placement of a mesh of ``sizes`` (and its ``context_balance``) on the first devices."""
  cfg = sharding.MeshConfig(**{"data": 1, "fsdp": 1, "tensor": 1, **sizes})
  n = cfg.data * cfg.fsdp * cfg.tensor * cfg.context
  return sharding.Placement.of(sharding.make_mesh(cfg, devices=jax.devices()[:n]), cfg)


def case_report(kind, mesh_sizes, overrides):
  batch = batch_of(kind)
  cfg = tiny_decoder_config(**{"attention_impl": "reference", **overrides})
  placement = placement_of(**mesh_sizes)
  want, want_grads, _ = outputs_and_grads(cfg, batch)
  got, got_grads, gathered = outputs_and_grads(cfg, batch, placement)
  read = weights_of(batch, want) != 0
  exact, float32_values = float64_grads(cfg.replace(attention_impl="reference"), batch)
  return {
    "one_device_error": float(np.abs(want_grads - exact).max()),
    "sharded_error": float(np.abs(got_grads - exact).max()),
    "float64_f32_values": float32_values,
    "spread": float(np.ptp(want[read])),
    "out_diff": float(np.abs(got - want)[read].max()),
    "grad_max": float(np.abs(want_grads).max()),
    "grad_diff": float(np.abs(got_grads - want_grads).max()),
    "all_gather": gathered,
    "summary": sharding_summary(cfg, placement),
  }


def sharding_summary(cfg, placement):
  from jaxrm.models.decoder import attention_summary

  return attention_summary(cfg.replace(attention_impl="auto"), "gpu", placement=placement)


def training_losses(mesh_sizes=None, steps_n=3):
  """Losses of three SGD steps of the token head on stepwise rows (one device without sizes)."""
  import optax

  from jaxrm.config import RewardSpec
  from jaxrm.data import pipeline
  from jaxrm.run import steps

  cfg = tiny_decoder_config(attention_impl="reference", head="token", num_labels=2)
  model = tiny_model(cfg)
  placement = placement_of(**(mesh_sizes or {}))
  mesh = placement.mesh
  tx = optax.sgd(0.01)
  params = nnx.state(model)
  params = jax.device_put(params, sharding.param_shardings(params, mesh))
  state, shardings = steps.init_state(params, tx, seed=0, mesh=mesh)
  train_step = steps.make_train_step(
    steps.make_loss_fn(model, RewardSpec("stepwise"), placement=placement),
    tx,
    lambda _: 0.01,
    state_shardings=shardings,
  )
  batch = pipeline.to_global_batch(batch_of("stepwise"), mesh)
  losses = []
  for _ in range(steps_n):
    state, (metrics, _) = train_step(state, batch)
    losses.append(float(metrics["loss"].total / metrics["loss"].count))
  return losses


# ------------------------------------------------------------------ the leak test


def tree_rows(length=64):
  """Shared-prompt rows of ``length`` tokens, the last all padding: segments, branches, padding."""
  batch = packing.pack_preference(
    random_groups(np.random.default_rng(4), 4, 3), packing.PackSpec(length, shared_prompt=True), num_rows=4
  )
  return batch.attention_mask, batch.positions, batch.segment_ids, batch.branch_ids


def numpy_mask(mask, positions, segments, branches, window, drop=()):
  """bool [B, T, T], written out independently of jaxrm; ``drop`` leaves rules out."""
  t = mask.shape[1]
  idx = np.arange(t)
  rules = {
    "later": np.broadcast_to(idx[:, None] >= idx[None, :], (len(mask), t, t)),
    "padding": np.broadcast_to(mask[:, None, :] > 0, (len(mask), t, t)),
    "segment": segments[:, :, None] == segments[:, None, :],
    "branch": (branches[:, None, :] == 0) | (branches[:, None, :] == branches[:, :, None]),
    "window": positions[:, :, None] - positions[:, None, :] < window,
  }
  return np.logical_and.reduce([r for name, r in rules.items() if name not in drop])


def numpy_attention(q, k, v, visible, scale):
  """float64 grouped-query attention [B, T, H, Dh] under the bool mask [B, T, S]."""
  g = q.shape[2] // k.shape[2]
  k, v = (np.repeat(np.asarray(x, np.float64), g, axis=2) for x in (k, v))
  logits = np.einsum("bthd,bshd->bhts", np.asarray(q, np.float64), k) * scale
  peak = np.where(visible[:, None], logits, -np.inf).max(-1, keepdims=True)
  weights = np.where(visible[:, None], np.exp(logits - np.where(np.isfinite(peak), peak, 0)), 0)
  weights = weights / np.maximum(weights.sum(-1, keepdims=True), 1e-300)  # 0 where nothing is seen
  return np.einsum("bhts,bshd->bthd", weights, v)


WINDOW = 5
SCALE = 0.5


def leak_sets(mask, positions, segments, branches):
  """rule -> (loud keys, queries that must see none of them) [B, T] bool: loud keys are
  other segments', sibling branches', padding, later tokens' and those outside the window."""
  real = mask > 0
  idx = np.broadcast_to(np.arange(mask.shape[1]), mask.shape)
  return {
    ("segment", "branch", "padding"): (
      (segments % 2 == 0) | (branches % 2 == 1) | ~real,
      real & (segments % 2 == 1) & (branches % 2 == 0),
    ),
    ("later",): (idx >= 37, real & (idx < 37)),  # 37: inside a shard's chunk, not at its edge
    ("window",): (positions < 4, real & (positions >= 4 + WINDOW - 1)),
  }


def stored_attention(rows, order, window, placement, softcap, **route):
  """``f(q, k, v)`` [B, T, H, D] -> [B, T, H, D]: the context-parallel attention over ``rows``
  (attention mask, positions, segment and branch ids [B, T]) and q, k, v stored in ``order`` (the
  shards' layout), its output put back in row order."""
  b, t = rows[0].shape
  stored = lambda x: jnp.take(jnp.asarray(x), order, axis=1)
  ids = L.token_ids(*map(stored, rows), index_bt=jnp.broadcast_to(jnp.asarray(order), (b, t)))

  def attend(q, k, v):
    out = CP.attention(
      stored(q),
      stored(k),
      stored(v),
      ids,
      order,
      window,
      placement=placement,
      scale=SCALE,
      softcap=softcap,
      **route,
    )
    return jnp.take(out, np.argsort(order), axis=1)

  return attend


def leak_report():
  """Under context 4 (zigzag), each rule's loud keys carry values of 1e4; the queries that must
  not see them give the float64 reference's outputs, and the reference with that rule dropped is
  shown to move by orders of magnitude."""
  mask, positions, segments, branches = tree_rows()
  rng = np.random.default_rng(1)
  b, t = mask.shape
  q = rng.standard_normal((b, t, 4, 8)).astype(np.float32)
  k, v = rng.standard_normal((2, b, t, 2, 8)).astype(np.float32)
  order = CP.storage_order(t, 4, "zigzag")
  rows = (mask, positions, segments, branches)
  sharded = jax.jit(stored_attention(rows, order, jnp.int32(WINDOW), placement_of(context=4), None))

  report = {}
  for rules, (loud, quiet) in leak_sets(mask, positions, segments, branches).items():
    v_loud = np.where(loud[:, :, None, None], 1e4, 1.0).astype(np.float32) * v
    visible = numpy_mask(mask, positions, segments, branches, WINDOW)
    quiet = quiet & visible.any(-1) & ~(visible & loud[:, None, :]).any(-1)
    want = numpy_attention(q, k, v_loud, visible, SCALE)[quiet]
    leaky = numpy_attention(
      q, k, v_loud, numpy_mask(mask, positions, segments, branches, WINDOW, rules), SCALE
    )[quiet]
    report["+".join(rules)] = {
      "queries": int(quiet.sum()),
      "diff": float(np.abs(np.asarray(sharded(q, k, v_loud))[quiet] - want).max()),
      "leak_moves": float(np.abs(leaky - want).max()),
    }
  return report


# ------------------------------------------------------------------ the Pallas route


# name -> (rows, mesh, window, softcap): the padded case's window of 6 crosses its shards
# (test_the_window_crosses_shard_boundaries); tree rows restart positions in each branch, so that
# the window (by position) and causality (by index) disagree.
KERNEL_CASES = {
  "padded_c2_zigzag_window": ("padded", dict(context=2), 6, None),
  "packed_c4_none_softcap": ("packed", dict(context=4, context_balance="none"), None, 3.0),
  "tree_c4_zigzag_window_softcap": ("tree", dict(context=4), 5, 2.0),
}


def rows_of(kind):
  """(attention mask, positions, segment ids, branch ids) [B, T] of 4 rows of ``batch_of(kind)``."""
  batch = batch_of(kind)
  mask = np.asarray(batch.attention_mask)[:4]
  if kind == "padded":
    zeros = np.zeros_like(mask)
    return mask, np.maximum(np.cumsum(mask, 1) - 1, 0), zeros, zeros
  return mask, *(np.asarray(x)[:4] for x in (batch.positions, batch.segment_ids, batch.branch_ids))


def kernel_report(kind, mesh_sizes, window, softcap):
  """The context-parallel attention's Pallas route (interpret mode) against its reference route
  and the one-device kernel: the largest differences of the outputs and of (dq, dk, dv) for a
  cotangent that is 0 on the queries that see no key (padding, which the reference gives the real
  keys before it; the kernel, none)."""
  mask, positions, segments, branches = rows_of(kind)
  b, t = mask.shape
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.standard_normal((b, t, 4, 8)), jnp.float32)
  k, v = jnp.asarray(rng.standard_normal((2, b, t, 2, 8)), jnp.float32)
  visible = numpy_mask(mask, positions, segments, branches, F.NO_WINDOW if window is None else window)
  seen = visible.any(-1) & (mask > 0)
  d_out = jnp.asarray(rng.standard_normal(q.shape) * seen[..., None, None], jnp.float32)
  placement = placement_of(**mesh_sizes)
  context = mesh_sizes["context"]
  order = CP.storage_order(t, context, mesh_sizes.get("context_balance", "zigzag"))
  traced_window = None if window is None else jnp.int32(window)
  split = lambda kernel: stored_attention(
    (mask, positions, segments, branches),
    order,
    traced_window,
    placement,
    softcap,
    kernel=kernel,
    interpret=True,
  )

  layout = F.layout_of(L.token_ids(mask, positions, segments, branches))
  one_device = lambda q, k, v: F.flash_attention(
    q, k, v, layout, traced_window, scale=SCALE, softcap=softcap, interpret=True
  )

  def out_and_grads(attend):
    def run(q, k, v, d_out):
      out, vjp = jax.vjp(attend, q, k, v)
      return out, *vjp(d_out)

    return dict(zip(("out", "dq", "dk", "dv"), map(np.asarray, jax.jit(run)(q, k, v, d_out))))

  got, want, one = (out_and_grads(f) for f in (split("pallas"), split("reference"), one_device))
  real = lambda x: {**x, "out": x["out"] * seen[..., None, None]}  # padding's outputs differ by design
  diff = lambda x, y: {n: float(np.abs(x[n] - y[n]).max()) for n in x}
  shard = np.empty(t, int)
  shard[order] = np.arange(t) // (t // context)
  return {
    "largest": {n: float(np.abs(x).max()) for n, x in real(want).items()},
    "vs_reference": diff(real(got), real(want)),
    "vs_one_device": diff(got, one),
    "window_crossings": int((visible & (shard[:, None] != shard[None, :])).sum()),
    "window_hides": int((numpy_mask(mask, positions, segments, branches, F.NO_WINDOW) & ~visible).sum()),
  }


# ------------------------------------------------------------------ the subprocess


def error_report():
  """What the decoder says of a row that does not split into the shards' chunks."""
  batch = Collator(batch_size=2, buckets=(30,), num_completions=2)(
    random_groups(np.random.default_rng(0), 2, 2)
  )
  model = tiny_model(tiny_decoder_config(attention_impl="reference"))
  try:
    batch.outputs(functools.partial(model, placement=placement_of(context=2)))
  except ValueError as e:
    return str(e)
  return "no error"


def window_crosses_shards():
  """(query, key) pairs of the windowed layer's mask whose tokens sit on different shards."""
  batch = batch_of("padded")
  visible = numpy_mask(
    batch.attention_mask,
    np.maximum(np.cumsum(batch.attention_mask, 1) - 1, 0),
    np.zeros_like(batch.attention_mask),
    np.zeros_like(batch.attention_mask),
    6,
  )
  shard = np.empty(32, int)
  shard[CP.storage_order(32, 2, "zigzag")] = np.arange(32) // 16
  return int((visible & (shard[:, None] != shard[None, :])).sum())


def report():
  out = {name: case_report(*case) for name, case in CASES.items()}
  out["training"] = {"one": training_losses(), "split": training_losses(dict(fsdp=2, context=2))}
  out["leaks"] = leak_report()
  out["kernel"] = {name: kernel_report(*case) for name, case in KERNEL_CASES.items()}
  out["error"] = error_report()
  out["window_crossings"] = window_crosses_shards()
  out["devices"] = jax.device_count()
  return out


if __name__ == "__main__" and sys.argv[1:] == ["report"]:
  jax.config.update("jax_num_cpu_devices", DEVICES)
  print("CONTEXT " + json.dumps(report()))


@pytest.fixture(scope="module")
def sharded(cache_root):
  result = tiny_run.run([sys.executable, __file__, "report"])
  assert result.returncode == 0, tiny_run.describe(result)
  return json.loads(result.stdout.split("CONTEXT ", 1)[1].splitlines()[0])


# ------------------------------------------------------------------ equal to one device


@pytest.mark.parametrize("name", list(CASES))
def test_outputs_and_gradients_equal_one_device(sharded, name):
  """Outputs equal one device's; gradients, sharded and on one device, equal the float64 ones
  within float32's error (so the two within twice that)."""
  r = sharded[name]
  assert sharded["devices"] == DEVICES and r["all_gather"]
  assert r["spread"] > 0.1  # the outputs differ between rows and tokens: the comparison has teeth
  np.testing.assert_allclose(r["out_diff"], 0, atol=REORDERED_ATOL)
  assert r["float64_f32_values"] == 0, r  # the reference holds no float32 value
  assert r["grad_max"] > 1 and r["sharded_error"] <= GRAD_RTOL * r["grad_max"], r
  assert r["one_device_error"] <= GRAD_RTOL * r["grad_max"], r
  assert r["grad_diff"] <= 2 * GRAD_RTOL * r["grad_max"], r


def test_the_window_crosses_shard_boundaries(sharded):
  """The padded case's windowed layer has visible (query, key) pairs on different shards."""
  assert sharded["window_crossings"] > 10


def test_three_training_steps_equal_one_device(sharded):
  one, split = sharded["training"]["one"], sharded["training"]["split"]
  assert len(one) == 3 and one[0] != one[2]
  np.testing.assert_allclose(split, one, atol=STEP_LOSS_ATOL, rtol=0)


def test_no_token_sees_a_key_it_must_not(sharded):
  for rules, r in sharded["leaks"].items():
    assert r["queries"] >= 10, rules
    assert r["diff"] <= LEAK_ATOL, rules
    assert r["leak_moves"] > 1e2, f"dropping {rules} moves the reference by only {r['leak_moves']}"


def test_the_summary_names_context_parallelism(sharded):
  assert sharded["tree_c2_fsdp2_tensor2"]["summary"] == (
    "attention: pallas flash kernel per shard on all "
    "2 layers; context parallel over 2 devices: all-gather K/V, zigzag; sliding window of 6 positions "
    "on 1 of them"
  )
  assert "context parallel over 4 devices: all-gather K/V, none" in sharded["tree_c4_none_softcap"]["summary"]


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_the_pallas_route_equals_the_reference_route_and_one_device(sharded, name):
  """Outputs and dq, dk, dv of the Pallas kernel over gathered keys, from each run's traced offset,
  equal the reference route's (real queries) and the one-device kernel's (every query)."""
  r = sharded["kernel"][name]
  for what, largest in r["largest"].items():
    assert largest > 0.1, (what, r)  # the comparison has teeth
    assert r["vs_reference"][what] <= KERNEL_ATOL, (what, r)
    assert r["vs_one_device"][what] <= KERNEL_ATOL, (what, r)
  if "window" in name:  # the window hides keys, some of them across a shard boundary
    assert r["window_hides"] > 10 and r["window_crossings"] > 10, r


def test_an_unknown_kernel_names_the_kernels():
  with pytest.raises(ValueError, match=r"kernel='cudnn'; use one of reference, pallas$"):
    CP.attention(
      *[jnp.zeros((1, 8, 2, 8))] * 3,
      None,
      np.arange(8),
      placement=placement_of(context=1),
      scale=1.0,
      softcap=None,
      kernel="cudnn",
    )


# ------------------------------------------------------------------ errors


def test_a_row_that_does_not_split_names_the_keys(sharded):
  assert sharded["error"] == (
    "mesh.context=2 with mesh.context_balance='zigzag' splits each row into 4 equal chunks, but a row "
    "has 30 tokens: set data.packed_row_length (packed rows) or data.bucket_multiple and "
    "data.max_length to a multiple of 4"
  )
  with pytest.raises(ValueError, match=r"into 3 equal chunks, but a row has 32 tokens"):
    CP.storage_order(32, 3, "none")


def test_zigzag_deals_chunks_i_and_2c_minus_1_minus_i():
  np.testing.assert_array_equal(CP.storage_order(8, 2, "zigzag"), [0, 1, 6, 7, 2, 3, 4, 5])
  np.testing.assert_array_equal(CP.storage_order(8, 2, "none"), np.arange(8))


def test_bad_balance_and_a_context_that_does_not_divide_the_devices():
  with pytest.raises(ValueError, match=r"^mesh.context_balance='ring': use one of zigzag, none"):
    sharding.MeshConfig(context_balance="ring")
  with pytest.raises(ValueError, match=r"^mesh.context=0: use a number of devices"):
    sharding.MeshConfig(context=0)
  with pytest.raises(ValueError, match=r"data=1 x fsdp=1 x context=2 x tensor=1 = 2 devices, but 1 are"):
    sharding.make_mesh(sharding.MeshConfig(1, 1, 1, context=2), devices=jax.devices()[:1])
  fake = [jax.devices()[0]] * 8  # make_mesh checks the count before it places anything
  with pytest.raises(ValueError, match=r"8 devices are not divisible by the fixed axes' product 3"):
    sharding.make_mesh(sharding.MeshConfig(1, -1, 1, context=3), devices=fake)


def test_config_rows_must_split_into_the_chunks():
  with pytest.raises(
    ConfigError,
    match=r"^data.bucket_multiple=6: mesh.context=2 with "
    r"mesh.context_balance='zigzag' splits each row into 4 chunks; "
    r"set data.bucket_multiple to a multiple of 4$",
  ):
    RunConfig.from_dict({"mesh": {"context": 2}, "data": {"bucket_multiple": 6}})
  with pytest.raises(ConfigError, match=r"^data.packed_row_length=100: .* into 8 chunks"):
    RunConfig.from_dict({"mesh": {"context": 4}, "data": {"packing": "packed", "packed_row_length": 100}})
  with pytest.raises(ConfigError, match=r"^data.max_length=90: .*'none' splits each row into 4 chunks"):
    RunConfig.from_dict(
      {"mesh": {"context": 4, "context_balance": "none"}, "data": {"max_length": 90, "bucket_multiple": 16}}
    )
  RunConfig.from_dict({"mesh": {"context": 4, "context_balance": "none"}, "data": {"bucket_multiple": 4}})


# ------------------------------------------------------------------ the command line


@pytest.mark.slow
def test_a_context_parallel_run_learns_the_hidden_task(model_dir, tmp_path):
  """``python -m jaxrm.train`` on 2 fake CPU devices with mesh.context=2: six epochs of the tiny
  run's 64 pairs rank them as the one-device run of tests/test_precision.py does (its criterion)."""
  from tiny_run import LEARN, LEARNED_ACCURACY, LEARNED_LOSS

  out = str(tmp_path / "context")
  flags = [f"--config.{k}={v}" for k, v in LEARN.items()] + [
    "--config.mesh.context=2",
    "--config.mesh.fsdp=1",
  ]
  result = tiny_run.run(
    tiny_run.cli(model_dir, out, *flags), timeout=600, XLA_FLAGS="--xla_force_host_platform_device_count=2"
  )
  assert result.returncode == 0, tiny_run.describe(result)
  assert "mesh: {'data': 1, 'fsdp': 1, 'context': 2, 'tensor': 1} on 2 cpu devices" in result.stdout
  assert "context parallel over 2 devices: all-gather K/V, zigzag" in result.stdout
  val = [r for r in tiny_run.read_metrics(out) if "validation-train_sample_accuracy" in r][-1]
  assert val["validation-train_sample_accuracy"] >= LEARNED_ACCURACY, val
  assert val["validation-train_sample_loss"] <= LEARNED_LOSS, val
