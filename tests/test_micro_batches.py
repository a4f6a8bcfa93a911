"""Gradient accumulation over micro-batches padded each to its own length (steps.MicroBatchedStep)
updates the model as one step over the whole batch does."""

import jax
import numpy as np
import optax
from flax import nnx

from jaxrm import sharding
from jaxrm.config import RewardSpec
from jaxrm.data import pipeline, registry
from jaxrm.data.drops import DropReport
from jaxrm.data.tokenize import TokenizeOptions, pad_id, tokenize_all
from jaxrm.models.lora import LoraConfig, LoraParam
from jaxrm.run import steps
from jaxrm.scoring.reward_model import RewardModel

# SGD at learning rate 1: the first update is minus the mean-loss gradient, which micro-batches of
# other lengths must compute alike up to float32 sums in another order (a few float32 epsilons
# of the largest element, as in test_packed_training.py); a micro-batch counted twice or
# missed moves elements by a large fraction of the largest.
UPDATE_RTOL = 1e-4
BUCKETS = tuple(range(4, 97, 4))  # the demo's pairs are 33 to 41 tokens long


def _examples(rm):
  """8 demo pairs, sorted by their longest sequence: the 4 shortest and 4 longest of 64."""
  records = registry.load_records("demo_arithmetic", None, split="train", drops=DropReport())[:64]
  examples = tokenize_all(records, rm.tokenizer, TokenizeOptions(max_length=96), DropReport())
  examples = sorted(examples, key=lambda e: max(len(s) for s in e.input_ids))
  return examples[:4] + examples[-4:]


def _collate(rm, groups):
  return pipeline.Collator(
    batch_size=len(groups), buckets=BUCKETS, pad_id=pad_id(rm.tokenizer), num_completions=2
  )(groups)


def _update(load, step_of, batch):
  """The first update of ``step_of(tx, shardings, mesh)`` on ``batch``, from a model ``load()``
  gives (a fresh one: the step donates the state, whose arrays are the model's)."""
  rm = load()
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), devices=jax.devices()[:1])
  tx = optax.sgd(1.0)
  params = nnx.state(rm.model)
  trainable = nnx.Any(LoraParam, nnx.PathContains("score")) if rm.config.lora.enabled else ...
  state, shardings = steps.init_state(params, tx, seed=0, mesh=mesh, trainable=trainable)
  before = jax.tree.map(np.asarray, state["params"])
  state, (metrics, _) = step_of(tx, shardings, mesh)(state, batch)
  after = jax.tree.map(np.asarray, state["params"])
  flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
  return flat(after) - flat(before), float(metrics["loss"].count)


def test_micro_batches_of_their_own_length_update_as_the_whole_batch(tiny_rm, model_dir):
  groups = _examples(tiny_rm)
  short, long = _collate(tiny_rm, groups[:4]), _collate(tiny_rm, groups[4:])
  whole = _collate(tiny_rm, groups)
  assert short.input_ids.shape[1] < long.input_ids.shape[1] == whole.input_ids.shape[1]
  loss_fn = steps.make_loss_fn(tiny_rm.model, RewardSpec())
  load = lambda: RewardModel.from_pretrained(model_dir)
  one_step = lambda tx, sh, mesh: steps.make_train_step(loss_fn, tx, lambda _: 1.0, state_shardings=sh)
  micro = lambda tx, sh, mesh: steps.MicroBatchedStep(loss_fn, tx, lambda _: 1.0, state_shardings=sh)
  want, count = _update(load, one_step, whole)
  got, micro_count = _update(load, micro, (short, long))
  assert count == micro_count == 8
  np.testing.assert_allclose(got, want, rtol=0, atol=UPDATE_RTOL * np.abs(want).max())
  # Leaving a micro-batch out is caught at this tolerance.
  partial, _ = _update(load, micro, (short,))
  assert np.abs(partial - want).max() > 100 * UPDATE_RTOL * np.abs(want).max()


def test_micro_batches_draw_the_dropout_of_the_scanned_step(model_dir):
  """With LoRA dropout, micro-batch i draws what the scan over stacked micro-batches draws."""
  load = lambda: RewardModel.from_pretrained(
    model_dir, lora=LoraConfig(rank=4, dropout=0.5, targets="all-linear")
  )
  rm = load()
  groups = _examples(rm)
  # The scanned step splits one batch into micro-batches of groups (0, 2, 4, 6) and (1, 3, 5, 7).
  whole = _collate(rm, groups)
  first, second = _collate(rm, groups[0::2]), _collate(rm, groups[1::2])
  loss_fn = steps.make_loss_fn(rm.model, RewardSpec())
  scanned = lambda tx, sh, mesh: steps.make_train_step(
    loss_fn, tx, lambda _: 1.0, grad_accum_steps=2, state_shardings=sh
  )
  micro = lambda tx, sh, mesh: steps.MicroBatchedStep(loss_fn, tx, lambda _: 1.0, state_shardings=sh)
  want, _ = _update(load, scanned, whole)
  pad = pad_id(rm.tokenizer)
  got, _ = _update(load, micro, (_padded(first, whole, pad), _padded(second, whole, pad)))
  np.testing.assert_allclose(got, want, rtol=0, atol=UPDATE_RTOL * np.abs(want).max())
  other, _ = _update(load, micro, (_padded(second, whole, pad), _padded(first, whole, pad)))  # draws swapped
  assert np.abs(other - want).max() > 100 * UPDATE_RTOL * np.abs(want).max()


def _padded(batch, like, pad: int):
  """``batch`` padded to ``like``'s length: dropout masks are drawn over the padded shape."""
  t = like.input_ids.shape[1] - batch.input_ids.shape[1]
  widen = lambda x, value: np.pad(x, ((0, 0), (0, t)), constant_values=value)
  return batch.replace(input_ids=widen(batch.input_ids, pad), attention_mask=widen(batch.attention_mask, 0))


def test_micro_batches_clip_as_the_whole_batch(tiny_rm, model_dir):
  """Clipped to a tenth of the mean gradient's norm, both steps' SGD update is the unclipped one
  scaled by that tenth: the clipping happens in the step, on the whole batch's mean gradient."""
  groups = _examples(tiny_rm)
  short, long, whole = _collate(tiny_rm, groups[:4]), _collate(tiny_rm, groups[4:]), _collate(tiny_rm, groups)
  loss_fn = steps.make_loss_fn(tiny_rm.model, RewardSpec())
  load = lambda: RewardModel.from_pretrained(model_dir)
  one_step = lambda clip: (
    lambda tx, sh, mesh: steps.make_train_step(
      loss_fn, tx, lambda _: 1.0, max_grad_norm=clip, state_shardings=sh
    )
  )
  micro = lambda clip: (
    lambda tx, sh, mesh: steps.MicroBatchedStep(
      loss_fn, tx, lambda _: 1.0, max_grad_norm=clip, state_shardings=sh
    )
  )
  unclipped, _ = _update(load, one_step(0.0), whole)
  clip = float(np.linalg.norm(unclipped)) / 10
  want = unclipped / 10
  for step_of, batch in ((one_step(clip), whole), (micro(clip), (short, long))):
    got, _ = _update(load, step_of, batch)
    # UPDATE_RTOL of the largest element, as above, of an update now a tenth the size.
    np.testing.assert_allclose(got, want, rtol=0, atol=UPDATE_RTOL * np.abs(want).max())
