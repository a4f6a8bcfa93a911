"""LoRA runs end to end on the tiny Llama: they train over a base that stays the HF checkpoint's,
save only the adapters and the head, resume exactly, and load back for scoring."""

import os
import shutil
import subprocess

import numpy as np
import orbax.checkpoint as ocp
import pytest
import tiny_run
from flax import nnx
from helpers import flat_params

from jaxrm.data import registry
from jaxrm.data.drops import DropReport
from jaxrm.data.tokenize import TokenizeOptions
from jaxrm.errors import ConfigError
from jaxrm.evaluation import evaluate
from jaxrm.models import lora
from jaxrm.run import checkpointing, run_files
from jaxrm.scoring.reward_model import RewardModel

# Rank 4 on q and v, with dropout (so that resuming must draw the masks an uninterrupted run
# draws); a LoRA learning rate (adapters start at B = 0 and need larger steps).
LORA = dict(
  model__lora__rank=4,
  model__lora__target_modules="q_proj,v_proj",
  model__lora__dropout=0.1,
  train__learning_rate=1e-2,
  eval__val_at_start=True,
)
ADAPTERS = ["layers.q_lora_a", "layers.q_lora_b", "layers.v_lora_a", "layers.v_lora_b", "score"]


def _rows(output_dir, key):
  return {r["step"]: r for r in tiny_run.read_metrics(output_dir) if key in r}


def _du(path: str) -> int:
  """Bytes on disk under ``path`` (as ``du -sb``)."""
  return int(
    subprocess.run(["du", "-sb", path], capture_output=True, text=True, check=True).stdout.split()[0]
  )


@pytest.fixture(scope="module")
def lora_run(model_dir, tmp_path_factory):
  """4 uninterrupted LoRA steps; validation at the start and at steps 2 and 4."""
  out = str(tmp_path_factory.mktemp("lora") / "run")
  tiny_run.train(tiny_run.config(model_dir, out, **LORA))
  return out


def test_lora_run_trains(lora_run):
  val = _rows(lora_run, "validation-train_sample_loss")
  assert list(val) == [0, 2, 4]
  # On the training rows the loss falls from the base model's (step 0: B = 0, the new head).
  assert val[4]["validation-train_sample_loss"] < val[0]["validation-train_sample_loss"] - 0.01
  assert all(np.isfinite(r["train/loss"]) for r in _rows(lora_run, "train/loss").values())


def test_checkpoint_holds_only_adapters_and_head(lora_run, baseline):
  step_dir = os.path.join(lora_run, "checkpoints", "4")
  ckpt = checkpointing.Checkpointer(os.path.join(lora_run, "checkpoints"))
  try:
    saved = ckpt.manager.restore(4, args=ocp.args.Composite(params=ocp.args.StandardRestore()))["params"]
  finally:
    ckpt.close()
  names = sorted(".".join(path) for path in _paths(saved))
  assert names == ADAPTERS
  # The tiny model is mostly its 49k x 64 embedding, which a LoRA checkpoint leaves out.
  lora_size, full_size = _du(step_dir), _du(os.path.join(baseline, "checkpoints", "4"))
  assert lora_size < full_size / 20, (lora_size, full_size)
  print(f"checkpoint of step 4: LoRA {lora_size} bytes, full {full_size} bytes")


def _paths(tree, prefix=()):
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from _paths(value, prefix + (str(key),))
    else:
      yield prefix + (str(key),)


def test_restored_base_is_the_hf_checkpoint_and_scores_like_the_live_model(lora_run, tiny_rm, model_dir):
  rm = RewardModel.from_pretrained(lora_run, step=4)
  assert run_files.RunFiles.read(lora_run).base_model == os.path.abspath(model_dir)
  assert rm.config.lora == lora.LoraConfig(rank=4, dropout=0.1, targets=("q_proj", "v_proj"))
  state = nnx.state(rm.model)
  trained, base = nnx.split_state(state, lora.trainable_filter(rm.config.lora), ...)
  assert sorted(flat_params(trained)) == ADAPTERS
  want = flat_params(nnx.state(tiny_rm.model))
  got = flat_params(base)
  assert sorted(got) == sorted(set(want) - {"score"})
  for name in got:  # bit-identical: training never wrote the base
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  assert not np.array_equal(flat_params(trained)["score"], want["score"])

  # The validation the live state ran at step 4, again with the loaded model. Rows are padded to
  # other lengths here (buckets of 64 instead of 96), which changes float32 sums at ~1e-7.
  records = registry.load_records("demo_arithmetic", None, split="validation", drops=DropReport())[:8]
  metrics = evaluate(rm, records, options=TokenizeOptions(max_length=96))["metrics"]
  live = _rows(lora_run, "validation-default_loss")[4]
  assert metrics["loss"] == pytest.approx(live["validation-default_loss"], abs=1e-5)
  assert metrics["accuracy"] == pytest.approx(live["validation-default_accuracy"], abs=1e-6)


def test_resume_equals_uninterrupted_run(lora_run, model_dir, tmp_path):
  out = str(tmp_path / "run")
  tiny_run.train(tiny_run.config(model_dir, out, **LORA), stop_after_steps=2)
  assert list(tiny_run.train_losses(out)) == [1, 2]
  stopped = str(tmp_path / "stopped")
  shutil.copytree(out, stopped)
  tiny_run.train(tiny_run.config(model_dir, out, **LORA))  # the base is read again; adapters from step 2
  tiny_run.assert_resumed_equals_uninterrupted(out, lora_run, steps=[1, 2, 3, 4])
  assert _rows(out, "validation-default_loss")[4]["validation-default_loss"] == pytest.approx(
    _rows(lora_run, "validation-default_loss")[4]["validation-default_loss"], abs=1e-6
  )

  # Resuming with other adapters is refused before anything trains.
  with pytest.raises(
    ConfigError,
    match=r"holds a run \(checkpoint at step 2\) trained with other settings than this one's:\n"
    r"  model.lora.rank  4 when saved, 8 now\nTo resume it, run with its settings",
  ):
    tiny_run.train(tiny_run.config(model_dir, stopped, **dict(LORA, model__lora__rank=8)))


@pytest.mark.parametrize(
  "overrides, message",
  [
    (dict(model__lora__rank=-2), r"model.lora.rank=-2: LoRA rank=-2; use 0"),
    (
      dict(model__lora__rank=4, model__lora__target_modules="q_proj,qkv"),
      r"model.lora.target_modules='q_proj,qkv': LoRA targets \['qkv'\] are not projections",
    ),
    (
      dict(model__lora__rank=4, model__lora__dropout=1.5),
      r"model.lora.dropout=1.5: LoRA dropout=1.5; use a probability in \[0, 1\)",
    ),
    (dict(model__lora__rank=4, model__lora__alpha=-1.0), r"model.lora.alpha=-1.0: LoRA alpha=-1.0"),
  ],
)
def test_config_errors_name_their_key(model_dir, tmp_path, overrides, message):
  with pytest.raises(ConfigError, match=message):
    tiny_run.train(tiny_run.config(model_dir, str(tmp_path / "run"), **overrides))


def test_lora_over_a_training_run_is_refused(baseline, model_dir, tmp_path):
  c = tiny_run.config(baseline, str(tmp_path / "run"), model__lora__rank=4)
  with pytest.raises(
    ConfigError,
    match=r"model.lora.rank=4 needs an HF checkpoint or .gguf file .* is a "
    r"jaxrm training run: export it first",
  ):
    tiny_run.train(c)


def test_quantized_base_trains_and_loads_back(model_dir, tmp_path):
  out = str(tmp_path / "nf4")
  tiny_run.train(
    tiny_run.config(
      model_dir,
      out,
      **dict(LORA, model__lora__base_dtype="nf4", train__max_steps=2, eval__val_at_start=False),
    )
  )
  rm = RewardModel.from_pretrained(out)
  assert rm.config.lora.base_dtype == "nf4"
  records = registry.load_records("demo_arithmetic", None, split="validation", drops=DropReport())[:8]
  metrics = evaluate(rm, records, options=TokenizeOptions(max_length=96))["metrics"]
  live = _rows(out, "validation-default_loss")[2]
  assert metrics["loss"] == pytest.approx(live["validation-default_loss"], abs=1e-5)
