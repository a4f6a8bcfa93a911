r"""GPU memory of one context-parallel attention layer, Pallas kernel against the reference blocks.

Compiles the forward and backward pass (bfloat16) of ``context_parallel.attention`` for
compile-only GPUs (:mod:`jaxrm.planning.gpu_targets`; no GPU needed) and prints, per row length and context
size, each route's temporaries per device (``compiled.memory_analysis().temp_size_in_bytes``) and
how many Triton kernels its program holds, as a Markdown table::

  python scripts/context_attention_plan.py
  python scripts/context_attention_plan.py --lengths=16384 --contexts=2,8 --gpu=h100-80gb

The layer is Llama-3.1-8B's (32 query heads over 8 key heads of 128), one padded row of full
attention, its tokens dealt over the mesh's ``context`` axis as the decoder stores them; the other
devices of the topology form ``fsdp`` (which a single row leaves idle). Temporaries are what the
layer needs beyond its inputs (q, k, v, the output cotangent and ids) and outputs (out, dq, dk,
dv); a compile does not autotune, and cuBLAS/NCCL workspaces lie outside them.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxrm import sharding
from jaxrm.models import context_parallel as CP
from jaxrm.models import layers as L
from jaxrm.planning import gpu_targets

ROUTES = ("reference", "pallas")


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--lengths", default="16384,32768,65536,131072", help="tokens per row, comma-separated")
  p.add_argument("--contexts", default="2,4,8", help="mesh.context sizes, comma-separated")
  p.add_argument("--gpu", default="h200", help=f"target GPU: {', '.join(gpu_targets.TARGETS)}")
  p.add_argument("--devices", type=int, default=8, help="GPUs of the (one-host) topology")
  p.add_argument("--balance", default="zigzag", choices=sharding.CONTEXT_BALANCES)
  p.add_argument("--heads", default="32,8,128", help="query heads, key heads, head dim")
  return p.parse_args(argv)


def compile_layer(route: str, length: int, mesh, balance: str, heads: tuple[int, int, int]):
  """The layer's forward and backward, compiled over ``mesh`` for one row of ``length`` tokens."""
  h, kv, d = heads
  placement = sharding.Placement(mesh, balance)
  order = CP.storage_order(length, placement.context, balance)
  index = jnp.broadcast_to(jnp.asarray(order), (1, length))

  def layer(q, k, v, d_out, mask, positions):
    ids = L.token_ids(mask, positions, index_bt=index)
    attend = lambda q, k, v: CP.attention(
      q, k, v, ids, order, placement=placement, scale=d**-0.5, softcap=None, kernel=route
    )
    out, vjp = jax.vjp(attend, q, k, v)
    return out, *vjp(d_out)

  q_spec, k_spec = placement.attention_specs((1, length, h, d), (1, length, kv, d))
  arg = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
  q = arg((1, length, h, d), jnp.bfloat16, q_spec)
  k = arg((1, length, kv, d), jnp.bfloat16, k_spec)
  row = arg((1, length), jnp.int32, jax.sharding.PartitionSpec(q_spec[0], q_spec[1]))
  with gpu_targets.uncached():
    return jax.jit(layer).lower(q, k, k, q, row, row).compile()


def main(argv=None) -> None:
  args = parse_args(argv)
  devices = gpu_targets.devices(args.gpu, f"1x{args.devices}")
  heads = tuple(int(x) for x in args.heads.split(","))
  print(
    f"{gpu_targets.get(args.gpu).description}, {args.devices} devices; heads {heads}, bfloat16, batch 1, "
    f"{args.balance}; forward + backward of one layer\n"
  )
  print(
    "| tokens | context | reference temp GiB | pallas temp GiB | Triton kernels | compile s (ref, pallas) |"
  )
  print("|---:|---:|---:|---:|---:|---|")
  for length in (int(x) for x in args.lengths.split(",")):
    for context in (int(x) for x in args.contexts.split(",")):
      mesh = sharding.make_mesh(
        sharding.MeshConfig(context=context, context_balance=args.balance), devices=devices
      )
      temps, seconds, kernels = {}, {}, 0
      for route in ROUTES:
        start = time.perf_counter()
        compiled = compile_layer(route, length, mesh, args.balance, heads)
        seconds[route] = time.perf_counter() - start
        temps[route] = compiled.memory_analysis().temp_size_in_bytes / 2**30
        if route == "pallas":
          kernels = compiled.as_text().count('custom_call_target="__gpu$xla.gpu.triton"')
      print(
        f"| {length} | {context} | {temps['reference']:.2f} | {temps['pallas']:.2f} | {kernels} | "
        f"{seconds['reference']:.0f}, {seconds['pallas']:.0f} |",
        flush=True,
      )


if __name__ == "__main__":
  main()
