"""Tensors that hold several parameters side by side (Phi-3's ``qkv_proj`` and ``gate_up_proj``):
split on loading, whether from safetensors or GGUF, stacked in a peft adapter, and checked.

The family's parity with transformers (load and export) is in tests/test_models.py and
tests/test_export.py, which take every family of the registry.
"""

import json

import gguf
import hf_tiny
import jax
import numpy as np
import peft
import pytest
import safetensors.numpy
import torch
import transformers
from flax import nnx
from helpers import PARITY_ATOL, VOCAB, flat_params

from jaxrm import RewardModel
from jaxrm.errors import CheckpointError, UnsupportedModelError
from jaxrm.hf.export import save_peft_adapters
from jaxrm.hf.gguf import GGUFCheckpoint
from jaxrm.hf.loader import load_model
from jaxrm.hf.safetensors_io import HFCheckpoint, save_safetensors
from jaxrm.models.config import from_hf_config
from jaxrm.models.lora import LoraConfig

QKV = "model.layers.{i}.self_attn.qkv_proj.weight"
GATE_UP = "model.layers.{i}.mlp.gate_up_proj.weight"


@pytest.fixture(scope="module")
def causal_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("phi3") / "causal"
  hf_tiny.build("phi3", "causal", seed=5).save_pretrained(path)
  return path


def test_split_parts_are_the_rows_of_the_fused_tensors(causal_dir):
  """q, k, v are qkv_proj's rows in that order, gate and up gate_up_proj's; each lands transposed."""
  ckpt = HFCheckpoint(str(causal_dir))
  params = flat_params(nnx.state(load_model(from_hf_config(ckpt.config), ckpt)))
  qkv, gate_up = ckpt.get_tensor(QKV.format(i=1)), ckpt.get_tensor(GATE_UP.format(i=1))
  q, k, v = params["layers.q"][1].T, params["layers.k"][1].T, params["layers.v"][1].T
  assert (q.shape, k.shape, v.shape) == ((64, 64), (32, 64), (32, 64))
  np.testing.assert_array_equal(np.concatenate([q, k, v]), qkv)
  np.testing.assert_array_equal(
    np.concatenate([params["layers.gate"][1].T, params["layers.up"][1].T]), gate_up
  )


# llama.cpp's names of the tiny model's tensors; its Phi-3 files keep the fused tensors whole.
GGUF_NAMES = {
  "model.embed_tokens.weight": "token_embd.weight",
  "model.norm.weight": "output_norm.weight",
  "lm_head.weight": "output.weight",
  "input_layernorm": "attn_norm",
  "post_attention_layernorm": "ffn_norm",
  "self_attn.qkv_proj": "attn_qkv",
  "self_attn.o_proj": "attn_output",
  "mlp.gate_up_proj": "ffn_up",
  "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
  if hf in GGUF_NAMES:
    return GGUF_NAMES[hf]
  layer, module = hf.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
  return f"blk.{layer}.{GGUF_NAMES[module]}.weight"


def test_a_gguf_file_splits_alike(causal_dir, tmp_path):
  """A Phi-3 GGUF file (llama.cpp's names, the fused tensors whole) loads the same parameters as
  the safetensors checkpoint it was written from."""
  hf = HFCheckpoint(str(causal_dir))
  path = str(tmp_path / "phi3.gguf")
  writer = gguf.GGUFWriter(path, "phi3")
  for add, value in dict(
    block_count=3,
    context_length=128,
    embedding_length=64,
    feed_forward_length=96,
    head_count=4,
    head_count_kv=2,
    layer_norm_rms_eps=1e-5,
    rope_dimension_count=16,
    rope_freq_base=10000.0,
    vocab_size=VOCAB,
    sliding_window=8,
  ).items():
    getattr(writer, f"add_{add}")(value)
  for key in hf.keys():
    writer.add_tensor(_gguf_name(key), hf.get_tensor(key))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()

  ckpt = GGUFCheckpoint(path)
  assert QKV.format(i=0) in ckpt.keys() and GATE_UP.format(i=2) in ckpt.keys()
  cfg = from_hf_config(ckpt.config)
  assert (cfg.family, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window) == ("phi3", 2, 16, 8)
  ours, theirs = (flat_params(nnx.state(load_model(cfg, source))) for source in (ckpt, hf))
  assert ours.keys() == theirs.keys()
  for name in ours:
    np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


def test_a_fused_tensor_of_the_wrong_size_names_its_parts(causal_dir, tmp_path):
  ckpt = HFCheckpoint(str(causal_dir))
  tensors = {k: ckpt.get_tensor(k) for k in ckpt.keys()}
  tensors[QKV.format(i=2)] = tensors[QKV.format(i=2)][:-16]  # one key/value head short
  (tmp_path / "config.json").write_text(json.dumps(ckpt.config))
  save_safetensors(str(tmp_path / "model.safetensors"), tensors)
  with pytest.raises(
    CheckpointError,
    match=r"'model\.layers\.2\.self_attn\.qkv_proj\.weight' has shape \(112, 64\), but it should hold 128 "
    r"along axis 0: the parameters layers\.q, layers\.k, layers\.v side by side",
  ):
    RewardModel.from_pretrained(tmp_path)


@pytest.mark.parametrize(
  "rope",
  [
    (
      {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
      "partial_rotary_factor 0.75",
    ),
    ({"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}, "rope type 'longrope'"),
  ],
  ids=["partial", "longrope"],
)
def test_what_the_decoder_cannot_compute_is_refused(causal_dir, rope):
  params, message = rope
  hf = {**HFCheckpoint(str(causal_dir)).config, "rope_parameters": params}
  with pytest.raises(UnsupportedModelError, match=message):
    from_hf_config(hf)


def test_peft_stacks_the_adapters_of_a_fused_module(tmp_path):
  """q and k adapted (of qkv_proj: rank 2r, v's rows zero), up (of gate_up_proj: rank r, gate's
  rows zero) and o: peft over the base scores like jaxrm."""
  src, out = tmp_path / "src", tmp_path / "adapters"
  hf_tiny.build("phi3", "sequence", seed=7).save_pretrained(src)
  rm = RewardModel.from_pretrained(
    src, lora=LoraConfig(rank=2, alpha=4, targets=("q_proj", "k_proj", "o_proj", "up_proj"))
  )
  base_scores = _scores(rm)
  key = jax.random.key(3)
  for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(rm.model))):
    if path[-1].endswith("_lora_b"):
      var.set_value(0.05 * jax.random.normal(jax.random.fold_in(key, i), var.get_value().shape))
  assert np.abs(_scores(rm) - base_scores).mean() > 100 * PARITY_ATOL  # the adapters matter
  save_peft_adapters(out, rm.model, base_model_name_or_path=str(src))

  config = json.loads((out / "adapter_config.json").read_text())
  assert config["target_modules"] == ["o_proj", "qkv_proj", "gate_up_proj"]
  assert (config["r"], config["rank_pattern"], config["alpha_pattern"]) == (
    2,
    {"qkv_proj": 4},
    {"qkv_proj": 8},
  )
  tensors = safetensors.numpy.load_file(out / "adapter_model.safetensors")
  b = tensors["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"]
  assert b.shape == (128, 4) and not b[64:96, :2].any() and not b[:64, 2:].any() and not b[96:].any()
  assert tensors["base_model.model.model.layers.0.mlp.gate_up_proj.lora_A.weight"].shape == (2, 64)

  base = transformers.AutoModelForSequenceClassification.from_pretrained(
    src, dtype=torch.float32, attn_implementation="eager"
  )
  loaded = peft.PeftModel.from_pretrained(base, out)
  ids, mask = hf_tiny.batch(hf_tiny.LENGTHS, seed=1)
  np.testing.assert_allclose(
    hf_tiny.torch_forward(loaded.eval(), ids, mask)[:, 0], _scores(rm), atol=PARITY_ATOL, rtol=0
  )


def _scores(rm) -> np.ndarray:
  return rm.score_tokens(*hf_tiny.batch(hf_tiny.LENGTHS, seed=1))
