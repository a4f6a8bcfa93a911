"""Checkpoints that don't fit the model fail with a message naming the tensor or file."""

import json
import os
import re

import hf_tiny
import jax
import numpy as np
import pytest
from flax import nnx
from helpers import PARITY_ATOL

from jaxrm import RewardModel, sharding
from jaxrm.errors import CheckpointError, UnsupportedModelError
from jaxrm.hf.safetensors_io import HFCheckpoint, SafetensorsFile, save_safetensors


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  path = tmp_path_factory.mktemp("llama")
  hf_tiny.build("qwen2").save_pretrained(path)
  return path


def _rewrite(src, dst, edit):
  os.makedirs(dst, exist_ok=True)
  with open(os.path.join(src, "config.json")) as f:
    cfg = json.load(f)
  f = SafetensorsFile(os.path.join(src, "model.safetensors"))
  tensors = {k: np.array(f.get_tensor(k)) for k in f.keys()}
  edit(cfg, tensors)
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(cfg, f)
  save_safetensors(os.path.join(dst, "model.safetensors"), tensors)
  return dst


def test_missing_key(saved, tmp_path):
  path = _rewrite(saved, tmp_path, lambda c, t: t.pop("model.layers.1.self_attn.k_proj.weight"))
  with pytest.raises(
    CheckpointError, match=re.escape("missing tensor 'model.layers.1.self_attn.k_proj.weight'")
  ):
    RewardModel.from_pretrained(path)


def test_unexpected_key(saved, tmp_path):
  path = _rewrite(
    saved, tmp_path, lambda c, t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)})
  )
  with pytest.raises(CheckpointError, match=re.escape("unexpected tensor 'model.layers.0.mlp.extra.weight'")):
    RewardModel.from_pretrained(path)


def test_shape_mismatch(saved, tmp_path):
  def edit(c, t):
    t["model.layers.2.mlp.up_proj.weight"] = np.zeros((95, 64), np.float32)

  path = _rewrite(saved, tmp_path, edit)
  with pytest.raises(
    CheckpointError,
    match=re.escape(
      "tensor 'model.layers.2.mlp.up_proj.weight' has shape (95, 64), but parameter layers.up expects (96, 64)"
    ),
  ):
    RewardModel.from_pretrained(path)


def test_layer_out_of_range(saved, tmp_path):
  path = _rewrite(saved, tmp_path, lambda c, t: c.update(num_hidden_layers=2))
  with pytest.raises(CheckpointError, match="is for layer 2, but the config has 2 layers"):
    RewardModel.from_pretrained(path)


def test_pytorch_bin_only_is_refused(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(hf_tiny.tiny_config("llama").to_dict()))
  (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
  with pytest.raises(
    CheckpointError, match=r"only pickled PyTorch weights \(pytorch_model.bin\).*save_pretrained"
  ):
    RewardModel.from_pretrained(tmp_path)


def test_unsupported_architecture(tmp_path):
  (tmp_path / "config.json").write_text(
    json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
  )
  with pytest.raises(
    UnsupportedModelError,
    match=r"model_type 'gpt2' \(architectures: GPT2LMHeadModel\) is not supported; jaxrm supports: llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3",
  ):
    RewardModel.from_pretrained(tmp_path)


def test_missing_path(tmp_path):
  with pytest.raises(CheckpointError, match="no such file or directory"):
    RewardModel.from_pretrained(tmp_path / "nope")


def test_sharded_checkpoint_and_bf16(tmp_path):
  """A checkpoint split over two bf16 files with an index loads like the single-file one."""
  import torch

  model = hf_tiny.build("llama")
  with torch.no_grad():  # the float32 reference computes with the bf16-rounded weights
    for p in model.parameters():
      p.copy_(p.bfloat16().float())
  ids, mask = hf_tiny.batch([10, 7])
  expected = hf_tiny.torch_forward(model, ids, mask)[:, 0]
  ref = model.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
  model.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="40KB")
  assert os.path.exists(tmp_path / "model.safetensors.index.json")
  ckpt = HFCheckpoint(str(tmp_path))
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 1
  tensor = ckpt.get_tensor("model.layers.0.self_attn.q_proj.weight")
  assert tensor.dtype.name == "bfloat16"
  np.testing.assert_array_equal(tensor.astype(np.float32), ref)
  rm = RewardModel.from_pretrained(tmp_path, dtype="float32")
  np.testing.assert_allclose(rm.score_tokens(ids, mask), expected, atol=PARITY_ATOL, rtol=0)


def test_base_model_gets_seeded_new_head(tmp_path):
  import transformers

  base = transformers.AutoModelForCausalLM.from_config(hf_tiny.tiny_config("llama"))
  base.save_pretrained(tmp_path)
  a = RewardModel.from_pretrained(tmp_path, seed=3)
  b = RewardModel.from_pretrained(tmp_path, seed=3)
  c = RewardModel.from_pretrained(tmp_path, seed=4)
  w = np.asarray(a.model.score[...])
  np.testing.assert_array_equal(w, np.asarray(b.model.score[...]))
  assert not np.allclose(w, np.asarray(c.model.score[...]))
  assert abs(w.std() - 1 / np.sqrt(64 + 1)) < 0.05
  tok = RewardModel.from_pretrained(tmp_path, head="token")
  assert tok.config.num_labels == 2 and tok.model.score_bias[...].shape == (2,)


def test_token_head_from_sequence_classifier_gets_new_head(saved):
  """A process reward model can start from a saved sequence classifier: its head is replaced."""
  seq = RewardModel.from_pretrained(saved)
  tok = RewardModel.from_pretrained(saved, head="token", seed=5)
  assert tok.config.head == "token" and tok.model.score[...].shape == (64, 2)
  np.testing.assert_array_equal(np.asarray(tok.model.layers.q[...]), np.asarray(seq.model.layers.q[...]))


def test_abstract_load_reads_no_tensor(saved, monkeypatch):
  """load_weights=False: no tensor read; each parameter a ShapeDtypeStruct placed like the loaded one."""
  mesh = sharding.make_mesh(sharding.MeshConfig(1, -1, 1))
  loaded = {m: RewardModel.from_pretrained(saved, mesh=m) for m in (None, mesh)}

  def no_reading(self, key):
    raise AssertionError(f"tensor {key} was read")

  monkeypatch.setattr(HFCheckpoint, "get_tensor", no_reading)
  for m, full in loaded.items():
    rm = RewardModel.from_pretrained(saved, mesh=m, load_weights=False)
    assert rm.config == full.config
    want = dict(nnx.to_flat_state(nnx.state(full.model)))
    got = dict(nnx.to_flat_state(nnx.state(rm.model)))
    assert got.keys() == want.keys()
    for path, var in got.items():
      value, ref = var.get_value(), want[path].get_value()
      assert isinstance(value, jax.ShapeDtypeStruct), path
      assert (value.shape, value.dtype, value.sharding) == (ref.shape, ref.dtype, ref.sharding), path
