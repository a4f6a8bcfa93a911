r"""One NVIDIA GPU, under 8 minutes: the GPU tests, the Qwen2.5-1.5B throughput benchmark, and the
largest shape of the memory plan that trains one step, all into one JSON file.

  bash scripts/gpu_check.sh --out=gpu_check.json   # on the GPU machine (installs carried wheels)
  python scripts/gpu_check.py --dry_run            # anywhere: what would run, sized, no compiling

Steps, each in its own process with its own time limit, within one overall ``--budget_s``:

1. ``machine``: the GPU as JAX and nvidia-smi see it (its usable bytes size step 4).
2. ``gpu_tests``: ``pytest -m gpu`` over the test files that hold a gpu mark.
3. ``bench``: ``scripts/bench.py --gpu`` with ``BENCH_ARGS`` and ``--attention=auto``: pairs/s,
   real tokens/s and MFU of a Qwen2.5-1.5B-shaped reward model (random weights, bf16,
   shared-prompt packed rows of 4096 tokens holding generated pairs of up to 2048 tokens); once
   more with ``--attention=cudnn`` if that fails.
4. ``fit``: ``scripts/memory_plan.py --fit``: one training step on the GPU of the largest
   one-device shape of ``--plan`` without gradient accumulation (most parameters, then longest
   sequences; of one shape, the remat policy with the smallest planned total) whose planned
   total fits the GPU, within ``PLAN_SLACK``; out of memory, the next shape, while time is left.
5. ``calibration``: the same setting's step compiled on the GPU with the reference attention
   (``memory_plan.py --plan_backend=gpu``), so XLA:GPU's temporaries stand beside XLA:CPU's
   from the plan for the same program; only if time is left.

The parent process never imports JAX, so each step has the whole GPU to itself.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "scripts", "bench.py")
MEMORY_PLAN = os.path.join(ROOT, "scripts", "memory_plan.py")
PLAN = os.path.join(ROOT, "scripts", "memory_plan.json")
H200_GIB = 143771 / 1024  # what nvidia-smi reports for an H200, when the GPU cannot be asked
# Each step's limit in seconds (less when the overall budget has less left).
LIMITS = {"machine": 60, "gpu_tests": 150, "bench": 210, "fit": 200, "calibration": 150}
MIN_START_S = 45  # a step is not started with less than this left
# The plan's temporaries are XLA:CPU's, a lead for a GPU's: a setting planned up to this much over
# the GPU's memory is still tried (a failure for want of memory moves on to the next one).
PLAN_SLACK = 1.05
RECOMPUTE = ("full", "dots", "none")  # most recompute (least memory) first
JSON_KEYS = {
    "machine": "backend, devices, device_kind, bytes_limit, nvidia_smi, jax, python",
    "gpu_tests": "files, tests, passed, failed, errors, skipped, cases [{name, outcome, seconds}]",
    "bench": "attempts [{attention, rc, wall_s}], result {pairs_per_s, real_tokens_per_s, "
             "model_tflops, mfu, peak_tflops, flop_formula, peak_memory_gib, compile_s, "
             "compiled_shapes, attention, params_m, totals}",
    "fit": "candidates, attempts [{setting, rc, wall_s}], result {model, length, remat, params, "
           "param_bytes, opt_state_bytes, argument_bytes, temp_bytes, peak_bytes_in_use, "
           "bytes_limit, compile_s, step_s, loss, grad_norm}, planned (the plan's row)",
    "calibration": "result (a plan row: XLA:GPU's bytes for the reference attention), planned "
                   "(XLA:CPU's row)",
}


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default="gpu_check.json", help="the JSON file with every result")
  p.add_argument("--plan", default=PLAN, help="the memory plan (memory_plan.py --json=...)")
  p.add_argument("--budget_s", type=float, default=450, help="time for all steps together")
  p.add_argument("--dry_run", action="store_true",
                 help="size every step (shapes, batch, FLOP formula, plan candidates, JSON keys) "
                      "without compiling or a GPU")
  return p.parse_args(argv)


class Deadline:

  def __init__(self, seconds: float):
    self.end = time.monotonic() + seconds

  def left(self) -> float:
    return self.end - time.monotonic()

  def limit(self, step: str) -> float:
    return min(LIMITS[step], self.left())


def run(cmd: list[str], timeout: float, log: str) -> dict:
  """Runs ``cmd`` from the repository root, its output echoed and kept in ``log``; returns rc,
  wall seconds and the last lines of the output."""
  print(f"$ {' '.join(cmd)}  (limit {timeout:.0f}s)", flush=True)
  start = time.monotonic()
  with open(log, "w") as f:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    try:
      rc = proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
      rc = "timeout"
  with open(log) as f:
    output = f.read()
  print(output[-4000:], flush=True)
  return {"rc": rc, "wall_s": round(time.monotonic() - start, 1), "tail": output[-1500:]}


def _read_json(path: str):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


# ------------------------------------------------------------------------------ the steps


MACHINE = r"""
import json, platform, jax
d = jax.devices()[0]
stats = d.memory_stats() or {}
print("MACHINE " + json.dumps({"backend": jax.default_backend(), "devices": jax.device_count(),
      "device_kind": d.device_kind, "bytes_limit": stats.get("bytes_limit"),
      "jax": jax.__version__, "python": platform.python_version()}))
"""


def machine(deadline: Deadline, tmp: str) -> dict:
  out = run([sys.executable, "-c", MACHINE], deadline.limit("machine"), os.path.join(tmp, "machine.log"))
  found = re.search(r"^MACHINE (.*)$", out["tail"], re.M)
  result = json.loads(found.group(1)) if found else {"error": out["tail"][-500:]}
  try:
    result["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=20).stdout.strip()
  except (OSError, subprocess.TimeoutExpired) as e:
    result["nvidia_smi"] = f"not run: {e}"
  return result


def gpu_test_files() -> list[str]:
  """Test files that mark a test with ``@pytest.mark.gpu``."""
  files = []
  for path in sorted(glob.glob(os.path.join(ROOT, "tests", "test_*.py"))):
    with open(path) as f:
      if "mark.gpu" in f.read():
        files.append(os.path.relpath(path, ROOT))
  return files


def gpu_tests(deadline: Deadline, tmp: str, dry_run: bool) -> dict:
  files = gpu_test_files()
  if dry_run:  # which tests would run; collecting imports the test files, compiling nothing
    out = run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p",
               "no:cacheprovider", *files], 120, os.path.join(tmp, "collect.log"))
    cases = [line for line in out["tail"].splitlines() if "::" in line]
    return {"files": files, "would_run": cases, "rc": out["rc"]}
  xml = os.path.join(tmp, "gpu_tests.xml")
  out = run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
             f"--junitxml={xml}", *files], deadline.limit("gpu_tests"), os.path.join(tmp, "pytest.log"))
  result = {"files": files, "rc": out["rc"], "wall_s": out["wall_s"], "tail": out["tail"]}
  try:
    suite = ET.parse(xml).getroot()
  except (OSError, ET.ParseError):
    return result
  suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
  cases = []
  for case in suite.iter("testcase"):
    outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
    cases.append({"name": f"{case.get('classname')}.{case.get('name')}", "outcome": outcome,
                  "seconds": float(case.get("time", 0))})
  counts = {o: sum(c["outcome"] == o for c in cases) for o in ("passed", "failure", "error", "skipped")}
  result.update(tests=len(cases), passed=counts["passed"], failed=counts["failure"],
                errors=counts["error"], skipped=counts["skipped"], cases=cases)
  return result


# Rows of 4096 tokens: 2 batch shapes to compile for 9 steps (as long as the longest group: 4 for 4)
BENCH_ARGS = ["--gpu", "--modes=shared_prompt", "--row_length=4096", "--steps=8"]


def bench(deadline: Deadline, tmp: str, dry_run: bool) -> dict:
  if dry_run:
    out = run([sys.executable, BENCH, *BENCH_ARGS, "--attention=auto", "--dry_run"], 120,
              os.path.join(tmp, "bench.log"))
    return {"command": f"bench.py {' '.join(BENCH_ARGS)} --attention=auto", "rc": out["rc"],
            "dry_run_output": out["tail"]}
  result = {"attempts": []}
  for attention in ("auto", "cudnn"):
    if deadline.left() < MIN_START_S:
      break
    path = os.path.join(tmp, f"bench_{attention}.json")
    out = run([sys.executable, BENCH, *BENCH_ARGS, f"--attention={attention}", f"--json={path}"],
              deadline.limit("bench"), os.path.join(tmp, f"bench_{attention}.log"))
    result["attempts"].append({"attention": attention, **out})
    found = _read_json(path)
    if out["rc"] == 0 and found and found.get("results"):
      result["result"] = found["results"][0]
      result["data"] = found.get("data")
      break
  return result


def _setting(row: dict) -> str:
  return f"{row['model']} T={row['length']} remat={row['remat']}"


def fit_candidates(plan: dict | None, capacity_gib: float) -> list[dict]:
  """Of each shape (model and length) the plan's one-device row without gradient accumulation
  (the step ``--fit`` trains) with the smallest total (on a tie, the most recompute), if that is
  within ``PLAN_SLACK`` of ``capacity_gib``; largest shape first: most parameters, then longest
  sequences."""
  best = {}
  for r in (plan or {}).get("rows", []):
    key = (r["model"], r["length"])
    rank = (r["total_bytes"], RECOMPUTE.index(r["remat"]))
    one_step = r["devices"] == 1 and r.get("grad_accum", 1) == 1
    if one_step and (key not in best or rank < best[key][0]):
      best[key] = (rank, r)
  rows = [r for _, r in best.values() if r["total_bytes"] <= PLAN_SLACK * capacity_gib * 2**30]
  return sorted(rows, key=lambda r: (-r["params"], -r["length"]))


def fit(deadline: Deadline, tmp: str, dry_run: bool, plan: dict | None, capacity_gib: float) -> dict:
  candidates = fit_candidates(plan, capacity_gib)
  result = {"capacity_gib": round(capacity_gib, 2), "candidates": [_setting(r) for r in candidates[:4]],
            "attempts": []}
  if not candidates:
    result["error"] = "no one-device setting of the plan fits; run memory_plan.py first"
    return result
  if dry_run:
    top = candidates[0]
    path = os.path.join(tmp, "fit.json")
    out = run([sys.executable, MEMORY_PLAN, "--fit", "--dry_run", f"--model={top['model']}",
               f"--max_length={top['length']}", f"--remat={top['remat']}", "--attention=auto",
               f"--json={path}"], 120, os.path.join(tmp, "fit.log"))
    result.update(rc=out["rc"], would_train=_setting(top), planned=top, sized=_read_json(path))
    return result
  for row in candidates[:3]:
    # Out of memory: try the next, smaller setting. Another failure: the same one with cuDNN's
    # attention instead of the Pallas kernel.
    for attention in ("auto", "cudnn"):
      if deadline.left() < MIN_START_S + 30:
        return result
      path = os.path.join(tmp, f"fit_{len(result['attempts'])}.json")
      out = run([sys.executable, MEMORY_PLAN, "--fit", f"--model={row['model']}",
                 f"--max_length={row['length']}", f"--remat={row['remat']}",
                 f"--attention={attention}", f"--json={path}"],
                deadline.limit("fit"), os.path.join(tmp, "fit.log"))
      result["attempts"].append({"setting": _setting(row), "attention": attention, **out})
      found = _read_json(path)
      if out["rc"] == 0 and found:
        result.update(result=found, planned=row)
        return result
      if re.search(r"RESOURCE_EXHAUSTED|out of memory", out["tail"], re.I):
        break
  return result


def calibration_command(row: dict, path: str) -> list[str]:
  """``row``'s step compiled (not run) on the GPU with the reference attention, as the plan
  compiled it on CPU."""
  return [sys.executable, MEMORY_PLAN, "--plan_backend=gpu", f"--plan_models={row['model']}",
          f"--plan_lengths={row['length']}", f"--plan_remat={row['remat']}", "--plan_meshes=1x1x1",
          "--attention=reference", f"--json={path}"]


def calibration(deadline: Deadline, tmp: str, planned: dict | None) -> dict:
  if not planned:
    return {"skipped": "no setting trained in the fit step"}
  if deadline.left() < MIN_START_S + 30:
    return {"skipped": f"{deadline.left():.0f}s left"}
  path = os.path.join(tmp, "calibration.json")
  out = run(calibration_command(planned, path), deadline.limit("calibration"),
            os.path.join(tmp, "calibration.log"))
  rows = (_read_json(path) or {}).get("rows") or [None]
  return {**out, "result": rows[0], "planned": planned}


# ------------------------------------------------------------------------------------ main


def main(argv=None) -> None:
  args = parse_args(argv)
  deadline = Deadline(args.budget_s)
  started = time.time()
  plan = _read_json(args.plan)
  report = {"dry_run": args.dry_run, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "budget_s": args.budget_s, "plan": os.path.relpath(args.plan, ROOT) if plan else None,
            "steps": {}}
  if args.dry_run:
    report["json_keys"] = JSON_KEYS
    print(f"steps, each with its limit, within {args.budget_s:.0f}s: "
          + ", ".join(f"{k} ({v}s)" for k, v in LIMITS.items()))
    print("planned JSON keys per step:\n" + "\n".join(f"  {k}: {v}" for k, v in JSON_KEYS.items()))

  def save():
    report["wall_s"] = round(time.time() - started, 1)
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)

  with tempfile.TemporaryDirectory() as tmp:
    steps = report["steps"]
    if args.dry_run:
      steps["machine"] = {"skipped": "dry run; step 4 assumes an H200's memory"}
      capacity = H200_GIB
    else:
      steps["machine"] = machine(deadline, tmp)
      limit = steps["machine"].get("bytes_limit")
      capacity = limit / 2**30 if limit else H200_GIB
    save()
    steps["gpu_tests"] = gpu_tests(deadline, tmp, args.dry_run)
    save()
    steps["bench"] = bench(deadline, tmp, args.dry_run)
    save()
    steps["fit"] = fit(deadline, tmp, args.dry_run, plan, capacity)
    save()
    if args.dry_run:
      top = (fit_candidates(plan, capacity) or [None])[0]
      steps["calibration"] = {"would_run": " ".join(calibration_command(top, "calibration.json")[1:])
                              if top else None}
    else:
      steps["calibration"] = calibration(deadline, tmp, steps["fit"].get("planned"))
    save()
  print(f"wrote {args.out} after {report['wall_s']}s")
  failed = [name for name, s in report["steps"].items()
            if s.get("rc") not in (None, 0) or "error" in s
            or (not args.dry_run and name in ("bench", "fit") and "result" not in s)]
  if failed:
    sys.exit(f"gpu check: {', '.join(failed)} failed (see {args.out})")


if __name__ == "__main__":
  main()
