"""HF export: transformers loads it and scores like jaxrm; jaxrm loads it back exactly."""

import json
import os
import struct
import sys

import hf_tiny
import ml_dtypes
import numpy as np
import pytest
import tiny_run
import torch
import transformers
from helpers import IM_END, NL, PARITY_ATOL, assert_same_params, params, right_padded

from jaxrm import RewardModel
from jaxrm.errors import CheckpointError
from jaxrm.export import export
from jaxrm.hf import gguf
from jaxrm.hf.export import MANIFEST
from jaxrm.models import families, lora
from jaxrm.run.run_files import RunFiles


def safetensors_header(path):
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(n))


@pytest.mark.parametrize("head", ["sequence", "token"])
@pytest.mark.parametrize("family", hf_tiny.FAMILIES)
def test_transformers_loads_export_and_scores_like_jaxrm(family, head, tmp_path):
  hf_tiny.build(family, head, seed=3).save_pretrained(tmp_path / "src")
  rm = RewardModel.from_pretrained(tmp_path / "src")
  out = tmp_path / "out"
  rm.save_pretrained(out)

  config = json.loads((out / "config.json").read_text())
  arch = families.get(family).architecture + (
    "ForSequenceClassification" if head == "sequence" else "ForTokenClassification"
  )
  assert config["architectures"] == [arch]
  assert (config["num_labels"], config["pad_token_id"]) == ((1 if head == "sequence" else 2), hf_tiny.PAD)
  task = {"name": "preference" if head == "sequence" else "process"}  # an HF model's, told from its head
  assert config["jaxrm"] == {"reward_stats": None, "step_separator": "\n", "task": task}
  cls = (
    transformers.AutoModelForSequenceClassification
    if head == "sequence"
    else transformers.AutoModelForTokenClassification
  )
  hf, info = cls.from_pretrained(
    out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
  )
  assert type(hf).__name__ == arch
  assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]

  ids, mask = hf_tiny.batch(hf_tiny.LENGTHS, seed=1)  # right-padded; no real token is the pad id
  theirs = hf_tiny.torch_forward(hf.eval(), ids, mask)
  ours = rm.score_tokens(ids, mask)
  if head == "sequence":
    np.testing.assert_allclose(ours, theirs[:, 0], atol=PARITY_ATOL, rtol=0)
  else:
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], theirs[real], atol=PARITY_ATOL, rtol=0)

  back = RewardModel.from_pretrained(out)
  assert back.config == rm.config
  assert back.training_max_length is None  # not trained by jaxrm: the server falls back to 2048
  assert_same_params(rm, back)


def test_prm_export_names_its_classes(tiny_prm, tiny_rm, tmp_path):
  """A process reward model's two classes are named by what they mean: class 1, the probability
  score_steps gives, is "correct"."""
  tiny_prm.save_pretrained(tmp_path / "prm")
  config = json.loads((tmp_path / "prm" / "config.json").read_text())
  assert config["id2label"] == {"0": "incorrect", "1": "correct"}
  assert config["label2id"] == {"incorrect": 0, "correct": 1}
  hf = transformers.AutoModelForTokenClassification.from_pretrained(
    tmp_path / "prm", dtype=torch.float32, attn_implementation="eager"
  ).eval()
  assert hf.config.id2label == {0: "incorrect", 1: "correct"}
  ids, positions = tiny_prm.encode_steps("Q: 2 + 3?", [" 2 + 3 = 5.", " So 5."])
  with torch.no_grad():
    logits = hf(torch.tensor([ids])).logits[0, positions]
  theirs = torch.softmax(logits, -1)[:, hf.config.label2id["correct"]].numpy()
  # transformers' float32 forward against jaxrm's: the parity tolerance of the tests above.
  np.testing.assert_allclose(
    theirs, tiny_prm.score_steps("Q: 2 + 3?", [" 2 + 3 = 5.", " So 5."]), atol=PARITY_ATOL, rtol=0
  )
  assert RewardModel.from_pretrained(tmp_path / "prm").kind == "process"
  tiny_rm.save_pretrained(tmp_path / "rm")  # a preference model's one output keeps transformers' name
  assert json.loads((tmp_path / "rm" / "config.json").read_text())["id2label"] == {"0": "LABEL_0"}


def test_bfloat16_export(tmp_path):
  hf_tiny.build("qwen3", seed=4).save_pretrained(tmp_path / "src")
  rm = RewardModel.from_pretrained(tmp_path / "src")
  export(str(tmp_path / "src"), str(tmp_path / "out"), dtype="bfloat16")
  header = safetensors_header(tmp_path / "out" / "model.safetensors")
  header.pop("__metadata__")
  assert {v["dtype"] for v in header.values()} == {"BF16"}
  assert header["model.layers.2.self_attn.q_proj.weight"]["shape"] == [4 * 24, 64]  # [out, in]
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert config["torch_dtype"] == "bfloat16"
  back = RewardModel.from_pretrained(tmp_path / "out", dtype="bfloat16")
  for k, v in params(rm).items():
    np.testing.assert_array_equal(params(back)[k], v.astype(ml_dtypes.bfloat16), err_msg=str(k))


def test_export_refuses_a_run_directory(tmp_path):
  hf_tiny.build("llama").save_pretrained(tmp_path / "src")
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "model_config.json").write_text("{}")
  with pytest.raises(CheckpointError, match=f"{tmp_path / 'run'} is a training output directory"):
    export(str(tmp_path / "src"), str(tmp_path / "run"))


def test_embedded_gguf_export_scores_like_jaxrm(smollm2_tokenizer, tmp_path):
  """SmolLM2-135M from its GGUF (with a new, seeded head): the export scores alike in transformers."""
  rm = RewardModel.from_pretrained(gguf.embedded_model_path(), seed=2, tokenizer=smollm2_tokenizer)
  rm.save_pretrained(tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["architectures"] == ["LlamaForSequenceClassification"] and config["tie_word_embeddings"]
  assert config["pad_token_id"] == smollm2_tokenizer.pad_token_id == smollm2_tokenizer.eos_token_id == 2
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype=torch.float32).eval()
  tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
  assert tok.chat_template == smollm2_tokenizer.chat_template

  chats = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, I think."}],
  ]
  rows = [rm.encode(c) for c in chats]
  assert (
    rows[0] == tok(tok.apply_chat_template(chats[0], tokenize=False), add_special_tokens=False)["input_ids"]
  )
  ids, mask = right_padded(rows, pad=IM_END, dtype=np.int64)
  # Rows end "<|im_end|>\n": transformers pools at the last token that is not the pad (== eos) id,
  # which is the last real token, where jaxrm reads the reward.
  assert all(r[-2:] == [IM_END, NL] for r in rows)
  theirs = hf_tiny.torch_forward(hf, ids, mask)[:, 0]
  np.testing.assert_allclose(rm.score(chats), theirs, atol=PARITY_ATOL, rtol=0)


def test_cli(tmp_path):
  hf_tiny.build("mistral", seed=5).save_pretrained(tmp_path / "src")
  ok = tiny_run.run(
    [
      sys.executable,
      "-m",
      "jaxrm.export",
      f"--model={tmp_path / 'src'}",
      f"--out={tmp_path / 'out'}",
      "--dtype=bfloat16",
    ]
  )
  assert ok.returncode == 0, tiny_run.describe(ok)
  assert f"to {tmp_path / 'out'} as MistralForSequenceClassification in bfloat16" in ok.stdout
  assert sorted(os.listdir(tmp_path / "out")) == ["config.json", MANIFEST, "model.safetensors"]

  missing = tmp_path / "missing"
  bad = tiny_run.run(
    [
      sys.executable,
      "-m",
      "jaxrm.export",
      f"--model={missing}",
      f"--out={tmp_path / 'out2'}",
      "--step=3",
    ]
  )
  assert bad.returncode == 1
  assert bad.stderr.strip() == (
    f"error: {missing}: no such file or directory (jaxrm loads HF checkpoint "
    "directories, .gguf files, training output directories and their checkpoints)"
  )
  assert not os.path.exists(tmp_path / "out2")


def sharded(model, out):
  """``model`` saved by transformers in shards with their index, as a large model is."""
  model.save_pretrained(out, max_shard_size="20KB")
  names = os.listdir(out)
  assert "model.safetensors.index.json" in names and "model.safetensors" not in names
  return sorted(names)


def test_export_over_an_earlier_export_removes_the_files_it_does_not_rewrite(tiny_rm, tmp_path):
  """An earlier export with a tokenizer: its files that this one does not write are removed, and
  the manifest lists what is there now."""
  out = tmp_path / "out"
  tiny_rm.save_pretrained(out)
  assert "tokenizer.json" in json.loads((out / MANIFEST).read_text())["files"]
  hf_tiny.build("llama", seed=2).save_pretrained(tmp_path / "src")  # no tokenizer
  export(str(tmp_path / "src"), str(out))
  assert sorted(os.listdir(out)) == ["config.json", MANIFEST, "model.safetensors"]
  assert json.loads((out / MANIFEST).read_text()) == {"files": ["config.json", "model.safetensors"]}
  assert_same_params(RewardModel.from_pretrained(out), RewardModel.from_pretrained(tmp_path / "src"))


def listing(directory):
  return {n: os.stat(directory / n, follow_symlinks=False).st_mtime_ns for n in os.listdir(directory)}


def test_a_model_folder_without_a_manifest_is_refused_naming_its_files(tmp_path):
  """A user's sharded checkpoint is not an earlier export: nothing in it is written or removed."""
  out = tmp_path / "out"
  names = sharded(hf_tiny.build("llama", seed=1), out)
  before = listing(out)
  hf_tiny.build("llama", seed=2).save_pretrained(tmp_path / "src")
  with pytest.raises(CheckpointError) as e:
    export(str(tmp_path / "src"), str(out))
  assert str(e.value) == (
    f"{out} holds {', '.join(names)}, a model's files that no jaxrm export wrote (no {MANIFEST} "
    "lists them): an export replaces only the files of an earlier export; export into a new or "
    "empty directory, or move them out of it"
  )
  assert listing(out) == before


def test_export_refuses_a_folder_holding_other_files(tmp_path):
  out = tmp_path / "out"
  hf_tiny.build("llama", seed=2).save_pretrained(tmp_path / "src")
  export(str(tmp_path / "src"), str(out))
  (out / "notes.txt").write_text("mine")
  (out / "eval").mkdir()
  before = listing(out)
  with pytest.raises(
    CheckpointError, match=f"^{out} holds eval, notes.txt, which no earlier export there wrote"
  ):
    export(str(tmp_path / "src"), str(out))
  assert listing(out) == before  # nothing written


def test_links_in_the_output_folder_are_replaced_not_written_through(tmp_path):
  hf_tiny.build("llama", seed=2).save_pretrained(tmp_path / "src")
  target = tmp_path / "elsewhere.json"
  target.write_text("theirs")
  fresh = tmp_path / "fresh"
  fresh.mkdir()
  (fresh / "config.json").symlink_to(target)  # not an export's: refused
  with pytest.raises(CheckpointError, match=r"holds config\.json \(a link\), a model's files"):
    export(str(tmp_path / "src"), str(fresh))
  out = tmp_path / "out"
  export(str(tmp_path / "src"), str(out))
  (out / "config.json").unlink()
  (out / "config.json").symlink_to(target)  # an export's file, now a link: replaced
  export(str(tmp_path / "src"), str(out))
  assert target.read_text() == "theirs"
  assert not (out / "config.json").is_symlink()
  assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]


def test_export_into_the_folder_a_run_loads_its_base_from_is_refused(tmp_path):
  """A LoRA run's base, exported over by the run itself, would change what the run scores."""
  base = tmp_path / "base"
  hf_tiny.build("llama", seed=1).save_pretrained(base)
  export(str(base), str(tmp_path / "base_export"))  # an export: the manifest would allow it
  run = tmp_path / "run"
  (run / "tokenizer").mkdir(parents=True)
  cfg = RewardModel.from_pretrained(base, load_weights=False).config
  RunFiles(
    str(run), cfg.replace(lora=lora.LoraConfig(rank=2)), base_model=str(tmp_path / "base_export")
  ).write(None)
  before = listing(tmp_path / "base_export")
  with pytest.raises(CheckpointError) as e:
    export(str(run), str(tmp_path / "base_export"))
  assert str(e.value) == (
    f"{tmp_path / 'base_export'} holds the base model that {run} loads its LoRA adapters over; "
    "exporting into it would change that run's scores: export into another directory"
  )
  with pytest.raises(CheckpointError, match="is the directory the model is read from"):
    export(str(tmp_path / "base_export"), str(tmp_path / "base_export"))
  assert listing(tmp_path / "base_export") == before


def test_an_index_beside_a_single_weights_file_is_read_as_transformers_reads_it(tmp_path, caplog):
  """transformers reads model.safetensors before a sharded index; jaxrm reads the same weights."""
  both = tmp_path / "both"
  sharded(hf_tiny.build("llama", seed=1), both)
  hf_tiny.build("llama", seed=2).save_pretrained(tmp_path / "single")
  os.link(tmp_path / "single" / "model.safetensors", both / "model.safetensors")
  theirs = transformers.AutoModelForSequenceClassification.from_pretrained(both, dtype=torch.float32)
  single = transformers.AutoModelForSequenceClassification.from_pretrained(
    tmp_path / "single", dtype=torch.float32
  )
  for (name, a), (_, b) in zip(theirs.state_dict().items(), single.state_dict().items()):
    assert torch.equal(a, b), name
  assert_same_params(RewardModel.from_pretrained(both), RewardModel.from_pretrained(tmp_path / "single"))
  assert "reading model.safetensors, as transformers does" in caplog.text
