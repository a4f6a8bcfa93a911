"""The decoder backbone with a reward head, for every supported family.

Layer parameters are stacked along a leading ``layers`` axis and the forward pass scans over
them, so a 30-layer model compiles one block, not thirty. The LM head is never computed over the
vocabulary: the model ends in a sequence head (``score``: one reward per row, read at the last real
token), a token head (``num_labels`` logits per token, for process reward models), or a verifier
head (two of the LM head's logits at the last real token: :mod:`jaxrm.tasks.verifier`).

Attention takes one of three routes (:func:`attention_route`): the Pallas flash kernel
(``flash_attention.py``, the default on a GPU), which masks from per-token ids; the reference
einsum (``layers.dot_product_attention``, the default elsewhere) and ``jax.nn.dot_product_attention``
(cuDNN), which take a dense mask built once for all layers. Under context parallelism (a mesh whose
``context`` axis splits each row's tokens) each shard's queries meet the row's gathered keys,
masked from gathered per-token ids (:mod:`jaxrm.models.context_parallel`): through the Pallas
kernel on its route, through the reference einsum on the others.

With ``config.lora`` on, the targeted projections carry low-rank adapters (:mod:`jaxrm.models.lora`),
stacked like the weights they adapt; ``config.lora.base_dtype`` stores the frozen projection
weights in bfloat16, int8 or nf4 (:mod:`jaxrm.models.quantize`), decoded layer by layer in the scan.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrm import sharding
from jaxrm.models import context_parallel, heads, lora, quantize
from jaxrm.models import flash_attention as F
from jaxrm.models import layers as L
from jaxrm.models.config import ModelConfig
from jaxrm.models.flash_attention import NO_WINDOW, flash_attention, layout_of


class Layers(nnx.Module):
  """Holds the stacked per-layer parameters as attributes (``q``, ``input_norm``...)."""


def _param(rng, shape, axes, dtype, init):
  return nnx.Param(init(rng, shape, dtype), logical_axes=axes)


def layer_param_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
  """Name -> (shape, logical axes) of each stacked layer parameter."""
  n, d, f = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
  qd, kvd, hd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
  shapes = {
    "input_norm": ((n, d), ("layers", "embed")),
    "q": ((n, d, qd), ("layers", "embed", "heads")),
    "k": ((n, d, kvd), ("layers", "embed", "kv_heads")),
    "v": ((n, d, kvd), ("layers", "embed", "kv_heads")),
    "o": ((n, qd, d), ("layers", "heads", "embed")),
    "mlp_norm": ((n, d), ("layers", "embed")),
    "gate": ((n, d, f), ("layers", "embed", "mlp")),
    "up": ((n, d, f), ("layers", "embed", "mlp")),
    "down": ((n, f, d), ("layers", "mlp", "embed")),
  }
  if cfg.qkv_bias:
    shapes.update(
      q_bias=((n, qd), ("layers", "heads")),
      k_bias=((n, kvd), ("layers", "kv_heads")),
      v_bias=((n, kvd), ("layers", "kv_heads")),
    )
  if cfg.o_bias:
    shapes["o_bias"] = ((n, d), ("layers", "embed"))
  if cfg.mlp_bias:
    shapes.update(
      gate_bias=((n, f), ("layers", "mlp")),
      up_bias=((n, f), ("layers", "mlp")),
      down_bias=((n, d), ("layers", "embed")),
    )
  if cfg.qk_norm:
    shapes.update(q_norm=((n, hd), ("layers", "head_dim")), k_norm=((n, hd), ("layers", "head_dim")))
  if cfg.gemma_norms:
    shapes.update(post_attn_norm=((n, d), ("layers", "embed")), post_mlp_norm=((n, d), ("layers", "embed")))
  return shapes


class Decoder(nnx.Module):
  """A decoder LLM ending in a reward head (:mod:`jaxrm.models.heads`) instead of the LM head.

  ``__call__`` returns rewards [B] (sequence head) or logits [B, T, C] (token head).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.config = cfg
    dtype = jnp.dtype(cfg.param_dtype)
    normal = jax.nn.initializers.normal(0.02)
    # Gemma norms scale by (1 + w): zeros are the identity there, ones elsewhere.
    norm_init = jax.nn.initializers.zeros if cfg.gemma_norms else jax.nn.initializers.ones
    self.embed = _param(rngs.params(), (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype, normal)
    self.layers = Layers()
    base_dtype = cfg.lora.base_dtype
    for name, (shape, axes) in layer_param_shapes(cfg).items():
      init = (
        norm_init if name.endswith("norm") else jax.nn.initializers.zeros if name.endswith("bias") else normal
      )
      if base_dtype is None or name not in quantize.WEIGHTS:
        setattr(self.layers, name, _param(rngs.params(), shape, axes, dtype, init))
      elif base_dtype == "bfloat16":
        setattr(self.layers, name, _param(rngs.params(), shape, axes, jnp.bfloat16, init))
      else:
        codes, scale = quantize.quantize(init(rngs.params(), shape, dtype), base_dtype)
        for suffix, value in (("", codes), (quantize.SCALE, scale)):
          stored_axes = quantize.stored(base_dtype, shape, axes)[suffix][2]
          setattr(self.layers, name + suffix, quantize.QuantizedWeight(value, logical_axes=stored_axes))
    self.final_norm = _param(rngs.params(), (cfg.hidden_size,), ("embed",), dtype, norm_init)
    if cfg.head == "lm":  # the LM head, unless tied to the embedding; no reward head
      if not cfg.tie_word_embeddings:
        self.lm_head = _param(
          rngs.params(), (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dtype, normal
        )
    else:
      self.score = _param(
        rngs.params(), (cfg.hidden_size, cfg.num_labels), ("embed", "labels"), dtype, heads.head_init(cfg)
      )
    if cfg.head_bias:
      self.score_bias = _param(
        rngs.params(), (cfg.num_labels,), ("labels",), dtype, jax.nn.initializers.zeros
      )
    # Last, so that the base and head draw the same random numbers with adapters as without.
    for name, (shape, axes) in lora.adapter_shapes(cfg.lora, layer_param_shapes(cfg)).items():
      value = lora.adapter_init(name)(rngs.params(), shape, dtype)
      setattr(self.layers, name, lora.LoraParam(value, logical_axes=axes))

  def hidden_states(
    self,
    input_ids,
    attention_mask,
    positions=None,
    segment_ids=None,
    branch_ids=None,
    dropout_rng=None,
    placement: sharding.Placement | None = None,
  ):
    """Final-norm hidden states [B, T, D] in the compute dtype.

    Args:
      input_ids: [B, T] int32.
      attention_mask: [B, T] (1 = real token, 0 = padding), any padding side.
      positions: [B, T] int32; default: the count of real tokens before each one.
      segment_ids: [B, T] int32; tokens attend only within their segment (packed rows).
      branch_ids: [B, T] int32 (shared-prompt rows): 0 = a segment's shared prefix, b > 0 = one
        branch, which sees the prefix and itself only (see ``layers.visible``).
      dropout_rng: a PRNG key for the adapters' dropout (``config.lora.dropout``), given in
        training only; None (scoring, evaluation) drops nothing.
      placement: the mesh and rules that pin the activations at block boundaries (and split the
        attention per device); None: unconstrained, on the default device's attention route.

    The states of padding tokens depend on the attention route (the Pallas kernel gives padding
    queries no keys, the reference the real keys before them); losses and scores read real
    tokens only.

    With a ``placement`` whose mesh has a ``context`` axis of c > 1 devices, each row's tokens are
    split over them (:mod:`jaxrm.models.context_parallel`): stored in the order of its
    ``context_balance`` through the layers, and returned in row order. T must then be a multiple
    of 2c (zigzag) or c (none).
    """
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    if positions is None:
      positions = jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0)
    order = None  # context parallel: the row index of each stored token
    if placement is not None and placement.context > 1:
      order = context_parallel.storage_order(input_ids.shape[1], placement.context, placement.context_balance)
      input_ids, attention_mask, positions, segment_ids, branch_ids = (
        None if x is None else jnp.take(x, order, axis=1)
        for x in (input_ids, attention_mask, positions, segment_ids, branch_ids)
      )
    x = jnp.take(self.embed[...], input_ids, axis=0).astype(dtype)
    if cfg.gemma_norms:
      x = x * jnp.asarray(cfg.hidden_size**0.5, dtype)
    rope = _rope_tables(cfg, positions)
    attend = _layer_attention(cfg, placement, attention_mask, positions, segment_ids, branch_ids, order)

    def block(x_btd, per_layer):
      p, is_sliding, key = per_layer
      x_btd = sharding.constrain(x_btd, ("batch", "length", "act_embed"), placement)
      cos, sin = rope(is_sliding)
      return _block(cfg, functools.partial(attend, is_sliding=is_sliding), x_btd, p, cos, sin, key), None

    block = checkpointed(block, cfg, sharding.platform(placement), context_parallel=order is not None)
    params = {k: v[...] for k, v in vars(self.layers).items() if isinstance(v, nnx.Variable)}
    keys = None  # one dropout key per layer, or none
    if dropout_rng is not None and cfg.lora.enabled and cfg.lora.dropout > 0:
      keys = jax.random.split(dropout_rng, cfg.num_layers)
    sliding = jnp.asarray(cfg.sliding_layers)
    if cfg.scan_layers:
      x, _ = jax.lax.scan(block, x, (params, sliding, keys))
    else:
      for i, p in enumerate(_unstacked(params, cfg.num_layers)):
        x, _ = block(x, (p, sliding[i], None if keys is None else keys[i]))
    x = L.rms_norm(x, self.final_norm[...], cfg.rms_norm_eps, cfg.gemma_norms)
    return x if order is None else jnp.take(x, np.argsort(order), axis=1)  # back in row order

  def __call__(
    self,
    input_ids,
    attention_mask,
    positions=None,
    segment_ids=None,
    branch_ids=None,
    reward_positions=None,
    dropout_rng=None,
    placement: sharding.Placement | None = None,
  ):
    """Rewards float32 [B] (sequence head, one label; verifier head: the answers' log-odds), [B, C]
    (several), or logits [B, T, C] (token head).

    Args:
      input_ids, attention_mask, positions, segment_ids, branch_ids, dropout_rng, placement: as in
        :meth:`hidden_states`.
      reward_positions: [B, R] int32 (sequence or verifier head, packed rows): read a reward at each of these
        indices instead of at the last real token, giving rewards [B, R] ([B, R, C] for several
        labels); slots of -1 are unused and read 0.
    """
    cfg = self.config
    if reward_positions is not None and cfg.head == "token":
      raise ValueError(
        "reward_positions needs a sequence head; a token head already returns logits at every position"
      )
    h = self.hidden_states(
      input_ids, attention_mask, positions, segment_ids, branch_ids, dropout_rng, placement
    )
    if cfg.head == "lm":
      return heads.verifier_log_odds(
        h, self.answer_weights(), attention_mask, reward_positions, cfg.final_logit_softcapping
      )
    bias = self.score_bias[...] if cfg.head_bias else None
    if cfg.head == "token":
      return heads.token_logits(h, self.score[...], bias)
    return heads.sequence_rewards(h, self.score[...], bias, attention_mask, reward_positions)

  def answer_weights(self):
    """[D, 2]: the LM head's columns of a verifier's two answers (the embedding's rows, tied)."""
    ids = jnp.asarray(self.config.verifier_tokens, jnp.int32)
    if self.config.tie_word_embeddings:
      return jnp.take(self.embed[...], ids, axis=0).T
    return jnp.take(self.lm_head[...], ids, axis=1)


def _rope_tables(cfg: ModelConfig, positions_bt) -> Callable:
  """``is_sliding -> (cos, sin)`` of one layer: ``cfg.rope``'s tables, or on the sliding layers
  ``cfg.sliding_rope``'s where it has one (e.g. Gemma 3's local base frequency). Each table is
  computed once for all layers."""
  tables = L.rope_tables(positions_bt, cfg.rope.inv_freq(cfg.head_dim))
  if cfg.sliding_rope is None or not cfg.sliding_layers.any():
    return lambda is_sliding: tables
  local = L.rope_tables(positions_bt, cfg.sliding_rope.inv_freq(cfg.head_dim))
  return lambda is_sliding: tuple(jnp.where(is_sliding, a, b) for a, b in zip(local, tables))


def _unstacked(params: dict[str, jax.Array], n: int) -> list[dict[str, jax.Array]]:
  """Stacked [L, ...] weights as L per-layer dicts. ``lax.split``, whose gradient is one
  concatenation, rather than L slices, whose gradients would be L padded copies summed."""
  pieces = {k: [x[0] for x in jax.lax.split(v, [1] * n, axis=0)] for k, v in params.items()}
  return [{k: v[i] for k, v in pieces.items()} for i in range(n)]


NAMED_RESIDUALS = ("reference", "pallas")  # the attention routes whose residuals elementwise keeps


def checkpointed(
  block: Callable, cfg: ModelConfig, platform: str | None, *, context_parallel: bool
) -> Callable:
  """``block`` (one layer) as ``cfg.remat`` checkpoints it for the backward pass: ``full`` keeps
  its input only, ``dots`` the projections' outputs too, ``elementwise`` every product's output
  (``layers.ELEMENTWISE_REMAT``), ``none`` everything (``block`` itself).

  ``elementwise`` needs the attention to name its residuals (``layers.ATTENTION_RESIDUALS``), as
  the reference route and the Pallas kernel do; cuDNN's kernel (whose residuals are its own) and
  context parallelism (whose gathered keys and values are residuals too) would run theirs again,
  so there it keeps everything, as ``none``.
  """
  if cfg.remat == "full":
    return jax.checkpoint(block, prevent_cse=False)
  if cfg.remat == "dots":
    return jax.checkpoint(
      block, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable, prevent_cse=False
    )
  if (
    cfg.remat == "elementwise" and not context_parallel and attention_route(cfg, platform) in NAMED_RESIDUALS
  ):
    return jax.checkpoint(block, policy=L.ELEMENTWISE_REMAT, prevent_cse=False)
  return block


def attention_route(cfg: ModelConfig, platform: str | None = None) -> str:
  """What computes the attention of ``cfg`` on devices of ``platform`` (``sharding.platform``:
  default, the default device's): ``"pallas"`` (:mod:`jaxrm.models.flash_attention`), ``"cudnn"``
  (``jax.nn.dot_product_attention``) or ``"reference"`` (``layers.dot_product_attention``).

  ``auto`` takes the Pallas kernel on a GPU and the reference elsewhere. ``cudnn`` has no logit
  soft-capping, so soft-capped models (Gemma 2) take the reference instead. On a GPU whose JAX
  lacks Pallas's Triton lowering (``flash_attention.triton_missing``, said once), the Pallas
  kernel's place goes to cuDNN where it runs (bfloat16/float16, no soft-capping), else the reference.
  """
  platform = platform or sharding.platform()
  impl = cfg.attention_impl
  if impl == "auto":
    impl = "pallas" if platform == "gpu" else "reference"
  if impl == "pallas" and platform == "gpu" and F.triton_missing():
    # cuDNN's fused kernel takes head dims up to 128 (256 on Hopper only), multiples of 8.
    fused = cfg.head_dim % 8 == 0 and cfg.head_dim <= 128
    impl = "cudnn" if fused and _cudnn_runs(cfg, platform) else "reference"
  if impl == "cudnn" and cfg.attn_logit_softcapping is not None:
    return "reference"
  return impl


def attention_fn(cfg: ModelConfig, platform: str | None = None) -> Callable:
  """The attention of ``cfg`` on devices of ``platform`` (default: the default device's).

  Every route takes q [B, T, H, Dh], k/v [B, S, K, Dh] and returns [B, T, H, Dh]; the Pallas
  kernel then takes a ``flash_attention.Layout`` and a window, the others a bool mask [B, T, S].
  The Pallas kernel runs through Triton on a GPU and in interpret mode elsewhere (slow: for
  tests); the cudnn setting reaches cuDNN's kernel on a GPU in bfloat16/float16 and the same
  call's XLA lowering otherwise. A GPU here is the devices the step is compiled for, which may be
  compile-only ones (:mod:`jaxrm.planning.gpu_targets`) in a CPU process.
  """
  platform = platform or sharding.platform()
  route = attention_route(cfg, platform)
  if route == "pallas":
    return functools.partial(
      flash_attention, scale=cfg.attn_scale, softcap=cfg.attn_logit_softcapping, interpret=platform != "gpu"
    )
  if route == "cudnn":
    return functools.partial(
      L.fused_attention, scale=cfg.attn_scale, implementation="cudnn" if _cudnn_runs(cfg, platform) else "xla"
    )
  return functools.partial(L.dot_product_attention, scale=cfg.attn_scale, softcap=cfg.attn_logit_softcapping)


def _cudnn_runs(cfg: ModelConfig, platform: str) -> bool:
  return platform == "gpu" and jnp.dtype(cfg.dtype) in (jnp.bfloat16, jnp.float16)


def attention_summary(
  cfg: ModelConfig, platform: str | None = None, placement: sharding.Placement | None = None
) -> str:
  """One line saying what computes the attention of ``cfg`` under ``placement`` (None: one
  device) on devices of ``platform`` (default: the placement's, else the default device's), for
  the run's log."""
  platform = platform or sharding.platform(placement)
  route = attention_route(cfg, platform)
  context = context_parallel.describe(placement)
  if context is not None and route == "pallas":
    what = "pallas flash kernel per shard" + (
      "" if platform == "gpu" else " in interpret mode (no GPU; slow)"
    )
  elif context is not None:
    what = "reference einsum per shard" + (
      " (cuDNN's kernel takes no gathered keys)" if route == "cudnn" else ""
    )
  elif route == "pallas":
    what = "pallas flash kernel" + ("" if platform == "gpu" else " in interpret mode (no GPU; slow)")
  elif route == "cudnn":
    what = (
      "cuDNN (jax.nn.dot_product_attention)"
      if _cudnn_runs(cfg, platform)
      else "jax.nn.dot_product_attention's XLA lowering (cuDNN needs a GPU and bfloat16/float16)"
    )
  else:
    what = "reference einsum"
    if cfg.attention_impl == "auto" and platform != "gpu":
      what += f" (auto: the pallas kernel needs a GPU; these devices are {platform})"
    elif cfg.attention_impl == "cudnn":
      what += " (cudnn has no logit soft-capping)"
  if platform == "gpu" and route != "pallas" and cfg.attention_impl in ("auto", "pallas"):
    what += f" instead of the pallas flash kernel: {F.triton_missing()}"
  features = [] if context is None else [context]
  if sliding := int(cfg.sliding_layers.sum()):
    rope = "" if cfg.sliding_rope is None else f" (rotary base {cfg.sliding_rope.theta:g} there)"
    features.append(f"sliding window of {cfg.sliding_window} positions on {sliding} of them{rope}")
  if cfg.attn_logit_softcapping is not None:
    features.append(f"logit soft-capping at {cfg.attn_logit_softcapping:g}")
  return f"attention: {what} on all {cfg.num_layers} layers" + "".join(f"; {f}" for f in features)


# Rows of this many tokens or more take the reference attention on a CPU as loops over blocks of
# CPU_LOOP_BLOCKS (queries, keys), each row on its own, skipping the blocks the mask hides entirely
# (another segment's or branch's keys, padding, later tokens). For SmolLM2's heads, against the
# dense mask's unrolled chunks: 2.2x forward and 5.2x forward and backward on two shared-prompt
# rows of 3,072 tokens holding GRPO groups, 1.1x / 1.5x on full unpacked rows of 1,024; at 512
# tokens the loops are 0.56x forward (1.29x forward and backward). Measured on a 2-core CPU
# (scripts/bench_attention.py; docs/benchmarks.md, "Attention on a CPU").
LOOP_MIN_TOKENS = 1024
CPU_LOOP_BLOCKS = (256, 256)


def _layer_attention(
  cfg: ModelConfig, placement, attention_mask, positions, segment_ids, branch_ids, order=None
) -> Callable:
  """``(q, k, v, *, is_sliding) -> [B, T, H, Dh]`` for one layer of the scan; what masks the
  attention (a dense mask, the Pallas kernel's per-token layout, or the per-token ids that context
  parallelism gathers) is built once for all layers.

  ``order`` (context parallel): int [T], the row index of each stored token; the inputs are
  already in that order. Each shard's queries then meet the gathered keys through the Pallas
  kernel on its route, through the reference einsum on the others (cuDNN's takes a dense mask).
  The route is the placement's devices' (without one, the default device's).
  """
  windowed = bool(cfg.sliding_layers.any())
  platform = sharding.platform(placement)
  # Who attends to whom, described once: every route below reads these ids.
  index = None if order is None else jnp.broadcast_to(jnp.asarray(order), attention_mask.shape)
  ids = L.token_ids(attention_mask, positions, segment_ids, branch_ids, index)
  if order is not None:
    kernel = "pallas" if attention_route(cfg, platform) == "pallas" else "reference"

    def gathered(q, k, v, *, is_sliding):
      window = jnp.where(is_sliding, cfg.sliding_window, NO_WINDOW) if windowed else None
      return context_parallel.attention(
        q,
        k,
        v,
        ids,
        order,
        window,
        placement=placement,
        scale=cfg.attn_scale,
        softcap=cfg.attn_logit_softcapping,
        kernel=kernel,
        interpret=platform != "gpu",
      )

    return gathered
  attend = attention_fn(cfg, platform)
  if attention_route(cfg, platform) == "pallas":
    kernel_ids = layout_of(ids)
    device = placement.mesh.devices.flat[0] if placement is not None else jax.devices()[0]
    attend = functools.partial(attend, blocks=F.blocks_for(device, cfg.head_dim, cfg.dtype))

    def fused(q, k, v, *, is_sliding):
      window = jnp.where(is_sliding, cfg.sliding_window, NO_WINDOW) if windowed else None
      return _per_shard(attend, placement, q, k, v, kernel_ids, window)

    return fused
  if (
    attention_route(cfg, platform) == "reference"
    and platform == "cpu"
    and ids.real.shape[1] >= LOOP_MIN_TOKENS
  ):

    def looped(q, k, v, *, is_sliding):
      window = jnp.where(is_sliding, cfg.sliding_window, NO_WINDOW) if windowed else None
      return attend(q, k, v, L.IdMask(ids, ids, window, offset=0, blocks=CPU_LOOP_BLOCKS))

    return looped
  full = L.mask_from_ids(ids, ids)
  window = L.mask_from_ids(ids, ids, cfg.sliding_window) if windowed else None

  def dense(q, k, v, *, is_sliding):
    return attend(q, k, v, full if window is None else jnp.where(is_sliding, window, full))

  return dense


def _per_shard(attend: Callable, placement, q_bthd, k_bskd, v_bskd, ids, window):
  """``attend(q, k, v, ids, window)``, run on each device's rows and heads of ``placement``.

  XLA cannot split a Pallas kernel: left to itself, it would gather the whole batch onto every
  device and compute all of it there (heads split as ``Placement.attention_specs`` says). Rows
  are whole here: context parallelism has its own per-shard attention
  (:mod:`jaxrm.models.context_parallel`).
  """
  args = (q_bthd, k_bskd, v_bskd, ids) + (() if window is None else (window,))
  if placement is None:
    return attend(*args)
  q_spec, k_spec = placement.attention_specs(q_bthd.shape, k_bskd.shape)
  specs = (q_spec, k_spec, k_spec, P(q_spec[0], None)) + (() if window is None else (P(),))
  return jax.shard_map(attend, mesh=placement.mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(*args)


_PROJECTIONS = tuple(lora.TARGETS.values())  # each adapter's dropout draws from its own key


def _block(cfg: ModelConfig, attend: Callable, x_btd, p, cos, sin, dropout_key=None):
  b, t, d = x_btd.shape
  h_, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  norm = lambda x, w: L.rms_norm(x, w, cfg.rms_norm_eps, cfg.gemma_norms)

  def linear(x_nd, name):  # the projection ``name``, plus its adapter where it has one
    if name + quantize.SCALE in p:  # a coded base weight, decoded here for this layer only
      y = quantize.linear(x_nd, p[name], p[name + quantize.SCALE], cfg.lora.base_dtype)
      y = y if f"{name}_bias" not in p else y + p[f"{name}_bias"].astype(y.dtype)
    else:
      y = L.linear(x_nd, p[name], p.get(f"{name}_bias"))
    if f"{name}_lora_a" in p:
      key = None if dropout_key is None else jax.random.fold_in(dropout_key, _PROJECTIONS.index(name))
      y = y + lora.delta(
        x_nd, p[f"{name}_lora_a"], p[f"{name}_lora_b"], cfg.lora.scale, dropout=cfg.lora.dropout, key=key
      )
    return y

  x = x_btd.reshape(b * t, d)
  h = norm(x, p["input_norm"])
  q = linear(h, "q").reshape(b, t, h_, hd)
  k = linear(h, "k").reshape(b, t, kv, hd)
  v = linear(h, "v").reshape(b, t, kv, hd)
  if cfg.qk_norm:
    q, k = norm(q, p["q_norm"][None, None]), norm(k, p["k_norm"][None, None])
  q, k = L.apply_rope(q, cos, sin), L.apply_rope(k, cos, sin)
  a = attend(q, k, v)
  a = linear(a.reshape(b * t, h_ * hd), "o")
  if cfg.gemma_norms:
    a = norm(a, p["post_attn_norm"])
  x = x + a
  h = norm(x, p["mlp_norm"])
  act = L.activation(cfg.hidden_act)
  m = linear(L.gated(act, linear(h, "gate"), linear(h, "up")), "down")
  if cfg.gemma_norms:
    m = norm(m, p["post_mlp_norm"])
  return (x + m).reshape(b, t, d)
