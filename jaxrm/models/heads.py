"""Reward heads on the decoder's final hidden states, and what their outputs mean.

A sequence head reads one reward per row at the row's last real token (or, in packed rows, at
given positions); a token head gives ``num_labels`` logits at every position, for process reward
models, whose class 1 means "this step is correct"; a verifier head reads, where a sequence head
would, the log-odds of two answer tokens from the LM head (:mod:`jaxrm.tasks.verifier`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrm.models import layers as L
from jaxrm.models.config import ModelConfig


def head_init(cfg: ModelConfig):
  """Initializer of a new reward head: normal(0, 1/sqrt(hidden + 1))."""
  return jax.nn.initializers.normal(1.0 / np.sqrt(cfg.hidden_size + 1))


def last_token_index(attention_mask_bt):
  """int32 [B]: index of the last real token of each row, for left or right padding."""
  t = attention_mask_bt.shape[1]
  return (t - 1 - jnp.argmax(jnp.flip(attention_mask_bt > 0, axis=1), axis=1)).astype(jnp.int32)


def sequence_rewards(h_btd, w_dc, bias_c, attention_mask_bt, reward_positions_br=None):
  """Float32 rewards [B] (one label) or [B, C] at each row's last real token.

  With ``reward_positions_br`` [B, R] int32 (packed rows), rewards [B, R] ([B, R, C]) at those
  indices instead; slots of -1 are unused and read 0.
  """
  w = w_dc.astype(jnp.float32)
  if reward_positions_br is not None:
    h_read = jnp.take_along_axis(h_btd, jnp.maximum(reward_positions_br, 0)[..., None], axis=1)  # [B, R, D]
    b, r, d = h_read.shape
    rewards = L.linear(h_read.reshape(b * r, d).astype(jnp.float32), w, bias_c).reshape(b, r, -1)
    rewards = jnp.where(reward_positions_br[..., None] >= 0, rewards, 0.0)
  else:
    last = last_token_index(attention_mask_bt)
    h_last = jnp.take_along_axis(h_btd, last[:, None, None], axis=1)[:, 0]  # [B, D]
    rewards = L.linear(h_last.astype(jnp.float32), w, bias_c)
  return rewards[..., 0] if w_dc.shape[-1] == 1 else rewards


def verifier_log_odds(h_btd, w_d2, attention_mask_bt, reward_positions_br=None, softcap: float | None = None):
  """Float32 ``z_yes - z_no`` [B] at each row's last real token ([B, R] at ``reward_positions_br``,
  0 in unused slots), ``w_d2`` [D, 2] being the LM head's columns of the two answers.

  Only the two answers' logits are computed: ``log p(yes) - log p(no)`` needs no other, the
  softmax's normaliser cancelling. ``softcap`` is the LM head's final soft-capping (Gemma 2), which
  acts on each logit before the difference.
  """
  logits = sequence_rewards(h_btd, w_d2, None, attention_mask_bt, reward_positions_br)  # [..., 2]
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  return logits[..., 0] - logits[..., 1]


def token_logits(h_btd, w_dc, bias_c):
  """Float32 logits [B, T, C] at every position."""
  b, t, d = h_btd.shape
  logits = L.linear(h_btd.reshape(b * t, d).astype(jnp.float32), w_dc.astype(jnp.float32), bias_c)
  return logits.reshape(b, t, w_dc.shape[-1])


def correct_probability(logits_sc: np.ndarray) -> np.ndarray:
  """P(step correct) [S] of a process reward model's logits [S, C] at step tokens: class 1 (any
  leading shape: [..., C] -> [...])."""
  logits_sc = np.asarray(logits_sc, np.float32)
  e = np.exp(logits_sc - logits_sc.max(-1, keepdims=True))
  return e[..., 1] / e.sum(-1)
