"""Pure functions for the decoder's building blocks.

Projections act on 2-D ``[N, D]`` token-by-feature arrays (N = B*T): on CPU that is markedly
faster than 3-D einsums. Attention alone works on ``[B, T, heads, head_dim]``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.ad_checkpoint import checkpoint_name

NEG_INF = -1e30  # finite: fully-masked (padding) query rows stay NaN-free

ATTENTION_RESIDUALS = "attention_residuals"  # the name of what the attention's backward pass reads
# remat "elementwise": a layer's backward pass keeps the outputs of its products (the projections,
# the attention's output and log-sum-exp) and recomputes from them what only adds or scales (norms,
# rope, the MLP's activation, the residual sums), instead of holding each of those for every layer.
ELEMENTWISE_REMAT = jax.checkpoint_policies.save_from_both_policies(
  jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  jax.checkpoint_policies.save_only_these_names(ATTENTION_RESIDUALS),
)


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


class TokenIds(NamedTuple):
  """What decides which keys a token sees, token by token: each [B, T] int32.

  ``index`` is the token's place in its row as written (causal order), which differs from where it
  is stored when context parallelism deals a row's tokens out of order.
  """

  index: jax.Array
  real: jax.Array  # 1 for a real token, 0 for padding
  segment: jax.Array
  branch: jax.Array
  position: jax.Array


def token_ids(
  attention_mask_bt, positions_bt, segment_ids_bt=None, branch_ids_bt=None, index_bt=None
) -> TokenIds:
  """The :class:`TokenIds` of a batch; no segments or branches are all 0; ``index`` defaults to
  the storage order."""
  zeros = jnp.zeros(attention_mask_bt.shape, jnp.int32)
  if index_bt is None:
    index_bt = jnp.broadcast_to(jnp.arange(attention_mask_bt.shape[1], dtype=jnp.int32), zeros.shape)
  pick = lambda x: zeros if x is None else jnp.asarray(x, jnp.int32)
  return TokenIds(
    pick(index_bt),
    (jnp.asarray(attention_mask_bt) > 0).astype(jnp.int32),
    pick(segment_ids_bt),
    pick(branch_ids_bt),
    pick(positions_bt),
  )


def visible(q: TokenIds, k: TokenIds, sliding_window=None):
  """Who attends to whom, the one rule every attention path applies: the key is not after the
  query (by ``index``), not padding, of the query's segment, of branch 0 or the query's own, and
  fewer than ``sliding_window`` positions back (when given; it may be traced).

  ``q`` and ``k`` hold arrays that broadcast against each other (queries along one axis, keys
  along another); the result is bool of their broadcast shape.
  """
  mask = (q.index >= k.index) & (k.real > 0)
  mask &= q.segment == k.segment
  mask &= (k.branch == 0) | (k.branch == q.branch)
  if sliding_window is not None:
    mask &= (q.position - k.position) < sliding_window
  return mask


def mask_from_ids(q: TokenIds, k: TokenIds, sliding_window=None):
  """bool [B, T, S] (query, key) of queries' ids [B, T] and keys' ids [B, S] (:func:`visible`)."""
  return visible(TokenIds(*(x[:, :, None] for x in q)), TokenIds(*(x[:, None, :] for x in k)), sliding_window)


def attention_mask(
  attention_mask_bt, positions_bt, segment_ids_bt=None, sliding_window=None, branch_ids_bt=None
):
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
  ids = token_ids(attention_mask_bt, positions_bt, segment_ids_bt, branch_ids_bt)
  return mask_from_ids(ids, ids, sliding_window)


@struct.dataclass
class IdMask:
  """A mask kept as its queries' and keys' ids (O(T)), built block by block where it is used:
  queries [B, T], keys [B, S] (e.g. all of a row's keys, gathered), and a window or None.

  ``offset`` (static): the keys are a row's first S tokens in row order and query j is token
  ``offset + j``, so that the key blocks past a block of queries, which causality hides, are
  skipped; None: the keys are in any order, and every block is computed.

  ``blocks`` (static): the (queries, keys) per block of the attention's ``lax`` loops; None:
  ``LOOP_BLOCKS``.
  """

  queries: TokenIds
  keys: TokenIds
  window: jax.Array | None = None
  offset: int | None = struct.field(pytree_node=False, default=None)
  blocks: tuple[int, int] | None = struct.field(pytree_node=False, default=None)


CHUNK = 128  # block of queries (forward) and of keys (backward) of a dense mask's attention


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def dot_product_attention(q_bthd, k_bskd, v_bskd, mask_bts, scale: float, softcap: float | None):
  """Causal grouped-query attention; logits and softmax in float32. Returns [B, T, H, Dh].

  ``mask_bts`` is a bool [B, T, S] that must hide every key after its query, as
  :func:`attention_mask` does: the forward pass takes queries in blocks of ``CHUNK`` and
  multiplies each block only with the keys up to its last query; the backward pass takes keys in
  blocks and each only with the queries from its first key on. Or it is an :class:`IdMask`, whose
  blocks are built from the ids as they are needed (no [T, S] array is ever held) inside
  ``lax`` loops over fixed-size blocks, so that the compiled program and its temporaries do not
  grow with T or S (a dense mask's blocks are unrolled); its keys may be stored in any order
  (every block is computed) or, with an ``offset``, in row order (blocks skipped as for a dense
  mask). The backward recomputes the attention weights from the logits
  and each query's log-sum-exp kept by the forward pass (as flash attention does), so a layer
  holds O(T) activations rather than O(T^2) weights per head.
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


def _attention(q_bthd, k_bskd, v_bskd, mask, scale, softcap):
  """The output [B, T, H, Dh] and each query's log-sum-exp of its visible logits, float32
  [B, K, T * G] (rows as :func:`_rows`): +inf where a query sees no key, so that the weights the
  backward pass recomputes from it are 0 there (that query's output is unused)."""
  if isinstance(mask, IdMask):
    return _loop_attention(q_bthd, k_bskd, v_bskd, mask, scale, softcap)
  b, t, h, _ = q_bthd.shape
  kv = k_bskd.shape[2]
  g = h // kv
  q, k, v = _rows(q_bthd, kv), _heads(k_bskd), _heads(v_bskd)
  out, lse = [], []
  for start, end in _chunks(t):
    logits = (
      jnp.einsum(
        "bkrd,bksd->bkrs", q[:, :, start * g : end * g], k[:, :, :end], preferred_element_type=jnp.float32
      )
      * scale
    )
    logits = _capped(logits, softcap).reshape(b, kv, end - start, g, end)
    logits = jnp.where(mask[:, None, start:end, None, :end], logits, NEG_INF).reshape(b, kv, -1, end)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    unnormalized = jnp.exp(logits - peak)
    total = jnp.sum(unnormalized, axis=-1, keepdims=True)
    # Normalised after the product: a pass over [rows, Dh] instead of over [rows, keys].
    values = jnp.einsum(
      "bkrs,bksd->bkrd", unnormalized.astype(v.dtype), v[:, :, :end], preferred_element_type=jnp.float32
    )
    out.append((values / total).astype(v.dtype))
    lse.append(jnp.where(peak > NEG_INF, peak + jnp.log(total), jnp.inf)[..., 0])
  return _unrows(jnp.concatenate(out, axis=2), t), jnp.concatenate(lse, axis=2)


def _attention_fwd(q_bthd, k_bskd, v_bskd, mask, scale, softcap):
  out, lse = _attention(q_bthd, k_bskd, v_bskd, mask, scale, softcap)
  # Named, so that a layer checkpointed under ``ELEMENTWISE_REMAT`` keeps them: recomputing them
  # would run the attention twice.
  out, lse = checkpoint_name(out, ATTENTION_RESIDUALS), checkpoint_name(lse, ATTENTION_RESIDUALS)
  return out, (q_bthd, k_bskd, v_bskd, mask, out, lse)


def _attention_bwd(scale, softcap, residuals, d_out_bthd):
  """Flash attention's backward pass, block by block of keys, in the transposed layout (keys by
  queries) that makes four of its five products plain matrix products on CPU: the weights are
  recomputed as ``exp(logits - lse)`` (exactly 0 where hidden), and the softmax's Jacobian takes
  each query's ``sum(d_out * out)`` instead of a sum over its keys."""
  q_bthd, k_bskd, v_bskd, mask, out_bthd, lse = residuals
  if isinstance(mask, IdMask):
    return _loop_attention_bwd(scale, softcap, residuals, d_out_bthd)
  b, t, h, _ = q_bthd.shape
  kv = k_bskd.shape[2]
  g = h // kv
  q, d_out, k, v = _rows(q_bthd, kv), _rows(d_out_bthd, kv), _heads(k_bskd), _heads(v_bskd)
  d_lse = jnp.sum(d_out.astype(jnp.float32) * _rows(out_bthd, kv).astype(jnp.float32), axis=-1)
  mask_bst = mask.transpose(0, 2, 1)
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
    d_v.append(
      jnp.einsum("bksr,bkrd->bksd", probs.astype(v.dtype), d_out_c, preferred_element_type=jnp.float32)
    )
    d_probs = jnp.einsum("bksd,bkrd->bksr", v_c, d_out_c, preferred_element_type=jnp.float32)
    d_logits = probs * (d_probs - d_lse[:, :, None, rows])
    if softcap is not None:
      d_logits = d_logits * (1.0 - jnp.tanh(logits / softcap) ** 2)
    d_logits = d_logits * scale
    d_k.append(jnp.einsum("bksr,bkrd->bksd", d_logits, q_c, preferred_element_type=jnp.float32))
    d_q = d_q.at[:, :, rows].add(
      jnp.einsum("bksr,bksd->bkrd", d_logits, k_c, preferred_element_type=jnp.float32)
    )
  return (
    _unrows(d_q, t).astype(q_bthd.dtype),
    _heads(jnp.concatenate(d_k, axis=2)).astype(k_bskd.dtype),
    _heads(jnp.concatenate(d_v, axis=2)).astype(v_bskd.dtype),
    None,
  )


# Blocks of the loop-form attention (an IdMask's path): (queries, keys) per block. Each loop
# step multiplies [K, 512 * G] rows by 1024 keys (Llama-3.1-8B: 64 MiB of float32 logits), large
# enough for an accelerator's matrix units, and the compiled program holds one body per loop
# whatever the row length.
LOOP_BLOCKS = (512, 1024)


def _loop_blocks(t: int, s: int, blocks) -> tuple[int, int]:
  """The (query, key) block sizes for t queries and s keys: a length shorter than its block is
  one block; a longer one that the block does not divide is padded to a multiple of it (padded
  keys are hidden, padded queries' results are dropped), so that every block has one shape."""
  bq, bk = blocks or LOOP_BLOCKS
  return min(bq, t), min(bk, s)


def _padded(x, length: int):
  """``x`` padded with zeros along axis 1 (tokens) to ``length``: padded keys' ids are padding."""
  extra = length - x.shape[1]
  return x if not extra else jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))


def _ids_block(ids: TokenIds, row, start, size: int, rows: int = 1) -> TokenIds:
  """Tokens ``start`` to ``start + size`` of rows ``row`` to ``row + rows`` of each id,
  [rows, size]; ``row`` and ``start`` may be traced."""
  return TokenIds(*(jax.lax.dynamic_slice(x, (row, start), (rows, size)) for x in ids))


def _rows_block(x_bkrd, row, start, size: int, rows: int = 1):
  """[rows, K, size, ...]: rows (or keys) ``start`` on of batch rows ``row`` to ``row + rows``;
  ``row`` and ``start`` may be traced."""
  at = (row, 0, start) + (0,) * (x_bkrd.ndim - 3)
  return jax.lax.dynamic_slice(x_bkrd, at, (rows, x_bkrd.shape[1], size, *x_bkrd.shape[3:]))


def _update_block(x_bkrd, block, row, start):
  """``x_bkrd`` with ``block`` [rows, K, size, ...] written at batch row ``row``, rows ``start`` on."""
  at = (row, 0, start) + (0,) * (x_bkrd.ndim - 3)
  return jax.lax.dynamic_update_slice(x_bkrd, block.astype(x_bkrd.dtype), at)


def _row_and_block(n, blocks: int):
  """The (row, block) of loop step ``n`` over every row's ``blocks`` blocks (``n`` may be traced)."""
  return divmod(n, blocks)


def _rows_per_step(b: int, query_blocks: int, key_blocks: int) -> tuple[int, bool]:
  """The batch rows each loop step takes, and whether it skips hidden blocks: one row, skipping,
  so that a block hidden in one row is skipped there whatever the others hold; all rows, not
  skipping, where each row is a single block (nothing to skip, and one straight-line step
  compiles faster than a loop over rows)."""
  single = query_blocks == key_blocks == 1
  return (b, False) if single else (1, True)


def _if_any(visible, body, state, skip: bool):
  """``body(state)`` where any of ``visible`` is true (or without ``skip``), else ``state``: a
  block of queries and keys that the mask hides entirely (another segment's or branch's, padding,
  outside the window) is never multiplied. It would add exactly 0 to every sum, so skipping it
  changes no result."""
  if not skip:
    return body(state)
  return jax.lax.cond(jnp.any(visible), body, lambda state: state, state)


def _ceil_div(a, b):
  return -(-a // b)


def _fori(lower, upper, body, carry):
  """``lax.fori_loop``, or the body itself where the bounds are static and one step apart: a row
  of one block then compiles to straight-line code (its index static too), as short rows do."""
  if _static(lower, upper) and upper - lower == 1:
    return body(lower, carry)
  return jax.lax.fori_loop(lower, upper, body, carry)


def _static(a, b) -> bool:
  return isinstance(a, int) and isinstance(b, int)


def _min(a, b):
  return min(a, b) if _static(a, b) else jnp.minimum(a, b)


def _max(a, b):
  return max(a, b) if _static(a, b) else jnp.maximum(a, b)


def _loop_attention(q_bthd, k_bskd, v_bskd, mask: IdMask, scale, softcap):
  """:func:`_attention` of an :class:`IdMask` as ``lax`` loops over fixed-size blocks, row by row:
  for each row's block of queries, the key blocks up to its last query (all, without an
  ``offset``) with an online softmax (running peak, sum and weighted values, as flash attention);
  a block the mask hides entirely is skipped. The output and lse are :func:`_attention`'s (+inf
  lse for a query that sees no key); the compiled program holds one block body, so its size and
  temporaries do not grow with B, T or S."""
  b, t, h, dh = q_bthd.shape
  s, kv = k_bskd.shape[1], k_bskd.shape[2]
  g = h // kv
  bq, bk = _loop_blocks(t, s, mask.blocks)
  tp, sp = _ceil_div(t, bq) * bq, _ceil_div(s, bk) * bk
  q, k, v = _rows(_padded(q_bthd, tp), kv), _heads(_padded(k_bskd, sp)), _heads(_padded(v_bskd, sp))
  q_ids, k_ids = (
    TokenIds(*(_padded(x, tp) for x in mask.queries)),
    TokenIds(*(_padded(x, sp) for x in mask.keys)),
  )

  rb, skip = _rows_per_step(b, tp // bq, sp // bk)

  def query_block(n, carry):
    out, lse = carry
    r, i = _row_and_block(n, tp // bq)
    r = r * rb
    q_c, q_ids_c = _rows_block(q, r, i * bq * g, bq * g, rb), _ids_block(q_ids, r, i * bq, bq, rb)

    def key_block(j, state):
      visible = mask_from_ids(q_ids_c, _ids_block(k_ids, r, j * bk, bk, rb), mask.window)

      def attend(state):
        peak, total, acc = state
        k_c, v_c = _rows_block(k, r, j * bk, bk, rb), _rows_block(v, r, j * bk, bk, rb)
        logits = jnp.einsum("bkrd,bksd->bkrs", q_c, k_c, preferred_element_type=jnp.float32) * scale
        logits = _capped(logits, softcap).reshape(rb, kv, bq, g, bk)
        logits = jnp.where(visible[:, None, :, None, :], logits, NEG_INF).reshape(rb, kv, bq * g, bk)
        new_peak = jnp.maximum(peak, jnp.max(logits, axis=-1))
        # While every key so far is hidden the peak is NEG_INF and the hidden keys add weights of
        # exp(0): the first visible key's peak then rescales them by exp(NEG_INF - peak) = 0.
        rescale = jnp.exp(peak - new_peak)
        unnormalized = jnp.exp(logits - new_peak[..., None])
        total = total * rescale + jnp.sum(unnormalized, axis=-1)
        acc = acc * rescale[..., None] + jnp.einsum(
          "bkrs,bksd->bkrd", unnormalized.astype(v.dtype), v_c, preferred_element_type=jnp.float32
        )
        return new_peak, total, acc

      return _if_any(visible, attend, state, skip)

    # The key blocks this block's queries may see: up to its last query's row index.
    stop = sp // bk if mask.offset is None else _min(_ceil_div(mask.offset + (i + 1) * bq, bk), sp // bk)
    zeros = jnp.zeros((rb, kv, bq * g), jnp.float32)
    init = (jnp.full(zeros.shape, NEG_INF, jnp.float32), zeros, jnp.zeros((rb, kv, bq * g, dh), jnp.float32))
    peak, total, acc = _fori(0, stop, key_block, init)
    # A query whose blocks were all skipped (it sees no key: padding) has a total of 0: its output
    # is 0, finite, as the keys and values that later layers read from it must be.
    out = _update_block(out, acc / jnp.where(total > 0, total, 1.0)[..., None], r, i * bq * g)
    lse_c = jnp.where(peak > NEG_INF, peak + jnp.log(total), jnp.inf)
    return out, _update_block(lse, lse_c, r, i * bq * g)

  out = jnp.zeros((b, kv, tp * g, dh), v.dtype)
  out, lse = _fori(0, b // rb * (tp // bq), query_block, (out, jnp.zeros((b, kv, tp * g), jnp.float32)))
  return _unrows(out, tp)[:, :t], lse[:, :, : t * g]


def _loop_attention_bwd(scale, softcap, residuals, d_out_bthd):
  """:func:`_attention_bwd` of an :class:`IdMask` as ``lax`` loops over fixed-size blocks, row by
  row (the same arithmetic): for each row's block of keys, the query blocks from the first that
  may see it (all, without an ``offset``), a block the mask hides entirely skipped; dK and dV of a
  key block are complete after its loop, dQ accumulates in a float32 buffer over the key blocks."""
  q_bthd, k_bskd, v_bskd, mask, out_bthd, lse = residuals
  b, t, h, dh = q_bthd.shape
  s, kv = k_bskd.shape[1], k_bskd.shape[2]
  g = h // kv
  bq, bk = _loop_blocks(t, s, mask.blocks)
  tp, sp = _ceil_div(t, bq) * bq, _ceil_div(s, bk) * bk
  q, d_out = _rows(_padded(q_bthd, tp), kv), _rows(_padded(d_out_bthd, tp), kv)
  k, v = _heads(_padded(k_bskd, sp)), _heads(_padded(v_bskd, sp))
  q_ids, k_ids = (
    TokenIds(*(_padded(x, tp) for x in mask.queries)),
    TokenIds(*(_padded(x, sp) for x in mask.keys)),
  )
  # Padded queries: +inf lse and zero d_out, so their weights and gradients are 0.
  lse = jnp.pad(lse, [(0, 0), (0, 0), (0, (tp - t) * g)], constant_values=jnp.inf)
  d_lse = jnp.sum(d_out.astype(jnp.float32) * _rows(_padded(out_bthd, tp), kv).astype(jnp.float32), axis=-1)

  rb, skip = _rows_per_step(b, tp // bq, sp // bk)

  def key_block(n, carry):
    d_q, d_k, d_v = carry
    r, j = _row_and_block(n, sp // bk)
    r = r * rb
    k_c, v_c, k_ids_c = (
      _rows_block(k, r, j * bk, bk, rb),
      _rows_block(v, r, j * bk, bk, rb),
      _ids_block(k_ids, r, j * bk, bk, rb),
    )

    def query_block(i, state):
      rows = i * bq * g
      visible = mask_from_ids(_ids_block(q_ids, r, i * bq, bq, rb), k_ids_c, mask.window).transpose(0, 2, 1)

      def attend(state):
        d_q, d_k_c, d_v_c = state
        q_c, d_out_c = _rows_block(q, r, rows, bq * g, rb), _rows_block(d_out, r, rows, bq * g, rb)
        logits = jnp.einsum("bksd,bkrd->bksr", k_c, q_c, preferred_element_type=jnp.float32) * scale
        masked = _capped(logits, softcap).reshape(rb, kv, bk, bq, g)
        masked = jnp.where(visible[:, None, :, :, None], masked, NEG_INF).reshape(logits.shape)
        probs = jnp.exp(masked - _rows_block(lse, r, rows, bq * g, rb)[:, :, None])
        d_v_c += jnp.einsum(
          "bksr,bkrd->bksd", probs.astype(v.dtype), d_out_c, preferred_element_type=jnp.float32
        )
        d_probs = jnp.einsum("bksd,bkrd->bksr", v_c, d_out_c, preferred_element_type=jnp.float32)
        d_logits = probs * (d_probs - _rows_block(d_lse, r, rows, bq * g, rb)[:, :, None])
        if softcap is not None:
          d_logits = d_logits * (1.0 - jnp.tanh(logits / softcap) ** 2)
        d_logits = d_logits * scale
        d_k_c += jnp.einsum("bksr,bkrd->bksd", d_logits, q_c, preferred_element_type=jnp.float32)
        d_q_c = _rows_block(d_q, r, rows, bq * g, rb) + jnp.einsum(
          "bksr,bksd->bkrd", d_logits, k_c, preferred_element_type=jnp.float32
        )
        return _update_block(d_q, d_q_c, r, rows), d_k_c, d_v_c

      return _if_any(visible, attend, state, skip)

    # The first query block that may see these keys: from the first query at or after them.
    first = 0 if mask.offset is None else _max(0, j * bk - mask.offset) // bq
    zeros = jnp.zeros((rb, kv, bk, dh), jnp.float32)
    d_q, d_k_c, d_v_c = _fori(first, tp // bq, query_block, (d_q, zeros, zeros))
    return d_q, _update_block(d_k, d_k_c, r, j * bk), _update_block(d_v, d_v_c, r, j * bk)

  init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype))
  d_q, d_k, d_v = _fori(0, b // rb * (sp // bk), key_block, init)
  return (_unrows(d_q, tp)[:, :t].astype(q_bthd.dtype), _heads(d_k)[:, :s], _heads(d_v)[:, :s], None)


dot_product_attention.defvjp(_attention_fwd, _attention_bwd)


def attention_forward(q_bthd, k_bskd, v_bskd, mask, scale: float, softcap: float | None):
  """:func:`dot_product_attention`'s output [B, T, H, Dh] and the log-sum-exp its backward pass
  takes, for a caller that keeps its own residuals (:mod:`jaxrm.models.context_parallel`)."""
  return _attention(q_bthd, k_bskd, v_bskd, mask, scale, softcap)


def attention_backward(
  q_bthd, k_bskd, v_bskd, mask, out_bthd, lse, d_out_bthd, scale: float, softcap: float | None
):
  """(dq, dk, dv) of :func:`dot_product_attention` from :func:`attention_forward`'s output and lse."""
  return _attention_bwd(scale, softcap, (q_bthd, k_bskd, v_bskd, mask, out_bthd, lse), d_out_bthd)[:3]


def fused_attention(q_bthd, k_bskd, v_bskd, mask_bts, *, scale: float, implementation: str):
  """Grouped-query attention through ``jax.nn.dot_product_attention``. Returns [B, T, H, Dh].

  ``implementation="cudnn"`` runs cuDNN's fused kernel (GPU, bfloat16/float16 only); "xla" is the
  same call lowered by XLA. The mask already holds causality; ``is_causal`` lets cuDNN skip the
  upper triangle instead of computing and then masking it.
  """
  return jax.nn.dot_product_attention(
    q_bthd, k_bskd, v_bskd, mask=mask_bts[:, None], scale=scale, is_causal=True, implementation=implementation
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gated(act, gate_nf, up_nf):
  """``act(gate) * up``, the gated MLP's hidden layer, keeping only ``gate`` and ``up`` for the
  backward pass.

  Differentiated as written, XLA keeps the activation's intermediates too (for SiLU: the sigmoid,
  the activation and the product), each a [N, F] array per layer; here the backward recomputes
  them from ``gate``: 1.1 GB less per training step of a 135M model on 2048 tokens (docs/benchmarks.md).
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
