"""Pure functions for the decoder's building blocks.

Projections act on 2-D ``[N, D]`` token-by-feature arrays (N = B*T): on CPU that is markedly
faster than 3-D einsums. Attention alone works on ``[B, T, heads, head_dim]``.
"""

from __future__ import annotations

import functools

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


def attention_mask(attention_mask_bt, positions_bt, segment_ids_bt=None, sliding_window=None,
                   branch_ids_bt=None):
  """bool [B, T, S] (query, key): causal, key not padding, same segment, same branch, in the window.

  Causality is by index; the window by position difference, which equals the index difference
  for padded or packed rows and stays right when a packed row restarts or shares positions.

  Args:
    attention_mask_bt: [B, T], 1 for real tokens.
    positions_bt: [B, T] int32 rotary positions.
    segment_ids_bt: [B, T] int32; a token sees only keys of its own segment (packed rows).
    sliding_window: keys at least this many positions back are hidden.
    branch_ids_bt: [B, T] int32 (shared-prompt rows): 0 marks the prefix that every branch of a
      segment shares, b > 0 one branch; a token sees the prefix and its own branch only.
  """
  t = attention_mask_bt.shape[1]
  idx = jnp.arange(t)
  mask = (idx[:, None] >= idx[None, :])[None] & (attention_mask_bt[:, None, :] > 0)
  if segment_ids_bt is not None:
    mask &= segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
  if branch_ids_bt is not None:
    key_branch = branch_ids_bt[:, None, :]
    mask &= (key_branch == 0) | (key_branch == branch_ids_bt[:, :, None])
  if sliding_window is not None:
    mask &= (positions_bt[:, :, None] - positions_bt[:, None, :]) < sliding_window
  return mask


CHUNK = 128  # query block of the attention; keys after a block's last query are skipped


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def dot_product_attention(q_bthd, k_bskd, v_bskd, mask_bts, scale: float, softcap: float | None):
  """Causal grouped-query attention; logits and softmax in float32. Returns [B, T, H, Dh].

  ``mask_bts`` must hide every key after its query, as :func:`attention_mask` does: queries are
  taken in blocks of ``CHUNK``, and each block is multiplied only with the keys up to its last
  query. The backward pass recomputes the attention weights instead of keeping them from the
  forward pass, so a layer holds O(T) activations rather than O(T^2) weights per head.
  """
  q, k, v = _grouped(q_bthd, k_bskd, v_bskd)
  out = []
  for start, end in _chunks(q.shape[3]):
    probs = _attention_weights(q[:, :, :, start:end], k[:, :, :end], mask_bts[:, start:end, :end],
                               scale, softcap)[0]
    out.append(jnp.einsum("bkgts,bksd->bkgtd", probs.astype(v.dtype), v[:, :, :end]))
  return _ungrouped(jnp.concatenate(out, axis=3))


def _chunks(length: int) -> list[tuple[int, int]]:
  return [(s, min(s + CHUNK, length)) for s in range(0, length, CHUNK)]


def _grouped(q_bthd, k_bskd, v_bskd):
  """q [B, K, G, T, Dh] (the G query heads that share key head K), k and v [B, K, S, Dh].

  Batched matrix products in this layout run markedly faster on CPU than with heads inside.
  """
  b, t, h, d = q_bthd.shape
  kv = k_bskd.shape[2]
  q = q_bthd.reshape(b, t, kv, h // kv, d).transpose(0, 2, 3, 1, 4)
  return q, k_bskd.transpose(0, 2, 1, 3), v_bskd.transpose(0, 2, 1, 3)


def _ungrouped(x_bkgtd):
  b, kv, g, t, d = x_bkgtd.shape
  return x_bkgtd.transpose(0, 3, 1, 2, 4).reshape(b, t, kv * g, d)


def _attention_weights(q_bkgtd, k_bksd, mask_bts, scale, softcap):
  """Softmax weights float32 [B, K, G, T, S], and the logits before soft-capping."""
  b, kv, g, t, d = q_bkgtd.shape
  q = q_bkgtd.reshape(b, kv, g * t, d)  # one matrix product per key head
  logits = jnp.einsum("bkqd,bksd->bkqs", q, k_bksd, preferred_element_type=jnp.float32) * scale
  logits = logits.reshape(b, kv, g, t, -1)
  capped = logits if softcap is None else jnp.tanh(logits / softcap) * softcap
  capped = jnp.where(mask_bts[:, None, None], capped, NEG_INF)
  return jax.nn.softmax(capped, axis=-1), logits


def _attention_fwd(q_bthd, k_bskd, v_bskd, mask_bts, scale, softcap):
  out = dot_product_attention(q_bthd, k_bskd, v_bskd, mask_bts, scale, softcap)
  return out, (q_bthd, k_bskd, v_bskd, mask_bts)


def _attention_bwd(scale, softcap, residuals, d_out_bthd):
  q_bthd, k_bskd, v_bskd, mask_bts = residuals
  q, k, v = _grouped(q_bthd, k_bskd, v_bskd)
  d_out = _grouped(d_out_bthd, k_bskd, v_bskd)[0]
  d_q, d_k, d_v = [], jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
  for start, end in _chunks(q.shape[3]):
    q_c, d_out_c, mask_c = q[:, :, :, start:end], d_out[:, :, :, start:end], mask_bts[:, start:end, :end]
    probs, logits = _attention_weights(q_c, k[:, :, :end], mask_c, scale, softcap)
    d_v = d_v.at[:, :, :end].add(jnp.einsum("bkgts,bkgtd->bksd", probs.astype(v.dtype), d_out_c,
                                            preferred_element_type=jnp.float32))
    d_probs = jnp.einsum("bkgtd,bksd->bkgts", d_out_c, v[:, :, :end], preferred_element_type=jnp.float32)
    d_logits = probs * (d_probs - jnp.sum(probs * d_probs, axis=-1, keepdims=True))
    d_logits = jnp.where(mask_c[:, None, None], d_logits, 0.0)
    if softcap is not None:
      d_logits = d_logits * (1.0 - jnp.tanh(logits / softcap) ** 2)
    d_logits = d_logits * scale
    d_q.append(jnp.einsum("bkgts,bksd->bkgtd", d_logits, k[:, :, :end], preferred_element_type=jnp.float32))
    d_k = d_k.at[:, :, :end].add(jnp.einsum("bkgts,bkgtd->bksd", d_logits, q_c,
                                            preferred_element_type=jnp.float32))
  return (_ungrouped(jnp.concatenate(d_q, axis=3)).astype(q_bthd.dtype),
          d_k.transpose(0, 2, 1, 3).astype(k_bskd.dtype),
          d_v.transpose(0, 2, 1, 3).astype(v_bskd.dtype), None)


dot_product_attention.defvjp(_attention_fwd, _attention_bwd)


def fused_attention(q_bthd, k_bskd, v_bskd, mask_bts, *, scale: float, implementation: str):
  """Grouped-query attention through ``jax.nn.dot_product_attention``. Returns [B, T, H, Dh].

  ``implementation="cudnn"`` runs cuDNN's fused kernel (GPU, bfloat16/float16 only); "xla" is the
  same call lowered by XLA. The mask already holds causality; ``is_causal`` lets cuDNN skip the
  upper triangle instead of computing and then masking it.
  """
  return jax.nn.dot_product_attention(q_bthd, k_bskd, v_bskd, mask=mask_bts[:, None], scale=scale,
                                      is_causal=True, implementation=implementation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gated(act, gate_nf, up_nf):
  """``act(gate) * up``, the gated MLP's hidden layer, keeping only ``gate`` and ``up`` for the
  backward pass.

  Differentiated as written, XLA keeps the activation's intermediates too (for SiLU: the sigmoid,
  the activation and the product), each a [N, F] array per layer; here the backward recomputes
  them from ``gate``: 1.1 GB less per training step of a 135M model on 2048 tokens (BENCHMARKS.md).
  """
  return act(gate_nf) * up_nf


def _gated_fwd(act, gate_nf, up_nf):
  return gated(act, gate_nf, up_nf), (gate_nf, up_nf)


def _gated_bwd(act, residuals, d_nf):
  gate_nf, up_nf = residuals
  activated, act_vjp = jax.vjp(act, gate_nf)
  return act_vjp(d_nf * up_nf)[0], d_nf * activated


gated.defvjp(_gated_fwd, _gated_bwd)


def activation(name: str):
  if name == "silu":
    return jax.nn.silu
  if name == "gelu_pytorch_tanh":
    return lambda x: jax.nn.gelu(x, approximate=True)
  raise ValueError(f"unsupported activation {name!r}")
