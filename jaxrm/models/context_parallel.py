"""Context parallelism: each row's tokens split over the ``context`` mesh axis.

Everything but attention acts token by token, so XLA splits it along the tokens by itself once the
decoder constrains its activations' ``length`` to the context axis (``sharding.DEFAULT_RULES``).
Attention needs every key of a row. Each device keeps its queries [B, T/c, H, Dh] and all-gathers
the row's keys and values (and each token's ids: index, padding, segment, branch, position) over
the context axis; the gradient of that all-gather is the reduce-scatter of dK and dV. With
grouped-query attention the keys and values are small: Llama-3.1-8B at 128k tokens gathers
128k x 8 kv heads x 128 x 2 (K and V) x 2 bytes = 512 MiB per layer, transiently; each device
receives (c-1)/c of them per layer, as much as a ring passes round, and every mask (causal,
padding, segments, branches, sliding windows crossing a shard boundary) is exact from the gathered
ids, with none of a ring's per-step bookkeeping. Llama 3 trained its long-context stage this way.

Causal attention gives the last tokens the most keys. ``zigzag`` balance deals a row's 2c chunks
of T/(2c) tokens so that shard i holds chunks i and 2c-1-i: every shard then has one early and one
late chunk, and as much work. The decoder stores the tokens in that order for all its layers and
puts the final hidden states back in row order, so that heads and losses never see it.

Each shard multiplies each run of its queries (a chunk) only with the keys up to the run's last
token, and within that skips the key blocks past each query block, as the one-device reference
does: under zigzag that is (2c+1)/(4c) of the work of all keys (measured on 4 CPU devices, 4096
tokens, forward and backward: 2.0x faster, half the temporary memory). The slices are static per
shard and picked by ``lax.switch`` on the shard's index.

``kernel="pallas"`` runs each run through the Pallas flash kernel (:mod:`jaxrm.models.flash_attention`)
instead, against all the row's keys from a traced offset, the run's first row index: the kernel
skips the key blocks past each block of queries itself, so every shard runs the same program, with
no switch, and no [T/c, T] logits are ever held.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxrm import sharding
from jaxrm.models import flash_attention as F
from jaxrm.models import layers as L

KERNELS = ("reference", "pallas")


def storage_order(length: int, context: int, balance: str) -> np.ndarray:
  """int32 [T]: the row index of the token stored at each place (the identity for ``none``).

  Raises:
    ValueError: ``length`` does not split evenly into the shards' chunks.
  """
  chunks = 2 * context if balance == "zigzag" else context
  if length % chunks:
    key = "data.packed_row_length (packed rows) or data.bucket_multiple and data.max_length"
    raise ValueError(
      f"mesh.context={context} with mesh.context_balance={balance!r} splits each row into {chunks} "
      f"equal chunks, but a row has {length} tokens: set {key} to a multiple of {chunks}"
    )
  order = np.arange(length, dtype=np.int32)
  if balance == "none":
    return order
  pieces = order.reshape(chunks, length // chunks)
  return np.concatenate([np.concatenate([pieces[i], pieces[chunks - 1 - i]]) for i in range(context)])


def describe(placement: sharding.Placement | None) -> str | None:
  """The run log's words for the placement's context parallelism; None without it."""
  if placement is None or placement.context == 1:
    return None
  return f"context parallel over {placement.context} devices: all-gather K/V, {placement.context_balance}"


def attention(
  q_bthd,
  k_bskd,
  v_bskd,
  ids: L.TokenIds,
  order: np.ndarray,
  window=None,
  *,
  placement: sharding.Placement,
  scale: float,
  softcap: float | None,
  kernel: str = "reference",
  interpret: bool = False,
):
  """Attention on each device's rows, tokens and heads, with the keys, values and ids of the whole
  row gathered over the context axis. Returns [B, T, H, Dh], sharded as q.

  Args:
    q_bthd, k_bskd, v_bskd: the layer's queries and keys/values, tokens in storage order.
    ids: every token's ids [B, T], in the same order.
    order: int [T], the row index of each stored token (:func:`storage_order`).
    window: the layer's sliding window (traced), or None.
    placement: the mesh whose ``context`` axis splits the tokens, and the rules.
    scale, softcap: the attention's logit scale and soft cap.
    kernel: ``"reference"`` (``layers.dot_product_attention``'s arithmetic) or ``"pallas"`` (the
      flash kernel; padding queries then see no key and get zeros, as without context parallelism).
    interpret: run the Pallas kernel as XLA ops (off a GPU) instead of through Triton.
  """
  if kernel not in KERNELS:
    raise ValueError(f"context_parallel.attention: kernel={kernel!r}; use one of {', '.join(KERNELS)}")
  mesh = placement.mesh
  q_spec, k_spec = placement.attention_specs(q_bthd.shape, k_bskd.shape)
  ids_spec = P(q_spec[0], q_spec[1])
  axis = sharding.CONTEXT_AXIS
  runs = _runs(order, placement.context)
  row_order = np.argsort(order)  # gathered keys, stored order -> row order

  def local(q, k, v, ids, *window):
    gathered = lambda x: jnp.take(
      jax.lax.all_gather(x, axis_name=axis, axis=1, tiled=True), row_order, axis=1
    )
    keys, shard = L.TokenIds(*(gathered(x) for x in ids)), jax.lax.axis_index(axis)
    window = window[0] if window else None
    if kernel == "pallas":
      return _flash_runs(
        runs,
        shard,
        q,
        gathered(k),
        gathered(v),
        keys,
        window,
        scale=scale,
        softcap=softcap,
        interpret=interpret,
      )
    return _causal_runs(runs, scale, softcap, shard, q, gathered(k), gathered(v), ids, keys, window)

  args = (q_bthd, k_bskd, v_bskd, ids) + (() if window is None else (window,))
  specs = (q_spec, k_spec, k_spec, L.TokenIds(*[ids_spec] * len(ids))) + (() if window is None else (P(),))
  return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(*args)


Runs = tuple[tuple[tuple[int, int, int], ...], ...]


def _runs(order: np.ndarray, context: int) -> Runs:
  """For each shard, its tokens as runs of consecutive row indices: (first place on the shard,
  length, row index of the first). The runs sit at the same places on every shard, so that one
  program with a traced offset serves them all: zigzag gives every shard two (the last shard's
  chunks, c-1 and c, meet but are cut as the others'), ``none`` one."""
  shards = order.reshape(context, -1)
  starts = [0, *(np.flatnonzero((np.diff(shards, axis=1) != 1).any(axis=0)) + 1)]
  lengths = np.diff([*starts, shards.shape[1]])
  return tuple(tuple((int(a), int(n), int(shard[a])) for a, n in zip(starts, lengths)) for shard in shards)


def _flash_runs(runs: Runs, shard, q_bthd, k_bskd, v_bskd, keys: L.TokenIds, window, **kernel_args):
  """One shard's attention through the Pallas kernel: each run of its queries against the row's
  keys (in row order), from the run's first row index, which depends on the shard and so is
  traced: one program serves every shard."""
  ids = F.layout_of(keys)
  firsts = jnp.asarray([[first for _, _, first in shard_runs] for shard_runs in runs], jnp.int32)[shard]
  outs = [
    F.flash_attention(
      q_bthd[:, start : start + n], k_bskd, v_bskd, ids, window, q_offset=firsts[i], **kernel_args
    )
    for i, (start, n, _) in enumerate(runs[0])
  ]
  return jnp.concatenate(outs, axis=1)


def _cut(ids: L.TokenIds, start: int, stop: int) -> L.TokenIds:
  return L.TokenIds(*(x[:, start:stop] for x in ids))


def _run_mask(run, q_ids, k_ids, window):
  """A run of queries' mask over the keys up to its last query (the later ones are all hidden)."""
  start, n, first = run
  return L.IdMask(_cut(q_ids, start, start + n), _cut(k_ids, 0, first + n), window, offset=first)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _causal_runs(runs: Runs, scale, softcap, shard, q_bthd, k_bskd, v_bskd, q_ids, k_ids, window):
  """One shard's attention, each run of its queries against the row's keys (in row order) up to
  the run's last query: shard i of c (zigzag) multiplies (2c+1)/(4c) of what all keys would cost.

  ``lax.switch`` on the shard index picks the static slices of that shard. Each run's attention
  (an :class:`~jaxrm.models.layers.IdMask`) is ``lax`` loops over fixed-size blocks, so that a
  branch compiles to the same few block bodies at any row length. The custom VJP keeps the
  residuals every shard shares (q, the gathered k and v, the ids, the output and its lse), so
  that the switch's branches do not each keep their own.
  """
  return _runs_forward(runs, scale, softcap, shard, q_bthd, k_bskd, v_bskd, q_ids, k_ids, window)[0]


def _runs_forward(runs, scale, softcap, shard, q_bthd, k_bskd, v_bskd, q_ids, k_ids, window):
  def branch(shard_runs):
    def forward(q, k, v, q_ids, k_ids, window):
      outs, lses = [], []
      for run in shard_runs:
        start, n, first = run
        out, lse = L.attention_forward(
          q[:, start : start + n],
          k[:, : first + n],
          v[:, : first + n],
          _run_mask(run, q_ids, k_ids, window),
          scale,
          softcap,
        )
        outs.append(out)
        lses.append(lse)
      return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=2)

    return forward

  return jax.lax.switch(shard, [branch(r) for r in runs], q_bthd, k_bskd, v_bskd, q_ids, k_ids, window)


def _causal_runs_fwd(runs, scale, softcap, shard, q_bthd, k_bskd, v_bskd, q_ids, k_ids, window):
  out, lse = _runs_forward(runs, scale, softcap, shard, q_bthd, k_bskd, v_bskd, q_ids, k_ids, window)
  return out, (shard, q_bthd, k_bskd, v_bskd, q_ids, k_ids, window, out, lse)


def _causal_runs_bwd(runs, scale, softcap, residuals, d_out_bthd):
  shard, q_bthd, k_bskd, v_bskd, q_ids, k_ids, window, out_bthd, lse = residuals
  g = q_bthd.shape[2] // k_bskd.shape[2]  # query heads per key head: lse rows per token

  def branch(shard_runs):
    def backward(q, k, v, q_ids, k_ids, window, out, lse, d_out):
      d_q, d_k, d_v = [], jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
      for run in shard_runs:
        start, n, first = run
        here = slice(start, start + n)
        grads = L.attention_backward(
          q[:, here],
          k[:, : first + n],
          v[:, : first + n],
          _run_mask(run, q_ids, k_ids, window),
          out[:, here],
          lse[:, :, start * g : (start + n) * g],
          d_out[:, here],
          scale,
          softcap,
        )
        d_q.append(grads[0])
        d_k = d_k.at[:, : first + n].add(grads[1].astype(jnp.float32))
        d_v = d_v.at[:, : first + n].add(grads[2].astype(jnp.float32))
      return jnp.concatenate(d_q, axis=1), d_k.astype(k.dtype), d_v.astype(v.dtype)

    return backward

  d_q, d_k, d_v = jax.lax.switch(
    shard, [branch(r) for r in runs], q_bthd, k_bskd, v_bskd, q_ids, k_ids, window, out_bthd, lse, d_out_bthd
  )
  return None, d_q, d_k, d_v, None, None, None


_causal_runs.defvjp(_causal_runs_fwd, _causal_runs_bwd)
