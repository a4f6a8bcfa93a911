"""Parity of every family with transformers' PyTorch models, on tiny random checkpoints."""

import dataclasses
import json
import re

import hf_tiny
import numpy as np
import pytest
import torch
import transformers
from helpers import PARITY_ATOL

from jaxrm import RewardModel
from jaxrm.errors import CheckpointError
from jaxrm.hf.safetensors_io import SafetensorsFile, save_safetensors
from jaxrm.models.config import config_from_dict, from_hf_config


@pytest.fixture(scope="module", params=hf_tiny.FAMILIES)
def family(request):
  return request.param


@pytest.mark.parametrize("head", ["sequence", "token"])
def test_parity_with_transformers(family, head, tmp_path):
  torch_model = hf_tiny.build(family, head)
  torch_model.save_pretrained(tmp_path)
  rm = RewardModel.from_pretrained(tmp_path, dtype="float32")
  assert rm.config.family == family and rm.config.head == head
  ids, mask = hf_tiny.batch(hf_tiny.LENGTHS)
  expected = hf_tiny.torch_forward(torch_model, ids, mask)
  got = rm.score_tokens(ids, mask)
  if head == "sequence":
    np.testing.assert_allclose(got, expected[:, 0], atol=PARITY_ATOL, rtol=0)
    # Left padding gives the rewards of the unpadded rows.
    lids, lmask = hf_tiny.batch(hf_tiny.LENGTHS, left=True)
    np.testing.assert_allclose(rm.score_tokens(lids, lmask), expected[:, 0], atol=PARITY_ATOL, rtol=0)
  else:
    assert got.shape == (3, max(hf_tiny.LENGTHS), 2)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], expected[real], atol=PARITY_ATOL, rtol=0)


@pytest.mark.parametrize("family", hf_tiny.KERNEL_FAMILIES)
def test_parity_with_transformers_through_the_pallas_kernel(family, tmp_path):
  """The flash kernel (interpret mode off a GPU) in each family's decoder: Gemma 2's soft-capping
  and sliding layers, Qwen's and Mistral's windows, rows of 24 tokens (the kernel pads to 32)."""
  torch_model = hf_tiny.build(family, "sequence")
  torch_model.save_pretrained(tmp_path)
  rm = RewardModel.from_pretrained(tmp_path, dtype="float32", attention_impl="pallas")
  assert rm.config.attention_impl == "pallas"
  ids, mask = hf_tiny.batch(hf_tiny.LENGTHS)
  expected = hf_tiny.torch_forward(torch_model, ids, mask)
  np.testing.assert_allclose(rm.score_tokens(ids, mask), expected[:, 0], atol=PARITY_ATOL, rtol=0)


# ------------------------------------------------------------------ Gemma 3's own layouts


def assert_scores_like(torch_model, path, **overrides):
  rm = RewardModel.from_pretrained(path, dtype="float32", **overrides)
  ids, mask = hf_tiny.batch(hf_tiny.LENGTHS)
  expected = hf_tiny.torch_forward(torch_model, ids, mask)[:, 0]
  np.testing.assert_allclose(rm.score_tokens(ids, mask), expected, atol=PARITY_ATOL, rtol=0)
  return rm


def test_gemma3_without_sliding_layers(tmp_path):
  """Every layer full: one rotary embedding (the full layers'), no window."""
  torch_model = hf_tiny.build("gemma3", layer_types=["full_attention"] * 3)
  torch_model.save_pretrained(tmp_path / "src")
  rm = assert_scores_like(torch_model, tmp_path / "src")
  assert (rm.config.sliding_window, rm.config.layer_types, rm.config.sliding_rope) == (None, (), None)
  # Exported, it still has a window, unused: transformers builds the sliding layers' mask regardless.
  rm.save_pretrained(tmp_path / "out")
  exported = transformers.AutoModelForSequenceClassification.from_pretrained(
    tmp_path / "out", dtype=torch.float32, attn_implementation="eager"
  )
  assert set(exported.config.layer_types) == {"full_attention"}
  assert assert_scores_like(exported.eval(), tmp_path / "out").config == rm.config


def test_gemma3_config_before_transformers_5_reads_alike(tmp_path):
  """Older config.json files give rope_theta, rope_scaling, rope_local_base_freq and
  sliding_window_pattern where transformers 5 writes per-layer-type rope_parameters and layer_types."""
  hf_tiny.build("gemma3").save_pretrained(tmp_path)
  current = json.loads((tmp_path / "config.json").read_text())
  old = {k: v for k, v in current.items() if k not in ("rope_parameters", "layer_types")}
  old.update(
    rope_theta=1000.0,
    rope_scaling={"rope_type": "linear", "factor": 2.0},
    rope_local_base_freq=100.0,
    sliding_window_pattern=2,
  )
  assert from_hf_config(old) == from_hf_config(current)


def test_a_runs_model_config_keeps_the_sliding_layers_rope(tmp_path):
  hf_tiny.build("gemma3").save_pretrained(tmp_path)
  cfg = from_hf_config(json.loads((tmp_path / "config.json").read_text()))
  saved = json.loads(json.dumps(dataclasses.asdict(cfg)))  # as a run's model_config.json holds it
  assert cfg.sliding_rope is not None and config_from_dict(saved, "model_config.json") == cfg


def _vision_language_gemma3(seed=0):
  """A Gemma3ForSequenceClassification over a Gemma3Config: the tiny text decoder and a tiny vision
  tower, which text-only inputs leave unused."""
  text = hf_tiny.tiny_config("gemma3")
  vision = transformers.SiglipVisionConfig(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
  )
  config = transformers.Gemma3Config(
    text_config=text, vision_config=vision, mm_tokens_per_image=4, num_labels=1, pad_token_id=hf_tiny.PAD
  )
  torch.manual_seed(seed)
  model = transformers.AutoModelForSequenceClassification.from_config(
    config, attn_implementation="eager", dtype=torch.float32
  )
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.05)
  return model.eval()


def _tensors(path) -> dict[str, np.ndarray]:
  f = SafetensorsFile(str(path / "model.safetensors"))
  return {k: np.array(f.get_tensor(k)) for k in f.keys()}


def _modules_layout(key: str) -> str:
  """transformers' name of a tensor by its modules: ``model.language_model.``, ``model.vision_tower.``."""
  if key in ("score.weight", "language_model.lm_head.weight"):
    return key.removeprefix("language_model.")
  return "model." + key.replace("language_model.model.", "language_model.", 1)


def test_the_text_decoder_of_a_vision_language_gemma3(tmp_path):
  """config.json's text_config, the tensors under language_model.model. (as transformers writes
  them) or model.language_model. (as its modules name them); the vision tower is left."""
  torch_model = _vision_language_gemma3()
  torch_model.save_pretrained(tmp_path)
  written = _tensors(tmp_path)
  assert "language_model.model.norm.weight" in written and any(k.startswith("vision_tower.") for k in written)
  # A causal LM's untied head, which a reward model leaves.
  written["language_model.lm_head.weight"] = written["language_model.model.embed_tokens.weight"]
  save_safetensors(str(tmp_path / "model.safetensors"), written)
  rm = assert_scores_like(torch_model, tmp_path)
  assert rm.config.family == "gemma3" and rm.config.sliding_rope.theta == 100.0

  save_safetensors(str(tmp_path / "model.safetensors"), {_modules_layout(k): v for k, v in written.items()})
  assert_scores_like(torch_model, tmp_path)

  both = {**{_modules_layout(k): v for k, v in written.items()}, **written}
  save_safetensors(str(tmp_path / "model.safetensors"), both)
  both_hold = "tensors 'model.language_model.embed_tokens.weight' and 'language_model.model.embed_tokens.weight' both hold embed"
  with pytest.raises(CheckpointError, match=re.escape(both_hold)):
    RewardModel.from_pretrained(tmp_path)
