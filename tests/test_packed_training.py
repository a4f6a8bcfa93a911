"""Training on packed rows (data.packing=packed or shared_prompt) equals training on unpacked ones:
the first update, per-step metrics and validation, with gradient accumulation, data-parallel
devices and resume; and the config errors of packing."""

import jax
import numpy as np
import optax
import pytest
import tiny_run
from flax import nnx

from jaxrm import sharding
from jaxrm.data import packing
from jaxrm.data.batches import IGNORE_INDEX
from jaxrm.data.tokenize import PreferenceExample, StepwiseExample
from jaxrm.errors import UserError

# float32 sums taken in another order (rows of other lengths, several sequences side by side,
# micro-batches) move these runs' losses and gradient norms by about 1e-7; a token that sees one it
# should not (shared-prompt branches seeing each other) moves the loss by about 1e-2.
METRIC_ATOL = 1e-5
# The first update with plain SGD at learning rate 1 is minus the gradient of the mean loss, the
# one thing every layout must compute alike, up to float32 sums taken in another order: an element
# summed over every row (the reward head's) then moves by tens of float32 epsilons of the largest
# (6e-6 of it seen here, on 3.2M elements), while a shared-prompt branch that sees its sibling
# moves elements by twice the largest. (Parameters after a few Adam steps are no such thing: for a
# gradient element near zero, m / sqrt(v) turns float noise into a step of the full learning rate.)
UPDATE_RTOL = 1e-4
TRAIN_KEYS = ("train/loss", "train/accuracy", "train/grad_norm", "train/chosen_reward", "train/reward_std")
STEP_KEYS = (
  "train/loss",
  "train/step_accuracy",
  "train/grad_norm",
  "train/f1_error",
  "train/first_error_found",
)

# 3 steps (the first at learning rate 0 under warmup) and a checkpoint at the end; preference runs
# validate at the end, in batches of 3 groups, so the last of 8 holds a filler.
RUN = {
  "train.max_steps": 3,
  "eval.val_period": 0,
  "eval.batch_size": 3,
  "data.val_data_paths": {"default": "validation"},
  "checkpointing.metric_name": "",
  "checkpointing.save_period": 0,
  "logger.tensorboard": False,
}


@pytest.fixture(scope="module")
def runs(cache_root, tmp_path_factory):
  """``runs(head, packing, micro_batch_size)``: the output directory of that run, trained once.

  ``head``: "sequence" trains pairs, "token" stepwise rows (without validation, to compile less).
  """
  done = {}

  def get(head, packing, micro_batch_size=8, fit_multiple=0):
    key = (head, packing, micro_batch_size, fit_multiple)
    if key not in done:
      out = str(tmp_path_factory.mktemp("runs") / "-".join(map(str, key)))
      tiny_run.train(
        config(
          cache_root,
          head,
          out,
          packing,
          micro_batch_size,
          eval__val_at_end=head == "sequence",
          data__packed_fit_multiple=fit_multiple,
        )
      )
      done[key] = out
    return done[key]

  return get


def config(cache_root, head, out, packing, micro_batch_size=8, **overrides):
  c = tiny_run.config(
    tiny_run.tiny_model_dir(cache_root, head=head),
    out,
    data__packing=packing,
    train__micro_batch_size=micro_batch_size,
  )
  if head == "token":
    tiny_run.set_keys(c, {"reward.type": "stepwise", "data.dataset_name": "demo_arithmetic_steps"})
  return tiny_run.set_keys(c, {**RUN, **{k.replace("__", "."): v for k, v in overrides.items()}})


def train_rows(out):
  return [r for r in tiny_run.read_metrics(out) if "train/loss" in r]


def assert_same_training(out, expected, keys):
  rows, want = train_rows(out), train_rows(expected)
  assert [r["step"] for r in rows] == [r["step"] for r in want] == [1, 2, 3]
  for key in keys:
    np.testing.assert_allclose(
      [r[key] for r in rows], [r[key] for r in want], rtol=0, atol=METRIC_ATOL, err_msg=key
    )
  # Tokens are counted alike whatever the layout: every completion whole.
  tokens = lambda rs: [r["train/tokens_per_second"] * r["timing/train/step_time"] for r in rs]
  np.testing.assert_allclose(tokens(rows), tokens(want), rtol=1e-6)
  val, val_want = (
    [r for r in tiny_run.read_metrics(o) if "validation-default_loss" in r] for o in (out, expected)
  )
  assert len(val) == len(val_want)
  for key in val_want[0] if val_want else ():
    if key.startswith("validation-default_"):
      np.testing.assert_allclose(val[0][key], val_want[0][key], rtol=0, atol=METRIC_ATOL, err_msg=key)
  # The parameters themselves are compared where it is exact: see test_first_update_*.


def test_shared_prompt_training_equals_unpacked(runs):
  # 8 pairs per step as 2 micro-batches of 4: the micro-batches are packed apart.
  out, unpacked = runs("sequence", "shared_prompt", 4), runs("sequence", "none")
  assert_same_training(out, unpacked, TRAIN_KEYS)
  # Packing is the point: more of every row is real tokens.
  efficiency = lambda o: np.mean([r["train/packing_efficiency"] for r in train_rows(o)])
  assert efficiency(out) > 2 * efficiency(unpacked)


def test_packed_stepwise_training_equals_unpacked(runs):
  # Fitted rows (data.packed_fit_multiple): each batch's row length and count chosen for it.
  assert_same_training(runs("token", "packed", fit_multiple=16), runs("token", "none"), STEP_KEYS)


def test_packed_run_resumes_exactly(runs, cache_root, tmp_path):
  out = str(tmp_path / "run")
  tiny_run.train(config(cache_root, "sequence", out, "shared_prompt", 4), stop_after_steps=2)
  assert [r["step"] for r in train_rows(out)] == [1, 2]
  tiny_run.train(config(cache_root, "sequence", out, "shared_prompt", 4))
  # The same batches in the same order: equal to the last bit.
  tiny_run.assert_resumed_equals_uninterrupted(
    out, runs("sequence", "shared_prompt", 4), [1, 2, 3], TRAIN_KEYS, atol=0
  )


@pytest.mark.slow
def test_packed_rows_split_over_two_devices(runs, cache_root, tmp_path):
  """fsdp=2 on 2 CPU devices, 2 micro-batches of 2 pairs per device: each device takes half of
  every micro-batch's rows, and the rewards are read back across the two."""
  out = str(tmp_path / "sharded")
  flags = [
    "--config.data.packing=packed",
    "--config.mesh.fsdp=2",
    "--config.train.micro_batch_size=2",
    "--config.train.max_steps=3",
    "--config.eval.val_period=0",
    "--config.eval.val_at_end=False",
    "--config.checkpointing.enabled=False",
  ]
  result = tiny_run.run(
    tiny_run.cli(tiny_run.tiny_model_dir(cache_root), out, *flags),
    XLA_FLAGS="--xla_force_host_platform_device_count=2",
  )
  assert result.returncode == 0, tiny_run.describe(result)
  assert "mesh: {'data': 1, 'fsdp': 2, 'tensor': 1} on 2 cpu devices" in result.stdout
  # model.attention=auto on CPU: the reference path, and the summary says why.
  assert (
    "attention: reference einsum (auto: the pallas kernel needs a GPU; these devices are cpu) on all "
    "2 layers\n"
  ) in result.stdout
  assert "(x2 accumulation)" in result.stdout
  rows, want = train_rows(out), train_rows(runs("sequence", "none"))
  for key in TRAIN_KEYS:
    np.testing.assert_allclose(
      [r[key] for r in rows], [r[key] for r in want], rtol=0, atol=METRIC_ATOL, err_msg=key
    )


# ------------------------------------------------------------------ the first update


def first_update(cache_root, head, pack, micro_batches):
  """The update of ``steps.make_train_step`` (SGD, learning rate 1: minus the mean-loss gradient)
  on one global batch of 8 groups at the tiny model's initial parameters, as a flat vector."""
  from jaxrm.config import RewardSpec
  from jaxrm.data import pipeline, registry
  from jaxrm.data.drops import DropReport
  from jaxrm.data.tokenize import TokenizeOptions, pad_id, tokenize_all
  from jaxrm.run import steps
  from jaxrm.scoring.reward_model import RewardModel

  rm = RewardModel.from_pretrained(tiny_run.tiny_model_dir(cache_root, head=head))
  name, spec = (
    ("demo_arithmetic_steps", RewardSpec("stepwise"))
    if head == "token"
    else ("demo_arithmetic", RewardSpec())
  )
  records = registry.load_records(name, None, split="train", drops=DropReport())[:8]
  examples = tokenize_all(records, rm.tokenizer, TokenizeOptions(max_length=96), DropReport())
  collate = pipeline.make_train_iterator(
    examples,
    batch_size=8,
    seed=0,
    buckets=(96,),
    pad_id=pad_id(rm.tokenizer),
    pack=pack,
    micro_batches=micro_batches if pack is not None else 1,
  )[0]
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), devices=jax.devices()[:1])
  tx = optax.sgd(1.0)
  params = nnx.state(rm.model)
  before = np.concatenate([np.ravel(x) for x in jax.tree.leaves(params)])
  state, shardings = steps.init_state(params, tx, seed=0, mesh=mesh)
  train_step = steps.make_train_step(
    steps.make_loss_fn(rm.model, spec),
    tx,
    lambda _: 1.0,
    grad_accum_steps=micro_batches,
    state_shardings=shardings,
  )
  stacked = pack is not None and micro_batches > 1
  state, _ = train_step(state, pipeline.to_global_batch(next(collate), mesh, stacked=stacked))
  return np.concatenate([np.ravel(x) for x in jax.tree.leaves(state["params"])]) - before


@pytest.mark.parametrize(
  "head, pack",
  [
    ("sequence", packing.PackSpec(row_length=192, length_multiple=16, shared_prompt=True)),
    ("sequence", packing.PackSpec(row_length=192, length_multiple=16)),
    ("token", packing.PackSpec(row_length=192, length_multiple=16)),
  ],
  ids=["shared_prompt", "packed", "packed_stepwise"],
)
def test_first_update_equals_unpacked(cache_root, head, pack):
  """Packed micro-batches (2 of 4 groups) move every parameter as the unpacked batch does."""
  unpacked = first_update(cache_root, head, None, 2)
  got = first_update(cache_root, head, pack, 2)
  scale = np.abs(unpacked).max()
  assert scale > 0
  np.testing.assert_allclose(got, unpacked, rtol=0, atol=UPDATE_RTOL * scale)


# ------------------------------------------------------------------ micro-batches of two hosts


def test_micro_batches_of_two_hosts_index_the_global_batch():
  rng = np.random.default_rng(0)
  prompt = lambda i: list(range(100 * i, 100 * i + 1 + i % 3))
  pair = lambda i: (
    np.array(prompt(i) + [1, 2 + i], np.int32),
    np.array(prompt(i) + [3] * (1 + i % 2), np.int32),
  )
  pairs = [PreferenceExample(pair(i), (0, 1), 0.0, f"pair {i}", {}) for i in range(8)]
  seqs = [
    StepwiseExample(
      rng.integers(3, 99, 2 + i % 4).astype(np.int32),
      np.full(2 + i % 4, IGNORE_INDEX, np.int32),
      f"seq {i}",
      {},
    )
    for i in range(8)
  ]
  spec = packing.PackSpec(row_length=16, length_multiple=4, shared_prompt=True, rewards_multiple=1)
  for groups in (pairs, seqs):
    hosts = [
      packing.PackedCollator(4, spec, num_completions=2, process_index=p, process_count=2, micro_batches=2)(
        groups
      )
      for p in range(2)
    ]
    assert {k: v.shape for k, v in vars(hosts[0]).items()} == {k: v.shape for k, v in vars(hosts[1]).items()}
    # What to_global_batch assembles: rows (and groups) of host 0, then of host 1, on axis 1.
    whole = jax.tree.map(lambda *xs: np.concatenate(xs, axis=1), *hosts)
    assert whole.input_ids.shape[0] == 2
    for m in range(2):  # micro-batch m holds groups m, m + 2, m + 4, m + 6, as unpacked
      ids = whole.input_ids[m]
      if groups is pairs:  # a completion's last token stands in for its reward
        last = np.take_along_axis(ids, np.maximum(whole.reward_positions[m], 0), axis=1)
        np.testing.assert_array_equal(
          packing.group_rewards(last, whole.reward_index[m]),
          [[c[-1] for c in pairs[i].input_ids] for i in range(m, 8, 2)],
        )
      else:
        tokens = packing.group_logits(ids[..., None], whole.token_index[m])[..., 0]
        for g, i in enumerate(range(m, 8, 2)):
          np.testing.assert_array_equal(tokens[g, : len(seqs[i].input_ids)], seqs[i].input_ids)


# ------------------------------------------------------------------ config errors


def test_bad_packing_values_name_the_key(cache_root, tmp_path):
  out = str(tmp_path / "run")
  with pytest.raises(
    UserError,
    match=r"^data.packing must be one of none, packed, "
    r"shared_prompt; got 'pack'$",
  ):
    tiny_run.train(config(cache_root, "sequence", out, "pack"))
  with pytest.raises(UserError, match=r"^data.packed_row_length=-1: use a number of tokens"):
    tiny_run.train(config(cache_root, "sequence", out, "packed", data__packed_row_length=-1))
  with pytest.raises(UserError, match=r"^data.packed_fit_multiple=-16: use a number of tokens"):
    tiny_run.train(config(cache_root, "sequence", out, "packed", data__packed_fit_multiple=-16))
  with pytest.raises(
    UserError,
    match=r"^data.packing='shared_prompt' writes a preference "
    r"group's prompt once; .* use data.packing='packed'$",
  ):
    tiny_run.train(config(cache_root, "token", out, "shared_prompt"))


def test_row_too_short_for_a_group(cache_root, tmp_path):
  c = config(cache_root, "sequence", str(tmp_path / "run"), "packed", data__packed_row_length=40)
  # Demo pairs are 30-odd tokens per completion: a pair needs more than 40 tokens.
  with pytest.raises(
    UserError,
    match=r"^data.packed_row_length=40 is too short for "
    r"demo_arithmetic:train\[row \d+\] \(train\), which takes \d+ "
    r"tokens in one row: set data.packed_row_length >= \d+, "
    r"or 0 to size rows automatically$",
  ):
    tiny_run.train(c)
