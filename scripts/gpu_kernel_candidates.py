r"""Which of jaxrm's attention masks each successor of the Pallas Triton kernel can carry, decided
on a machine without a GPU: each candidate is given each mask in the form its API takes, that form
is expanded to a dense [B, T, S] mask and compared with jaxrm's own (``layers.attention_mask``) on
CPU, and the candidate's forward and backward pass is compiled for an H100 (sm90) by XLA's GPU
compiler (``jaxrm.planning.gpu_targets``). Nothing runs on a GPU: speed and on-device numerics are left
to a lent one.

  .venv/bin/python -m pip install --no-deps --target /tmp/tokamax tokamax==0.0.12 einshape==1.0 \
      immutabledict==4.3.1 jaxtyping==0.3.11 qwix==0.1.8 typeguard==2.13.3 wadler_lindig==0.1.8
  PYTHONPATH=/tmp/tokamax .venv/bin/python scripts/gpu_kernel_candidates.py \
      --json=benchmarks/gpu_kernel_candidates.json

tokamax is kept out of .venv and pyproject.toml: what it adds beside jaxrm's own (the list above,
typeguard pinned to 2.13.3 among them) is for this comparison only.

Candidates: jaxrm's kernel (``jaxrm.models.flash_attention``, Pallas on Triton); cuDNN through
``jax.nn.dot_product_attention``; JAX's Pallas Mosaic GPU attention
(``jax.experimental.pallas.ops.gpu.attention_mgpu``); tokamax's Mosaic GPU attention (where
``import tokamax`` works). Masks: causal rows, right-padded rows, packed rows (sequences one after
another, each causal), and shared-prompt rows (a tree: each branch sees the prompt and itself).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrm import sharding
from jaxrm.models import flash_attention as F
from jaxrm.models import layers as L
from jaxrm.planning import gpu_targets

MASKS = ("causal", "padded", "packed", "tree")
TARGET = "h100-80gb"
B, T, H, K, D = 2, 256, 4, 2, 128  # two rows, grouped-query heads, Qwen's head dim


def mask_ids() -> dict[str, dict[str, np.ndarray]]:
  """Per mask, the rows' per-token ids as jaxrm's batches hold them ([B, T] int32 each)."""
  index = np.broadcast_to(np.arange(T), (B, T))
  real = (index < np.array([[T], [T - 90]])).astype(np.int32)  # row 1 ends in 90 padding tokens
  # Packed: three sequences in row 0, two in row 1.
  starts = [np.array([0, 100, 180]), np.array([0, 70])]
  segment = np.stack([np.searchsorted(s, np.arange(T), side="right") for s in starts]) * real
  packed_positions = np.stack([np.arange(T) - s[segment[r] - 1] for r, s in enumerate(starts)]) * real
  # Tree: a prompt of 60 tokens, then branches 1, 2, 3 of 50 tokens, in one segment.
  branch = np.where(index >= 60, 1 + (index - 60) // 50, 0) * real
  tree_positions = np.where(branch > 0, 60 + (index - 60) % 50, index) * real
  ones, zeros = np.ones((B, T), np.int32), np.zeros((B, T), np.int32)
  return {
    "causal": dict(real=ones, positions=index, segment=ones, branch=zeros),
    "padded": dict(real=real, positions=index * real, segment=real, branch=zeros),
    "packed": dict(real=real, positions=packed_positions, segment=segment, branch=zeros),
    "tree": dict(real=real, positions=tree_positions, segment=real, branch=branch),
  }


def jaxrm_mask(ids) -> np.ndarray:
  """bool [B, T, S]: who attends to whom, as jaxrm's reference attention masks."""
  return np.asarray(
    L.attention_mask(ids["real"], ids["positions"], ids["segment"], branch_ids_bt=ids["branch"])
  )


def key_ranges(ids) -> tuple[np.ndarray, np.ndarray] | None:
  """[first, last + 1) of the keys each query sees, if every query's keys are one range (else
  None): what a kernel that masks by key ranges can carry."""
  mask = jaxrm_mask(ids)
  first = np.where(mask.any(-1), mask.argmax(-1), 0)
  end = np.where(mask.any(-1), T - mask[..., ::-1].argmax(-1), 0)
  ranged = (np.arange(T)[None, None] >= first[..., None]) & (np.arange(T)[None, None] < end[..., None])
  return (first, end) if (ranged == mask).all() else None


# ------------------------------------------------------------------ the candidates, as masks


def express(candidate: str, name: str, ids) -> tuple[str, np.ndarray | None, dict]:
  """How ``candidate``'s API takes mask ``name``: (how, the dense mask it amounts to or None when
  it cannot take it, the arguments to compile with)."""
  ranges = key_ranges(ids)
  full = jaxrm_mask(ids)
  if candidate == "jaxrm_pallas_triton":
    return "per-token ids (flash_attention.layout): segment, branch, position", full, {"ids": ids}
  if candidate == "cudnn":
    if name == "causal":
      return "is_causal=True", full, {"causal": True}
    return "a dense bool mask [B, 1, T, S] (cuDNN reads it as a bias) with is_causal", full, {"mask": full}
  if candidate == "pallas_mosaic_gpu":
    if name == "causal":
      return "TuningConfig(causal=True)", full, {"causal": True}
    return "not expressible: the kernel takes no mask, only causal=True", None, {}
  if candidate == "tokamax_mosaic_gpu":
    if name == "causal":
      return "is_causal=True", full, {"causal": True}
    if ranges is not None:
      first, end = ranges
      how = "base.Mask(k_start, k_end): each query's keys as one range [first, last + 1)"
      return how, full, {"k_start": first, "k_end": end}
    return (
      "a dense bool mask [B, 1, T, S] (the ranges cannot say it: a branch sees two)",
      full,
      {"mask": full},
    )
  raise ValueError(candidate)


def dense(args) -> np.ndarray:
  """The dense mask ``args`` amount to, recomputed from them alone."""
  causal = np.tril(np.ones((T, T), bool))[None]
  if "ids" in args:  # the kernel masks by layers.visible of these ids, the reference's own rule
    return jaxrm_mask(args["ids"])
  if "mask" in args:
    return args["mask"] & causal
  if "k_start" in args:
    keys = np.arange(T)[None, None]
    return (keys >= args["k_start"][..., None]) & (keys < args["k_end"][..., None]) & causal
  return np.broadcast_to(causal, (B, T, T))


# ------------------------------------------------------------------ compiling for sm90


def attention(candidate: str, args: dict):
  """``(q, k, v) -> out`` of ``candidate`` with ``args`` (jax arrays where they vary per row)."""
  if candidate == "jaxrm_pallas_triton":
    ids = args["ids"]
    layout = F.layout(
      jnp.asarray(ids["segment"] * ids["real"]), jnp.asarray(ids["branch"]), jnp.asarray(ids["positions"])
    )
    return lambda q, k, v: F.flash_attention(q, k, v, layout, scale=D**-0.5, blocks=F.blocks_for(DEVICE, D))
  if candidate == "cudnn":
    mask = None if "mask" not in args else jnp.asarray(args["mask"])[:, None]
    return lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, mask=mask, is_causal=True, implementation="cudnn"
    )
  if candidate == "pallas_mosaic_gpu":
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am

    # Its version check asks the CUDA runtime, which a machine without a GPU lacks; 12.9.1 is the
    # first release it accepts with causal masking.
    am.cuda_versions = am.cuda_versions or types.SimpleNamespace(cuda_runtime_get_version=lambda: 12091)
    config = am.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, causal=True)
    return lambda q, k, v: am.attention(q, k, v, config)
  if candidate == "tokamax_mosaic_gpu":
    from tokamax._src.ops.attention import api, base

    if "k_start" in args:
      mask = base.Mask(
        k_start=jnp.asarray(args["k_start"])[:, None], k_end=jnp.asarray(args["k_end"])[:, None]
      )
    elif "mask" in args:
      mask = base.Mask(jnp.asarray(args["mask"])[:, None], is_causal=True)
    else:
      mask = base.Mask(is_causal=True)
    return lambda q, k, v: api.IMPLEMENTATIONS["mosaic_gpu"](q, k, v, mask=mask, logits_scale=D**-0.5)
  raise ValueError(candidate)


def compile_sm90(candidate: str, args: dict) -> dict:
  """Forward and backward of ``candidate`` compiled for an H100: ok with its custom calls and
  seconds, or the error's first line."""
  spec = lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(MESH, P()))
  q, kv = spec((B, T, H, D)), spec((B, T, K, D))
  attend = attention(candidate, args)
  loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32))
  start = time.perf_counter()
  try:
    with gpu_targets.uncached():
      text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile().as_text()
  except Exception as e:  # noqa: BLE001  (a candidate's refusal is the finding)
    return {"compiled": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
  calls = sorted(set(re.findall(r'custom_call_target="([^"]*)"', text)))
  return {"compiled": True, "custom_calls": calls, "compile_s": round(time.perf_counter() - start, 1)}


def cross_compile_tokamax() -> str | None:
  """Lets tokamax compile for a compile-only GPU: its checks ask the default device (here a CPU)
  for its compute capability. Returns tokamax's version, or None where it is not importable."""
  try:
    import tokamax
    from absl import flags
    from tokamax._src import gpu_utils
    from tokamax._src.ops import op
  except ImportError:
    return None
  flags.FLAGS(["gpu_kernel_candidates", "--tokamax_cross_compile"], known_only=True)
  gpu_utils._compute_capability = lambda *a, **k: 9.0
  op.backend.get_default_device = lambda: DEVICE
  return getattr(tokamax, "__version__", "?")


def carries(expressible: bool, row: dict) -> bool | None:
  """True: the mask is expressible, equals jaxrm's, and compiled for sm90; None: undecided here
  (the compile needs a library this machine lacks, e.g. cuDNN); False otherwise."""
  if not expressible or not row["same_as_jaxrm"]:
    return False
  if row["compiled"]:
    return True
  return None if "not detected" in row["error"] else False


CANDIDATES = {
  "jaxrm_pallas_triton": "jaxrm.models.flash_attention (Pallas on Triton, the route today)",
  "cudnn": "jax.nn.dot_product_attention(implementation='cudnn')",
  "pallas_mosaic_gpu": "jax.experimental.pallas.ops.gpu.attention_mgpu (Pallas on Mosaic GPU)",
  "tokamax_mosaic_gpu": "tokamax.dot_product_attention's Mosaic GPU kernel",
}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--json", default="", help="write the table here")
  args = p.parse_args(argv)
  global DEVICE, MESH
  DEVICE = gpu_targets.devices(TARGET)[0]
  MESH = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), devices=[DEVICE])
  tokamax_version = cross_compile_tokamax()
  ids = mask_ids()
  table = {}
  for candidate, what in CANDIDATES.items():
    rows = {}
    for name in MASKS:
      if candidate == "tokamax_mosaic_gpu" and tokamax_version is None:
        rows[name] = {"carries": None, "how": "tokamax not importable here"}
        continue
      how, amounts_to, kwargs = express(candidate, name, ids[name])
      row = {"how": how}
      if amounts_to is not None:
        row["same_as_jaxrm"] = bool((dense(kwargs) == jaxrm_mask(ids[name])).all())
        row.update(compile_sm90(candidate, kwargs))
      row["carries"] = carries(amounts_to is not None, row)
      rows[name] = row
      print(candidate, name, json.dumps(row)[:200], flush=True)
    carried = [m for m, r in rows.items() if r["carries"]]
    table[candidate] = {"what": what, "carries": carried, "masks": rows}
  record = {
    "target": gpu_targets.TARGETS[TARGET].description,
    "shape": {"rows": B, "tokens": T, "heads": H, "kv_heads": K, "head_dim": D, "dtype": "bfloat16"},
    "jax": jax.__version__,
    "tokamax": tokamax_version,
    "decided_by": "each mask in the candidate's own form, expanded to a dense mask and compared with "
    "jaxrm's layers.attention_mask on CPU (same_as_jaxrm), then forward and backward compiled for an "
    "sm90 compile-only device (compiled); carries = both (null: the compile needs a library this "
    "machine lacks). A dense mask costs B x T x S bytes a layer where per-token ids cost B x T. "
    "No GPU ran anything: speed and on-device numerics wait for one.",
    "candidates": table,
  }
  if args.json:
    with open(args.json, "w") as f:
      json.dump(record, f, indent=1)
      f.write("\n")


if __name__ == "__main__":
  sys.exit(main())
