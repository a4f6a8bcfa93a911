r"""The step-time estimate (``jaxrm.planning.step_time``) beside every training step measured on a GPU.

Each measured step of ``benchmarks/gpu_check_*.json`` is compiled again here, on any machine, for
its GPU target, estimated kernel by kernel, and written with the measured time to
``benchmarks/step_time_calibration.json``; ``jaxrm.planning.step_time.CALIBRATION`` holds the same figures,
which ``python -m jaxrm.plan`` scales its estimates by and prints the errors of::

  python scripts/step_time_calibration.py            # both settings, minutes on 2 cores
  python scripts/step_time_calibration.py --only=bench

The settings: ``bench`` is ``scripts/bench.py --gpu --modes=shared_prompt --row_length=4096
--steps=8`` (Qwen2.5-1.5B, 8 pairs a step, remat=dots): each timed step's batch shape and attended
share, estimated and summed against the benchmark's total time. ``fit`` is ``memory_plan.py --fit
--model=qwen3-8b --max_length=8192 --remat=full``: one pair of two 8192-token completions, full
fine-tuning, one step timed after its compile.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURED = os.path.join(ROOT, "benchmarks", "gpu_check_h200.json")
OUT = os.path.join(ROOT, "benchmarks", "step_time_calibration.json")
BENCH_ARGS = ["--gpu", "--modes=shared_prompt", "--row_length=4096", "--steps=8", "--attention=auto"]


def bench_point(target: str, measured: dict) -> dict:
  """The benchmark's timed steps, each estimated from its batch shape's compiled program."""
  import bench
  import jax
  import numpy as np

  from jaxrm import sharding
  from jaxrm.planning import gpu_targets, step_time

  args = bench.parse_args(BENCH_ARGS)
  built, collate, mesh, _ = bench.compile_only_update(args, target)
  shapes: dict[tuple, dict] = {}
  for i, group in enumerate(bench.batches_of(bench.bench_pairs(args), args)):
    if i < args.warmup:
      continue
    batch = collate(group)
    rows, length = batch.input_ids.shape
    one = shapes.setdefault(batch.input_ids.shape, {"batch": batch, "steps": 0, "keys": 0, "causal": 0})
    one["steps"] += 1
    one["keys"] += bench.attended_keys(batch)
    one["causal"] += rows * length * (length + 1) // 2
  total, parts = 0.0, []
  for shape, one in shapes.items():
    abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.batch_sharding(mesh, x.ndim)),
      one["batch"],
    )
    with gpu_targets.uncached():
      text = built.train_step.compile(built.state, abstract).as_text()
    _keep(f"bench_{shape[0]}x{shape[1]}", text)
    attended = one["keys"] / one["causal"]
    est = step_time.estimate(text, target, attended=attended)
    total += est.seconds * one["steps"]
    parts.append(
      {
        "input_ids": list(shape),
        "steps": one["steps"],
        "attended": round(attended, 4),
        "estimated_s": est.seconds,
      }
    )
    print(
      f"bench {list(shape)}: {one['steps']} steps, attended {attended:.3f}, {est.seconds:.4f} s", flush=True
    )
  result = measured["steps"]["bench"]["result"]
  steps = len(result["totals"]["step_seconds"])
  return {
    "name": "qwen2.5-1.5b shared_prompt",
    "setting": f"scripts/bench.py {' '.join(BENCH_ARGS)}: Qwen2.5-1.5B, shared-prompt rows of 4096, "
    f"8 pairs a step, remat=dots, mean of {steps} timed steps",
    "measured_s": result["totals"]["seconds"] / steps,
    "estimated_s": total / steps,
    "shapes": parts,
    "model_flops": result["totals"]["flops"] / steps,
    "tokens": int(np.round(result["totals"]["fed"] / steps)),
  }


def fit_point(target: str, measured: dict) -> dict:
  """The one full fine-tuning step of Qwen3-8B at 8192 tokens, estimated from its program."""
  import memory_plan

  from jaxrm import sharding
  from jaxrm.hf.loader import placed_abstract_model
  from jaxrm.planning import gpu_targets, step_time

  fit = measured["steps"]["fit"]["result"]
  cfg = memory_plan.plan_config(fit["model"], fit["remat"], fit["attention"])
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), devices=gpu_targets.devices(target, "1x1"))
  built = memory_plan.planned_update(placed_abstract_model(cfg, mesh), mesh)
  batch = memory_plan.planned_batch(cfg, fit["length"], mesh)
  text = memory_plan.compile_programs(built, batch)["step"].as_text()
  _keep(f"fit_{fit['model']}_{fit['length']}", text)
  est = step_time.estimate(text, target)  # both completions fill their rows: every causal pair
  print(f"fit {fit['model']} T={fit['length']}: {est.seconds:.3f} s", flush=True)
  return {
    "name": f"{fit['model']} full fine-tuning",
    "setting": f"scripts/memory_plan.py --fit --model={fit['model']} --max_length={fit['length']} "
    f"--remat={fit['remat']}: one pair of two {fit['length']}-token completions, one step after its compile",
    "measured_s": fit["step_s"],
    "estimated_s": est.seconds,
    "tokens": 2 * fit["length"],
  }


_KEEP: list[str] = []


def _keep(name: str, text: str) -> None:
  """Writes a compiled program's HLO text to --keep_hlo's folder, to estimate again without
  compiling."""
  if _KEEP:
    with open(os.path.join(_KEEP[0], name + ".hlo"), "w") as f:
      f.write(text)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--measured", default=MEASURED, help="a gpu_check JSON file holding measured steps")
  p.add_argument("--only", default="bench,fit", help="which settings, comma-separated: bench, fit")
  p.add_argument("--out", default=OUT, help="the record of the points, with each batch shape's estimate")
  p.add_argument("--keep_hlo", default="", help="a folder to keep each compiled program's HLO text in")
  args = p.parse_args(argv)
  if args.keep_hlo:
    os.makedirs(args.keep_hlo, exist_ok=True)
    _KEEP.append(args.keep_hlo)
  from jaxrm.planning import step_time

  out_path = args.out
  with open(args.measured) as f:
    measured = json.load(f)
  target = measured["gpu"]
  source = os.path.relpath(args.measured, ROOT)
  kept = []
  if os.path.exists(out_path):
    with open(out_path) as f:
      kept = json.load(f)["points"]
  start = time.perf_counter()
  points = {p["name"]: p for p in kept}
  for name in args.only.split(","):
    point = {"bench": bench_point, "fit": fit_point}[name](target, measured)
    points[point["name"]] = {
      **point,
      "target": target,
      "device": measured["steps"]["machine"]["device_kind"],
      "source": f"{source} (run of {measured['started']}, jax {measured['steps']['machine']['jax']})",
    }
  with open(out_path, "w") as f:
    json.dump(
      {
        "note": "Measured GPU steps beside jaxrm.planning.step_time's estimate of the same program, compiled "
        "for the same target on a machine without the GPU (scripts/step_time_calibration.py).",
        "efficiency": dataclasses.asdict(step_time.Efficiency()),
        "points": list(points.values()),
      },
      f,
      indent=1,
    )
  print(f"{out_path} written in {time.perf_counter() - start:.0f} s; jaxrm.planning.step_time.CALIBRATION:")
  for point in points.values():
    print(f"  {point['name']}: measured {point['measured_s']:.4g} s, estimated {point['estimated_s']:.4g} s")


if __name__ == "__main__":
  main()
