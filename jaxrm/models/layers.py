"""Pure functions for the decoder's building blocks.

Projections act on 2-D ``[N, D]`` token-by-feature arrays (N = B*T): on CPU that is markedly
faster than 3-D einsums. Attention alone works on ``[B, T, heads, head_dim]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -1e30  # finite: fully-masked (padding) query rows stay NaN-free


def rms_norm(x, scale, eps: float, gemma: bool):
  """RMSNorm in float32. Gemma scales by (1 + w) before casting back; Llama casts, then scales."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if gemma:
    return (normed * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
  return scale.astype(x.dtype) * normed.astype(x.dtype)


def linear(x_nd, w_df, b_f=None):
  """``x @ w (+ b)`` on a 2-D activation, in the activation's dtype."""
  y = x_nd @ w_df.astype(x_nd.dtype)
  return y if b_f is None else y + b_f.astype(y.dtype)


def rope_tables(positions_bt, inv_freq: np.ndarray):
  """cos, sin: float32 [B, T, head_dim] in transformers' rotate-half layout."""
  angles = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, Dh/2]
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_bthd, cos_btd, sin_btd):
  half = x_bthd.shape[-1] // 2
  rotated = jnp.concatenate([-x_bthd[..., half:], x_bthd[..., :half]], axis=-1)
  cos = cos_btd[:, :, None, :].astype(x_bthd.dtype)
  sin = sin_btd[:, :, None, :].astype(x_bthd.dtype)
  return x_bthd * cos + rotated * sin


def attention_mask(attention_mask_bt, positions_bt, segment_ids_bt=None, sliding_window=None):
  """bool [B, T, S] (query, key): causal, key not padding, same segment, within the window.

  Causality is by index; the window by position difference, which equals the index difference
  for padded or packed rows and stays right when a packed row restarts or shares positions.
  """
  t = attention_mask_bt.shape[1]
  idx = jnp.arange(t)
  mask = (idx[:, None] >= idx[None, :])[None] & (attention_mask_bt[:, None, :] > 0)
  if segment_ids_bt is not None:
    mask &= segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
  if sliding_window is not None:
    mask &= (positions_bt[:, :, None] - positions_bt[:, None, :]) < sliding_window
  return mask


def dot_product_attention(q_bthd, k_bskd, v_bskd, mask_bts, *, scale: float, softcap: float | None):
  """Grouped-query attention; logits and softmax in float32. Returns [B, T, H, Dh]."""
  b, t, h, d = q_bthd.shape
  kv = k_bskd.shape[2]
  q = q_bthd.reshape(b, t, kv, h // kv, d)
  logits = jnp.einsum("btkgd,bskd->bkgts", q, k_bskd, preferred_element_type=jnp.float32) * scale
  if softcap is not None:
    logits = jnp.tanh(logits / softcap) * softcap
  logits = jnp.where(mask_bts[:, None, None], logits, NEG_INF)
  probs = jax.nn.softmax(logits, axis=-1).astype(v_bskd.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v_bskd)
  return out.reshape(b, t, h, d)


def activation(name: str):
  if name == "silu":
    return jax.nn.silu
  if name == "gelu_pytorch_tanh":
    return lambda x: jax.nn.gelu(x, approximate=True)
  raise ValueError(f"unsupported activation {name!r}")
