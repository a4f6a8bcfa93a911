"""bfloat16 compute over float32 master weights, and the remat policies.

bfloat16 (``model.dtype="bfloat16"``, ``model.param_dtype="float32"``): the model's matrix products
run in bfloat16 while parameters and Adam's moments stay float32, live and in checkpoints; a run
follows the float32 run's losses within bfloat16's rounding and learns what it learns.
``model.remat`` (none | full | dots): the same loss and gradient in a train step, in less
temporary memory.
"""

import os
import re

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import tiny_run
from flax import nnx
from tiny_run import LEARN, LEARNED_ACCURACY, LEARNED_LOSS

from jaxrm import sharding
from jaxrm.config import RewardSpec
from jaxrm.data import pipeline, registry
from jaxrm.data.drops import DropReport
from jaxrm.data.tokenize import TokenizeOptions, pad_id, tokenize_all
from jaxrm.run import optim, steps
from jaxrm.scoring.reward_model import RewardModel

# ------------------------------------------------------------------ tolerances

# bfloat16 keeps 8 significant bits: every activation rounded to it moves by up to 2^-8 (0.4%) of
# itself, and the rewards and the loss made from those activations inherit errors of that relative
# size (norms, attention logits, rewards and the loss are float32). Over the first epoch (8 steps)
# of the tiny run the bfloat16 loss is measured within 1.4e-3 of the float32 one, relatively (9e-4
# at a loss of 0.69), 2.9x inside 2^-8. Later the runs part: bfloat16's gradients differ from
# float32's by up to 20% of the largest element, Adam turns that into other steps, and by step 16
# the losses differ by tens of percent; from there on only what each run learns is compared.
BF16_LOSS_RTOL = 2**-8
# A float32 run repeats its losses to the bit (tests/test_train.py resumes exactly); computing in
# bfloat16 moves them by 1.7e-4 to 9.3e-4 in the first epoch. Less than this would mean the run never
# computed in bfloat16.
BF16_MIN_GAP = 1e-5


# A remat policy recomputes the forward pass with the same ops on the same values, so the loss is
# bit-equal here; 1e-6 leaves room for a few float32 roundings (the loss is ~0.7) where XLA fuses
# the recomputed forward otherwise.
REMAT_LOSS_RTOL = 1e-6
# The backward pass under remat fuses and orders its sums otherwise: every gradient element is a sum
# over the batch's 1536 token positions (or its 16 rows) whose terms cancel heavily, so elements
# differ by float32 roundings of the terms, measured up to 4.3e-6 of the largest element (8.5e-8 at
# 0.021) for both policies. As for other float32 reorderings in this suite
# (tests/test_packed_training.py), the bound is 1e-4 of the largest; a recomputation from other
# values (a residual lost or stale) moves elements by their own size.
REMAT_GRAD_RTOL = 1e-4

REMAT_POLICIES = ("none", "elementwise", "dots", "full")

# ------------------------------------------------------------------ one batch, one step


def single_device_mesh():
  return sharding.make_mesh(sharding.MeshConfig(1, 1, 1), devices=jax.devices()[:1])


def demo_batch(rm, mesh, groups=8, length=96):
  """The first global batch of ``groups`` demo pairs, in one length bucket: [2*groups, length]."""
  records = registry.load_records("demo_arithmetic", None, split="train", drops=DropReport())[:groups]
  examples = tokenize_all(records, rm.tokenizer, TokenizeOptions(max_length=length), DropReport())
  batches = pipeline.make_train_iterator(
    examples, batch_size=groups, seed=0, buckets=(length,), pad_id=pad_id(rm.tokenizer)
  )[0]
  return pipeline.to_global_batch(next(batches), mesh)


def keep_gradients() -> optax.GradientTransformation:
  """An optimizer that leaves the parameters alone and keeps the gradient it is given as its state."""
  zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
  return optax.GradientTransformation(zeros, lambda grads, _, params=None: (zeros(grads), grads))


def flat(tree):
  return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


def by_path(tree):
  """Leaves as numpy arrays, by path (``"['layers']['q'].value"``)."""
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def dot_generals(jaxpr):
  """(lhs, rhs, out) avals of every dot_general in ``jaxpr`` and in the jaxprs it calls (the layer
  scan's body, custom_vjp functions)."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.append(tuple(v.aval for v in (*eqn.invars, *eqn.outvars)))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jex.core.ClosedJaxpr):
          found += dot_generals(sub.jaxpr)
        elif isinstance(sub, jex.core.Jaxpr):
          found += dot_generals(sub)
  return found


def moments(opt_state):
  """Adam's first and second moments, each a tree shaped like the parameters."""
  return {name: optax.tree_utils.tree_get(opt_state, name) for name in ("mu", "nu")}


# ------------------------------------------------------------------ bfloat16: one step


def bf16_model(model_dir, tokenizer):
  return RewardModel.from_pretrained(model_dir, dtype="bfloat16", param_dtype="float32", tokenizer=tokenizer)


def test_bf16_model_multiplies_in_bf16(model_dir, tiny_rm):
  """The seven projections of a block (q, k, v, o, gate, up, down) take and give bfloat16, so the
  hidden states and the attention's inputs are bfloat16; the reward head stays float32."""
  mesh = single_device_mesh()
  batch = demo_batch(tiny_rm, mesh)
  tokens, hidden = batch.input_ids.size, tiny_rm.config.hidden_size
  rows = batch.input_ids.shape[0]
  for rm, dtype in ((tiny_rm, jnp.float32), (bf16_model(model_dir, tiny_rm.tokenizer), jnp.bfloat16)):
    graphdef, params = nnx.split(rm.model)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    h = jax.eval_shape(
      lambda p, graphdef=graphdef: nnx.merge(graphdef, p).hidden_states(
        batch.input_ids, batch.attention_mask
      ),
      params,
    )
    assert (h.shape, h.dtype) == ((rows, batch.input_ids.shape[1], hidden), dtype)
    loss_fn = steps.make_loss_fn(rm.model, RewardSpec())
    dots = dot_generals(jax.make_jaxpr(loss_fn)(params, batch).jaxpr)
    # Projections act on [B*T, features] activations (jaxrm.models.layers.linear).
    projections = [d for d in dots if d[0].ndim == 2 and d[0].shape[0] == tokens]
    assert len(projections) == 7, [(d[0].shape, d[1].shape) for d in dots]
    for lhs, rhs, out in projections:
      assert (lhs.dtype, rhs.dtype, out.dtype) == (dtype, dtype, dtype), (lhs.shape, rhs.shape)
    head = [d for d in dots if d[0].shape == (rows, hidden)]
    assert [tuple(a.dtype for a in d) for d in head] == [(jnp.float32,) * 3]


def test_bf16_train_step_keeps_float32_weights_and_moments(model_dir, tiny_rm):
  bf16_rm = bf16_model(model_dir, tiny_rm.tokenizer)  # its own: the step donates the parameters
  mesh = single_device_mesh()
  batch = demo_batch(bf16_rm, mesh)
  tx = optim.make_optimizer(optax.constant_schedule(1e-3), weight_decay=0.01)
  params = nnx.state(bf16_rm.model)
  before = by_path(params)
  state, shardings = steps.init_state(params, tx, seed=0, mesh=mesh)
  train_step = steps.make_train_step(
    steps.make_loss_fn(bf16_rm.model, RewardSpec(), placement=sharding.Placement(mesh)),
    tx,
    lambda _: 1e-3,
    state_shardings=shardings,
  )
  state, (metrics, extra) = train_step(state, batch)
  assert np.isfinite(float(metrics["loss"].total)) and np.isfinite(float(extra["grad_norm"]))
  float32 = {jnp.dtype(jnp.float32)}
  assert {x.dtype for x in jax.tree.leaves(state["params"])} == float32
  for name, tree in moments(state["opt_state"]).items():
    assert jax.tree.structure(tree) == jax.tree.structure(params), name
    assert {x.dtype for x in jax.tree.leaves(tree)} == float32, name
  # Adam's first step moves each weight by about the learning rate, 1e-3: less than half of
  # bfloat16's spacing near 1 (2^-8 below, 2^-7 above), where the norm scales sit. Measured: the
  # step moves 99% or more of each norm scale, and 14-29% of them would move kept in bfloat16.
  after = by_path(state["params"])
  norms = [k for k in before if "norm" in k]
  assert len(norms) == 3, list(before)  # input_norm, mlp_norm, final_norm
  for k in norms:
    moved = after[k] != before[k]
    moved_in_bf16 = after[k].astype(jnp.bfloat16) != before[k].astype(jnp.bfloat16)
    assert moved.mean() > 0.95 and moved_in_bf16[moved].mean() < 0.5, k


# ------------------------------------------------------------------ bfloat16: a run


EPOCH = 8  # steps


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
  """dtype -> (output directory, last validation metrics) of the tiny run computing in dtype."""
  done = {}
  for dtype in ("float32", "bfloat16"):
    out = str(tmp_path_factory.mktemp("precision") / dtype)
    c = tiny_run.set_keys(
      tiny_run.config(model_dir, out), {**LEARN, "model.dtype": dtype, "model.param_dtype": "float32"}
    )
    done[dtype] = out, tiny_run.train(c)
  return done


@pytest.mark.slow
def test_bf16_run_follows_float32_losses(runs):
  f32, bf16 = (tiny_run.train_losses(runs[d][0]) for d in ("float32", "bfloat16"))
  assert list(f32) == list(bf16) == list(range(1, LEARN["train.max_steps"] + 1))
  first_epoch = range(1, EPOCH + 1)
  want, got = (np.array([losses[s] for s in first_epoch]) for losses in (f32, bf16))
  np.testing.assert_allclose(got, want, rtol=BF16_LOSS_RTOL, atol=0)
  assert np.abs(got - want).max() > BF16_MIN_GAP
  assert all(np.isfinite(v) for v in bf16.values())


@pytest.mark.slow
def test_bf16_checkpoint_holds_float32_weights_and_moments(runs):
  last = os.path.join(runs["bfloat16"][0], "checkpoints", str(LEARN["train.max_steps"]))
  read = lambda item: jax.tree_util.tree_flatten_with_path(
    ocp.StandardCheckpointer().metadata(os.path.join(last, item)).item_metadata
  )[0]
  params = read("params")
  assert len(params) > 10 and {m.dtype for _, m in params} == {np.dtype(np.float32)}
  arrays = {jax.tree_util.keystr(path): m for path, m in read("opt_state")}
  for name in ("mu", "nu"):
    saved = [m for path, m in arrays.items() if f"['{name}']" in path]
    assert len(saved) == len(params), name
    assert {m.dtype for m in saved} == {np.dtype(np.float32)}, name


@pytest.mark.slow
def test_bf16_learns_what_float32_learns(runs):
  for dtype in ("float32", "bfloat16"):
    val = runs[dtype][1]
    assert val["validation-train_sample_accuracy"] >= LEARNED_ACCURACY, (dtype, val)
    assert val["validation-train_sample_loss"] <= LEARNED_LOSS, (dtype, val)


# ------------------------------------------------------------------ remat


@pytest.fixture(scope="module")
def remat_steps(model_dir, tiny_rm):
  """policy -> (mean loss, gradient of the mean loss as a flat vector, the compiled train step's
  temporary bytes) of one train step at the tiny model's weights, on one batch of 8 pairs; the step
  divides the summed gradient by the loss count, and keep_gradients keeps what it gives."""
  mesh = single_device_mesh()
  batch = demo_batch(tiny_rm, mesh)
  tx = keep_gradients()
  out = {}
  for policy in REMAT_POLICIES:
    rm = RewardModel.from_pretrained(model_dir, remat=policy, tokenizer=tiny_rm.tokenizer)
    assert rm.config.remat == policy
    state, shardings = steps.init_state(nnx.state(rm.model), tx, seed=0, mesh=mesh)
    train_step = steps.CompiledPerShape(
      "train",
      steps.make_train_step(
        steps.make_loss_fn(rm.model, RewardSpec(), placement=sharding.Placement(mesh)),
        tx,
        lambda _: 1.0,
        state_shardings=shardings,
      ),
    )
    compiled = train_step.compile(state, batch)
    state, (metrics, _) = compiled(state, batch)
    loss = float(metrics["loss"].total / metrics["loss"].count)
    products = len(re.findall(r"= \S+ dot\(", compiled.as_text()))  # each product the step computes
    out[policy] = loss, flat(state["opt_state"]), compiled.memory_analysis().temp_size_in_bytes, products
  return out


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["elementwise", "dots", "full"])
def test_remat_keeps_loss_and_gradient(remat_steps, policy):
  loss, grads, *_ = remat_steps["none"]
  got_loss, got_grads, *_ = remat_steps[policy]
  np.testing.assert_allclose(got_loss, loss, rtol=REMAT_LOSS_RTOL)
  scale = np.abs(grads).max()
  assert scale > 0
  np.testing.assert_allclose(got_grads, grads, rtol=0, atol=REMAT_GRAD_RTOL * scale)


@pytest.mark.slow
def test_remat_saves_temporary_memory(remat_steps):
  """Measured here (CPU, 2 layers, 16 rows of 96 tokens): none 34.8 MB, elementwise 30.4 MB, dots
  31.2 MB, full 24.4 MB.

  ``none`` keeps every layer's activations for the backward pass; ``elementwise`` the products'
  outputs (the attention's too) and recomputes norms, rope and activations; ``dots`` keeps only
  the projections' outputs and recomputes the rest (the attention's temporaries then live in the
  backward pass too, so it need not be below ``elementwise``); ``full`` keeps each layer's input
  alone.
  """
  temp = {policy: remat_steps[policy][2] for policy in REMAT_POLICIES}
  for middle in ("dots", "elementwise"):
    assert temp["full"] < temp[middle] < temp["none"], temp


@pytest.mark.slow
def test_elementwise_remat_recomputes_no_product(remat_steps):
  """``elementwise`` recomputes norms, rope and activations only: the step holds as many products
  as with nothing recomputed (the attention's included, whose residuals it keeps by name), where
  ``dots`` runs the attention's again."""
  products = {policy: remat_steps[policy][3] for policy in REMAT_POLICIES}
  assert products["elementwise"] == products["none"] < products["dots"], products
