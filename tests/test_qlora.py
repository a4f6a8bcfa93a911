"""QLoRA: a frozen base stored in bfloat16, int8 or nf4, decoded layer by layer in the forward pass;
training moves the adapters and leaves the codes bit-identical."""

import jax
import jax.ad_checkpoint as ad_checkpoint
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
from jaxrm.models import lora, quantize
from jaxrm.models.config import ModelConfig
from jaxrm.models.lora import LoraConfig, LoraParam
from jaxrm.models.quantize import QuantizedWeight
from jaxrm.run import optim, steps
from jaxrm.scoring.reward_model import RewardModel

# Rewards (0.4 to 0.8 in size) of the tiny model with its base rounded, against float32. Measured:
# bfloat16 2.6e-3 (each weight within 2^-9 of itself), int8 3.3e-3 (within absmax/254 of its
# channel), nf4 2.7e-2 (within 0.15 of its block's absmax, 0.05 typically). The bounds are about
# four times those: the errors are the rounding's, summed over 2 layers of 7 projections.
REWARD_ATOL = {"bfloat16": 1e-2, "int8": 1.5e-2, "nf4": 0.1}


def _weights(shape=(2, 96, 40), seed=0):
  return np.random.default_rng(seed).normal(0, 0.02, shape).astype(np.float32)


# ------------------------------------------------------------------ formats


def test_int8_is_within_half_a_step_of_each_weight():
  w = _weights()
  codes, scale = quantize.quantize(w, "int8")
  assert codes.dtype == np.int8 and codes.shape == w.shape and scale.shape == (2, 1, 40)
  np.testing.assert_allclose(
    scale, np.abs(w).max(axis=1, keepdims=True) / 127, rtol=1e-7
  )  # per output channel
  assert np.abs(codes).max() == 127 and codes.min() >= -127
  err = np.abs(np.asarray(quantize.dequantize(codes, scale, "int8")) - w)
  assert (err <= scale / 2 * (1 + 1e-6)).all()  # float32 rounding of w / scale: a relative 1e-6


def test_nf4_is_within_half_the_widest_gap_of_each_weight():
  w = _weights()  # 96 input rows: a block of 64 and a short one of 32
  codes, scale = quantize.quantize(w, "nf4")
  assert codes.dtype == np.uint8 and codes.shape == (2, 48, 40) and scale.shape == (2, 2, 40)
  absmax = np.stack([np.abs(w[:, :64]).max(axis=1), np.abs(w[:, 64:]).max(axis=1)], axis=1)
  np.testing.assert_array_equal(scale, absmax)
  widest = np.diff(quantize.NF4).max()  # -1 to -0.696: 0.304
  assert widest == pytest.approx(0.3038, abs=1e-4)
  per_row = np.repeat(absmax, 64, axis=1)[:, :96]
  err = np.abs(np.asarray(quantize.dequantize(codes, scale, "nf4")) - w)
  assert (err <= widest / 2 * per_row * (1 + 1e-6)).all()
  assert err.max() > 0.25 * widest / 2 * per_row.min()  # the bound is not vacuous


def test_nf4_keeps_its_own_values_exactly_and_packs_two_rows_per_byte():
  idx = np.random.default_rng(1).integers(0, 16, (64, 3))
  idx[0] = 15  # every column reaches absmax 1 * 0.5
  w = (quantize.NF4[idx] * 0.5).astype(np.float32)
  codes, scale = quantize.quantize(w, "nf4")
  np.testing.assert_array_equal(codes, (idx[0::2] << 4) | idx[1::2])  # the even row high, as bitsandbytes
  np.testing.assert_array_equal(np.asarray(quantize.dequantize(codes, scale, "nf4")), w)


def test_numpy_and_jax_quantize_alike():
  w = _weights()
  for fmt in quantize.CODED:
    host, dev = quantize.quantize(w, fmt), quantize.quantize(jax.numpy.asarray(w), fmt)
    for a, b in zip(host, dev):
      np.testing.assert_array_equal(a, np.asarray(b), err_msg=fmt)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(rank=4, base_dtype="fp8"), r"base_dtype='fp8'; use one of bfloat16, int8, nf4, or None"),
    (dict(base_dtype="nf4"), r"rank=0 trains no adapters over it; set a rank"),
  ],
)
def test_bad_base_dtype_says_what_to_use(kwargs, message):
  with pytest.raises(ConfigError, match=message):
    LoraConfig(**kwargs)


def test_nf4_needs_even_input_sizes():
  with pytest.raises(ConfigError, match=r"intermediate_size=15 is odd; use base_dtype='int8'"):
    ModelConfig(
      family="llama",
      vocab_size=32,
      hidden_size=8,
      intermediate_size=15,
      num_layers=1,
      num_heads=2,
      num_kv_heads=1,
      head_dim=4,
      lora=LoraConfig(rank=2, base_dtype="nf4"),
    )


# ------------------------------------------------------------------ loading and scoring


@pytest.fixture(scope="module")
def qlora(model_dir):
  """The tiny model loaded over a base in each format."""
  return {
    fmt: RewardModel.from_pretrained(model_dir, lora=LoraConfig(rank=4, base_dtype=fmt))
    for fmt in quantize.FORMATS
  }


def test_loader_quantizes_the_checkpoints_weights(tiny_rm, qlora):
  want = flat_params(nnx.state(tiny_rm.model))
  for fmt, rm in qlora.items():
    state = nnx.state(rm.model)
    got = flat_params(state)
    for name in quantize.WEIGHTS:
      key = f"layers.{name}"
      if fmt == "bfloat16":
        assert isinstance(state["layers"][name], nnx.Param) and got[key].dtype == jax.numpy.bfloat16
        np.testing.assert_array_equal(got[key], want[key].astype(jax.numpy.bfloat16))
        continue
      assert isinstance(state["layers"][name], QuantizedWeight)
      assert isinstance(state["layers"][name + quantize.SCALE], QuantizedWeight)
      codes, scale = quantize.quantize(want[key], fmt)
      np.testing.assert_array_equal(got[key], codes, err_msg=f"{fmt} {key}")
      np.testing.assert_array_equal(got[key + quantize.SCALE], scale, err_msg=f"{fmt} {key}")
    # Embeddings, norms, biases and the head stay float32, as loaded.
    for key in ("embed", "final_norm", "score", "layers.input_norm", "layers.q_bias"):
      np.testing.assert_array_equal(got[key], want[key], err_msg=f"{fmt} {key}")
    # Adapters draw what they draw over a float32 base.
    for key, value in flat_params(nnx.state(qlora["bfloat16"].model, LoraParam)).items():
      np.testing.assert_array_equal(got[key], value, err_msg=f"{fmt} {key}")


def test_rewards_over_a_lowered_base_stay_near_float32(tiny_rm, qlora):
  ids, mask = padded_tokens(tiny_rm.config.vocab_size)
  want = np.asarray(tiny_rm.score_tokens(ids, mask))
  for fmt, rm in qlora.items():
    got = np.asarray(rm.score_tokens(ids, mask))
    np.testing.assert_allclose(got, want, rtol=0, atol=REWARD_ATOL[fmt], err_msg=fmt)
    assert not np.array_equal(got, want), fmt  # the base really is lowered


def test_nf4_base_is_about_an_eighth_of_float32(tiny_rm, qlora):
  def nbytes(state, names):
    return sum(v.get_value().nbytes for path, v in nnx.to_flat_state(state) if path[-1] in names)

  stored = [n + s for n in quantize.WEIGHTS for s in ("", quantize.SCALE)]
  f32 = nbytes(nnx.state(tiny_rm.model), quantize.WEIGHTS)
  ratios = {fmt: nbytes(nnx.state(rm.model), stored) / f32 for fmt, rm in qlora.items()}
  assert ratios["bfloat16"] == 0.5
  # int8: 1 byte a weight plus 4 per output channel of 64 or 96 inputs.
  assert 0.25 < ratios["int8"] < 0.27
  # nf4: half a byte a weight plus 4 per block of 64 (the short 32-row blocks of the 96-input
  # down projection cost more): 0.14 to 0.16 of float32; 0.14 for inputs that are whole blocks.
  assert 0.14 <= ratios["nf4"] < 0.16


def test_codes_shard_like_their_weight(model_dir):
  mesh = AbstractMesh((2, 2, 1, 2), sharding.MESH_AXES)
  for fmt in quantize.CODED:
    cfg = model_config_of(model_dir).replace(lora=LoraConfig(rank=4, base_dtype=fmt))
    shardings = sharding.param_shardings(nnx.state(abstract_model(cfg)), mesh)
    specs = {".".join(map(str, path)): s.spec for path, s in nnx.to_flat_state(shardings)}
    assert specs["layers.q"] == P(None, "fsdp", "tensor"), fmt
    assert specs["layers.down"] == P(None, "tensor", "fsdp"), fmt
    # int8's one scale per channel has no input dimension to split; nf4's q has a single block of
    # 64 inputs, which cannot split either, while down's 96 inputs make 2 blocks, as its codes split.
    assert specs["layers.q_scale"] == P(None, None, "tensor"), fmt
    down_scale = P(None, None, "fsdp") if fmt == "int8" else P(None, "tensor", "fsdp")
    assert specs["layers.down_scale"] == down_scale, fmt


# ------------------------------------------------------------------ training and merging


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_training_leaves_the_coded_base_bit_identical(model_dir, fmt):
  cfg = LoraConfig(rank=4, base_dtype=fmt)
  rm = RewardModel.from_pretrained(model_dir, lora=cfg)
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), devices=jax.devices()[:1])
  tx = optim.make_optimizer(optax.constant_schedule(1e-2), weight_decay=0.01)
  before = flat_params(nnx.state(rm.model))
  state, shardings = steps.init_state(
    nnx.state(rm.model), tx, seed=0, mesh=mesh, trainable=lora.trainable_filter(cfg)
  )
  frozen = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(state["frozen"])}
  assert all(
    isinstance(frozen[f"layers.{n}{s}"], QuantizedWeight)
    for n in quantize.WEIGHTS
    for s in ("", quantize.SCALE)
  )
  trained = sorted(flat_params(state["params"]))
  assert all(n.endswith(("_lora_a", "_lora_b")) or n == "score" for n in trained)
  train_step = steps.make_train_step(
    steps.make_loss_fn(rm.model, RewardSpec(), placement=sharding.Placement(mesh)),
    tx,
    lambda _: 1e-2,
    grad_accum_steps=2,
    state_shardings=shardings,
  )
  for batch in demo_batches(rm.tokenizer, 2):
    state, (_, extra) = train_step(state, pipeline.to_global_batch(batch, mesh))
    assert np.isfinite(extra["grad_norm"]) and extra["grad_norm"] > 0
  assert_only_trained_moved(before, flat_params(steps.model_params(state)), trained)


def test_merge_decodes_the_base_into_float_weights(qlora):
  rm = qlora["nf4"]
  graphdef, state = nnx.split(rm.model)
  key = jax.random.key(1)
  for i, (path, var) in enumerate(nnx.to_flat_state(state)):
    if path[-1].endswith("_lora_b"):
      var.set_value(0.05 * jax.random.normal(jax.random.fold_in(key, i), var.get_value().shape))
  adapted = RewardModel(nnx.merge(graphdef, state))
  merged_state = lora.merge(state, rm.config.lora, "float32")
  merged_cfg = rm.config.replace(lora=LoraConfig())
  abstract = abstract_model(merged_cfg)
  assert sorted(flat_params(merged_state)) == sorted(flat_params(nnx.state(abstract)))
  for name in quantize.WEIGHTS:
    var = merged_state["layers"][name]
    assert type(var) is nnx.Param and var.get_value().dtype == np.float32, name
  merged = RewardModel(nnx.merge(nnx.graphdef(abstract), merged_state))
  ids, mask = padded_tokens(rm.config.vocab_size)
  # Decoding, then adding A @ B, reorders float32 sums only (see test_lora.MERGE_ATOL).
  np.testing.assert_allclose(
    merged.score_tokens(ids, mask), adapted.score_tokens(ids, mask), rtol=0, atol=1e-5
  )


def test_backward_pass_keeps_codes_not_decoded_weights(capsys):
  """The decoded weights are recomputed for the backward pass (``quantize.linear`` is
  rematerialised): what the scan saves holds no float [L, in, out] weight."""
  from jaxrm.models.decoder import Decoder

  cfg = ModelConfig(
    family="llama",
    vocab_size=32,
    hidden_size=128,
    intermediate_size=256,
    num_layers=3,
    num_heads=2,
    num_kv_heads=1,
    head_dim=64,
    lora=LoraConfig(rank=2, base_dtype="nf4"),
  )
  graphdef, adapters, rest = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), LoraParam, ...)
  ids = jax.numpy.zeros((2, 8), jax.numpy.int32)
  loss = lambda p: nnx.merge(graphdef, p, rest)(ids, jax.numpy.ones_like(ids)).sum()
  ad_checkpoint.print_saved_residuals(loss, adapters)
  saved = capsys.readouterr().out
  assert "u8[3,64,128]" in saved  # the q codes: [L, in/2, out]
  for shape in ("3,128,128", "3,128,64", "3,128,256", "3,256,128"):
    assert f"f32[{shape}]" not in saved and f"bf16[{shape}]" not in saved, shape
