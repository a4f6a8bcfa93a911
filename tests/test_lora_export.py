"""Exporting a LoRA reward model: merged into a plain HF checkpoint that transformers scores like
jaxrm, or as a peft adapter directory that peft applies over the base checkpoint alike."""

import json
import sys

import hf_tiny
import jax
import numpy as np
import peft
import pytest
import safetensors.numpy
import tiny_run
import torch
import transformers
from flax import nnx
from helpers import IM_END, PARITY_ATOL, right_padded

from jaxrm import RewardModel
from jaxrm.errors import ConfigError
from jaxrm.export import export
from jaxrm.hf.export import save_peft_adapters
from jaxrm.models.lora import LoraConfig

QV = LoraConfig(rank=4, targets=("q_proj", "v_proj"))
ALL = LoraConfig(rank=4, alpha=8, targets="all-linear")

# (family, head, adapters): biases (llama), q/k norms (qwen3), gemma2's sandwich norms; both heads.
CASES = [("llama", "sequence", QV), ("qwen3", "token", ALL), ("gemma2", "sequence", ALL)]
IDS = [f"{f}-{h}-{'qv' if c is QV else 'all'}" for f, h, c in CASES]

HF_CLASSES = {
  "sequence": transformers.AutoModelForSequenceClassification,
  "token": transformers.AutoModelForTokenClassification,
}


def _adapted(family, head, cfg, src):
  """A tiny HF model saved to ``src``, loaded with adapters whose B is random (as after training),
  so that they move the outputs."""
  hf_tiny.build(family, head, seed=7).save_pretrained(src)
  rm = RewardModel.from_pretrained(src, lora=cfg)
  base_scores = _scores(rm)
  key = jax.random.key(3)
  for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(rm.model))):
    if path[-1].endswith("_lora_b"):
      var.set_value(0.05 * jax.random.normal(jax.random.fold_in(key, i), var.get_value().shape))
  # The adapters matter: they move the outputs by far more than the parity tolerance (on average;
  # a single logit may move little by chance).
  assert np.abs(_scores(rm) - base_scores).mean() > 100 * PARITY_ATOL
  return rm


def _batch():
  return hf_tiny.batch(hf_tiny.LENGTHS, seed=1)  # right-padded; no real token is the pad id


def _scores(rm) -> np.ndarray:
  ids, mask = _batch()
  out = rm.score_tokens(ids, mask)
  return out if rm.config.head == "sequence" else out[mask.astype(bool)]


def _torch_scores(model, head) -> np.ndarray:
  ids, mask = _batch()
  logits = hf_tiny.torch_forward(model.eval(), ids, mask)
  return logits[:, 0] if head == "sequence" else logits[mask.astype(bool)]


@pytest.mark.parametrize("family, head, cfg", CASES, ids=IDS)
def test_merged_export_scores_like_the_adapted_model(family, head, cfg, tmp_path):
  rm = _adapted(family, head, cfg, tmp_path / "src")
  rm.save_pretrained(tmp_path / "out")

  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert "lora" not in config and not any("lora" in k for k in config)
  hf, info = HF_CLASSES[head].from_pretrained(
    tmp_path / "out", dtype=torch.float32, attn_implementation="eager", output_loading_info=True
  )
  assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
  np.testing.assert_allclose(_torch_scores(hf, head), _scores(rm), atol=PARITY_ATOL, rtol=0)

  back = RewardModel.from_pretrained(tmp_path / "out")  # jaxrm reads it back as a model without LoRA
  assert back.config == rm.config.replace(lora=LoraConfig())
  np.testing.assert_allclose(_scores(back), _scores(rm), atol=PARITY_ATOL, rtol=0)


@pytest.mark.parametrize("base_dtype", ["nf4", "int8"])
def test_merged_export_decodes_a_quantized_base(base_dtype, tmp_path):
  """QLoRA: the export holds the decoded base plus the adapters, so transformers scores it as jaxrm
  scores the quantized model."""
  rm = _adapted(
    "llama", "sequence", LoraConfig(rank=4, targets="all-linear", base_dtype=base_dtype), tmp_path / "src"
  )
  rm.save_pretrained(tmp_path / "out")
  assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "float32"
  hf = HF_CLASSES["sequence"].from_pretrained(
    tmp_path / "out", dtype=torch.float32, attn_implementation="eager"
  )
  np.testing.assert_allclose(_torch_scores(hf, "sequence"), _scores(rm), atol=PARITY_ATOL, rtol=0)


@pytest.mark.parametrize("family, head, cfg", CASES, ids=IDS)
def test_peft_applies_the_adapters_over_the_base_like_jaxrm(family, head, cfg, tmp_path):
  rm = _adapted(family, head, cfg, tmp_path / "src")
  out = tmp_path / "adapters"
  save_peft_adapters(out, rm.model, base_model_name_or_path=str(tmp_path / "src"))

  # The file holds what peft itself saves for this LoraConfig, under the same names and shapes.
  task = "SEQ_CLS" if head == "sequence" else "TOKEN_CLS"
  reference = peft.get_peft_model(
    HF_CLASSES[head].from_pretrained(tmp_path / "src", dtype=torch.float32),
    peft.LoraConfig(
      task_type=task,
      r=cfg.rank,
      lora_alpha=cfg.alpha,
      target_modules=list(cfg.targets),
      lora_dropout=0.0,
      modules_to_save=["score"],
    ),
  )
  want = {k: tuple(v.shape) for k, v in peft.get_peft_model_state_dict(reference).items()}
  ours = safetensors.numpy.load_file(out / "adapter_model.safetensors")
  assert {k: v.shape for k, v in ours.items()} == want

  config = json.loads((out / "adapter_config.json").read_text())
  assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == (
    "LORA",
    task,
    cfg.rank,
    cfg.alpha,
  )
  assert config["target_modules"] == list(cfg.targets) and config["modules_to_save"] == ["score"]

  base = HF_CLASSES[head].from_pretrained(tmp_path / "src", dtype=torch.float32, attn_implementation="eager")
  loaded = peft.PeftModel.from_pretrained(base, out)
  assert loaded.peft_config["default"].base_model_name_or_path == str(tmp_path / "src")
  # Every tensor of the file landed in the model (a name peft did not know would be left out).
  for k, v in peft.get_peft_model_state_dict(loaded).items():
    np.testing.assert_array_equal(v.numpy(), ours[k], err_msg=k)
  np.testing.assert_allclose(_torch_scores(loaded, head), _scores(rm), atol=PARITY_ATOL, rtol=0)


def test_adapters_only_needs_adapters(tmp_path):
  hf_tiny.build("llama", seed=5).save_pretrained(tmp_path / "src")
  rm = RewardModel.from_pretrained(tmp_path / "src")
  with pytest.raises(ConfigError, match=r"the model has no LoRA adapters \(lora.rank is 0\)"):
    save_peft_adapters(tmp_path / "a", rm.model, base_model_name_or_path=None)

  bad = tiny_run.run(
    [
      sys.executable,
      "-m",
      "jaxrm.export",
      f"--model={tmp_path / 'src'}",
      f"--out={tmp_path / 'b'}",
      "--adapters_only",
    ]
  )
  assert bad.returncode == 2, tiny_run.describe(bad)  # a flag that cannot work here
  assert "the model has no LoRA adapters" in bad.stderr
  assert not (tmp_path / "b").exists()


@pytest.mark.slow
def test_cli_exports_a_lora_run_both_ways(model_dir, tmp_path):
  """A LoRA training run: ``--adapters_only`` names the run's base, and peft over that base, like
  transformers over the merged export, scores as the run's model does."""
  run = str(tmp_path / "run")
  tiny_run.train(
    tiny_run.config(
      model_dir, run, train__max_steps=2, model__lora__rank=4, model__lora__target_modules="q_proj,v_proj"
    )
  )
  ok = tiny_run.run(
    [
      sys.executable,
      "-m",
      "jaxrm.export",
      f"--model={run}",
      f"--out={tmp_path / 'adapters'}",
      "--adapters_only",
    ]
  )
  assert ok.returncode == 0, tiny_run.describe(ok)
  assert f"to {tmp_path / 'adapters'} as peft LoRA adapters (rank 4) in float32" in ok.stdout
  config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
  assert config["base_model_name_or_path"] == model_dir
  rm = export(run, str(tmp_path / "merged"))
  assert np.abs(np.asarray(rm.model.layers.q_lora_b[...])).max() > 0  # training moved B off zero

  chats = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, I think."}],
  ]
  # Rows end "<|im_end|>\n" and are padded with <|im_end|>, the pad id: transformers pools at the
  # last token that is not the pad id, the last real token, where jaxrm reads the reward.
  ids, mask = right_padded([rm.encode(c) for c in chats], pad=IM_END, dtype=np.int64)
  ours = rm.score(chats)
  cls = transformers.AutoModelForSequenceClassification
  base = cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
  with_adapters = peft.PeftModel.from_pretrained(base, tmp_path / "adapters").eval()
  merged = cls.from_pretrained(tmp_path / "merged", dtype=torch.float32, attn_implementation="eager").eval()
  for model in (with_adapters, merged):
    np.testing.assert_allclose(hf_tiny.torch_forward(model, ids, mask)[:, 0], ours, atol=PARITY_ATOL, rtol=0)
