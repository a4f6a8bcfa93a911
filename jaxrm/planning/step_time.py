"""How long a compiled step takes on a GPU, estimated from the program XLA's GPU compiler made.

A compile for a compile-only GPU (:mod:`jaxrm.planning.gpu_targets`) gives no cost analysis, so the
optimized HLO text is read instead: every kernel the step launches (a fusion, a custom call, a
copy, a collective), with its FLOPs (the dots it holds: 2 x output elements x contracted size;
one per element for the other arithmetic) and the bytes it reads and writes (a slice of a
stacked layer's weights counts as the slice, an update in place as the update). Each kernel takes
the longer of its FLOPs at the target's peak rate and its bytes at the memory bandwidth, each at a
stated efficiency (:class:`Efficiency`), plus a launch; a loop's body counts once per trip. A
Pallas (Triton) kernel's FLOPs are not in the HLO: the flash-attention kernels are counted from
their shapes and the share of (query, key) pairs the step attends, at their own efficiency.

What it leaves out: overlap of kernels with each other and of collectives with compute (summed),
caches, autotuning on the device, and host work between steps. :data:`CALIBRATION` holds every
step measured on a GPU beside the estimate of the same program: estimates are scaled to fit them,
and their errors are printed with every estimate.
"""

from __future__ import annotations

import dataclasses
import math
import re

from jaxrm.planning import gpu_targets

# The bytes of one element per HLO type; sub-byte types count a byte (a stated overestimate).
_TYPE_BYTES = {"pred": 1, "token": 0, "tuple": 0}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%(\S+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*)$")
# What launches nothing: names, tuples and the host-side halves of asynchronous pairs.
_FREE = {
  "parameter",
  "constant",
  "get-tuple-element",
  "tuple",
  "bitcast",
  "opt-barrier",
  "after-all",
  "add-dependency",
  "partition-id",
  "replica-id",
  "copy-done",
  "send-done",
  "recv-done",
  "async-done",
  "all-gather-done",
  "all-reduce-done",
  "collective-permute-done",
}
_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_NO_FLOPS = {
  "parameter",
  "constant",
  "get-tuple-element",
  "tuple",
  "bitcast",
  "broadcast",
  "reshape",
  "transpose",
  "copy",
  "slice",
  "dynamic-slice",
  "dynamic-update-slice",
  "concatenate",
  "pad",
  "iota",
  "convert",
  "fusion",
  "reverse",
  "gather",
  "scatter",
  "bitcast-convert",
}
# A flash kernel's FLOPs per attended (query, key) pair per head per head-dimension: forward
# QK^T and PV (4); dq recomputes QK^T and takes dP and dQ (6); dkv recomputes QK^T and takes dP,
# dV and dK (8). The model's count is 4 forward + 8 backward: the rest is recomputation.
FLASH_FLOPS = {"jaxrm_flash_forward": 4, "jaxrm_flash_dq": 6, "jaxrm_flash_dkv": 8}


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """The share of a GPU's peak each kind of kernel reaches, and a kernel's fixed cost.

  matmul: XLA's GEMM fusions on large bfloat16 products (cuBLAS reaches 70-80% of Hopper's dense
  peak on such shapes). pallas: the Triton flash-attention kernels, by their FLOPs (Triton's
  FlashAttention-2 tutorial kernels run at about 40-50% of an H100's peak). memory: a streaming
  kernel's share of the card's bandwidth. launch_s: a kernel's launch and tail. link_bytes_per_s:
  the bandwidth a collective moves data at (NVLink 4, per direction).
  """

  matmul: float = 0.7
  pallas: float = 0.45
  memory: float = 0.8
  launch_s: float = 4e-6
  link_bytes_per_s: float = 450e9


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One kernel of the step: what it computes and moves each time, and how often it runs."""

  name: str
  kind: str  # "gemm", "pallas", "fusion", "collective" or "other"
  flops: float
  bytes: float
  runs: int
  seconds: float  # each run, estimated

  @property
  def total_s(self) -> float:
    return self.seconds * self.runs


@dataclasses.dataclass(frozen=True)
class StepEstimate:
  """A compiled program's estimated time on ``target``, kernel by kernel."""

  target: str
  kernels: tuple[Kernel, ...]

  @property
  def seconds(self) -> float:
    return sum(k.total_s for k in self.kernels)

  @property
  def flops(self) -> float:
    return sum(k.flops * k.runs for k in self.kernels)

  @property
  def bytes(self) -> float:
    return sum(k.bytes * k.runs for k in self.kernels)

  @property
  def launches(self) -> int:
    return sum(k.runs for k in self.kernels)

  def share(self, kind: str) -> float:
    """The share of the step's time spent in kernels of ``kind``."""
    return sum(k.total_s for k in self.kernels if k.kind == kind) / max(self.seconds, 1e-30)

  def longest(self, n: int = 15) -> list[Kernel]:
    return sorted(self.kernels, key=lambda k: -k.total_s)[:n]

  def __add__(self, other: StepEstimate) -> StepEstimate:
    return StepEstimate(self.target, self.kernels + other.kernels)

  def times(self, runs: int) -> StepEstimate:
    """This program run ``runs`` times (a micro-batched step's gradient program)."""
    return StepEstimate(self.target, tuple(dataclasses.replace(k, runs=k.runs * runs) for k in self.kernels))


# ------------------------------------------------------------------ reading the HLO text


@dataclasses.dataclass
class _Instruction:
  name: str
  shape: str
  opcode: str
  operands: list[str]
  args: str  # the text between the parentheses
  attrs: str


def _split_shape(rest: str) -> tuple[str, str]:
  if not rest.startswith("("):
    shape, _, tail = rest.partition(" ")
    return shape, tail
  depth = 0
  for i, c in enumerate(rest):
    depth += (c == "(") - (c == ")")
    if depth == 0:
      return rest[: i + 1], rest[i + 2 :]
  return rest, ""


def _parse_instruction(line: str) -> _Instruction | None:
  m = _INSTRUCTION.match(line)
  if not m:
    return None
  shape, tail = _split_shape(m.group(2))
  op = re.match(r"([\w\-\$\.]+)\(", tail)
  if not op:
    return None
  depth, start = 0, op.end() - 1
  end = len(tail)
  for i in range(start, len(tail)):
    depth += (tail[i] == "(") - (tail[i] == ")")
    if depth == 0:
      end = i
      break
  operands = re.findall(r"%([\w\.\-]+)", tail[start:end])
  return _Instruction(m.group(1), shape, op.group(1), operands, tail[start + 1 : end], tail[end + 1 :])


def parse_computations(hlo_text: str) -> tuple[dict[str, list[_Instruction]], str]:
  """HLO text -> ({computation: its instructions}, the entry computation's name)."""
  computations: dict[str, list[_Instruction]] = {}
  entry, current = "", None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = computations.setdefault(header.group(2), [])
      entry = header.group(2) if header.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None:
      instruction = _parse_instruction(line)
      if instruction:
        current.append(instruction)
  return computations, entry


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape (a tuple's: all its elements)."""
  total = 0
  for dtype, dims in _SHAPE.findall(shape):
    size = _TYPE_BYTES.get(dtype)
    if size is None:
      bits = re.search(r"\d+", dtype)
      size = max(int(bits.group()) // 8, 1) if bits else 1
    total += size * math.prod(int(d) for d in dims.split(",") if d)
  return total


def _dims(shape: str) -> list[int]:
  found = _SHAPE.search(shape)
  return [int(d) for d in found.group(2).split(",") if d] if found else []


def _dtype(shape: str) -> str:
  found = _SHAPE.search(shape)
  return found.group(1) if found else ""


# ------------------------------------------------------------------ the cost of one kernel


class _Program:
  """The costs of one HLO module's kernels."""

  def __init__(self, hlo_text: str, target: gpu_targets.GpuTarget, eff: Efficiency, attended: float):
    self.computations, self.entry = parse_computations(hlo_text)
    self.target, self.eff, self.attended = target, eff, attended
    self.kernels: list[Kernel] = []

  def shapes(self, computation: str) -> dict[str, str]:
    return {i.name: i.shape for i in self.computations.get(computation, [])}

  def walk(self, computation: str, runs: int) -> None:
    """Adds the kernels ``computation`` launches, each run ``runs`` times."""
    shapes = self.shapes(computation)
    for ins in self.computations.get(computation, []):
      called = re.findall(r"(?:body|condition|to_apply|calls)=%([\w\.\-]+)", ins.attrs)
      if ins.opcode in _FREE:
        continue
      if ins.opcode == "while":
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
        for c in called:
          self.walk(c, runs * (int(trips.group(1)) if trips else 1))
      elif ins.opcode == "call" or ins.opcode == "async-start":
        for c in called:
          self.walk(c, runs)
      elif ins.opcode == "conditional":
        listed = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
        branches = re.findall(r"%([\w\.\-]+)", listed.group(1)) if listed else []
        branches += re.findall(r"(?:true|false)_computation=%([\w\.\-]+)", ins.attrs)
        costs = [self._sub(b) for b in branches]  # the costliest branch, as if it always ran
        if costs:
          self.kernels.extend(max(costs, key=lambda ks: sum(k.total_s for k in ks)))
      else:
        self.kernels.append(self.kernel(ins, shapes, runs))

  def _sub(self, computation: str) -> list[Kernel]:
    before = len(self.kernels)
    self.walk(computation, 1)
    out = self.kernels[before:]
    del self.kernels[before:]
    return out

  def kernel(self, ins: _Instruction, shapes: dict[str, str], runs: int) -> Kernel:
    moved = self.moved_bytes(ins, shapes)
    base = ins.opcode.removesuffix("-start")
    if base in _COLLECTIVES:
      seconds = shape_bytes(ins.shape) / self.eff.link_bytes_per_s + self.eff.launch_s
      return Kernel(ins.name, "collective", 0.0, moved, runs, seconds)
    if ins.opcode == "custom-call" and "__gpu$xla.gpu.triton" in ins.attrs:
      return self.pallas(ins, shapes, moved, runs)
    flops, dot_rate = self.flops(ins, shapes)
    kind = "gemm" if dot_rate else ("fusion" if ins.opcode == "fusion" else "other")
    rate = (dot_rate or self.target.peak_flops("bf16")) * self.eff.matmul
    seconds = max(flops / rate, moved / (self.target.memory_bandwidth * self.eff.memory))
    return Kernel(ins.name, kind, flops, moved, runs, seconds + self.eff.launch_s)

  def pallas(self, ins: _Instruction, shapes: dict[str, str], moved: float, runs: int) -> Kernel:
    """A Pallas kernel: a flash-attention kernel by its shapes and the attended share; another by
    its bytes alone."""
    name = next((n for n in FLASH_FLOPS if n in ins.attrs), "pallas_call")
    flops = 0.0
    if name in FLASH_FLOPS and len(ins.operands) >= 2:
      q, k = _dims(shapes.get(ins.operands[0], "")), _dims(shapes.get(ins.operands[1], ""))
      if len(q) == 4 and len(k) == 4:
        b, t, h, d = q
        s = k[1]
        pairs = t * (t + 1) / 2 if t == s else t * s
        flops = FLASH_FLOPS[name] * b * h * d * pairs * self.attended
    rate = self.target.peak_flops("bf16") * self.eff.pallas
    seconds = max(flops / rate, moved / (self.target.memory_bandwidth * self.eff.memory))
    return Kernel(name, "pallas", flops, moved, runs, seconds + self.eff.launch_s)

  def flops(self, ins: _Instruction, shapes: dict[str, str]) -> tuple[float, float]:
    """(FLOPs, the peak rate of its products, 0 if it has none) of one instruction, inside any
    fusion it calls."""
    if ins.opcode == "dot":
      lhs = _dims(shapes.get(ins.operands[0], "")) if ins.operands else []
      contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
      size = math.prod(lhs[int(c)] for c in contracting.group(1).split(",") if c) if contracting else 1
      out = math.prod(_dims(ins.shape))
      rate = self.target.peak_flops(_dtype(shapes.get(ins.operands[0], "")))
      return 2.0 * out * size, rate
    if ins.opcode == "custom-call" and "__cublas" in ins.attrs:
      return self.cublas(ins, shapes)
    called = re.findall(r"calls=%([\w\.\-]+)", ins.attrs)
    if called:
      total, rate = 0.0, 0.0
      for c in called:
        inner = self.shapes(c)
        for sub in self.computations.get(c, []):
          f, r = self.flops(sub, inner)
          total, rate = total + f, max(rate, r) if r else rate
      return total, rate
    if ins.opcode in _NO_FLOPS:
      return 0.0, 0.0
    return float(math.prod(_dims(ins.shape))), 0.0

  def cublas(self, ins: _Instruction, shapes: dict[str, str]) -> tuple[float, float]:
    lhs = _dims(shapes.get(ins.operands[0], "")) if ins.operands else []
    contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
    dims = [int(c.strip('"')) for c in contracting.group(1).split(",") if c] if contracting else []
    out = math.prod(_dims(ins.shape))
    rate = self.target.peak_flops(_dtype(shapes.get(ins.operands[0], "")))
    return 2.0 * out * math.prod(lhs[d] for d in dims), rate

  def moved_bytes(self, ins: _Instruction, shapes: dict[str, str]) -> float:
    """Bytes read and written: the operands and the output, but a slice of an operand where the
    kernel only slices it, and an in-place update's own bytes."""
    called = re.findall(r"calls=%([\w\.\-]+)", ins.attrs)
    inner = self.computations.get(called[0], []) if called and ins.opcode == "fusion" else []
    read = [shape_bytes(shapes.get(o, "")) for o in ins.operands]
    written = shape_bytes(ins.shape)
    if ins.opcode == "dynamic-slice" and read:
      read[0] = written
    if ins.opcode == "dynamic-update-slice" and len(read) > 1:
      read[0], written = 0, read[1]
    if inner:
      params = {i.name: int(i.args) for i in inner if i.opcode == "parameter" and i.args.isdigit()}
      inner_shapes = {i.name: i.shape for i in inner}
      for name, index in params.items():
        if index >= len(read):
          continue
        users = [i for i in inner if name in i.operands]
        if users and all(u.opcode == "dynamic-slice" and u.operands[0] == name for u in users):
          read[index] = sum(shape_bytes(u.shape) for u in users)
        elif any(u.opcode == "dynamic-update-slice" and u.operands[0] == name for u in users):
          read[index] = 0
      updates = [i for i in inner if i.opcode == "dynamic-update-slice"]
      if updates:
        written -= sum(shape_bytes(u.shape) for u in updates)
        written += sum(
          shape_bytes(inner_shapes.get(u.operands[1], "")) for u in updates if len(u.operands) > 1
        )
        written = max(written, 0)
    return float(sum(read) + written)


def estimate(
  hlo_text: str,
  target: str | gpu_targets.GpuTarget,
  *,
  attended: float = 1.0,
  efficiency: Efficiency | None = None,
) -> StepEstimate:
  """The estimated time of one run of the compiled program ``hlo_text`` (``compiled.as_text()``)
  on ``target``.

  Args:
    attended: the share of each flash kernel's causal (query, key) pairs that the batch attends
      (1: one sequence per row; packed rows of several sequences attend less, and the kernel skips
      blocks outside a sequence).
    efficiency: the share of peak each kind of kernel reaches (default :class:`Efficiency`).
  """
  target = gpu_targets.get(target) if isinstance(target, str) else target
  program = _Program(hlo_text, target, efficiency or Efficiency(), attended)
  program.walk(program.entry, 1)
  return StepEstimate(target.name, tuple(program.kernels))


def estimate_step(
  programs: dict, target: str | gpu_targets.GpuTarget, *, grad_accum: int = 1, attended: float = 1.0
) -> StepEstimate:
  """One train step's estimate from its compiled programs: ``{"step": c}``, or a micro-batched
  step's ``{"gradient": c, "update": c}``, the gradient program run ``grad_accum`` times."""
  each = {name: estimate(p.as_text(), target, attended=attended) for name, p in programs.items()}
  if "step" in each:
    return each["step"]
  return each["gradient"].times(grad_accum) + each["update"]


# ------------------------------------------------------------------ calibration


@dataclasses.dataclass(frozen=True)
class Measured:
  """A training step timed on a GPU beside this module's estimate of the same program (compiled
  for the same target without the GPU); ``source`` says where each figure comes from."""

  name: str
  target: str
  measured_s: float
  estimated_s: float  # uncalibrated: estimate(...).seconds
  source: str


# Every step measured on a GPU so far. Refreshed by scripts/step_time_calibration.py, which
# compiles each setting again, estimates it, and writes benchmarks/step_time_calibration.json.
CALIBRATION = (
  Measured(
    "qwen2.5-1.5b shared_prompt",
    "h200",
    0.2079,
    0.1834,
    "benchmarks/gpu_check_h200.json (H200, jax 0.11.2, 2026-12-04): scripts/bench.py --gpu "
    "--modes=shared_prompt --row_length=4096 --steps=8, remat=dots, 8 pairs a step, the mean of 8 "
    "timed steps",
  ),
  Measured(
    "qwen3-8b full fine-tuning",
    "h200",
    3.325,
    2.2744,
    "benchmarks/gpu_check_h200.json (H200, jax 0.11.2, 2026-12-04): scripts/memory_plan.py --fit "
    "--model=qwen3-8b --max_length=8192 --remat=full, one pair of two 8192-token completions, the "
    "first step after its compile",
  ),
)


def calibration_factor(points: tuple[Measured, ...] = CALIBRATION) -> float:
  """The geometric mean of measured / estimated over ``points``: what an estimate is multiplied
  by; 1 without points."""
  if not points:
    return 1.0
  return math.exp(sum(math.log(p.measured_s / p.estimated_s) for p in points) / len(points))


def calibrated(seconds: float) -> float:
  """An estimate scaled by :func:`calibration_factor`."""
  return seconds * calibration_factor()


def calibration_line(points: tuple[Measured, ...] = CALIBRATION) -> str:
  """The calibration in words: each measured step's error, before and after the scaling."""
  if not points:
    return "calibration: none (no measured GPU step recorded): the estimate is the roofline alone"
  f = calibration_factor(points)
  raw = ", ".join(f"{p.estimated_s / p.measured_s - 1:+.0%}" for p in points)
  after = ", ".join(
    f"{f * p.estimated_s / p.measured_s - 1:+.0%} {p.name} ({p.measured_s:.3g} s on {p.target})"
    for p in points
  )
  return (
    f"calibration: the roofline's error against the {len(points)} measured GPU steps is {raw}; "
    f"scaled x{f:.2f} to fit them: {after}"
  )
