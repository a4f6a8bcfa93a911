"""The trainer's step keeps no parameter-sized buffer beside the gradients, and trains as the step
that divided the summed gradients by their count and clipped them inside the optimizer did.

That step's temporaries were two float32 copies of the parameters whatever the remat policy: the
gradient sums, and the sums divided by their count, which XLA kept because the clip's norm and
Adam's two moments each read them. The step now scales the sums by one scalar (the mean and the
clip together) where the optimizer reads them, and takes the norm of the sums.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrm import sharding
from jaxrm.config import RewardSpec, TrainSpec
from jaxrm.data.batches import PreferenceBatch
from jaxrm.hf.loader import placed_abstract_model
from jaxrm.models.config import ModelConfig
from jaxrm.run import optim, update
from jaxrm.scoring.reward_model import RewardModel

# Parameters that outweigh what a step keeps of its batch: 5.2M float32 (21 MB) against rows of
# 32 tokens, whose [rows, 32, 256] activations are 32 KiB a row.
CONFIG = ModelConfig(
  family="llama",
  vocab_size=8192,
  hidden_size=256,
  intermediate_size=768,
  num_layers=4,
  num_heads=4,
  num_kv_heads=2,
  head_dim=64,
  dtype="bfloat16",
  param_dtype="float32",
  pad_token_id=0,
)
LENGTH = 32
# The step's temporaries hold the gradients (1.0 of the parameters' bytes) and what the batch's
# activations need, and XLA:CPU converts one layer's bf16 weights at a time to float32 for its
# dots (measured in all: 1.23 with remat full, 1.31 with dots). The buffer removed was another
# 1.0 (the former step: 2.0 with either), so the bound sits halfway. remat=none is left out: its
# forward pass keeps every layer's bf16 weights for the backward one, which XLA:CPU converts
# back to float32 all at once (2.04 either way, the former step's extra buffer coming later).
GRADIENTS_AND_ACTIVATIONS = 1.5
# The micro-batched update program reads the sums it is given and keeps nothing of its own
# (0.0 measured; the former update: 1.0, the sums divided by their count).
UPDATE_PROGRAM = 0.25


def _mesh():
  return sharding.make_mesh(sharding.MeshConfig(1, 1, 1), devices=jax.devices()[:1])


def _batch(pairs: int, mesh, concrete: bool = False, vocab: int = CONFIG.vocab_size, seed: int = 0):
  """``pairs`` preference pairs of two ``LENGTH``-token rows, abstract unless ``concrete``."""
  rng = np.random.default_rng(seed)
  batch = PreferenceBatch(
    input_ids=rng.integers(1, vocab, (2 * pairs, LENGTH)).astype(np.int32),
    attention_mask=np.ones((2 * pairs, LENGTH), np.int32),
    ranks=np.tile(np.arange(2, dtype=np.int32), (pairs, 1)),
    margin=np.zeros(pairs, np.float32),
    example_mask=np.ones(pairs, np.float32),
  )
  if concrete:
    return batch
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.batch_sharding(mesh, x.ndim)), batch
  )


def _param_bytes(state) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state["params"]))


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_step_temporaries_are_the_gradients_and_no_second_copy(remat):
  """The compiled train step of ``update.build_update`` (the trainer's, with the default
  TrainSpec: AdamW after clipping at 1.0) on one pair."""
  mesh = _mesh()
  model = placed_abstract_model(CONFIG.replace(remat=remat), mesh)
  built = update.build_update(model, RewardSpec(), TrainSpec(), total_steps=100, mesh=mesh)
  memory = built.train_step.compile(built.state, _batch(1, mesh)).memory_analysis()
  params = _param_bytes(built.state)
  assert memory.temp_size_in_bytes <= GRADIENTS_AND_ACTIVATIONS * params, memory.temp_size_in_bytes / params
  # The donated state is written in place: every output byte but the metrics' is an input's.
  assert memory.alias_size_in_bytes >= 3 * params


def test_micro_batched_update_keeps_no_copy_of_the_sums():
  """The micro-batched step's programs (``update.build_update(micro_batched=True)``)."""
  mesh = _mesh()
  built = update.build_update(
    placed_abstract_model(CONFIG.replace(remat="full"), mesh),
    RewardSpec(),
    TrainSpec(),
    total_steps=100,
    mesh=mesh,
    grad_accum=2,
    micro_batched=True,
  )
  programs = built.train_step.compile_programs(built.state, _batch(1, mesh))
  params = _param_bytes(built.state)
  assert programs["update"].memory_analysis().temp_size_in_bytes <= UPDATE_PROGRAM * params
  # The gradient program's are the step's less the gradients, which are its outputs.
  assert programs["gradient"].memory_analysis().temp_size_in_bytes <= (GRADIENTS_AND_ACTIVATIONS - 1) * params


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_optimizer_state_keeps_the_layout_checkpoints_hold(max_grad_norm):
  """The step clips, not the optimizer, but the optimizer state is laid out as
  ``optim.make_optimizer``'s (clip, AdamW) chain's, so that checkpoints restore either way."""
  mesh = _mesh()
  built = update.build_update(
    placed_abstract_model(CONFIG, mesh),
    RewardSpec(),
    TrainSpec(max_grad_norm=max_grad_norm),
    total_steps=100,
    mesh=mesh,
  )
  chain = optim.make_optimizer(built.schedule, max_grad_norm=max_grad_norm)
  want = jax.eval_shape(chain.init, built.state["params"])
  assert jax.tree.structure(built.state["opt_state"]) == jax.tree.structure(want)
  assert [(x.shape, x.dtype) for x in jax.tree.leaves(built.state["opt_state"])] == [
    (x.shape, x.dtype) for x in jax.tree.leaves(want)
  ]


def _reference_update(tx, divide: bool = True):
  """The former update: the summed gradients divided by their count (unless not ``divide``: a
  wrong update, to show the comparison can tell), then ``tx``, which clips if it was built to."""

  def update_(state, grads, metrics):
    if divide:
      count = jnp.maximum(metrics["loss"].count, 1.0)
      grads = jax.tree.map(lambda g: g / count, grads)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    state = dict(
      state, params=optax.apply_updates(state["params"], updates), opt_state=opt_state, step=state["step"] + 1
    )
    return state, optax.tree.norm(grads)

  return jax.jit(update_)


LR, UPDATES = 1e-3, 6
# The two updates differ by float32 roundings (2**-24 relative each): the mean gradient is
# g * (1 / count) where it was g / count, clipped it is g * (max / |g|) where it was
# (g / count) * (max / |g / count|), and XLA rewrites Adam's arithmetic a little differently in
# each program. Per update that moves a parameter by a rounding of its own (2**-23 relative at
# most), and by a few roundings (4, say) of an Adam step whose size is at most 3 (so
# LR * 3 * 4 * 2**-24), compounded over the updates through Adam's moments (x UPDATES).
# Measured: 1 rounding of the parameter, 1.9e-9 where the parameter is small.
RTOL = UPDATES * 2.0**-23
ATOL = UPDATES * UPDATES * LR * 3 * 4 * 2.0**-24


@pytest.mark.parametrize("max_grad_norm", [1e-3, 1e3])
def test_update_is_the_former_divide_then_clip(model_dir, max_grad_norm):
  """Six AdamW updates of the trainer's step (``update.build_update``) and of the former update,
  from the same weights and the same gradient sums, over 4 pairs (1/4 is exact in float32) and
  3 (1/3 is not), clipping every update (1e-3) or none (1e3). eps 1e-5 makes the step depend on
  the gradient's scale (Adam's is otherwise nearly scale-free), so a wrong mean or clip shows."""
  rm = RewardModel.from_pretrained(model_dir)
  train = TrainSpec(
    learning_rate=LR,
    lr_scheduler="constant",
    warmup_steps=0,
    weight_decay=0.1,
    max_grad_norm=max_grad_norm,
    adam_epsilon=1e-5,
  )
  mesh = _mesh()
  built = update.build_update(rm.model, RewardSpec(), train, total_steps=10, mesh=mesh, micro_batched=True)
  tx = lambda clip: optim.make_optimizer(built.schedule, weight_decay=0.1, max_grad_norm=clip, eps=1e-5)
  reference = _reference_update(tx(max_grad_norm))
  # Wrong: unclipped where every update clips (in the state layout of the clipping chain); not
  # divided by the count where none clips.
  unclipped = optax.chain(optax.identity(), tx(0.0))
  wrong_update = (
    _reference_update(unclipped) if max_grad_norm < 1 else _reference_update(tx(max_grad_norm), False)
  )
  state = built.state
  want, wrong = jax.tree.map(jnp.copy, state), jax.tree.map(jnp.copy, state)  # the step donates its state
  flat = lambda t: np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(t)])
  for i in range(UPDATES):
    pairs = 4 if i < UPDATES // 2 else 3
    batch = _batch(pairs, mesh, concrete=True, vocab=rm.config.vocab_size, seed=i)
    sums = built.train_step.grads(state, np.int32(0), batch)  # the step's own first program
    want, want_norm = reference(want, *sums)
    wrong, _ = wrong_update(wrong, *sums)
    state, (metrics, extra) = built.train_step(state, (batch,))
    assert float(metrics["loss"].count) == pairs
    if max_grad_norm < 1:
      assert float(want_norm) > 10 * max_grad_norm  # clipped
    else:
      assert float(want_norm) < max_grad_norm / 10  # not clipped
    # |g| / count against |g / count|: a rounding or two.
    np.testing.assert_allclose(extra["grad_norm"], want_norm, rtol=4 * 2.0**-24)
    np.testing.assert_allclose(flat(state["params"]), flat(want["params"]), rtol=RTOL, atol=ATOL)
  assert not np.allclose(flat(state["params"]), flat(wrong["params"]), rtol=100 * RTOL, atol=100 * ATOL)
