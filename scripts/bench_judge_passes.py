r"""Where a pairwise judge's shared scoring spends its time: each forward pass of ``score_groups``,
shared and unshared, timed with its shape, on the groups and model of ``bench_score.py --judge``::

  python scripts/bench_judge_passes.py --random_shape=4,256,768,4,2 --prompts=2 --group_size=8 \
      --strategy=round_robin --max_length=2048 --repeats=3

For each way of scoring it prints the passes' shapes, their token slots (rows x length, padding
included), the real tokens they hold and the seconds per thousand slots; the sharing's speedup is
then the ratio of slots times the ratio of the cost per slot. Compiling happens before timing; the
two ways run in turns, the median over ``--repeats`` is shown.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import bench_score
import numpy as np
from bench_common import commit


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default=bench_score.EMBEDDED, help="What RewardModel.from_pretrained loads.")
  p.add_argument("--random_shape", default=None, help="As bench_score.py's: a random Llama of this shape.")
  p.add_argument("--prompts", type=int, default=2)
  p.add_argument("--group_size", type=int, default=8)
  p.add_argument("--strategy", default="round_robin")
  p.add_argument("--max_length", type=int, default=2048)
  p.add_argument("--prompt_median", type=int, default=256)
  p.add_argument("--completion_median", type=int, default=128)
  p.add_argument("--batch_size", type=int, default=8)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", default=None, help="Also write the results here.")
  return p.parse_args(argv)


def timed_passes(rm, call) -> tuple[float, list[tuple[int, int, float]]]:
  """(seconds of ``call()``, (rows, length, seconds) of each forward pass rm ran in it)."""
  passes = []
  score_tokens, score_shared = rm.score_tokens, rm.score_shared

  def plain(ids, mask):
    start = time.perf_counter()
    out = score_tokens(ids, mask)
    passes.append((*np.shape(ids), time.perf_counter() - start))
    return out

  def shared(rows):
    start = time.perf_counter()
    out = score_shared(rows)
    passes.append((*rows.batch.input_ids.shape, time.perf_counter() - start))
    return out

  rm.score_tokens, rm.score_shared = plain, shared
  try:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start, passes
  finally:
    del rm.score_tokens, rm.score_shared


def main(argv=None) -> None:
  args = parse_args(argv)
  from jaxrm.tasks import pairwise

  model = bench_score.random_model(args.random_shape, args.seed) if args.random_shape else args.model
  rm = bench_score.load_judge(model, "float32")
  bench = bench_score.parse_args(
    [
      "--workload=grpo",
      "--judge",
      f"--prompts={args.prompts}",
      f"--max_length={args.max_length}",
      f"--prompt_median={args.prompt_median}",
      f"--completion_median={args.completion_median}",
      f"--seed={args.seed}",
    ]
  )
  drawn = bench_score.judge_groups(rm, bench, args.group_size, args.strategy)
  real = sum(map(len, drawn.ids))
  calls = {
    name: (
      lambda share=share: pairwise.score_groups(
        rm,
        drawn.prompts,
        drawn.groups,
        strategy=args.strategy,
        batch_size=args.batch_size,
        max_length=args.max_length,
        share_prefix=share,
      )
    )
    for name, share in (("shared", True), ("unshared", False))
  }
  for call in calls.values():
    call()  # untimed: compiling
  runs = {name: [] for name in calls}
  for _ in range(args.repeats):
    for name, call in calls.items():
      runs[name].append(timed_passes(rm, call))
  results = []
  for name, timings in runs.items():
    passes = timings[0][1]
    slots = sum(b * t for b, t, _ in passes)
    forward = statistics.median(sum(s for *_, s in p) for _, p in timings)
    results.append(
      dict(
        name=name,
        seconds=statistics.median(t for t, _ in timings),
        forward_seconds=forward,
        passes=[[b, t] for b, t, _ in passes],
        slots=slots,
        ms_per_1000_slots=1e6 * forward / slots,
      )
    )
  shared, unshared = results
  fed = bench_score.judge_tokens(rm, drawn, bench)["fed"]
  print(
    f"{args.strategy}, P={args.prompts} x G={args.group_size}: {len(drawn.texts)} judge texts, {real} tokens; "
    f"shared rows hold {fed}",
    flush=True,
  )
  for r in results:
    print(
      f"  {r['name']}: {r['seconds']:.2f} s ({r['forward_seconds']:.2f} s in {len(r['passes'])} passes), "
      f"{r['slots']} slots, {r['ms_per_1000_slots']:.1f} ms per 1000 slots; "
      + ", ".join(f"{b}x{t}" for b, t in r["passes"]),
      flush=True,
    )
  fewer = unshared["slots"] / shared["slots"]
  dearer = shared["ms_per_1000_slots"] / unshared["ms_per_1000_slots"]
  print(
    f"shared: {fewer:.2f}x fewer slots, each {dearer:.2f}x the cost: {fewer / dearer:.2f}x the speed; "
    f"measured {unshared['seconds'] / shared['seconds']:.2f}x; the real tokens alone would give {real / fed:.2f}x",
    flush=True,
  )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(args=vars(args), commit=commit(), tokens=real, fed=fed, results=results), f, indent=1)


if __name__ == "__main__":
  sys.exit(main())
