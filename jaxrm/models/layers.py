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


CHUNK = 128  # block of queries (forward) and of keys (backward) of the reference attention


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def dot_product_attention(q_bthd, k_bskd, v_bskd, mask_bts, scale: float, softcap: float | None):
  """Causal grouped-query attention; logits and softmax in float32. Returns [B, T, H, Dh].

  ``mask_bts`` must hide every key after its query, as :func:`attention_mask` does: the forward
  pass takes queries in blocks of ``CHUNK`` and multiplies each block only with the keys up to
  its last query; the backward pass takes keys in blocks and each only with the queries from its
  first key on. The backward recomputes the attention weights from the logits and each query's
  log-sum-exp kept by the forward pass (as flash attention does), so a layer holds O(T)
  activations rather than O(T^2) weights per head.
  """
  return _attention(q_bthd, k_bskd, v_bskd, mask_bts, scale, softcap)[0]


def _chunks(length: int) -> list[tuple[int, int]]:
  return [(s, min(s + CHUNK, length)) for s in range(0, length, CHUNK)]


def _rows(x_bthd, kv: int):
  """[B, K, T * G, Dh]: for each key head, the rows of its G query heads, token by token, so
  that a block of tokens is a block of rows and each product is one batched matrix product."""
  b, t, h, d = x_bthd.shape
  return x_bthd.reshape(b, t, kv, h // kv, d).transpose(0, 2, 1, 3, 4).reshape(b, kv, t * (h // kv), d)


def _unrows(x_bkrd, t: int):
  b, kv, r, d = x_bkrd.shape
  return x_bkrd.reshape(b, kv, t, r // t, d).transpose(0, 2, 1, 3, 4).reshape(b, t, r // t * kv, d)


def _heads(x_bskd):
  return x_bskd.transpose(0, 2, 1, 3)


def _capped(logits, softcap):
  return logits if softcap is None else jnp.tanh(logits / softcap) * softcap


def _attention(q_bthd, k_bskd, v_bskd, mask_bts, scale, softcap):
  """The output [B, T, H, Dh] and each query's log-sum-exp of its visible logits, float32
  [B, K, T * G] (rows as :func:`_rows`): +inf where a query sees no key, so that the weights the
  backward pass recomputes from it are 0 there (that query's output is unused)."""
  b, t, h, _ = q_bthd.shape
  kv = k_bskd.shape[2]
  g = h // kv
  q, k, v = _rows(q_bthd, kv), _heads(k_bskd), _heads(v_bskd)
  out, lse = [], []
  for start, end in _chunks(t):
    logits = jnp.einsum("bkrd,bksd->bkrs", q[:, :, start * g:end * g], k[:, :, :end],
                        preferred_element_type=jnp.float32) * scale
    logits = _capped(logits, softcap).reshape(b, kv, end - start, g, end)
    logits = jnp.where(mask_bts[:, None, start:end, None, :end], logits, NEG_INF).reshape(b, kv, -1, end)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    unnormalized = jnp.exp(logits - peak)
    total = jnp.sum(unnormalized, axis=-1, keepdims=True)
    out.append(jnp.einsum("bkrs,bksd->bkrd", (unnormalized / total).astype(v.dtype), v[:, :, :end]))
    lse.append(jnp.where(peak > NEG_INF, peak + jnp.log(total), jnp.inf)[..., 0])
  return _unrows(jnp.concatenate(out, axis=2), t), jnp.concatenate(lse, axis=2)


def _attention_fwd(q_bthd, k_bskd, v_bskd, mask_bts, scale, softcap):
  out, lse = _attention(q_bthd, k_bskd, v_bskd, mask_bts, scale, softcap)
  return out, (q_bthd, k_bskd, v_bskd, mask_bts, out, lse)


def _attention_bwd(scale, softcap, residuals, d_out_bthd):
  """Flash attention's backward pass, block by block of keys, in the transposed layout (keys by
  queries) that makes four of its five products plain matrix products on CPU: the weights are
  recomputed as ``exp(logits - lse)`` (exactly 0 where hidden), and the softmax's Jacobian takes
  each query's ``sum(d_out * out)`` instead of a sum over its keys."""
  q_bthd, k_bskd, v_bskd, mask_bts, out_bthd, lse = residuals
  b, t, h, _ = q_bthd.shape
  kv = k_bskd.shape[2]
  g = h // kv
  q, d_out, k, v = _rows(q_bthd, kv), _rows(d_out_bthd, kv), _heads(k_bskd), _heads(v_bskd)
  d_lse = jnp.sum(d_out.astype(jnp.float32) * _rows(out_bthd, kv).astype(jnp.float32), axis=-1)
  mask_bst = mask_bts.transpose(0, 2, 1)
  d_q, d_k, d_v = jnp.zeros(q.shape, jnp.float32), [], []
  for start, end in _chunks(t):
    rows = slice(start * g, None)  # the queries from this block's first key on
    q_c, d_out_c, k_c, v_c = q[:, :, rows], d_out[:, :, rows], k[:, :, start:end], v[:, :, start:end]
    logits = jnp.einsum("bksd,bkrd->bksr", k_c, q_c, preferred_element_type=jnp.float32) * scale
    masked = _capped(logits, softcap).reshape(b, kv, end - start, t - start, g)
    masked = jnp.where(mask_bst[:, None, start:end, start:, None], masked, NEG_INF).reshape(logits.shape)
    # exp(NEG_INF - lse) underflows to exactly 0 where a key is hidden, exp(-inf) where a query
    # sees no key.
    probs = jnp.exp(masked - lse[:, :, None, rows])
    d_v.append(jnp.einsum("bksr,bkrd->bksd", probs.astype(v.dtype), d_out_c, preferred_element_type=jnp.float32))
    d_probs = jnp.einsum("bksd,bkrd->bksr", v_c, d_out_c, preferred_element_type=jnp.float32)
    d_logits = probs * (d_probs - d_lse[:, :, None, rows])
    if softcap is not None:
      d_logits = d_logits * (1.0 - jnp.tanh(logits / softcap) ** 2)
    d_logits = d_logits * scale
    d_k.append(jnp.einsum("bksr,bkrd->bksd", d_logits, q_c, preferred_element_type=jnp.float32))
    d_q = d_q.at[:, :, rows].add(jnp.einsum("bksr,bksd->bkrd", d_logits, k_c, preferred_element_type=jnp.float32))
  return (_unrows(d_q, t).astype(q_bthd.dtype), _heads(jnp.concatenate(d_k, axis=2)).astype(k_bskd.dtype),
          _heads(jnp.concatenate(d_v, axis=2)).astype(v_bskd.dtype), None)


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
