r"""What the trainer's step needs per device, planned without weights; and one such step on a GPU.

Memory plan, on any machine and without weights: the trainer's update (``update.build_update``,
with the optimizer of the default ``TrainSpec``) compiled ahead of time on abstract parameters by
XLA's GPU compiler, per named shape (``scripts/bench_common.py``: their config.json values),
sequence length, remat policy, mesh and gradient accumulation, with each device's parameter,
optimizer-state and temporary bytes against an 80 GB and a 141 GB GPU, each card's verdict from a
compile for its own GPU (``--gpu``: compile-only H100 and H200 devices of ``jaxrm.planning.gpu_targets``,
one host of as many as the mesh needs; results and caveats: docs/benchmarks.md). A GPU row also
holds the step's time estimated from its program (``estimated_step_s``, ``jaxrm.planning.step_time``,
calibrated) and the FLOPs the program computes, recomputation included::

  python scripts/memory_plan.py --json=benchmarks/memory_plan.json
  python scripts/memory_plan.py --plan_models=llama3.1-8b --plan_lengths=8192 --plan_meshes=1x8x1
  python scripts/memory_plan.py --plan_models=llama3.1-8b --plan_lengths=4096 --plan_meshes=1x1x1 \
      --plan_lora=16 --plan_base_dtype=nf4 --json=benchmarks/memory_plan_lora.json

A GPU compile cannot tell speed, numerics on the device, or what a compile on the GPU would
autotune (it may pick cuBLAS or cuDNN where this one keeps a Triton fusion); cuBLAS, cuDNN and
NCCL workspaces and the CUDA context lie outside its figures. ``--plan_backend=cpu`` compiles for
fake CPU devices instead (XLA:CPU's figures, for comparison), and ``--compare`` puts two plans'
rows of the same settings side by side::

  python scripts/memory_plan.py --plan_backend=cpu --plan_models=qwen2.5-1.5b --plan_lengths=2048 \
      --plan_meshes=1x1x1 --json=benchmarks/memory_plan_cpu.json
  python scripts/memory_plan.py --compare=benchmarks/memory_plan_cpu.json,benchmarks/memory_plan.json

With ``--plan_grad_accum`` above 1, a batch comes as that many unpacked micro-batches, each padded
to its own length, and the step is the trainer's ``steps.MicroBatchedStep``: one gradient program
per micro-batch, adding to sums held between them, then one update program. Such a row's figures
are those of the program with the larger total.

One training step of a planned setting on this machine's first device, with random weights
(``scripts/gpu_check.py`` runs it on a GPU)::

  python scripts/memory_plan.py --fit --model=qwen2.5-1.5b --max_length=2048 --remat=dots
  python scripts/memory_plan.py --fit --dry_run --model=qwen2.5-1.5b  # sized only, runs anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from bench_common import PAD, SHAPES, commit, full_pairs, one_device_mesh

from jaxrm.models.config import REMAT_POLICIES, ModelConfig

PLAN_MODELS = ("qwen2.5-1.5b", "llama3.1-8b", "qwen3-8b")
PLAN_LENGTHS = (2048, 8192)
PLAN_REMATS = ("none", "dots", "full")  # the plan's default set, of REMAT_POLICIES
PLAN_MESHES = ("1x1x1", "1x8x1", "1x4x2")  # data x fsdp x tensor [x context]
PLAN_BACKENDS = ("gpu", "cpu")
# Memory of one GPU as nvidia-smi reports it (MiB): an 80 GB H100 and a 141 GB H200.
CARDS_GIB = {"80 GB": 81559 / 1024, "141 GB": 143771 / 1024}
# The GPU target each card's column is compiled for (jaxrm.planning.gpu_targets): XLA's GPU compiler reads
# the card's memory and bandwidth, and its programs for the two differ a little (docs/benchmarks.md).
CARD_OF_TARGET = {"h100-80gb": "80 GB", "h200": "141 GB"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--plan_models", default=",".join(PLAN_MODELS), help="shapes, comma-separated")
  p.add_argument(
    "--plan_lengths", default=",".join(map(str, PLAN_LENGTHS)), help="tokens per sequence, comma-separated"
  )
  p.add_argument("--plan_remat", default=",".join(PLAN_REMATS), help="remat policies, comma-separated")
  p.add_argument(
    "--plan_meshes",
    default=",".join(PLAN_MESHES),
    help="meshes as data x fsdp x tensor, or data x fsdp x tensor x context (1x8x1: "
    "fsdp=8; 1x2x1x4: fsdp=2, context=4), comma-separated",
  )
  p.add_argument(
    "--plan_grad_accum",
    default="1",
    help="micro-batches per update, comma-separated (above 1: the trainer's "
    "micro-batched step over unpacked micro-batches)",
  )
  p.add_argument(
    "--plan_lora",
    type=int,
    default=0,
    help="memory plan of LoRA training: adapters of this rank on every linear layer "
    "(0: full-parameter training)",
  )
  p.add_argument(
    "--plan_base_dtype",
    default="",
    help="with --plan_lora: the frozen base's dtype (bfloat16, int8, nf4; '': float32)",
  )
  p.add_argument(
    "--plan_backend",
    default="gpu",
    choices=PLAN_BACKENDS,
    help="gpu: XLA's GPU compiler, for compile-only devices of --gpu (on any machine); "
    "cpu: XLA:CPU on fake CPU devices, as many as the largest mesh needs (a "
    "comparison only: its temporaries are not a GPU's)",
  )
  p.add_argument(
    "--gpu",
    default=",".join(CARD_OF_TARGET),
    help="the GPU targets the plan compiles each setting for, comma-separated (of "
    f"{', '.join(CARD_OF_TARGET)}; jaxrm.planning.gpu_targets): each card's column is its "
    "own target's compile",
  )
  p.add_argument(
    "--compare",
    default="",
    help="instead of planning: two plans' JSON files, comma-separated (e.g. XLA:CPU's, "
    "then the GPU's); prints their rows of the same settings side by side",
  )
  p.add_argument(
    "--fit",
    action="store_true",
    help="instead of the plan: train one step of --model at --max_length with --remat on "
    "the first device (random weights, bf16 compute, one pair as the plan's); "
    "report its memory",
  )
  p.add_argument(
    "--dry_run",
    action="store_true",
    help="with --fit: size the step on abstract parameters; nothing is compiled",
  )
  p.add_argument("--model", choices=sorted(SHAPES), default="smollm2-135m", help="--fit's shape")
  p.add_argument("--max_length", type=int, default=512, help="--fit's tokens per sequence")
  p.add_argument("--remat", default="none", choices=REMAT_POLICIES, help="--fit's remat policy")
  p.add_argument(
    "--attention",
    default="auto",
    help="ModelConfig.attention_impl, passed as given (auto: the Pallas flash kernel on "
    "GPU devices, the reference path elsewhere)",
  )
  p.add_argument("--seed", type=int, default=0, help="--fit's random weights")
  p.add_argument(
    "--json",
    default=None,
    help="write the results here (the plan keeps the rows of other settings already there)",
  )
  args = p.parse_args(argv)
  args.plan_models = _names(p, "--plan_models", args.plan_models, SHAPES)
  args.plan_remat = _names(p, "--plan_remat", args.plan_remat, REMAT_POLICIES)
  try:
    args.plan_lengths = [int(n) for n in args.plan_lengths.split(",") if n]
    args.plan_grad_accum = [int(n) for n in args.plan_grad_accum.split(",") if n]
    args.plan_meshes = [mesh_sizes(m) for m in args.plan_meshes.split(",") if m]
  except ValueError as e:
    p.error(f"--plan_lengths, --plan_grad_accum or --plan_meshes: {e}")
  if min(args.plan_grad_accum, default=1) < 1:
    p.error(f"--plan_grad_accum: micro-batches per update are 1 or more; got {args.plan_grad_accum}")
  if args.dry_run and not args.fit:
    p.error("--dry_run sizes --fit's step: add --fit (the plan allocates nothing anyway)")
  args.gpu = _names(p, "--gpu", args.gpu, CARD_OF_TARGET)
  args.compare = [c for c in args.compare.split(",") if c]
  if args.compare and len(args.compare) != 2:
    p.error(f"--compare: give two plans' JSON files, comma-separated; got {len(args.compare)}")
  return args


def _names(p, flag: str, value: str, known) -> list[str]:
  names = [n for n in value.split(",") if n]
  unknown = sorted(set(names) - set(known))
  if unknown:
    p.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
  return names


def mesh_sizes(spec: str) -> tuple[int, ...]:
  """'1x4x2' -> (data, fsdp, tensor) = (1, 4, 2); '1x2x1x4' -> (data, fsdp, tensor, context)."""
  sizes = tuple(int(n) for n in spec.split("x"))
  if len(sizes) not in (3, 4) or min(sizes) < 1:
    raise ValueError(f"mesh {spec!r} is not data x fsdp x tensor [x context], e.g. 1x8x1 or 1x2x1x4")
  return sizes


# --------------------------------------------------------------------------- the planned step


def plan_config(
  name: str, remat: str, attention: str, lora_rank: int = 0, base_dtype: str = ""
) -> ModelConfig:
  """SHAPES[name] as the plan and ``--fit`` train it: bf16 compute, float32 master weights (with
  ``lora_rank``: float32 adapters on all seven linear layers over a frozen base in ``base_dtype``)."""
  from jaxrm.models.lora import LoraConfig

  lora = LoraConfig(rank=lora_rank, base_dtype=base_dtype or None) if lora_rank else LoraConfig()
  return SHAPES[name].replace(
    dtype="bfloat16",
    param_dtype="float32",
    remat=remat,
    attention_impl=attention,
    pad_token_id=PAD,
    lora=lora,
  )


def planned_update(model, mesh, *, grad_accum: int = 1, seed: int = 0):
  """The trainer's update of ``model`` on ``mesh`` (``update.build_update``), as a run with the
  default ``TrainSpec`` builds it: abstract (nothing allocated) when ``model`` is; with
  ``grad_accum`` > 1, over unpacked micro-batches of their own lengths."""
  from jaxrm.config import RewardSpec, TrainSpec
  from jaxrm.run import update

  train = TrainSpec(seed=seed)
  return update.build_update(
    model,
    RewardSpec(),
    train,
    total_steps=train.max_steps,
    mesh=mesh,
    grad_accum=grad_accum,
    micro_batched=grad_accum > 1,
  )


def planned_batch(cfg: ModelConfig, length: int, mesh):
  """The plan's (micro-)batch, abstract: one pair per data-parallel shard, both completions
  ``length`` tokens long."""
  import jax

  from jaxrm import sharding

  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.batch_sharding(mesh, x.ndim)),
    full_pairs(sharding.data_parallel_size(mesh), length, cfg.vocab_size),
  )


def compile_programs(built, batch) -> dict:
  """``built``'s train step compiled for ``batch``: ``{"step": ...}``, or a micro-batched step's
  ``{"gradient": ..., "update": ...}``."""
  from jaxrm.planning import gpu_targets
  from jaxrm.run import steps

  with gpu_targets.uncached():  # a compile-only GPU's executable cannot be loaded back
    if isinstance(built.train_step, steps.MicroBatchedStep):
      return built.train_step.compile_programs(built.state, batch)
    return {"step": built.train_step.compile(built.state, batch)}


_DEVICES: dict = {}


def plan_devices(backend: str, target: str, count: int) -> list:
  """``count`` devices to compile for: compile-only GPUs of ``target`` on one host (backend
  "gpu"), or this process's fake CPU devices (backend "cpu", set up by :func:`main`)."""
  import jax

  from jaxrm.planning import gpu_targets

  if backend == "cpu":
    return jax.devices("cpu")[:count]
  if (target, count) not in _DEVICES:
    _DEVICES[target, count] = gpu_targets.devices(target, f"1x{count}")
  return _DEVICES[target, count]


# --------------------------------------------------------------------------------- the plan


def plan_note(backend: str, targets: str) -> str:
  """What the plan's figures are, compiled by ``backend``'s compiler (for ``targets``, GPUs)."""
  common = (
    "Per device. params and opt state are the float32 master weights and AdamW moments of "
    "the device's shards, counted from the abstract state (exact). temp is the compiler's "
    "temporary allocation for the step (compiled.memory_analysis()); total = arguments + "
    "temp + outputs not aliased to the donated state (+ what a micro-batched gradient "
    "program holds beside it). "
  )
  if backend == "cpu":
    return common + (
      "Compiled by XLA:CPU for fake CPU devices: a comparison only. XLA:CPU computes "
      "bf16 dots in float32, fuses and schedules otherwise than XLA:GPU, and "
      "'auto' attention is the reference path there (a dense bool [B, T, T] mask "
      "and float32 scores per block of 128 queries), not the GPU's Pallas kernel."
    )
  return common + (
    f"Compiled by XLA's GPU compiler (with Triton) for compile-only devices of each of "
    f"{targets} (jaxrm.planning.gpu_targets), on a machine that need not have a GPU; each card "
    "is judged by its own target's compile. 'auto' attention is "
    "the Pallas flash kernel, except under context > 1, where every route takes the "
    "per-shard reference attention (masks built per block from the tokens' ids). "
    "What such a compile cannot tell: speed, numerics on the device, and what a "
    "compile on the GPU would autotune (it may pick cuBLAS or cuDNN where this one "
    "keeps a Triton fusion, moving memory a little); cuBLAS/cuDNN/NCCL workspaces and "
    "the CUDA context lie outside these figures, and JAX takes 75% of a GPU unless "
    "XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise."
  )


def plan_one(
  name: str,
  length: int,
  remat: str,
  mesh_dims: tuple[int, ...],
  attention: str,
  lora_rank: int = 0,
  base_dtype: str = "",
  grad_accum: int = 1,
  *,
  backend: str = "gpu",
  target: str = "h100-80gb",
) -> dict:
  """Compiles the trainer's step for shape ``name`` at ``length`` tokens on a mesh of
  ``backend``'s devices (:func:`plan_devices`) and returns one device's bytes: parameters,
  optimizer state, the compiler's temporaries and their total, and what was compiled."""
  import jax

  from jaxrm import sharding
  from jaxrm.hf.loader import placed_abstract_model
  from jaxrm.models.decoder import attention_summary
  from jaxrm.planning import fit_check
  from jaxrm.planning.memory import bytes_per_device, step_memory

  cfg = plan_config(name, remat, attention, lora_rank, base_dtype)
  devices = int(np.prod(mesh_dims))
  mesh = sharding.make_mesh(sharding.MeshConfig(*mesh_dims), devices=plan_devices(backend, target, devices))
  built = planned_update(placed_abstract_model(cfg, mesh), mesh, grad_accum=grad_accum)
  state, batch = built.state, planned_batch(cfg, length, mesh)
  start = time.perf_counter()
  programs = compile_programs(built, batch)
  compile_s = time.perf_counter() - start
  opt_state_bytes = bytes_per_device(state["opt_state"])
  # A gradient program does not read the optimizer state, which stays alive beside it.
  step, each = step_memory(programs, resident_bytes=opt_state_bytes)
  text = "\n".join(p.as_text() for p in programs.values())
  return {
    "model": name + (f"+lora{lora_rank}" + (f"-{base_dtype}" if base_dtype else "") if lora_rank else ""),
    "params": sum(x.size for x in jax.tree.leaves((state["params"], state.get("frozen", {})))),
    "trainable": sum(x.size for x in jax.tree.leaves(state["params"])),
    "length": length,
    "remat": cfg.remat,
    "attention": cfg.attention_impl,
    "mesh": "x".join(map(str, mesh_dims)),
    "devices": devices,
    "grad_accum": grad_accum,
    "backend": backend,
    "target": target if backend == "gpu" else None,
    "pairs": batch.margin.shape[0],
    "input_ids_per_device": list(batch.input_ids.sharding.shard_shape(batch.input_ids.shape)),
    "param_bytes": bytes_per_device((state["params"], state.get("frozen", {}))),
    "opt_state_bytes": opt_state_bytes,
    "batch_bytes": bytes_per_device(batch),
    **step.as_dict(),
    **({"programs": {k: m.as_dict() for k, m in each.items()}} if len(each) > 1 else {}),
    "fits": {card: step.total_bytes <= CARDS_GIB[card] * 2**30 for card in _cards(backend, target)},
    "attention_route": attention_summary(cfg, placement=sharding.Placement(mesh)),
    "triton_kernels": fit_check.triton_kernels(text),
    "triton_fusions": text.count('"kind":"__triton'),
    "compile_s": round(compile_s, 1),
    **(_estimated(programs, target, grad_accum) if backend == "gpu" else {}),
    "commit": commit(),
  }


def _estimated(programs: dict, target: str, grad_accum: int) -> dict:
  """The step's time estimated from its compiled programs (jaxrm.planning.step_time; every sequence fills its
  row, so every causal pair is attended), calibrated, and the FLOPs the program computes."""
  from jaxrm.planning import step_time

  e = step_time.estimate_step(programs, target, grad_accum=grad_accum)
  return {"estimated_step_s": round(step_time.calibrated(e.seconds), 4), "program_flops": e.flops}


def _cards(backend: str, target: str) -> list[str]:
  """The cards a row's total is judged against: its GPU target's, or every card for XLA:CPU's."""
  return list(CARDS_GIB) if backend == "cpu" else [CARD_OF_TARGET[target]]


# One line per setting: the 80 GB card's compile (or XLA:CPU's), then the 141 GB card's total.
PLAN_COLUMNS = (
  "model",
  "T",
  "remat",
  "mesh",
  "accum",
  "params GiB",
  "opt GiB",
  "temp GiB",
  "total GiB",
  "80 GB",
  "H200 total GiB",
  "141 GB",
  "compile s",
)


def plan_row(*rows: dict) -> str:
  """One line of the plan's Markdown table: the rows of one setting, one per compiler (an H100's
  and an H200's, or XLA:CPU's alone); a card nobody compiled for reads '-'."""
  first, h200 = rows[0], next((r for r in rows if _compiler(r) == ("gpu", "h200")), None)
  fits = {card: ok for r in rows for card, ok in r["fits"].items()}
  return _markdown(
    [
      *_setting_cells(first),
      _gib(first["param_bytes"]),
      _gib(first["opt_state_bytes"]),
      _gib(first["temp_bytes"]),
      _gib(first["total_bytes"]),
      _yes(fits.get("80 GB")),
      _gib(h200["total_bytes"]) if h200 else "-",
      _yes(fits.get("141 GB")),
      f"{first['compile_s']:.0f}",
    ]
  )


def _setting_cells(r: dict) -> list[str]:
  return [r["model"], str(r["length"]), r["remat"], r["mesh"], str(_grad_accum(r))]


def _yes(fits: bool | None) -> str:
  return "-" if fits is None else "yes" if fits else "no"


def _gib(n: int) -> str:
  return f"{n / 2**30:.2f}"


def _markdown(cells) -> str:
  return "| " + " | ".join(cells) + " |"


def _order(r: dict) -> tuple:
  """By model, length, mesh, accumulation and remat."""
  shape = r["model"].split("+")[0]
  return (
    list(SHAPES).index(shape) if shape in SHAPES else len(SHAPES),
    r["model"],
    r["length"],
    r["devices"],
    r["mesh"],
    _grad_accum(r),
    REMAT_POLICIES.index(r["remat"]),
  )


def _by_setting(rows: list[dict]) -> list[list[dict]]:
  """``rows`` grouped by setting, in :func:`_order`; in a group the H100's row first."""
  groups: dict[tuple, list[dict]] = {}
  for r in rows:
    groups.setdefault(_setting(r), []).append(r)
  rank = lambda r: list(CARD_OF_TARGET).index(r["target"]) if r.get("target") in CARD_OF_TARGET else -1
  return [sorted(g, key=rank) for g in sorted(groups.values(), key=lambda g: _order(g[0]))]


def plan_table(rows: list[dict]) -> str:
  """The plan's rows as a Markdown table, a line per setting (:func:`plan_row`)."""
  return "\n".join(
    [
      _markdown(PLAN_COLUMNS),
      _markdown(["---"] * len(PLAN_COLUMNS)),
      *(plan_row(*group) for group in _by_setting(rows)),
    ]
  )


def _grad_accum(row: dict) -> int:
  return row.get("grad_accum", 1)  # rows planned before accumulation was planned had none


def _compiler(row: dict) -> tuple:
  """Which compiler planned ``row``: ("cpu", None) or ("gpu", target); rows planned before GPU
  targets were all XLA:CPU's."""
  return row.get("backend", "cpu"), row.get("target")


def _setting(row: dict) -> tuple:
  return row["model"], row["length"], row["remat"], row["mesh"], row["attention"], _grad_accum(row)


COMPARE_COLUMNS = (
  "model",
  "T",
  "remat",
  "mesh",
  "accum",
  "params GiB",
  "XLA:CPU temp",
  "H100 temp",
  "XLA:CPU total",
  "H100 total",
  "H200 total",
  "80 GB: CPU / H100",
  "141 GB: CPU / H200",
)


def compare_table(cpu: list[dict], gpu: list[dict]) -> str:
  """The settings planned by XLA:CPU (``cpu``) and for the GPU targets (``gpu``), side by side."""
  gpu_groups = {_setting(g[0]): g for g in _by_setting(gpu)}
  lines = [_markdown(COMPARE_COLUMNS), _markdown(["---"] * len(COMPARE_COLUMNS))]
  for c in sorted((r for r in cpu if _setting(r) in gpu_groups), key=_order):
    by_target = {r["target"]: r for r in gpu_groups[_setting(c)]}
    total = lambda target, by_target=by_target: (
      _gib(by_target[target]["total_bytes"]) if target in by_target else "-"
    )
    fits = {card: ok for r in by_target.values() for card, ok in r["fits"].items()}
    h100 = by_target.get("h100-80gb")
    lines.append(
      _markdown(
        [
          *_setting_cells(c),
          _gib(c["param_bytes"]),
          _gib(c["temp_bytes"]),
          _gib(h100["temp_bytes"]) if h100 else "-",
          _gib(c["total_bytes"]),
          total("h100-80gb"),
          total("h200"),
          *(f"{_yes(c['fits'][card])} / {_yes(fits.get(card))}" for card in CARDS_GIB),
        ]
      )
    )
  return "\n".join(lines)


def compare(paths: list[str]) -> str:
  """``--compare``: the rows of the same settings in XLA:CPU's plan and a GPU plan (JSON files)."""
  plans = {}
  for path in paths:
    with open(path) as f:
      rows = json.load(f)["rows"]
    backends = {_compiler(r)[0] for r in rows}
    if len(backends) != 1:
      raise SystemExit(
        f"--compare: {path} holds {'no rows' if not rows else 'rows of several backends'}; "
        "give one plan by XLA:CPU and one for GPU targets"
      )
    plans[backends.pop()] = rows
  if set(plans) != {"cpu", "gpu"}:
    raise SystemExit(
      f"--compare: both files are {next(iter(plans))} plans; give one plan by XLA:CPU "
      "(--plan_backend=cpu) and one for GPU targets"
    )
  return compare_table(plans["cpu"], plans["gpu"])


def _kept_rows(path: str | None, wanted: set, backend: str) -> list[dict]:
  """The rows of ``path`` other than the ``wanted`` (setting, compiler) pairs; a file holds one
  backend's rows."""
  if not path or not os.path.exists(path):
    return []
  with open(path) as f:
    rows = json.load(f).get("rows", [])
  other = {_compiler(r)[0] for r in rows} - {backend}
  if other:
    raise SystemExit(
      f"{path} holds rows compiled by {other.pop()}, this plan by {backend}: give another --json "
      "(one backend's rows per file), or remove the file to plan it anew"
    )
  return [r for r in rows if (_setting(r), _compiler(r)) not in wanted]


def run_plan(args) -> dict:
  """Every setting of the --plan_* grid, for each --gpu target (or once, by XLA:CPU), one compile
  at a time; prints each row as it is done and rewrites ``--json`` after each, so an interrupted
  grid keeps what it measured. Rows already in ``--json`` for other settings are kept: a grid can
  be measured a part at a time."""
  import jax

  targets = args.gpu if args.plan_backend == "gpu" else [None]
  settings = [
    (m, t, r, mesh, k, target)
    for m in args.plan_models
    for t in args.plan_lengths
    for r in args.plan_remat
    for mesh in args.plan_meshes
    for k in args.plan_grad_accum
    for target in targets
  ]
  suffix = (
    f"+lora{args.plan_lora}" + (f"-{args.plan_base_dtype}" if args.plan_base_dtype else "")
    if args.plan_lora
    else ""
  )
  wanted = {
    ((m + suffix, t, r, "x".join(map(str, mesh)), args.attention, k), (args.plan_backend, target))
    for m, t, r, mesh, k, target in settings
  }
  kept = _kept_rows(args.json, wanted, args.plan_backend)
  out = {
    "note": plan_note(args.plan_backend, ", ".join(args.gpu)),
    "dtype": "bfloat16 compute, float32 parameters and AdamW moments",
    "optimizer": "the default TrainSpec's AdamW after clipping, as update.build_update builds it",
    "batch": "one pair per data-parallel shard and micro-batch: unpacked rows, both completions "
    "T tokens long, input_ids [2, T] per device (tensor-parallel devices share their "
    "pair); accum > 1: the trainer's micro-batched step, the figures of its gradient "
    "(with the sums it adds to and the optimizer state beside it) or update program, "
    "whichever totals more",
    "attention": args.attention,
    "backend": args.plan_backend,
    "targets": [t for t in targets if t],
    "versions": f"jax {jax.__version__}",
    "commit": commit(),
    "cards_gib": CARDS_GIB,
    "rows": list(kept),
    "failed": [],
  }
  print(out["note"])
  print(out["batch"])
  print(_markdown(PLAN_COLUMNS), flush=True)
  for name, length, remat, mesh, grad_accum, target in settings:
    try:
      row = plan_one(
        name,
        length,
        remat,
        mesh,
        args.attention,
        args.plan_lora,
        args.plan_base_dtype,
        grad_accum,
        backend=args.plan_backend,
        target=target,
      )
    except Exception as e:  # e.g. a mesh that does not divide the batch: say so, keep going
      where = f"{name} T={length} remat={remat} mesh={'x'.join(map(str, mesh))} accum={grad_accum}" + (
        f" gpu={target}" if target else ""
      )
      out["failed"].append({"setting": where, "error": str(e).splitlines()[0][:300]})
      print(f"{where}: failed: {out['failed'][-1]['error']}", flush=True)
      continue
    out["rows"].append(row)
    print(plan_row(row) + (f" ({target})" if target else ""), flush=True)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
  print(f"\n{'every row of ' + args.json if kept else 'the plan'}:\n{plan_table(out['rows'])}")
  return out


# -------------------------------------------------------------------------- one step on a GPU


def fit(args) -> dict:
  """One training step of ``--model`` on the first device, with random weights: the plan's
  batch (one pair of two ``--max_length``-token completions), bf16 compute, float32 state.
  Returns XLA's memory analysis on this backend, the device's peak bytes and the step time.

  The step is compiled first, on the abstract state, so that compiling (autotuning, on a GPU)
  has the memory to itself; the weights are then initialised straight into their shardings.
  """
  import jax
  from flax import nnx

  from jaxrm.data import pipeline
  from jaxrm.hf.loader import placed_abstract_model
  from jaxrm.models.decoder import Decoder
  from jaxrm.planning.memory import ProgramMemory, bytes_per_device

  cfg = plan_config(args.model, args.remat, args.attention)
  out = {
    "model": args.model,
    "length": args.max_length,
    "remat": args.remat,
    "attention": args.attention,
    "backend": jax.default_backend(),
    "device": str(jax.devices()[0].device_kind),
    "versions": f"jax {jax.__version__}",
  }
  mesh = one_device_mesh()
  abstract_model = placed_abstract_model(cfg, mesh)
  abstract = planned_update(abstract_model, mesh, seed=args.seed)
  out["params"] = sum(x.size for x in jax.tree.leaves(abstract.state["params"]))
  out["param_bytes"] = bytes_per_device(abstract.state["params"])
  out["opt_state_bytes"] = bytes_per_device(abstract.state["opt_state"])
  start = time.perf_counter()
  compiled = abstract.train_step.compile(abstract.state, planned_batch(cfg, args.max_length, mesh))
  out["compile_s"] = round(time.perf_counter() - start, 1)
  memory = ProgramMemory.of(compiled)
  out.update(memory.as_dict() if memory is not None else {})
  start = time.perf_counter()
  params = jax.jit(
    lambda: nnx.state(Decoder(cfg, rngs=nnx.Rngs(args.seed))),
    out_shardings=jax.tree.map(lambda x: x.sharding, nnx.state(abstract_model)),
  )()
  # The same construction, now over the weights: its state holds them, and the step donates it.
  state = planned_update(nnx.merge(nnx.graphdef(abstract_model), params), mesh, seed=args.seed).state
  del params
  batch = pipeline.to_global_batch(full_pairs(1, args.max_length, cfg.vocab_size, args.seed), mesh)
  jax.block_until_ready((state, batch))
  out["init_s"] = round(time.perf_counter() - start, 1)
  start = time.perf_counter()
  state, (metrics, extra) = compiled(state, batch)
  jax.block_until_ready(state)
  out["step_s"] = round(time.perf_counter() - start, 3)
  out["loss"] = float(metrics["loss"].total) / max(float(metrics["loss"].count), 1.0)
  out["grad_norm"] = float(extra["grad_norm"])
  stats = jax.devices()[0].memory_stats() or {}
  out["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
  out["bytes_limit"] = stats.get("bytes_limit")
  return out


def fit_dry_run(args) -> dict:
  """What ``--fit`` would train, sized on abstract parameters: nothing is compiled or allocated."""
  import jax

  from jaxrm.hf.loader import placed_abstract_model
  from jaxrm.planning.memory import bytes_per_device

  cfg = plan_config(args.model, args.remat, args.attention)
  mesh = one_device_mesh()
  state = planned_update(placed_abstract_model(cfg, mesh), mesh, seed=args.seed).state
  batch = planned_batch(cfg, args.max_length, mesh)
  return {
    "dry_run": True,
    "model": args.model,
    "length": args.max_length,
    "remat": args.remat,
    "attention": args.attention,
    "params": sum(x.size for x in jax.tree.leaves(state["params"])),
    "param_bytes": bytes_per_device((state["params"], state.get("frozen", {}))),
    "opt_state_bytes": bytes_per_device(state["opt_state"]),
    "input_ids": list(batch.input_ids.shape),
  }


def main(argv=None) -> None:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  if args.compare:
    print(compare(args.compare))
    return
  if args.fit:
    result = fit(args) if not args.dry_run else fit_dry_run(args)
    print(json.dumps(result, indent=1))
    if args.json:
      with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return
  if args.plan_backend == "cpu":  # fake CPU devices, before anything starts the backend
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", max(int(np.prod(m)) for m in args.plan_meshes))
  result = run_plan(args)
  if not result["rows"]:
    sys.exit("memory plan: no setting compiled (the errors are above)")


if __name__ == "__main__":
  main()
