r"""A generative verifier against a scalar head trained on the same data for the same steps, and the
verifier zero-shot: accuracy on the same held-out pairs, and each training's step time.

  .venv/bin/python scripts/bench_verifier.py --work_dir=/tmp/jaxrm_bench_verifier \
      --json=benchmarks/cpu_smollm2_verifier_vs_scalar.json

It runs the commands a user would, one after another, each in its own process:

1. ``python -m jaxrm.evaluate --model=embedded:SmolLM2-135M-Instruct --verifier`` on the held-out
   pairs: the instruct model as is, the baseline every verifier run is compared with;
2. ``python -m jaxrm.train --config=<config>`` (default ``configs/rm.py``: Bradley-Terry, a scalar
   head on the same model), then the same with ``--config.reward.type=verifier``;
3. ``python -m jaxrm.evaluate`` of each run's best checkpoint on the same held-out pairs.

The held-out pairs are the config's validation split (``--data``, ``--split``), scored at the
config's ``data.max_length``. Step times are the trainer's own (``metrics.jsonl``'s
``timing/train/step_time``; median and quartiles, which the few steps that compiled a new batch
shape do not move): a verifier's rows are
longer by its question turn, so this compares the two trainings, not the heads alone
(``scripts/bench.py --vs-variant=head=lm`` times the heads on the same rows, in lockstep).
``--extra`` passes more ``--config.key=value`` to both trainings (e.g. a shorter run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from bench_common import commit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZERO_SHOT_MODEL = "embedded:SmolLM2-135M-Instruct"


def run(cmd: list[str], log_path: str) -> float:
  """Runs ``cmd`` from the repository's root, its output into ``log_path``; its wall seconds."""
  print("$", " ".join(cmd), flush=True)
  start = time.perf_counter()
  with open(log_path, "w") as log:
    done = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
  seconds = time.perf_counter() - start
  if done.returncode:
    with open(log_path) as f:
      tail = f.read()[-3000:]
    sys.exit(f"{' '.join(cmd)} failed (exit {done.returncode}); the end of {log_path}:\n{tail}")
  return seconds


def evaluate(model: str, out: str, args, *extra: str) -> dict:
  """``jaxrm.evaluate`` of ``model`` on the held-out pairs: its eval.json, and the seconds it took."""
  cmd = [
    sys.executable,
    "-m",
    "jaxrm.evaluate",
    f"--model={model}",
    f"--data={args.data}",
    f"--split={args.split}",
    f"--max_length={args.max_length}",
    f"--output={out}",
    *extra,
  ]
  seconds = run(cmd, out + ".log")
  with open(os.path.join(out, "eval.json")) as f:
    result = json.load(f)
  return {"command": " ".join(cmd[1:]), "seconds": round(seconds, 1), "eval": result}


def train(name: str, args, *extra: str) -> dict:
  """One training of ``args.config`` into ``<work_dir>/<name>``: its metrics and step times."""
  out = os.path.join(args.work_dir, name)
  cmd = [
    sys.executable,
    "-m",
    "jaxrm.train",
    f"--config={args.config}",
    f"--config.output_dir={out}",
    *extra,
    *args.extra,
  ]
  seconds = run(cmd, out + ".log")
  with open(os.path.join(out, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  # The steps the trainer logged (every logger period's), "steps" below. The few that compiled a
  # new batch shape take seconds more; the median and quartiles are not moved by them.
  train_rows = [r for r in rows if "timing/train/step_time" in r]
  times = [r["timing/train/step_time"] for r in train_rows]
  validation = [r for r in rows if any(k.startswith("validation") for k in r)]
  return {
    "command": " ".join(cmd[1:]),
    "seconds": round(seconds, 1),
    "steps": len(train_rows),
    "step_time_median_s": round(statistics.median(times), 3) if times else None,
    "step_time_quartiles_s": [round(q, 3) for q in statistics.quantiles(times, n=4)[::2]]
    if len(times) > 1
    else None,
    "last_validation": validation[-1] if validation else None,
    "output_dir": out,
  }


def accuracy(result: dict) -> float:
  """The share of held-out pairs whose chosen response scored above the rejected one."""
  return result["eval"]["metrics"]["accuracy"]


def stage(name: str, args, work):
  """``work()``'s record, kept in ``<work_dir>/<name>.json``; with ``--reuse``, the record an
  earlier run of this script left there, where there is one."""
  path = os.path.join(args.work_dir, name + ".json")
  if args.reuse and os.path.exists(path):
    print(f"reusing {path}", flush=True)
    with open(path) as f:
      return json.load(f)
  record = work()
  with open(path, "w") as f:
    json.dump(record, f, indent=1)
  return record


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--work_dir", default="/tmp/jaxrm_bench_verifier", help="runs and evaluations go here")
  p.add_argument("--config", default="configs/rm.py", help="the training config of both runs")
  p.add_argument("--data", default="demo_arithmetic", help="the held-out pairs (jaxrm.evaluate --data)")
  p.add_argument("--split", default="validation", help="their split")
  p.add_argument("--max_length", type=int, default=128, help="as the config's data.max_length")
  p.add_argument("--extra", default="", help="more --config.key=value for both trainings, space-separated")
  p.add_argument("--json", default=None, help="write the results here")
  p.add_argument(
    "--reuse",
    action="store_true",
    help="keep --work_dir and take each step's record an earlier run left there (e.g. after it "
    "stopped), running only the steps without one",
  )
  args = p.parse_args()
  args.extra = args.extra.split()
  bad = [x for x in args.extra if not x.startswith("--config.")]
  if bad:
    p.error(f"--extra takes --config.key=value settings; got {bad[0]!r}")
  if os.path.exists(args.work_dir) and not args.reuse:
    shutil.rmtree(args.work_dir)
  os.makedirs(args.work_dir, exist_ok=True)
  w = args.work_dir
  results = {"commit": commit(), "args": vars(args)}
  results["zero_shot"] = stage(
    "eval_zero_shot",
    args,
    lambda: evaluate(ZERO_SHOT_MODEL, os.path.join(w, "eval_zero_shot"), args, "--verifier"),
  )
  results["scalar"] = stage("scalar", args, lambda: train("scalar", args))
  results["verifier"] = stage(
    "verifier", args, lambda: train("verifier", args, "--config.reward.type=verifier")
  )
  for name in ("scalar", "verifier"):
    out = results[name]["output_dir"]
    results[name]["held_out"] = stage(
      f"eval_{name}", args, lambda out=out, name=name: evaluate(out, os.path.join(w, f"eval_{name}"), args)
    )
  s, v = results["scalar"], results["verifier"]
  results["summary"] = {
    "zero_shot_accuracy": accuracy(results["zero_shot"]),
    "scalar_accuracy": accuracy(s["held_out"]),
    "verifier_accuracy": accuracy(v["held_out"]),
    "verifier_vs_scalar_step_time": round(v["step_time_median_s"] / s["step_time_median_s"], 3)
    if s["step_time_median_s"] and v["step_time_median_s"]
    else None,
  }
  print(json.dumps(results["summary"], indent=1))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
