"""A frozen LoRA base in lower precision (QLoRA): the layers' projection weights stored as codes.

Only the seven stacked projection weights of the layers (``q`` ... ``down``, :data:`WEIGHTS`) are
stored below the model's parameter dtype; embeddings, norms, biases and the reward head keep it.
``LoraConfig.base_dtype`` picks the format:

* ``bfloat16``: the weights as ``nnx.Param`` in bfloat16; nothing to decode.
* ``int8``: ``w ~ codes * scale`` with int8 codes [L, in, out] in [-127, 127] and one float32
  scale per output channel of each layer (absmax / 127), [L, 1, out].
* ``nf4``: 4-bit NormalFloat (Dettmers et al. 2023, "QLoRA", section 3 and appendix E):
  ``w ~ NF4[code] * absmax`` per block of :data:`BLOCK` input rows of one output column, the
  codes packed two to a byte along the input dimension, [L, in/2, out] uint8 (the even row in
  the high nibble, as bitsandbytes packs its first element), the block absmax float32
  [L, ceil(in/64), out]. A last block shorter than 64 rows (an input size such as 96) is
  scaled by its own absmax. QLoRA's double quantization of the absmax (to 8 bits) is not done:
  the float32 scales add 0.5 bits per weight, 4.5 bits in all, 0.14 of float32.

Codes and scales are :class:`QuantizedWeight` variables (not ``nnx.Param``): no trainable filter
selects them, so they stay in the frozen part of a train state, and they carry their weight's
logical axes, so they shard as it would. The decoder decodes one layer's weight at a time
inside its scan (:func:`linear`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

FORMATS = ("bfloat16", "int8", "nf4")
CODED = ("int8", "nf4")  # the formats stored as codes and scales
WEIGHTS = ("q", "k", "v", "o", "gate", "up", "down")  # the decoder's stacked projection weights
SCALE = "_scale"  # ``layers.q`` holds the codes of ``q``, ``layers.q_scale`` their scales
BLOCK = 64  # nf4: input rows per absmax, as QLoRA and bitsandbytes' default blocksize

# The 16 NF4 values: QLoRA's appendix E, identical to bitsandbytes' table
# (bitsandbytes/functional.py, get_4bit_type("nf4"); the CUDA kernel's dDequantizeNF4).
NF4 = np.array(
  [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
  ],
  np.float32,
)
_NF4_MIDPOINTS = (NF4[1:] + NF4[:-1]) / 2  # the decision boundaries of nearest rounding


class QuantizedWeight(nnx.Variable):
  """Codes or scales of a frozen base weight; never trained."""


def stored(
  fmt: str, shape: tuple[int, ...], axes: tuple
) -> dict[str, tuple[tuple[int, ...], np.dtype, tuple]]:
  """Suffix -> (shape, dtype, logical axes) of what holds a stacked [L, in, out] weight in
  ``fmt`` (``""``: the codes, :data:`SCALE`: the scales)."""
  n, d_in, d_out = shape
  layers_axis, in_axis, out_axis = axes
  if fmt == "int8":
    return {
      "": (shape, np.dtype(np.int8), axes),
      SCALE: ((n, 1, d_out), np.dtype(np.float32), (layers_axis, None, out_axis)),
    }
  if fmt == "nf4":
    return {
      "": ((n, d_in // 2, d_out), np.dtype(np.uint8), axes),
      SCALE: ((n, -(-d_in // BLOCK), d_out), np.dtype(np.float32), axes),
    }
  raise ValueError(f"{fmt!r} is not stored as codes; coded formats: {', '.join(CODED)}")


def quantize(w_df, fmt: str):
  """One weight [in, out] (or stacked [L, in, out]) -> (codes, scales) in ``fmt``.

  Runs in numpy for numpy input (the loader, on the host) and in jax otherwise.
  """
  xp = np if isinstance(w_df, np.ndarray) else jnp
  w = w_df.astype(np.float32)
  d_in = w.shape[-2]
  if fmt == "int8":
    absmax = xp.max(xp.abs(w), axis=-2, keepdims=True)
    scale = xp.where(absmax > 0, absmax * np.float32(1 / 127), 1).astype(np.float32)  # as XLA divides
    return xp.clip(xp.round(w / scale), -127, 127).astype(np.int8), scale
  if fmt != "nf4":
    raise ValueError(f"{fmt!r} is not stored as codes; coded formats: {', '.join(CODED)}")
  if d_in % 2:
    raise ValueError(f"nf4 packs two rows per byte; the input size {d_in} is odd")
  blocks = -(-d_in // BLOCK)
  pad = [(0, 0)] * (w.ndim - 2) + [(0, blocks * BLOCK - d_in), (0, 0)]
  padded = xp.pad(w, pad).reshape(*w.shape[:-2], blocks, BLOCK, w.shape[-1])
  absmax = xp.max(xp.abs(padded), axis=-2)  # [..., blocks, out]
  scale = xp.where(absmax > 0, absmax, 1).astype(np.float32)
  normed = w / _per_row(scale, d_in, xp)
  codes = xp.searchsorted(xp.asarray(_NF4_MIDPOINTS), normed.reshape(-1)).reshape(w.shape).astype(np.uint8)
  return (codes[..., 0::2, :] << 4) | codes[..., 1::2, :], scale


def dequantize(codes, scale, fmt: str, dtype=jnp.float32):
  """What :func:`quantize` gave -> the weight it stands for, in ``dtype`` (decoded in float32)."""
  if fmt == "int8":
    return (codes.astype(jnp.float32) * scale).astype(dtype)
  high, low = codes >> 4, codes & 0xF
  idx = jnp.stack([high, low], axis=-2).reshape(*codes.shape[:-2], 2 * codes.shape[-2], codes.shape[-1])
  values = jnp.asarray(NF4)[idx.astype(jnp.int32)]
  return (values * _per_row(scale, idx.shape[-2], jnp)).astype(dtype)


def _per_row(scale, d_in: int, xp):
  """Block scales [..., blocks, out] -> one per input row [..., in, out]."""
  return xp.repeat(scale, BLOCK, axis=-2)[..., :d_in, :]


@functools.partial(jax.checkpoint, static_argnums=(3,), prevent_cse=False)
def linear(x_nd, codes, scale, fmt: str):
  """``x @ dequantize(codes, scale)`` in ``x``'s dtype.

  Rematerialised: differentiating through it keeps the codes for the backward pass and decodes
  them again there, instead of saving every layer's decoded weight through the scan.
  """
  return x_nd @ dequantize(codes, scale, fmt, x_nd.dtype)
