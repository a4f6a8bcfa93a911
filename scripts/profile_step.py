r"""Where one training step's time goes on the CPU: XLA's operations, timed, against their FLOPs.

  python scripts/profile_step.py --model=smollm2-135m --mode=unpacked --batch_size=2

Builds the step as ``scripts/bench.py`` does (the trainer's update on the bench's rows), runs
``--warmup`` steps, then traces ``--steps`` steps with ``jax.profiler`` (host tracer level 3: one
event per XLA operation that XLA:CPU runs). Each event is joined with the compiled program's
instruction of that name (an asynchronous one's up to its ``end:`` marker): its opcode, its FLOPs
(2 x output x contracted size for every dot it holds) and the Python stack that made it (the program's stack-frame table), whose innermost
frame in jaxrm or optax names the bucket. Printed per bucket, forward and backward apart:
operation seconds (each operation's duration on the thread that ran it, its products spread over
every core; operations that overlap add up past the wall time), share, GFLOP, and FLOP/s against a
plain 2048^3 float32 matmul's in the same process; the same over the bucket's share of the wall
time (an instant in which n operations run is split evenly among them: the shares add up to the
time in which any ran); then the step's wall time, the part of it in
which no operation ran (dispatch, loop control, waiting), credited to the operation before each
gap, and the source lines that cost most.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import linecache
import os
import re
import sys
import tempfile
import time

import bench

from jaxrm.run import host_memory

_DEF = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_COMP = re.compile(r"^(?:ENTRY )?%(\S+) \((.*)\) -> .* \{$")
_SHAPE = re.compile(r"[a-z]\d*\[([\d,]*)\]")


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", choices=sorted(bench.SHAPES), default="smollm2-135m")
  p.add_argument("--mode", choices=bench.JAXRM_MODES, default="unpacked")
  p.add_argument("--batch_size", type=int, default=2, help="pairs per step")
  p.add_argument("--max_length", type=int, default=512)
  p.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's own)")
  p.add_argument("--warmup", type=int, default=2, help="untraced steps first")
  p.add_argument("--steps", type=int, default=2, help="traced steps (their times are summed)")
  p.add_argument("--top", type=int, default=12, help="source lines listed")
  p.add_argument("--json", default=None, help="write the table here")
  return p.parse_args(argv)


class Program:
  """The compiled program's text: each instruction's opcode, dot FLOPs and stack frame."""

  def __init__(self, text: str):
    self.frames = _frames(text)
    self.ops: dict[str, dict] = {}
    shapes: dict[str, list[int]] = {}
    calls: dict[str, list[str]] = collections.defaultdict(list)  # computation -> what it calls
    own_flops: dict[str, float] = collections.defaultdict(float)  # computation -> its dots' FLOPs
    comp = None
    for line in text.splitlines():
      if m := _COMP.match(line):
        comp = m.group(1)
        for name, shape in re.findall(r"(\S+?): ([a-z]\d*\[[\d,]*\])", m.group(2)):
          shapes[name] = _dims(shape)
        continue
      m = _DEF.match(line)
      if not m:
        continue
      name, shape, opcode, rest = m.groups()
      shapes[name] = _dims(shape)
      frame = re.search(r"stack_frame_id=(\d+)", rest)
      op_name = re.search(r'op_name="([^"]*)"', rest)
      flops = _dot_flops(shapes, shape, rest) if opcode == "dot" else 0.0
      own_flops[comp] += flops
      called = re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", rest)
      calls[comp] += called
      self.ops[name] = dict(
        computation=comp,
        opcode=opcode,
        flops=flops,
        called=called,
        frame=int(frame.group(1)) if frame else 0,
        backward="transpose(" in (op_name.group(1) if op_name else ""),
      )
    fused = {c for op in self.ops.values() if op["opcode"] == "fusion" for c in op["called"]}
    for op in self.ops.values():  # a fusion's FLOPs are those of the dots it calls
      if op["opcode"] == "fusion":
        op["flops"] += sum(_total(c, calls, own_flops) for c in op["called"])
    # What runs on its own (an event of the trace): not an instruction inside a fusion.
    self.ops = {name: op for name, op in self.ops.items() if op["computation"] not in fused}

  def stack(self, frame_id: int) -> list[tuple[str, str, int]]:
    """(file, function, line) from the innermost frame out."""
    out = []
    while frame_id:
      file, function, line, parent = self.frames[frame_id]
      out.append((file, function, line))
      frame_id = parent if 0 < parent < frame_id else 0
    return out


def _frames(text: str) -> dict[int, tuple]:
  tables: dict[str, dict[int, str]] = collections.defaultdict(dict)
  table = None
  for line in text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      table = line
    elif table and (m := re.match(r"^(\d+) (.*)$", line)):
      tables[table][int(m.group(1))] = m.group(2)
    elif table and line.strip():
      table = None
  parents = {
    i: int(re.search(r"parent_frame_id=(\d+)", frame).group(1)) for i, frame in tables["StackFrames"].items()
  }
  # XLA's text prints each parent one past its id (a root frame as its own id, none as 0): a frame
  # that names itself says so. A parent always comes before its child.
  shift = 1 if any(p == i for i, p in parents.items()) else 0
  out = {}
  for i, frame in tables["StackFrames"].items():
    loc = int(re.search(r"file_location_id=(\d+)", frame).group(1))
    parent = parents[i] - shift
    where = tables["FileLocations"][loc]
    file = tables["FileNames"][int(re.search(r"file_name_id=(\d+)", where).group(1))].strip('"')
    function = tables["FunctionNames"][int(re.search(r"function_name_id=(\d+)", where).group(1))].strip('"')
    out[i] = (file, function, int(re.search(r"line=(\d+)", where).group(1)), parent)
  return out


def _dims(shape: str) -> list[int]:
  m = _SHAPE.search(shape)
  return [int(d) for d in m.group(1).split(",") if d] if m else []


def _dot_flops(shapes, shape: str, rest: str) -> float:
  lhs = re.match(r"\s*(?:[a-z]\d*\[[\d,]*\]\{[\d,]*\} )?%([\w.\-]+)", rest).group(1)
  contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1)
  size = 1
  for d in (int(x) for x in contracting.split(",") if x):
    size *= shapes[lhs][d]
  out = 1
  for d in _dims(shape):
    out *= d
  return 2.0 * out * size


def _total(comp, calls, own_flops, seen=None) -> float:
  seen = seen or set()
  if comp in seen:
    return 0.0
  seen.add(comp)
  return own_flops[comp] + sum(_total(c, calls, own_flops, seen) for c in calls[comp])


# ------------------------------------------------------------------------------ buckets

BUCKETS = (  # (bucket, a function or file of the stack that puts an operation there), first match
  ("optimizer update", ("optax/", "apply_updates", "_update")),
  ("head and loss", ("losses.py", "heads.py", "sequence_rewards", "last_token_index")),
  ("attention: mask", ("mask_from_ids", "visible", "token_ids")),
  ("attention: scores, softmax, values", ("_layer_attention",)),
  ("norms and rope", ("rms_norm", "apply_rope", "rope_tables", "_rope_tables")),
  ("layer projections (q, k, v, o, MLP)", ("linear",)),
)
CONTAINERS = ("while", "conditional", "call")  # what runs other operations, each traced itself
COPIES = ("copy", "transpose", "dynamic-slice", "dynamic-update-slice", "slice", "concatenate", "pad")


def bucket_of(program: Program, name: str) -> tuple[str, tuple[str, int] | None]:
  """(bucket, innermost jaxrm source line) of the instruction ``name``."""
  op = program.ops.get(name)
  if op is None:
    return "not in the program (runtime)", None
  stack = program.stack(op["frame"])
  ours = [(f, fn, ln) for f, fn, ln in stack if "/jaxrm/" in f or "optax/" in f]
  where = (ours[0][0], ours[0][2]) if ours else None
  label = "other (residuals, activations, layer glue)"
  for bucket, keys in BUCKETS:
    if any(k in f or k == fn or fn.startswith(k + ".") for f, fn, _ in ours for k in keys):
      label = bucket
      break
  if (
    label.startswith("other")
    and not op["flops"]
    and (op["opcode"] in COPIES or any(name.startswith(c) or f"_{c}_" in name for c in COPIES))
  ):
    label = "copies, transposes, slices"
  if label != "optimizer update":
    label += " (backward)" if op["backward"] else " (forward)"
  return label, where


def profile(args) -> dict:
  import jax

  bargs = bench.parse_args(
    [
      f"--model={args.model}",
      f"--modes={args.mode}",
      f"--batch_size={args.batch_size}",
      f"--max_length={args.max_length}",
      f"--layers={args.layers}",
      f"--steps={args.steps}",
      f"--warmup={args.warmup}",
    ]
  )
  cfg = bench.model_config(bargs)
  built, num_params = bench._jaxrm_update(cfg, bargs.seed, args.warmup + args.steps)
  groups = bench.batches_of(bench.bench_pairs(bargs), bargs)
  collate = bench.collator(args.mode, bargs)
  batch = max((collate(g) for g in groups), key=lambda b: b.input_ids.size)  # the longest shape
  step, state = built.train_step, built.state
  program = Program(step.compile(state, batch).as_text())
  matmul = bench.jax_matmul_tflops()
  for _ in range(args.warmup):
    state, _ = step(state, batch)
  jax.block_until_ready(state)
  options = jax.profiler.ProfileOptions()
  options.host_tracer_level = 3  # an event per XLA operation
  options.python_tracer_level = 0
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True, profiler_options=options)
    start = time.perf_counter()
    for _ in range(args.steps):
      state, _ = step(state, batch)
      jax.block_until_ready(state)
    wall = time.perf_counter() - start
    jax.profiler.stop_trace()
    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    with gzip.open(path) as f:
      events = json.load(f)["traceEvents"]
  return table(program, events, wall, args, matmul, len(os.sched_getaffinity(0)), batch)


def table(program, events, wall, args, matmul_tflops, cores, batch) -> dict:
  seconds = collections.defaultdict(float)
  flops = collections.defaultdict(float)
  lines = collections.defaultdict(float)
  intervals = []  # (start, end, bucket)
  for e, dur in operations(events, program):
    name = e["name"]
    label, where = bucket_of(program, name)
    seconds[label] += dur
    flops[label] += program.ops[name]["flops"]
    if where:
      lines[where] += dur
    intervals.append((e["ts"] / 1e6, e["ts"] / 1e6 + dur, label))
  busy, gaps = _union(intervals)
  shares = _wall_shares(intervals)
  total = sum(seconds.values())
  rate = matmul_tflops * 1e12  # an operation's products run on every core, as the plain matmul's
  rows = [
    dict(
      bucket=k,
      seconds=round(v / args.steps, 3),
      share=round(v / total, 3),
      gflop=round(flops[k] / args.steps / 1e9, 1),
      of_matmul=round(flops[k] / v / rate, 3) if flops[k] else None,
      wall_seconds=round(shares[k] / args.steps, 3),
      wall_of_matmul=round(flops[k] / shares[k] / rate, 3) if flops[k] and shares[k] else None,
    )
    for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])
  ]
  top = [
    dict(where=f"{os.path.relpath(f)}:{ln}", seconds=round(s / args.steps, 3), code=_source(f, ln))
    for (f, ln), s in sorted(lines.items(), key=lambda kv: -kv[1])[: args.top]
  ]
  return dict(
    args=vars(args),
    input_ids=list(batch.input_ids.shape),
    cores=cores,
    matmul_tflops=round(matmul_tflops, 4),
    step_wall_s=round(wall / args.steps, 3),
    no_operation_running_s=round((wall - busy) / args.steps, 3),
    idle_after=[
      dict(bucket=k, seconds=round(v / args.steps, 3))
      for k, v in sorted(gaps.items(), key=lambda kv: -kv[1])[:6]
    ],
    operation_s=round(total / args.steps, 3),
    step_gflop=round(sum(flops.values()) / args.steps / 1e9, 1),
    buckets=rows,
    top_lines=top,
  )


def _union(intervals) -> tuple[float, dict[str, float]]:
  """Seconds in which some operation ran, and each gap between them (inside the traced steps)
  credited to the bucket of the operation that ended last before it."""
  covered, end, last = 0.0, None, None
  gaps = collections.defaultdict(float)
  for a, b, label in sorted(intervals):
    if end is not None and a > end:
      gaps[last] += a - end
    if end is None or b > end:
      covered += b - max(a, end if end is not None else a)
      end, last = b, label
  return covered, gaps


def operations(events, program) -> list[tuple[dict, float]]:
  """(event, seconds) of each operation the trace shows running. An operation that XLA:CPU runs
  asynchronously (a product handed to the thread pool, a large copy) has an event that ends when
  it is dispatched and an ``end: <name>`` marker when it completes: its seconds run to the marker
  (the n-th start of a name with its n-th marker). Loops and calls are left out: their operations
  are counted themselves."""
  starts, ends = collections.defaultdict(list), collections.defaultdict(list)
  for e in events:
    name = e.get("name", "")
    if e.get("ph") != "X":
      continue
    if name in program.ops:
      if program.ops[name]["opcode"] not in CONTAINERS:
        starts[name].append(e)
    elif name.startswith("end: ") and name[5:] in program.ops:
      ends[name[5:]].append(e["ts"])
  out = []
  for name, started in starts.items():
    started.sort(key=lambda e: e["ts"])
    done = sorted(ends.get(name, []))
    paired = len(done) == len(started)
    for i, e in enumerate(started):
      end = max(e["ts"] + e["dur"], done[i] if paired else 0.0)
      out.append((e, (end - e["ts"]) / 1e6))
  return out


def _wall_shares(intervals) -> dict[str, float]:
  """Each bucket's share of the wall time: every instant in which n operations run is split
  evenly among them, so that the shares add up to the time in which any ran (where independent
  operations run at once on the cores, each alone seems slow by its own duration)."""
  edges = sorted({t for a, b, _ in intervals for t in (a, b)})
  starts = collections.defaultdict(list)
  ends = collections.defaultdict(list)
  for i, (a, b, label) in enumerate(intervals):
    starts[a].append((i, label))
    ends[b].append(i)
  running: dict[int, str] = {}
  out = collections.defaultdict(float)
  for t0, t1 in zip(edges, edges[1:]):
    for i in ends[t0]:
      running.pop(i, None)
    for i, label in starts[t0]:
      if t1 > t0:
        running[i] = label
    for label in running.values():
      out[label] += (t1 - t0) / len(running)
  return out


def _source(file: str, line: int) -> str:
  return linecache.getline(file, line).strip()[:70]


def show(result: dict) -> None:
  print(
    f"input_ids {result['input_ids']}, {result['cores']} cores; plain 2048^3 matmul "
    f"{result['matmul_tflops']:.3f} TFLOP/s; step {result['step_wall_s']:.2f} s wall, "
    f"{result['operation_s']:.2f} s of operations, {result['no_operation_running_s']:.2f} s with none "
    f"running; {result['step_gflop']:.0f} GFLOP of dots"
  )
  print(
    f"{'bucket':58} {'op s':>7} {'share':>6} {'GFLOP':>7} {'of matmul':>9} {'wall s':>7} {'of matmul':>9}"
  )
  for r in result["buckets"]:
    rate = f"{r['of_matmul']:.0%}" if r["of_matmul"] is not None else "-"
    wall = f"{r['wall_of_matmul']:.0%}" if r["wall_of_matmul"] is not None else "-"
    print(
      f"{r['bucket']:58} {r['seconds']:7.3f} {r['share']:6.1%} {r['gflop']:7.1f} {rate:>9} "
      f"{r['wall_seconds']:7.3f} {wall:>9}"
    )
  print("\nnone running, after an operation of (seconds per step):")
  for r in result["idle_after"]:
    print(f"  {r['seconds']:7.3f}  {r['bucket']}")
  print("\nsource lines that cost most (operation seconds per step):")
  for r in result["top_lines"]:
    print(f"  {r['seconds']:7.3f}  {r['where']:34} {r['code']}")


def main(argv=None) -> None:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  host_memory.restart_with_huge_pages()  # as the commands do
  result = profile(args)
  show(result)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({**result, "commit": bench.commit()}, f, indent=1)


if __name__ == "__main__":
  main()
