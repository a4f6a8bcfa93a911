"""LoRA: new adapters leave the model unchanged, train over a frozen base, merge back into the
weights, and shard like the weights they adapt."""

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_only_trained_moved, demo_batches, flat_params, model_config_of, padded_tokens
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jaxrm import sharding
from jaxrm.config import RewardSpec
from jaxrm.data import pipeline
from jaxrm.errors import ConfigError
from jaxrm.hf.loader import abstract_model
from jaxrm.models import lora
from jaxrm.models.config import ModelConfig, config_from_dict
from jaxrm.models.decoder import Decoder
from jaxrm.models.lora import LoraConfig, LoraParam
from jaxrm.run import optim, steps
from jaxrm.scoring.reward_model import RewardModel

QV = LoraConfig(rank=4, targets=("q_proj", "v_proj"))
ALL = LoraConfig(rank=4, targets="all-linear")
BASE = nnx.Not(LoraParam)

# Merging computes x @ (W + s*A@B) where the adapted model computes x @ W + s*(x @ A) @ B: the same
# float32 products summed in another order, through 2 layers of 7 projections. The rewards (~1 in
# size) then agree to about one float32 ulp (measured: <= 1.2e-7); 1e-5 bounds that with room while
# the adapters move them by 5e-2 or more.
MERGE_ATOL = 1e-5


# ------------------------------------------------------------------ config


def test_targets_use_peft_names_and_all_linear_expands():
  assert ALL.targets == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
  assert ALL.params == ("q", "k", "v", "o", "gate", "up", "down")
  assert LoraConfig(rank=8, targets=["v_proj", "q_proj", "v_proj"]).targets == ("q_proj", "v_proj")
  assert LoraConfig().targets == ALL.targets and not LoraConfig().enabled
  assert LoraConfig(rank=8).scale == 2.0  # alpha 16


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (
      dict(rank=4, targets=("q_proj", "qkv_proj")),
      r"\['qkv_proj'\] are not projections of the decoder; use any of q_proj, .*, or 'all-linear'",
    ),
    (dict(rank=-1), r"rank=-1; use 0 \(no adapters"),
    (dict(rank=2.5), r"rank=2.5; use 0"),
    (dict(rank=4, alpha=0), r"alpha=0; use a positive number"),
    (dict(rank=4, targets=()), r"adapts no projection \(targets is empty\)"),
  ],
)
def test_bad_settings_say_what_to_use(kwargs, message):
  with pytest.raises(ConfigError, match=message):
    LoraConfig(**kwargs)


def test_model_config_round_trips_its_lora_settings(model_dir):
  cfg = model_config_of(model_dir).replace(lora=QV)
  assert config_from_dict(json.loads(json.dumps(dataclasses.asdict(cfg))), "model_config.json") == cfg
  old = dataclasses.asdict(cfg)
  del old["lora"]  # a run saved before LoRA existed
  assert config_from_dict(old, "model_config.json").lora == LoraConfig()


def test_trainable_filter():
  assert lora.trainable_filter(LoraConfig()) is ...
  model = nnx.eval_shape(lambda: _token_head_model())
  trained, _ = nnx.split_state(nnx.state(model), lora.trainable_filter(QV), ...)
  assert sorted(_names(trained)) == [
    "layers.q_lora_a",
    "layers.q_lora_b",
    "layers.v_lora_a",
    "layers.v_lora_b",
    "score",
    "score_bias",
  ]


def _token_head_model():
  cfg = ModelConfig(
    family="llama",
    vocab_size=32,
    hidden_size=8,
    intermediate_size=16,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    head="token",
    num_labels=2,
    head_bias=True,
    lora=QV,
  )
  return Decoder(cfg, rngs=nnx.Rngs(0))


def _names(state) -> list[str]:
  return [".".join(map(str, path)) for path, _ in nnx.to_flat_state(state)]


# ------------------------------------------------------------------ loading: adapters start as the identity


@pytest.mark.parametrize("cfg", [QV, ALL], ids=["q_v", "all_linear"])
def test_new_adapters_leave_rewards_bit_equal(tiny_rm, model_dir, cfg):
  rm = RewardModel.from_pretrained(model_dir, lora=cfg)
  adapters = flat_params(nnx.state(rm.model, LoraParam))
  assert sorted(adapters) == sorted(f"layers.{p}_lora_{ab}" for p in cfg.params for ab in "ab")
  for name, value in adapters.items():
    if name.endswith("_lora_a"):  # peft's kaiming-uniform: U(-1/sqrt(in), 1/sqrt(in))
      bound = 1 / np.sqrt(value.shape[1])
      assert value.shape[2] == cfg.rank and 0.9 * bound < np.abs(value).max() <= bound, name
    else:
      assert value.shape[1] == cfg.rank and not value.any(), name
  # The base is the checkpoint's, untouched.
  base, want = flat_params(nnx.state(rm.model, BASE)), flat_params(nnx.state(tiny_rm.model))
  assert base.keys() == want.keys()
  for name in want:
    np.testing.assert_array_equal(base[name], want[name], err_msg=name)
  ids, mask = padded_tokens(rm.config.vocab_size)
  np.testing.assert_array_equal(rm.score_tokens(ids, mask), tiny_rm.score_tokens(ids, mask))


# ------------------------------------------------------------------ training over a frozen base


def _size(tree) -> int:
  return sum(np.size(x) for x in jax.tree.leaves(tree))


def test_training_moves_adapters_and_head_only(tiny_rm, model_dir):
  rm = RewardModel.from_pretrained(model_dir, lora=QV)
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), devices=jax.devices()[:1])
  tx = optim.make_optimizer(optax.constant_schedule(1e-2), weight_decay=0.01)
  before = flat_params(nnx.state(rm.model))
  state, shardings = steps.init_state(
    nnx.state(rm.model), tx, seed=0, mesh=mesh, trainable=lora.trainable_filter(rm.config.lora)
  )
  assert sorted(state) == sorted(shardings) == ["frozen", "opt_state", "params", "rng", "step"]
  trained_names = sorted(_names(state["params"]))
  assert trained_names == [
    "layers.q_lora_a",
    "layers.q_lora_b",
    "layers.v_lora_a",
    "layers.v_lora_b",
    "score",
  ]

  # The optimizer holds two moments of the adapters and head only (plus scalar counters): 3,714
  # numbers against 6,416,898 for full training (the tiny model is mostly its 49k x 64 embedding).
  full_state, _ = steps.init_state(nnx.state(tiny_rm.model), tx, seed=0, mesh=mesh)
  assert "frozen" not in full_state
  trained, total = _size(state["params"]), _size(full_state["params"])
  assert _size(state["opt_state"]) - 2 * trained == _size(full_state["opt_state"]) - 2 * total < 8
  assert _size(state["opt_state"]) < 1e-3 * _size(full_state["opt_state"])
  assert _size(state["frozen"]) == total - _size(tiny_rm.model.score[...])  # all but the head

  # Two micro-batches: the frozen base passes through gradient accumulation as well.
  train_step = steps.make_train_step(
    steps.make_loss_fn(rm.model, RewardSpec()),
    tx,
    lambda _: 1e-2,
    grad_accum_steps=2,
    state_shardings=shardings,
  )
  for batch in demo_batches(rm.tokenizer, 3):
    state, (_, extra) = train_step(state, pipeline.to_global_batch(batch, mesh))
    assert np.isfinite(extra["grad_norm"]) and extra["grad_norm"] > 0
  assert int(state["step"]) == 3

  assert_only_trained_moved(before, flat_params(steps.model_params(state)), trained_names)


def test_first_step_trains_b_and_head_as_full_training_does(tiny_rm, model_dir):
  """At B = 0 the adapted model is the base, so one SGD step gives the head the gradient of full
  fine-tuning; A gets none (its gradient goes through B), B gets one."""
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), devices=jax.devices()[:1])
  tx = optax.sgd(1.0)
  batch = demo_batches(tiny_rm.tokenizer, 1)[0]

  def first_step(rm, trainable):
    before = flat_params(nnx.state(rm.model))
    state, shardings = steps.init_state(nnx.state(rm.model), tx, seed=0, mesh=mesh, trainable=trainable)
    step = steps.make_train_step(
      steps.make_loss_fn(rm.model, RewardSpec()), tx, lambda _: 1.0, state_shardings=shardings
    )
    state, (metrics, _) = step(state, pipeline.to_global_batch(batch, mesh))
    after = flat_params(state["params"])
    return {k: after[k] - before[k] for k in after}, metrics["loss"].total

  rm = RewardModel.from_pretrained(model_dir, lora=ALL)
  lora_update, lora_loss = first_step(rm, lora.trainable_filter(ALL))
  full_update, full_loss = first_step(RewardModel.from_pretrained(model_dir), ...)
  assert float(lora_loss) == float(full_loss)
  np.testing.assert_allclose(lora_update["score"], full_update["score"], rtol=1e-6, atol=0)
  for p in ALL.params:
    assert not lora_update[f"layers.{p}_lora_a"].any(), p
    assert np.abs(lora_update[f"layers.{p}_lora_b"]).max() > 0, p


# ------------------------------------------------------------------ merging for export


def test_merged_weights_give_the_adapted_models_rewards(tiny_rm, model_dir):
  rm = RewardModel.from_pretrained(model_dir, lora=ALL)
  graphdef, state = nnx.split(rm.model)
  key = jax.random.key(1)
  for i, (path, var) in enumerate(nnx.to_flat_state(state)):
    if path[-1].endswith("_lora_b"):  # trained-looking adapters: B no longer zero
      var.set_value(0.05 * jax.random.normal(jax.random.fold_in(key, i), var.get_value().shape))
  adapted = RewardModel(nnx.merge(graphdef, state))

  merged_state = lora.merge(state, ALL)
  merged_cfg = rm.config.replace(lora=LoraConfig())
  assert sorted(_names(merged_state)) == sorted(_names(nnx.state(abstract_model(merged_cfg))))
  merged = RewardModel(nnx.merge(nnx.graphdef(abstract_model(merged_cfg)), merged_state))

  ids, mask = padded_tokens(rm.config.vocab_size)
  want, got = adapted.score_tokens(ids, mask), merged.score_tokens(ids, mask)
  assert np.abs(want - tiny_rm.score_tokens(ids, mask)).min() > 100 * MERGE_ATOL  # the adapters matter
  np.testing.assert_allclose(got, want, rtol=0, atol=MERGE_ATOL)
  # Weights without adapters pass through as they are.
  np.testing.assert_array_equal(
    np.asarray(merged_state["embed"].get_value()), np.asarray(state["embed"].get_value())
  )


# ------------------------------------------------------------------ sharding


def test_adapters_shard_like_their_weights(model_dir):
  cfg = model_config_of(model_dir).replace(lora=ALL)
  mesh = AbstractMesh((2, 2, 1, 2), sharding.MESH_AXES)  # data, fsdp, context, tensor
  shardings = sharding.param_shardings(nnx.state(abstract_model(cfg)), mesh)
  specs = {".".join(map(str, path)): s.spec for path, s in nnx.to_flat_state(shardings)}
  # A [L, in, r] splits like its weight's input, B [L, r, out] like its output; r stays whole.
  assert specs["layers.q"] == P(None, "fsdp", "tensor")
  assert specs["layers.q_lora_a"] == P(None, "fsdp", None)
  assert specs["layers.q_lora_b"] == P(None, None, "tensor")
  assert specs["layers.k_lora_b"] == P(None, None, "tensor")
  assert specs["layers.o_lora_a"] == P(None, "tensor", None)
  assert specs["layers.o_lora_b"] == P(None, None, "fsdp")
  assert specs["layers.gate_lora_b"] == P(None, None, "tensor")
  assert specs["layers.down_lora_a"] == P(None, "tensor", None)
  assert specs["layers.down_lora_b"] == P(None, None, "fsdp")
