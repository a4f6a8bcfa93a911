"""``RewardModel``: a loaded reward model with its tokenizer, ready to score."""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrm.checkpoints.loader import load_model
from jaxrm.checkpoints.safetensors_io import HFCheckpoint
from jaxrm.checkpoints.weight_map import CheckpointError
from jaxrm.models.config import ModelConfig, from_hf_config
from jaxrm.models.decoder import RewardModelModule

log = logging.getLogger(__name__)


def pad_to_bucket(length: int, multiple: int = 64, max_length: int | None = None) -> int:
  """The smallest multiple of ``multiple`` >= length (capped at ``max_length`` when given)."""
  bucket = -(-max(length, 1) // multiple) * multiple
  return min(bucket, max_length) if max_length and length <= max_length else bucket


EMBEDDED_PREFIX = "embedded:"


def resolve_path(path: str) -> str:
  """``embedded:SmolLM2-135M-Instruct`` -> the packaged GGUF; a hub name -> its downloaded snapshot."""
  if path.startswith(EMBEDDED_PREFIX):
    from jaxrm.checkpoints.gguf import embedded_model_path
    return embedded_model_path()
  if not os.path.exists(path) and path.count("/") == 1 and not path.startswith((".", "/")):
    from huggingface_hub import snapshot_download
    try:
      return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja"])
    except Exception as e:  # offline, unknown repo, gated...
      raise CheckpointError(f"{path}: not a local path, and downloading it from the hub failed: {e}") from None
  return path


def open_checkpoint(path: str):
  """A tensor source for an HF checkpoint directory or a ``.gguf`` file."""
  path = resolve_path(path)
  if path.endswith(".gguf"):
    from jaxrm.checkpoints.gguf import GGUFCheckpoint
    return GGUFCheckpoint(path)
  if os.path.isdir(path):
    return HFCheckpoint(path)
  if not os.path.exists(path):
    raise CheckpointError(
        f"{path}: no such file or directory (jaxrm loads local HF checkpoint directories and .gguf files)")
  raise CheckpointError(f"{path}: not a checkpoint directory or a .gguf file")


def _load_tokenizer(source, path: str):
  if hasattr(source, "tokenizer"):
    return source.tokenizer()
  from transformers import AutoTokenizer
  if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
    log.warning("%s has no tokenizer files; rm.tokenizer is None", path)
    return None
  return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


class RewardModel:
  """A reward model (``model``: flax.nnx.Module), its ``config`` and ``tokenizer``."""

  def __init__(self, model: RewardModelModule, tokenizer=None):
    self.model = model
    self.tokenizer = tokenizer
    self._forward = None

  @property
  def config(self) -> ModelConfig:
    return self.model.config

  @classmethod
  def from_pretrained(
      cls,
      path: str | os.PathLike,
      *,
      dtype: str = "float32",
      param_dtype: str | None = None,
      head: str | None = None,
      num_labels: int | None = None,
      mesh: Mesh | None = None,
      seed: int = 0,
      tokenizer: Any = None,
      **config_overrides,
  ) -> "RewardModel":
    """Loads an HF checkpoint directory or a ``.gguf`` file.

    Args:
      path: checkpoint directory (config.json + safetensors) or a .gguf file.
      dtype: compute dtype ("float32" | "bfloat16"); parameters default to the same.
      head: "sequence" (one reward per row) or "token" (per-token logits, for process reward
        models); default: whatever the checkpoint was saved as (a sequence head for base models).
      num_labels: labels of a new head (default 1 for sequence, 2 for token heads).
      mesh: place parameters sharded over this mesh (default: the first device).
      seed: seed of a newly initialised head.
      tokenizer: use this tokenizer instead of the checkpoint's.
    """
    path = resolve_path(os.fspath(path))
    source = open_checkpoint(path)
    overrides = dict(dtype=dtype, param_dtype=param_dtype or dtype, **config_overrides)
    if head is not None:
      overrides["head"] = head
      overrides["head_bias"] = head == "token"
      overrides["num_labels"] = num_labels or (2 if head == "token" else 1)
    elif num_labels is not None:
      overrides["num_labels"] = num_labels
    cfg = from_hf_config(source.config, **overrides)
    model = load_model(cfg, source, mesh=mesh, seed=seed)
    tok = tokenizer if tokenizer is not None else _load_tokenizer(source, path)
    if tok is not None and cfg.pad_token_id is None and tok.pad_token_id is not None:
      model.config = cfg.replace(pad_token_id=tok.pad_token_id)
    return cls(model, tok)

  # ---------------------------------------------------------------- scoring

  def _apply(self, input_ids, attention_mask):
    if self._forward is None:
      graphdef, state = nnx.split(self.model)

      @jax.jit
      def forward(state, input_ids, attention_mask):
        return nnx.merge(graphdef, state)(input_ids, attention_mask)

      self._forward = lambda ids, mask: forward(nnx.state(self.model), ids, mask)
    return self._forward(input_ids, attention_mask)

  def score_tokens(self, input_ids, attention_mask) -> np.ndarray:
    """Rewards float32 [B] at each row's last real token (token heads: logits [B, T, C]).

    Args:
      input_ids: [B, T] int, any padding side.
      attention_mask: [B, T], 1 for real tokens.
    """
    ids = jnp.asarray(np.asarray(input_ids, np.int32))
    mask = jnp.asarray(np.asarray(attention_mask, np.int32))
    return np.asarray(self._apply(ids, mask), np.float32)

  def encode(self, item) -> list[int]:
    """Token ids of one item: a chat (message list, template applied) or plain text."""
    if self.tokenizer is None:
      raise ValueError("this model has no tokenizer; pass tokenizer= to from_pretrained or use score_tokens")
    if isinstance(item, str):
      return list(self.tokenizer(item, add_special_tokens=True)["input_ids"])
    if not self.tokenizer.chat_template:
      raise ValueError("the tokenizer has no chat template; score plain strings instead of message lists")
    ids = self.tokenizer.apply_chat_template(list(item), tokenize=True, add_generation_prompt=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
      ids = ids["input_ids"]
    return list(ids)

  def score(self, items: Sequence[Any], *, batch_size: int = 8, bucket: int = 64) -> np.ndarray:
    """Rewards float32 [N] for chats (message lists) or plain strings, in batches of ``batch_size``.

    Rows are right-padded to a multiple of ``bucket`` tokens so few programs compile.
    """
    encoded = [self.encode(x) for x in items]
    pad = self.config.pad_token_id or 0
    out = []
    for start in range(0, len(encoded), batch_size):
      chunk = encoded[start:start + batch_size]
      t = pad_to_bucket(max(len(x) for x in chunk), bucket)
      ids = np.full((batch_size, t), pad, np.int32)
      mask = np.zeros((batch_size, t), np.int32)
      for i, x in enumerate(chunk):
        ids[i, :len(x)] = x
        mask[i, :len(x)] = 1
      mask[len(chunk):, 0] = 1  # filler rows: one token, result discarded
      out.append(self.score_tokens(ids, mask)[:len(chunk)])
    return np.concatenate(out) if out else np.zeros((0,), np.float32)
