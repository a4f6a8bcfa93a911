"""Flash attention as Pallas kernels, masked per block from per-token ids instead of a dense mask.

One kernel serves jaxrm's three row layouts: right-padded rows, packed rows (block-diagonal
causal) and shared-prompt rows (a tree: each branch sees the prompt and itself). Who may attend to
whom is read from a :class:`Layout` of per-token int32 arrays, so no [B, T, S] mask is built or
read; blocks of keys after a block of queries (causal) or before its earliest segment (packed
rows) are skipped, not computed and then masked.

The queries may be a slice of their row that starts at ``q_offset`` (which may be traced), against
the row's first keys: context parallelism (:mod:`jaxrm.models.context_parallel`) gives each
device slices of a row's queries and gathers the row's keys, and the shards share one program.

The design follows ``jax.experimental.pallas.ops.gpu.attention`` (forward with a log-sum-exp
residual, backward recomputing the weights block by block), with separate dq and dk/dv kernels so
that grouped-query heads can sum their dk/dv inside the kernel. On a GPU the kernels lower through
Triton; elsewhere ``interpret=True`` runs them as ordinary XLA ops (slow: for tests). JAX has
announced the removal of Pallas's Triton lowering: :func:`triton_missing` says whether this JAX
still has it, and the attention route (``decoder.attention_route``) takes the next one where not.

The tiles are chosen per GPU (:func:`blocks_for`) from each kernel's shared memory and registers,
as the GPU compiler counts them, against what the GPU offers a block.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from jaxrm.models import layers as L
from jaxrm.models.layers import NEG_INF

LENGTH_MULTIPLE = 16  # rows are padded to this; Triton's matrix products need blocks of >= 16
NO_WINDOW = 2**30  # a window wider than any row: the full-attention layers of a sliding model
# What a GPU lowering of the kernels imports: the public Triton API (its CompilerParams) and the
# module JAX's own pallas_call lowering takes for Triton.
TRITON_MODULES = ("jax.experimental.pallas.triton", "jax._src.pallas.triton.pallas_call_registration")

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Rows per tile; each is reduced to the largest power of two (>= 16) that divides the length.

  Forward and dq programs hold ``q`` queries and loop over keys ``k`` at a time; dk/dv programs
  hold ``k_dkv`` keys and loop over queries ``q_dkv`` at a time. The defaults follow
  ``jax.experimental.pallas.ops.gpu.attention``'s and are not tuned for a particular GPU.
  """

  q: int = 64
  k: int = 64
  q_dkv: int = 32
  k_dkv: int = 32

  def shared_memory(self, head_dim: int, itemsize: int = 2) -> dict[str, int]:
    """Bytes of shared memory each kernel asks per program, as Triton counts them for sm90 at
    ``NUM_STAGES`` (measured by compiling for a GPU offering too little, whose refusal names the
    bytes): exact for tiles of 64 rows and more, above the count for smaller ones. The forward
    and dq kernels hold their queries (dq: and their output's gradient) and stage keys and values
    per stage; the dk/dv kernel holds its keys and values, stages queries, output gradients and
    their rows' log-sum-exp and delta, and keeps its weights as an operand of the second product.
    """
    d = _head_dim(head_dim)
    keys = 2 * NUM_STAGES * self.k * d * itemsize + 8 * self.k  # + the keys' int32 ids
    return {
      "forward": self.q * d * itemsize + keys,
      "dq": 2 * self.q * d * itemsize + keys,
      "dkv": self.q_dkv * (2 * NUM_STAGES * d * itemsize + 16)
      + 2 * self.k_dkv * d * itemsize
      + self.q_dkv * self.k_dkv * itemsize,
    }

  def registers(self, head_dim: int) -> dict[str, int]:
    """float32 values each thread of a program keeps live: its accumulators (forward: the output;
    dq: dq; dk/dv: both) and the block's logits and weights."""
    d = _head_dim(head_dim)
    threads = 32 * _num_warps(d)
    return {
      "forward": (self.q * d + 2 * self.q * self.k) // threads,
      "dq": (self.q * d + 2 * self.q * self.k) // threads,
      "dkv": (2 * self.k_dkv * d + 2 * self.q_dkv * self.k_dkv) // threads,
    }

  def fits(self, shared_memory_per_block: int, head_dim: int, itemsize: int = 2) -> bool:
    """Whether every kernel's tiles fit a GPU that gives a block ``shared_memory_per_block``
    bytes, with at most ``REGISTERS_PER_THREAD`` live float32 values a thread."""
    smem, regs = self.shared_memory(head_dim, itemsize), self.registers(head_dim)
    return max(smem.values()) <= shared_memory_per_block and max(regs.values()) <= REGISTERS_PER_THREAD


NUM_STAGES = 2  # Triton's software pipelining depth: keys (or queries) in flight per loop
# Half of a thread's 255 registers for live float32 values; the rest hold the operands, addresses
# and ids. A tile past it spills to local memory, which the shared-memory check does not see.
REGISTERS_PER_THREAD = 128
TILE_ROWS = (128, 64, 32, 16)
# Shared memory a block may opt into, by compute capability (CUDA's programming guide, "Technical
# Specifications"); and the capability of the GPUs known by name, for devices that report their
# kind but no capability (the compile-only ones of jaxrm.planning.gpu_targets, whose specs agree: tested).
SHARED_MEMORY_BY_CAPABILITY = {(9, 0): 232448, (10, 0): 232448, (8, 0): 166912, (8, 7): 166912}
SHARED_MEMORY_DEFAULT = 101376  # sm86 / sm89 and later consumer GPUs: 99 KiB
CAPABILITY_BY_NAME = {
  **dict.fromkeys(("H100", "H200", "H800", "GH200"), (9, 0)),
  **dict.fromkeys(("B100", "B200", "GB200"), (10, 0)),
  **dict.fromkeys(("A100", "A800", "A30"), (8, 0)),
}
GENERIC = BlockSizes()  # interpret mode's (off a GPU), and the tiles of a direct call


def blocks_for(device, head_dim: int, dtype=jnp.bfloat16) -> BlockSizes:
  """The tiles for the kernels of ``head_dim`` on ``device`` (a JAX device, possibly a compile-only
  GPU of :mod:`jaxrm.planning.gpu_targets`): the largest that fit its shared memory and registers
  (:meth:`BlockSizes.fits`). Forward and dq share theirs; of equal areas, more resident rows.
  Anything but a GPU (interpret mode) gets :data:`GENERIC`."""
  smem = shared_memory_per_block(device)
  if smem is None:
    return GENERIC
  itemsize = jnp.dtype(dtype).itemsize
  by_area = sorted(((q, k) for q in TILE_ROWS for k in TILE_ROWS), key=lambda qk: (-qk[0] * qk[1], -qk[0]))
  fits = lambda **tiles: dataclasses.replace(GENERIC, **tiles).fits(smem, head_dim, itemsize)
  q, k = next(((q, k) for q, k in by_area if fits(q=q, k=k, q_dkv=16, k_dkv=16)), (16, 16))
  q_dkv, k_dkv = next(((a, b) for b, a in by_area if fits(q=16, k=16, q_dkv=a, k_dkv=b)), (16, 16))
  return BlockSizes(q, k, q_dkv, k_dkv)


def shared_memory_per_block(device) -> int | None:
  """Bytes of shared memory a block may opt into on ``device``; None off a GPU."""
  if getattr(device, "platform", None) not in ("cuda", "rocm", "gpu"):
    return None
  capability = getattr(device, "compute_capability", None)  # "9.0" on a CUDA device
  if capability:
    major, minor = (int(x) for x in str(capability).split(".")[:2])
  else:
    names = {word.split("-")[0] for word in device.device_kind.split()}  # "NVIDIA A100-SXM4-80GB"
    major, minor = next((CAPABILITY_BY_NAME[n] for n in names if n in CAPABILITY_BY_NAME), (0, 0))
  return SHARED_MEMORY_BY_CAPABILITY.get((major, minor), SHARED_MEMORY_DEFAULT)


def triton_missing() -> str | None:
  """None where this JAX lowers Pallas kernels through Triton (the kernels' GPU lowering); else
  why not, which is also logged, once per reason, as a warning."""
  for name in TRITON_MODULES:
    try:
      importlib.import_module(name)
    except ImportError as e:
      reason = f"this JAX ({jax.__version__}) has no Pallas Triton lowering ({name}: {e})"
      say_once(reason)
      return reason
  return None


@functools.cache
def say_once(reason: str) -> None:
  """Logs ``reason`` the first time only (``say_once.cache_clear()`` forgets what was said)."""
  log.warning("%s: the flash kernel cannot run on a GPU here; attention takes the next route", reason)


class Layout(NamedTuple):
  """Who attends to whom: int32 [B, T'] arrays, T' = T rounded up to ``LENGTH_MULTIPLE``.

  Who attends to whom is ``layers.visible``'s rule (the reference path's and context
  parallelism's too), segment 0 marking padding.
  ``first_key`` and ``last_query`` bound each token's segment, so that the kernels skip the
  blocks that lie outside every segment of a block.
  """

  segment_ids: jax.Array  # 1, 2, ... per sequence; 0 = padding, which sees and is seen by nothing
  branch_ids: jax.Array  # 0 = a prefix every branch sees; b > 0 = a branch that sees 0 and b
  positions: jax.Array  # rotary positions, for the sliding window
  first_key: jax.Array  # lowest index of the token's segment (T' for padding)
  last_query: jax.Array  # highest index of the token's segment (-1 for padding)


def layout(segment_ids_bt, branch_ids_bt=None, positions_bt=None) -> Layout:
  """The :class:`Layout` of rows whose real tokens carry ``segment_ids_bt`` > 0 ([B, T] int32).

  Unpacked rows pass their attention mask as segment ids. Build it once per batch: every layer
  reads the same one.
  """
  b, t = segment_ids_bt.shape
  zeros = jnp.zeros((b, t), jnp.int32)
  ids = [
    segment_ids_bt,
    zeros if branch_ids_bt is None else branch_ids_bt,
    zeros if positions_bt is None else positions_bt,
  ]
  pad = _round_up(t, LENGTH_MULTIPLE) - t
  segment, branch, position = (jnp.pad(x.astype(jnp.int32), ((0, 0), (0, pad))) for x in ids)
  return Layout(segment, branch, position, *_segment_spans(segment))


def layout_of(ids: L.TokenIds) -> Layout:
  """The kernel's :class:`Layout` of a batch's :class:`~jaxrm.models.layers.TokenIds` (the one
  description of who attends to whom, which the reference and context-parallel paths read as is).
  The tokens are in row order (``ids.index`` counts 0, 1, ...): the kernel takes causality from
  where a token is stored."""
  return layout(jnp.where(ids.real > 0, ids.segment + 1, 0), ids.branch, ids.position)


def _segment_spans(segment_bt):
  """Lowest and highest index of each token's segment, as int32 [B, T] each."""
  b, t = segment_bt.shape
  real = segment_bt != 0
  # Ids outside [1, T] share one bucket: that widens spans, which stay valid bounds.
  bucket = (jnp.clip(segment_bt, 1, t) + (t + 1) * jnp.arange(b)[:, None]).ravel()
  index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  first = jax.ops.segment_min(jnp.where(real, index, t).ravel(), bucket, b * (t + 1))[bucket]
  last = jax.ops.segment_max(jnp.where(real, index, -1).ravel(), bucket, b * (t + 1))[bucket]
  return jnp.where(real, first.reshape(b, t), t), jnp.where(real, last.reshape(b, t), -1)


def flash_attention(
  q_bthd,
  k_bskd,
  v_bskd,
  ids: Layout,
  window=None,
  *,
  scale: float,
  softcap: float | None = None,
  interpret: bool = False,
  blocks: BlockSizes = BlockSizes(),
  q_offset=0,
):
  """Causal grouped-query attention; logits and softmax in float32. Returns [B, T, H, Dh].

  Args:
    q_bthd: [B, T, H, Dh] queries, tokens ``q_offset`` .. ``q_offset + T - 1`` of their rows; H a
      multiple of the K key heads.
    k_bskd, v_bskd: [B, S, K, Dh], the rows' first S tokens; S >= q_offset + T (S = T for
      self-attention).
    ids: the rows' :class:`Layout` (see :func:`layout`), of at least S tokens.
    window: None, or an int32 scalar (it may be traced, so that one kernel serves the sliding and
      the full layers of a scan): keys at least this many positions back are hidden.
    scale: multiplies the logits.
    softcap: Gemma 2's soft-capping, ``softcap * tanh(logits / softcap)``.
    interpret: run the kernels as XLA ops (any backend) instead of through Triton (GPU).
    blocks: the kernels' tile sizes.
    q_offset: the row index of the first query: an int, or an int32 scalar (it may be traced, so
      that one program serves every context-parallel shard's slices of a row).

  Queries that see no key (padding) get zeros, and pass no gradient.
  """
  b, t, h, d = q_bthd.shape
  s = k_bskd.shape[1]
  if h % k_bskd.shape[2] or ids.segment_ids.shape[1] < s or (isinstance(q_offset, int) and q_offset + t > s):
    raise ValueError(
      f"flash_attention: q {q_bthd.shape} at offset {q_offset}, k {k_bskd.shape} and ids "
      f"{ids.segment_ids.shape}: give ids of at least as many tokens as the keys, keys up to "
      "the last query, and query heads that are a multiple of the key heads"
    )
  # Triton loads power-of-two tiles and multiplies matrices of >= 16: zero-padded queries, keys and
  # head dims add nothing to the logits (padding ids hide them), and their outputs are cut off.
  t_pad, s_pad = _round_up(t, LENGTH_MULTIPLE), _round_up(s, LENGTH_MULTIPLE)
  d_pad = _head_dim(d)
  pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, d_pad - d)))
  q_ids, k_ids = _tokens(ids, q_offset, t, t_pad, s_pad), _tokens(ids, 0, s, s_pad, s_pad)
  scalars = jnp.stack(
    [jnp.asarray(NO_WINDOW if window is None else window, jnp.int32), jnp.asarray(q_offset, jnp.int32)]
  )
  static = _Static(scale, softcap, window is not None, interpret, blocks)
  out = _attention(
    pad(q_bthd, t_pad), pad(k_bskd, s_pad), pad(v_bskd, s_pad), (*q_ids, *k_ids, scalars), static
  )
  return out[:, :t, :, :d]


def _tokens(ids: Layout, start, n: int, length: int, keys: int) -> Layout:
  """Tokens [start, start + n) of ``ids`` (``start`` may be traced), then padding up to ``length``
  tokens, whose ``first_key`` is ``keys``: past every key, as :func:`layout` gives padding."""
  fill = Layout(0, 0, 0, keys, -1)
  cut = lambda x: jax.lax.dynamic_slice_in_dim(x, start, n, axis=1)
  return Layout(*(jnp.pad(cut(x), ((0, 0), (0, length - n)), constant_values=f) for x, f in zip(ids, fill)))


@dataclasses.dataclass(frozen=True)
class _Static:
  scale: float
  softcap: float | None
  windowed: bool
  interpret: bool
  blocks: BlockSizes


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, ids, static: _Static):
  return _forward(q, k, v, ids, static)[0]


def _attention_fwd(q, k, v, ids, static):
  out, lse = _forward(q, k, v, ids, static)
  # Named, as the reference route's: a layer checkpointed under ``layers.ELEMENTWISE_REMAT`` keeps
  # them instead of running the kernel again.
  out, lse = checkpoint_name(out, L.ATTENTION_RESIDUALS), checkpoint_name(lse, L.ATTENTION_RESIDUALS)
  return out, (q, k, v, ids, out, lse)


def _attention_bwd(static, residuals, d_out):
  q, k, v, ids, out, lse = residuals
  # The softmax's backward subtracts sum_d(out * d_out) per query: computed once, not per block.
  delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), d_out.astype(jnp.float32))
  d_q = _backward_dq(q, k, v, d_out, lse, delta, ids, static)
  d_k, d_v = _backward_dkv(q, k, v, d_out, lse, delta, ids, static)
  return d_q, d_k, d_v, None


_attention.defvjp(_attention_fwd, _attention_bwd)


# ------------------------------------------------------------------ pallas_call wrappers


def _forward(q, k, v, ids, static):
  (b, t, h, d), s = q.shape, k.shape[1]
  groups = h // k.shape[2]
  block_q, block_k = _block(t, static.blocks.q), _block(s, static.blocks.k)
  q_spec = pl.BlockSpec((None, block_q, None, d), lambda i, b, h: (b, i, h, 0))
  kv_spec = pl.BlockSpec((None, s, None, d), lambda i, b, h: (b, 0, lax.div(h, groups), 0))
  kernel = functools.partial(
    _forward_kernel, scale=static.scale, softcap=static.softcap, windowed=static.windowed, block_k=block_k
  )
  return pl.pallas_call(
    kernel,
    grid=(t // block_q, b, h),
    in_specs=[q_spec, kv_spec, kv_spec, *_id_specs(t, s, lambda i, b, h: b)],
    out_specs=[q_spec, pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))],
    out_shape=[
      jax.ShapeDtypeStruct(q.shape, q.dtype),
      jax.ShapeDtypeStruct((b, h, t), jnp.float32),
    ],  # log-sum-exp of each query's logits
    compiler_params=_compiler_params(d, static.interpret),
    interpret=static.interpret,
    name="jaxrm_flash_forward",
  )(q, k, v, *ids)


def _backward_dq(q, k, v, d_out, lse, delta, ids, static):
  (b, t, h, d), s = q.shape, k.shape[1]
  groups = h // k.shape[2]
  block_q, block_k = _block(t, static.blocks.q), _block(s, static.blocks.k)
  q_spec = pl.BlockSpec((None, block_q, None, d), lambda i, b, h: (b, i, h, 0))
  kv_spec = pl.BlockSpec((None, s, None, d), lambda i, b, h: (b, 0, lax.div(h, groups), 0))
  row_spec = pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))
  kernel = functools.partial(
    _dq_kernel, scale=static.scale, softcap=static.softcap, windowed=static.windowed, block_k=block_k
  )
  return pl.pallas_call(
    kernel,
    grid=(t // block_q, b, h),
    in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *_id_specs(t, s, lambda i, b, h: b)],
    out_specs=q_spec,
    out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    compiler_params=_compiler_params(d, static.interpret),
    interpret=static.interpret,
    name="jaxrm_flash_dq",
  )(q, k, v, d_out, lse, delta, *ids)


def _backward_dkv(q, k, v, d_out, lse, delta, ids, static):
  """dk and dv, each program summing over the query heads that share its key head."""
  (b, s, kv, d), t = k.shape, q.shape[1]
  groups = q.shape[2] // kv
  block_q, block_k = _block(t, static.blocks.q_dkv), _block(s, static.blocks.k_dkv)
  group_spec = pl.BlockSpec((None, t, groups, d), lambda j, b, g: (b, 0, g, 0))
  group_rows_spec = pl.BlockSpec((None, groups, t), lambda j, b, g: (b, g, 0))
  kv_spec = pl.BlockSpec((None, block_k, None, d), lambda j, b, g: (b, j, g, 0))
  kernel = functools.partial(
    _dkv_kernel,
    scale=static.scale,
    softcap=static.softcap,
    windowed=static.windowed,
    block_q=block_q,
    groups=groups,
  )
  return pl.pallas_call(
    kernel,
    grid=(s // block_k, b, kv),
    in_specs=[
      group_spec,
      kv_spec,
      kv_spec,
      group_spec,
      group_rows_spec,
      group_rows_spec,
      *_id_specs(t, s, lambda j, b, g: b),
    ],
    out_specs=[kv_spec, kv_spec],
    out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
    compiler_params=_compiler_params(d, static.interpret),
    interpret=static.interpret,
    name="jaxrm_flash_dkv",
  )(q, k, v, d_out, lse, delta, *ids)


def _id_specs(t, s, row_of):
  """Whole rows of the queries' and the keys' :class:`Layout` arrays, and the scalars (window,
  q_offset)."""
  rows = lambda n: [pl.BlockSpec((None, n), lambda *grid: (row_of(*grid), 0))] * len(Layout._fields)
  return rows(t) + rows(s) + [pl.BlockSpec((2,), lambda *grid: (0,))]


def _refs(refs):
  """A kernel's id refs as the queries' and the keys' :class:`Layout`, the window (or None) and
  q_offset, then its remaining refs."""
  n = len(Layout._fields)
  q_ids, k_ids, scalars_ref = Layout(*refs[:n]), Layout(*refs[n : 2 * n]), refs[2 * n]
  return q_ids, k_ids, scalars_ref[0], scalars_ref[1], refs[2 * n + 1 :]


def _block(length: int, preferred: int) -> int:
  block = preferred
  while length % block:
    block //= 2
  return block


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def _compiler_params(head_dim: int, interpret: bool):
  """Triton's (for the GPU lowering only; interpret mode takes none, and needs no Triton)."""
  if interpret:
    return None
  from jax.experimental.pallas import triton as plgpu

  return plgpu.CompilerParams(num_warps=_num_warps(head_dim), num_stages=NUM_STAGES)


def _num_warps(head_dim: int) -> int:
  return 4 if head_dim <= 64 else 8


def _head_dim(head_dim: int) -> int:
  """The head dim as the kernels take it: padded to a power of two, at least 16."""
  return max(16, pl.next_power_of_2(head_dim))


# ------------------------------------------------------------------ kernels


def _forward_kernel(q_ref, k_ref, v_ref, *refs, scale, softcap, windowed, block_k):
  """One block of queries of one head: an online softmax over the blocks of keys it can see."""
  q_ids, k_ids, window, q_offset, (out_ref, lse_ref) = _refs(refs)
  window = window if windowed else None
  block_q = q_ref.shape[0]
  q_start = pl.program_id(0) * block_q
  q_rows = pl.ds(q_start, block_q)
  q_index = q_offset + q_start
  q_tokens = _ids(q_ids, q_rows)
  q = q_ref[...]

  def step(kb, carry):
    acc, row_max, row_sum = carry
    k_start = pl.multiple_of(kb * block_k, block_k)
    k_rows = pl.ds(k_start, block_k)
    logits, _ = _logits(q, k_ref[k_rows, :], scale, softcap)
    mask = _mask(q_index, q_tokens, k_start, _ids(k_ids, k_rows), window)
    new_max = jnp.maximum(row_max, jnp.max(jnp.where(mask, logits, NEG_INF), axis=1))
    # Masked entries are zeroed, not just pushed to NEG_INF: while a row has seen no key its
    # running max is NEG_INF too, and exp(0) would count them.
    probs = jnp.where(mask, jnp.exp(logits - new_max[:, None]), 0.0)
    rescale = jnp.exp(row_max - new_max)
    acc = acc * rescale[:, None] + _matmul(probs.astype(v_ref.dtype), v_ref[k_rows, :])
    return acc, new_max, row_sum * rescale + jnp.sum(probs, axis=1)

  start, stop = _key_blocks(q_ids.first_key[q_rows], q_index + block_q, block_k, k_ref.shape[0])
  init = (
    jnp.zeros(q.shape, jnp.float32),
    jnp.full((block_q,), NEG_INF, jnp.float32),
    jnp.zeros((block_q,), jnp.float32),
  )
  acc, row_max, row_sum = lax.fori_loop(start, stop, step, init)
  # A query that sees no key (row_sum 0) gets zeros, and a log-sum-exp so large that the
  # backward pass's exp(logits - lse) is 0 for it.
  seen = row_sum > 0
  safe_sum = jnp.where(seen, row_sum, 1.0)
  out_ref[...] = (acc / safe_sum[:, None]).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(seen, row_max + jnp.log(safe_sum), -NEG_INF)


def _dq_kernel(q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, *refs, scale, softcap, windowed, block_k):
  """dq of one block of queries of one head, over the blocks of keys it can see."""
  q_ids, k_ids, window, q_offset, (d_q_ref,) = _refs(refs)
  window = window if windowed else None
  block_q = q_ref.shape[0]
  q_start = pl.program_id(0) * block_q
  q_rows = pl.ds(q_start, block_q)
  q_index = q_offset + q_start
  q_tokens = _ids(q_ids, q_rows)
  q, d_out, lse, delta = q_ref[...], d_out_ref[...], lse_ref[...], delta_ref[...]

  def step(kb, d_q):
    k_start = pl.multiple_of(kb * block_k, block_k)
    k_rows = pl.ds(k_start, block_k)
    k, v = k_ref[k_rows, :], v_ref[k_rows, :]
    mask = _mask(q_index, q_tokens, k_start, _ids(k_ids, k_rows), window)
    d_logits = _d_logits(q, k, v, d_out, lse, delta, mask, scale, softcap)[1]
    return d_q + _matmul(d_logits.astype(k.dtype), k)

  start, stop = _key_blocks(q_ids.first_key[q_rows], q_index + block_q, block_k, k_ref.shape[0])
  d_q = lax.fori_loop(start, stop, step, jnp.zeros(q.shape, jnp.float32))
  d_q_ref[...] = (d_q * scale).astype(d_q_ref.dtype)


def _dkv_kernel(
  q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, *refs, scale, softcap, windowed, block_q, groups
):
  """dk and dv of one block of keys of one key head, over its query heads and the queries that
  can see it."""
  q_ids, k_ids, window, q_offset, (d_k_ref, d_v_ref) = _refs(refs)
  window = window if windowed else None
  block_k = k_ref.shape[0]
  k_start = pl.program_id(0) * block_k
  k_rows = pl.ds(k_start, block_k)
  k_tokens = _ids(k_ids, k_rows)
  k, v = k_ref[...], v_ref[...]
  # Queries before the block see none of it (causal), nor do those after its last segment; query
  # block qb holds the row's tokens from q_offset + qb * block_q on.
  start = lax.div(jnp.maximum(k_start - q_offset, 0), block_q)
  stop = jnp.minimum(
    lax.div(jnp.max(k_ids.last_query[k_rows]) - q_offset + block_q, block_q), q_ref.shape[0] // block_q
  )

  def step_head(g, carry):
    def step(qb, carry):
      d_k, d_v = carry
      q_start = pl.multiple_of(qb * block_q, block_q)
      q_rows = pl.ds(q_start, block_q)
      q, d_out = q_ref[q_rows, g, :], d_out_ref[q_rows, g, :]
      mask = _mask(q_offset + q_start, _ids(q_ids, q_rows), k_start, k_tokens, window)
      probs, d_logits = _d_logits(
        q, k, v, d_out, lse_ref[g, q_rows], delta_ref[g, q_rows], mask, scale, softcap
      )
      d_v = d_v + _matmul_t(probs.astype(d_out.dtype), d_out)
      return d_k + _matmul_t(d_logits.astype(q.dtype), q), d_v

    return lax.fori_loop(start, stop, step, carry)

  zeros = jnp.zeros(k.shape, jnp.float32)
  d_k, d_v = lax.fori_loop(0, groups, step_head, (zeros, zeros))
  d_k_ref[...] = (d_k * scale).astype(d_k_ref.dtype)
  d_v_ref[...] = d_v.astype(d_v_ref.dtype)


# ------------------------------------------------------------------ kernel pieces


def _ids(refs: Layout, rows):
  return refs.segment_ids[rows], refs.branch_ids[rows], refs.positions[rows]


def _mask(q_start, q_ids, k_start, k_ids, window):
  """bool [block_q, block_k]: ``layers.visible`` of a block of queries and one of keys;
  ``q_start`` and ``k_start`` are the blocks' first row indices. Padding is segment 0 here."""

  def tokens(start, ids, axis):
    segment, branch, position = ids
    index = start + jnp.arange(segment.shape[0], dtype=jnp.int32)
    spread = lambda x: jnp.expand_dims(x, axis)
    return L.TokenIds(spread(index), spread(segment != 0), spread(segment), spread(branch), spread(position))

  return L.visible(tokens(q_start, q_ids, 1), tokens(k_start, k_ids, 0), window)


def _key_blocks(first_key_q, q_end, block_k, keys):
  """[start, stop) of the blocks of ``keys`` keys that a block of queries (their ``first_key``,
  the row index past the block's last) can see."""
  stop = jnp.minimum(lax.div(q_end + block_k - 1, block_k), keys // block_k)
  return lax.div(jnp.min(first_key_q), block_k), stop


def _logits(q, k, scale, softcap):
  """float32 [block_q, block_k] logits, and d(capped)/d(logits) when soft-capped."""
  logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  logits = logits * scale
  if softcap is None:
    return logits, None
  capped = jnp.tanh(logits / softcap)
  return capped * softcap, 1.0 - capped * capped


def _d_logits(q, k, v, d_out, lse, delta, mask, scale, softcap):
  """The attention weights of a block, and the gradient of the loss w.r.t. its scaled logits
  (before ``scale``, which the caller applies once)."""
  logits, slope = _logits(q, k, scale, softcap)
  probs = jnp.where(mask, jnp.exp(logits - lse[:, None]), 0.0)
  d_probs = lax.dot_general(d_out, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  d_logits = probs * (d_probs - delta[:, None])
  return probs, d_logits if slope is None else d_logits * slope


def _matmul(a, b):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _matmul_t(a, b):
  """a.T @ b."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
