"""The reference attention on a CPU: the dense mask's unrolled chunks against the block loops that
skip what the mask hides (``layers.IdMask``, the decoder's route for rows of
``decoder.LOOP_MIN_TOKENS`` tokens or more), forward and forward + backward, on rows of the
layouts jaxrm trains and scores: GRPO groups packed with shared prompts, packed segments, unpacked
rows with and without padding. SmolLM2-135M's heads (9 query heads over 3 key heads of 64), float32.

Both routes first show that they compute the same outputs and gradients; then they run in turns
(dense, loops, dense, ...), ``--repeats`` times each after one warm-up, and the medians' ratio is
reported with the range of each.

  .venv/bin/python scripts/bench_attention.py --repeats=7 --json=benchmarks/cpu_attention_blocks.json

``--shard_lengths`` measures instead what context parallelism's reference route compiles per shard
(``layers.IdMask`` with an offset, ``layers.LOOP_BLOCKS``): one layer's forward + backward for T
local queries, the last T of a row of 4T tokens, against the row's 4T keys, Llama-3.1-8B's heads
(32 query heads over 8 key heads of 128), bfloat16, batch 1, a traced window; compiled ahead of
time on XLA:CPU, nothing run. For each T: the compile's seconds, its temporaries
(``memory_analysis()``) and the optimised program's size:

  .venv/bin/python scripts/bench_attention.py --shard_lengths=4096,8192,16384 \
      --json=benchmarks/cpu_attention_shard_compile.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import commit

from jaxrm.models import decoder
from jaxrm.models import layers as L

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
SCALE = HEAD_DIM**-0.5


def grpo_row(length: int, groups: int, prompt: int = 256, completion: int = 128, group_size: int = 8):
  """(real, positions, segments, branches) of one row holding ``groups`` GRPO groups: a prompt,
  then ``group_size`` completions that each see it (branches), padding after."""
  ids = np.zeros((4, length), np.int32)
  at = 0
  for g in range(groups):
    spans = [(prompt, 0, 0)] + [(completion, b + 1, prompt) for b in range(group_size)]
    for n, branch, first_position in spans:
      ids[:, at : at + n] = [[1], [0], [g + 1], [branch]]
      ids[1, at : at + n] = first_position + np.arange(n)
      at += n
  return tuple(ids)


def packed_row(length: int, lengths: list[int]):
  """One row of packed segments of ``lengths`` tokens, padding after."""
  ids = np.zeros((4, length), np.int32)
  at = 0
  for i, n in enumerate(lengths):
    ids[0, at : at + n], ids[1, at : at + n], ids[2, at : at + n] = 1, np.arange(n), i + 1
    at += n
  return tuple(ids)


def padded_row(length: int, real: int):
  """One unpacked row of ``real`` tokens, padding after."""
  return packed_row(length, [real])


CASES = {
  "grpo_shared_2x3072": lambda: [grpo_row(3072, 2), grpo_row(3072, 2)],
  "packed_2x1024": lambda: [packed_row(1024, [300, 200, 400, 100]), packed_row(1024, [500, 450])],
  "unpacked_2x1024_padded": lambda: [padded_row(1024, 600), padded_row(1024, 900)],
  "unpacked_2x1024_full": lambda: [padded_row(1024, 1024), padded_row(1024, 1000)],
  "unpacked_2x512_full": lambda: [padded_row(512, 512), padded_row(512, 480)],
}


def routes(rows):
  """The dense mask and the decoder's block loops over the same ids."""
  real, positions, segments, branches = (np.stack(x) for x in zip(*rows))
  ids = L.token_ids(real, positions, segments, branches)
  return {
    "dense": L.mask_from_ids(ids, ids),
    "loops": L.IdMask(ids, ids, offset=0, blocks=decoder.CPU_LOOP_BLOCKS),
  }


def programs(mask, seen):
  """Jitted forward and forward + backward of the attention under ``mask`` (an argument, as the
  decoder's masks are traced values, not constants). The loss reads the outputs of the queries
  that see a key (``seen`` [B, T]): a padding query's output is unused, and the routes give it
  different values (the dense path an average over the keys it hides, the loops 0)."""
  attend = lambda q, k, v, m: L.dot_product_attention(q, k, v, m, SCALE, None)
  weights = lambda q: jnp.cos(q) * seen[:, :, None, None]
  loss = lambda q, k, v, m: jnp.sum(attend(q, k, v, m) * weights(q))
  return jax.jit(attend), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def run_case(name: str, repeats: int) -> dict:
  rows = CASES[name]()
  masks = routes(rows)
  b, t = masks["loops"].queries.real.shape
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((b, t, HEADS, HEAD_DIM)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((b, t, KV_HEADS, HEAD_DIM)), jnp.float32) for _ in range(2))
  seen = np.asarray(masks["dense"]).any(-1)  # queries that see no key (padding): outputs unused
  fns = {route: programs(mask, jnp.asarray(seen, jnp.float32)) for route, mask in masks.items()}
  outs = {route: jax.block_until_ready(fwd(q, k, v, masks[route])) for route, (fwd, _) in fns.items()}
  grads = {route: jax.block_until_ready(both(q, k, v, masks[route])[1]) for route, (_, both) in fns.items()}
  out_diff = float(np.abs(np.asarray(outs["loops"]) - np.asarray(outs["dense"]))[seen].max())
  grad_diff = max(
    float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(grads["loops"], grads["dense"])
  )
  times = {(route, part): [] for route in fns for part in ("forward", "forward_backward")}
  for _ in range(repeats):
    for route, (fwd, both) in fns.items():
      for part, fn in (("forward", fwd), ("forward_backward", both)):
        start = time.perf_counter()
        jax.block_until_ready(fn(q, k, v, masks[route]))
        times[route, part].append(time.perf_counter() - start)
  record = {
    "rows": b,
    "length": t,
    "real_tokens": int(np.sum([r[0] for r in rows])),
    "largest_output_difference": out_diff,
    "largest_gradient_difference": grad_diff,
  }
  for part in ("forward", "forward_backward"):
    dense, loops = (np.median(times[route, part]) for route in ("dense", "loops"))
    record[part] = {
      "dense_ms": round(1e3 * float(dense), 1),
      "dense_range_ms": [
        round(1e3 * min(times["dense", part]), 1),
        round(1e3 * max(times["dense", part]), 1),
      ],
      "loops_ms": round(1e3 * float(loops), 1),
      "loops_range_ms": [
        round(1e3 * min(times["loops", part]), 1),
        round(1e3 * max(times["loops", part]), 1),
      ],
      "speedup": round(float(dense / loops), 2),
    }
  return record


SHARD_HEADS, SHARD_KV_HEADS, SHARD_HEAD_DIM = 32, 8, 128  # Llama-3.1-8B


def compile_shard(t: int) -> dict:
  """One context-parallel shard's attention, forward + backward, compiled for T = ``t`` local
  queries (the last T of a row of 4T tokens) against the row's 4T keys."""
  s, first = 4 * t, 3 * t

  def step(q, k, v, d_out, index, real, segment, branch, position):
    keys = L.TokenIds(index, real, segment, branch, position)
    queries = L.TokenIds(*(x[:, first:] for x in keys))
    mask = L.IdMask(queries, keys, jnp.int32(4096), offset=first)
    attend = lambda q, k, v: L.dot_product_attention(q, k, v, mask, SHARD_HEAD_DIM**-0.5, None)
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(d_out)

  query = jax.ShapeDtypeStruct((1, t, SHARD_HEADS, SHARD_HEAD_DIM), jnp.bfloat16)
  key = jax.ShapeDtypeStruct((1, s, SHARD_KV_HEADS, SHARD_HEAD_DIM), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((1, s), jnp.int32)
  start = time.perf_counter()
  compiled = jax.jit(step).lower(query, key, key, query, *(ids,) * 5).compile()
  seconds = time.perf_counter() - start
  return {
    "queries": t,
    "keys": s,
    "compile_s": round(seconds, 2),
    "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
    "hlo_chars": len(compiled.as_text()),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
  parser.add_argument("--repeats", type=int, default=7, help="timed turns of each route")
  parser.add_argument("--json", help="write the results here")
  parser.add_argument(
    "--shard_lengths",
    help="comma-separated T: compile a context-parallel shard's attention instead (T queries, 4T keys)",
  )
  args = parser.parse_args()
  if args.shard_lengths:
    try:
      lengths = [int(x) for x in args.shard_lengths.split(",")]
    except ValueError:
      parser.error(f"--shard_lengths={args.shard_lengths}: comma-separated whole numbers, e.g. 4096,16384")
    if any(t < 1 for t in lengths):
      parser.error(f"--shard_lengths={args.shard_lengths}: each length must be at least 1")
    results = {"commit": commit(), "blocks": list(L.LOOP_BLOCKS), "shards": []}
    for t in lengths:
      r = compile_shard(t)
      results["shards"].append(r)
      print(
        f"T={t:6d} S={r['keys']:6d}: compile {r['compile_s']:.1f} s, temp {r['temp_bytes'] / 2**20:.0f} MiB, "
        f"program {r['hlo_chars'] / 1e3:.0f} k chars",
        flush=True,
      )
  else:
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
      parser.error(f"unknown case {unknown[0]!r}: choose among {', '.join(CASES)}")
    if args.repeats < 1:
      parser.error("--repeats must be at least 1")
    results = {"commit": commit(), "blocks": list(decoder.CPU_LOOP_BLOCKS), "cases": {}}
    for name in names:
      r = results["cases"][name] = run_case(name, args.repeats)
      print(
        f"{name:24s} forward {r['forward']['dense_ms']:7.1f} -> {r['forward']['loops_ms']:7.1f} ms "
        f"({r['forward']['speedup']:.2f}x); forward+backward {r['forward_backward']['dense_ms']:7.1f} -> "
        f"{r['forward_backward']['loops_ms']:7.1f} ms ({r['forward_backward']['speedup']:.2f}x); "
        f"largest differences {r['largest_output_difference']:.1e} / {r['largest_gradient_difference']:.1e}",
        flush=True,
      )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
