"""Tiny random transformers models for parity tests, built and saved offline."""

from __future__ import annotations

import numpy as np
import torch
import transformers
from helpers import PAD, VOCAB, tiny_config
from transformers.modeling_layers import GenericForTokenClassification

from jaxrm.models import families

# Each family's tiny config lives in its spec (jaxrm.models.families): small enough to run in
# seconds; GQA everywhere, windows shorter than the test sequences.
FAMILIES = families.names()
# The Pallas kernel's tests take one family per kind of attention: Gemma 3's (a window on some
# layers, no soft-capping) is Mistral's and Gemma 2's; its second rotary base acts before the kernel.
# Phi-3's (a window on every layer) is Mistral's; its fused tensors are split before the kernel.
KERNEL_FAMILIES = tuple(f for f in FAMILIES if f not in ("gemma3", "phi3"))
LENGTHS = [24, 17, 9]  # rows of a parity batch: longer than the sliding windows (8)


def build(family: str, head: str = "sequence", seed: int = 0, **overrides):
  """A randomly initialised ``*ForSequenceClassification`` / ``*ForTokenClassification`` (``head``
  "sequence" or "token"), or ``*ForCausalLM`` ("causal": a verifier's), in float32.

  Every parameter, norms and biases included, is perturbed away from its default init so that a
  weight loaded into the wrong place shows up in the outputs.
  """
  num_labels = 1 if head == "sequence" else 2
  cfg = tiny_config(family, num_labels=num_labels, **overrides)
  cls = auto_class(family, head, cfg)
  torch.manual_seed(seed)
  model = cls.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.05)
  return model.eval()


def auto_class(family: str, head: str, config):
  """transformers' Auto class of a ``head`` model of ``config``. Where transformers has no token
  classifier of the family (Gemma 3), it is given one as transformers writes the others:
  ``GenericForTokenClassification`` over the family's pretrained-model class."""
  if head == "sequence":
    return transformers.AutoModelForSequenceClassification
  if head == "causal":
    return transformers.AutoModelForCausalLM
  auto = transformers.AutoModelForTokenClassification
  if type(config) not in auto._model_mapping:
    decoder = transformers.AutoModel._model_mapping[type(config)]
    pretrained = next(c for c in decoder.__mro__ if c.__name__.endswith("PreTrainedModel"))
    name = families.get(family).architecture + "ForTokenClassification"
    cls = type(name, (GenericForTokenClassification, pretrained), {"config_class": type(config)})
    auto.register(type(config), cls, exist_ok=True)
  return auto


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
