"""Tiny random transformers models for parity tests, built and saved offline."""

from __future__ import annotations

import numpy as np
import torch
import transformers

VOCAB = 128
PAD = 0

# Small enough to run in seconds; GQA everywhere, windows shorter than the test sequences.
FAMILY_CONFIGS = {
  "llama": dict(
    cls="LlamaConfig",
    kw=dict(
      attention_bias=True,
      mlp_bias=True,
      rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
      },
    ),
  ),
  "mistral": dict(cls="MistralConfig", kw=dict(sliding_window=8)),
  "qwen2": dict(cls="Qwen2Config", kw=dict()),
  "qwen3": dict(cls="Qwen3Config", kw=dict(head_dim=24)),
  "gemma2": dict(
    cls="Gemma2Config",
    kw=dict(
      sliding_window=8,
      attn_logit_softcapping=2.0,
      query_pre_attn_scalar=20,
      head_dim=16,
      hidden_activation="gelu_pytorch_tanh",
      final_logit_softcapping=None,
    ),
  ),
}
FAMILIES = tuple(FAMILY_CONFIGS)
LENGTHS = [24, 17, 9]  # rows of a parity batch: longer than the sliding windows (8)


def tiny_config(family: str, num_labels: int = 1, **overrides):
  spec = FAMILY_CONFIGS[family]
  kw = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=PAD,
    bos_token_id=1,
    eos_token_id=2,
    num_labels=num_labels,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
  )
  kw.update(spec["kw"])
  kw.update(overrides)
  return getattr(transformers, spec["cls"])(**kw)


def build(family: str, head: str = "sequence", seed: int = 0, **overrides):
  """A randomly initialised ``*ForSequenceClassification`` / ``*ForTokenClassification`` in float32.

  Every parameter, norms and biases included, is perturbed away from its default init so that a
  weight loaded into the wrong place shows up in the outputs.
  """
  num_labels = 1 if head == "sequence" else 2
  cfg = tiny_config(family, num_labels=num_labels, **overrides)
  cls = (
    transformers.AutoModelForSequenceClassification
    if head == "sequence"
    else transformers.AutoModelForTokenClassification
  )
  torch.manual_seed(seed)
  model = cls.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.05)
  return model.eval()


def batch(lengths, seed=0, left=False, total=None):
  """Token ids (never the pad id) and a mask for rows of the given lengths, padded right or left."""
  rng = np.random.default_rng(seed)
  t = total or max(lengths)
  ids = np.full((len(lengths), t), PAD, np.int64)
  mask = np.zeros((len(lengths), t), np.int64)
  for i, n in enumerate(lengths):
    row = rng.integers(3, VOCAB, n)
    sl = slice(t - n, t) if left else slice(0, n)
    ids[i, sl], mask[i, sl] = row, 1
  return ids, mask


def torch_forward(model, ids, mask) -> np.ndarray:
  with torch.no_grad():
    return model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
