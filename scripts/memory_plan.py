r"""What the trainer's step needs per device, planned without weights; and one such step on a GPU.

Memory plan, on any machine and without weights: the trainer's update (``update.build_update``,
with the optimizer of the default ``TrainSpec``) compiled ahead of time on abstract parameters
over 8 fake CPU devices, per named shape (``scripts/bench_common.py``: their config.json values),
sequence length, remat policy, mesh and gradient accumulation, with each device's parameter,
optimizer-state and temporary bytes against an 80 GB and a 141 GB GPU (results and caveats:
BENCHMARKS.md)::

  python scripts/memory_plan.py --json=scripts/memory_plan.json
  python scripts/memory_plan.py --plan_models=llama3.1-8b --plan_lengths=8192 --plan_meshes=1x8x1
  python scripts/memory_plan.py --plan_models=llama3.1-8b --plan_lengths=4096 --plan_meshes=1x1x1 \
      --plan_lora=16 --plan_base_dtype=nf4 --json=scripts/memory_plan_lora.json

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

from bench_common import PAD, SHAPES, full_pairs, one_device_mesh
from jaxrm.models.config import ModelConfig

PLAN_MODELS = ("qwen2.5-1.5b", "llama3.1-8b", "qwen3-8b")
PLAN_LENGTHS = (2048, 8192)
PLAN_REMATS = ("none", "dots", "full")
PLAN_MESHES = ("1x1x1", "1x8x1", "1x4x2")  # data x fsdp x tensor [x context]
# Memory of one GPU as nvidia-smi reports it (MiB): an 80 GB H100 and a 141 GB H200.
CARDS_GIB = {"80 GB": 81559 / 1024, "141 GB": 143771 / 1024}


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--plan_models", default=",".join(PLAN_MODELS), help="shapes, comma-separated")
  p.add_argument("--plan_lengths", default=",".join(map(str, PLAN_LENGTHS)),
                 help="tokens per sequence, comma-separated")
  p.add_argument("--plan_remat", default=",".join(PLAN_REMATS), help="remat policies, comma-separated")
  p.add_argument("--plan_meshes", default=",".join(PLAN_MESHES),
                 help="meshes as data x fsdp x tensor, or data x fsdp x tensor x context (1x8x1: "
                      "fsdp=8; 1x2x1x4: fsdp=2, context=4), comma-separated")
  p.add_argument("--plan_grad_accum", default="1",
                 help="micro-batches per update, comma-separated (above 1: the trainer's "
                      "micro-batched step over unpacked micro-batches)")
  p.add_argument("--plan_lora", type=int, default=0,
                 help="memory plan of LoRA training: adapters of this rank on every linear layer "
                      "(0: full-parameter training)")
  p.add_argument("--plan_base_dtype", default="",
                 help="with --plan_lora: the frozen base's dtype (bfloat16, int8, nf4; '': float32)")
  p.add_argument("--plan_backend", default="cpu",
                 help="cpu: fake CPU devices, as many as the largest mesh needs; gpu (or any other "
                      "backend): compile for that machine's own devices instead")
  p.add_argument("--fit", action="store_true",
                 help="instead of the plan: train one step of --model at --max_length with --remat on "
                      "the first device (random weights, bf16 compute, one pair as the plan's); "
                      "report its memory")
  p.add_argument("--dry_run", action="store_true",
                 help="with --fit: size the step on abstract parameters; nothing is compiled")
  p.add_argument("--model", choices=sorted(SHAPES), default="smollm2-135m", help="--fit's shape")
  p.add_argument("--max_length", type=int, default=512, help="--fit's tokens per sequence")
  p.add_argument("--remat", default="none", choices=PLAN_REMATS, help="--fit's remat policy")
  p.add_argument("--attention", default="auto",
                 help="ModelConfig.attention_impl, passed as given (auto: a fused kernel on GPU, the "
                      "reference path elsewhere)")
  p.add_argument("--seed", type=int, default=0, help="--fit's random weights")
  p.add_argument("--json", default=None,
                 help="write the results here (the plan keeps the rows of other settings already there)")
  args = p.parse_args(argv)
  args.plan_models = _names(p, "--plan_models", args.plan_models, SHAPES)
  args.plan_remat = _names(p, "--plan_remat", args.plan_remat, PLAN_REMATS)
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


def plan_config(name: str, remat: str, attention: str, lora_rank: int = 0,
                base_dtype: str = "") -> ModelConfig:
  """SHAPES[name] as the plan and ``--fit`` train it: bf16 compute, float32 master weights (with
  ``lora_rank``: float32 adapters on all seven linear layers over a frozen base in ``base_dtype``)."""
  from jaxrm.models.lora import LoraConfig
  lora = LoraConfig(rank=lora_rank, base_dtype=base_dtype or None) if lora_rank else LoraConfig()
  return SHAPES[name].replace(dtype="bfloat16", param_dtype="float32", remat=remat,
                              attention_impl=attention, pad_token_id=PAD, lora=lora)


def planned_update(model, mesh, *, grad_accum: int = 1, seed: int = 0):
  """The trainer's update of ``model`` on ``mesh`` (``update.build_update``), as a run with the
  default ``TrainSpec`` builds it: abstract (nothing allocated) when ``model`` is; with
  ``grad_accum`` > 1, over unpacked micro-batches of their own lengths."""
  from jaxrm import update
  from jaxrm.config import RewardSpec, TrainSpec
  train = TrainSpec(seed=seed)
  return update.build_update(model, RewardSpec(), train, total_steps=train.max_steps, mesh=mesh,
                             grad_accum=grad_accum, micro_batched=grad_accum > 1)


def planned_batch(cfg: ModelConfig, length: int, mesh):
  """The plan's (micro-)batch, abstract: one pair per data-parallel shard, both completions
  ``length`` tokens long."""
  import jax
  from jaxrm import sharding
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.batch_sharding(mesh, x.ndim)),
      full_pairs(sharding.data_parallel_size(mesh), length, cfg.vocab_size))


def compile_programs(built, batch) -> dict:
  """``built``'s train step compiled for ``batch``: ``{"step": ...}``, or a micro-batched step's
  ``{"gradient": ..., "update": ...}``."""
  from jaxrm import steps
  if isinstance(built.train_step, steps.MicroBatchedStep):
    return built.train_step.compile_programs(built.state, batch)
  return {"step": built.train_step.compile(built.state, batch)}


def program_bytes(compiled, held: int = 0) -> dict:
  """One program's bytes per device (``compiled.memory_analysis()``); total = arguments + temp +
  outputs not aliased to the donated state + ``held``, buffers alive beside the program."""
  m = compiled.memory_analysis()
  total = (m.argument_size_in_bytes + m.temp_size_in_bytes
           + max(m.output_size_in_bytes - m.alias_size_in_bytes, 0) + held)
  return {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
          "alias_bytes": m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes,
          "held_bytes": held, "total_bytes": total}


def step_bytes(programs: dict) -> dict:
  """The step's bytes per device: its one program's, or of a micro-batched step's gradient (the
  sums of the micro-batches before it held beside it: as large as its outputs) and update
  programs, the larger total's, with both under ``programs``."""
  if "step" in programs:
    return program_bytes(programs["step"])
  gradient = programs["gradient"].memory_analysis()
  each = {"gradient": program_bytes(programs["gradient"], held=gradient.output_size_in_bytes),
          "update": program_bytes(programs["update"])}
  return {**max(each.values(), key=lambda b: b["total_bytes"]), "programs": each}


def bytes_per_device(tree) -> int:
  """Bytes of one device's shards of ``tree`` (arrays or ShapeDtypeStructs with shardings)."""
  import jax
  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


# --------------------------------------------------------------------------------- the plan


def plan_note(backend: str) -> str:
  """What the plan's figures are, compiled on ``backend``."""
  lead = (" a lead only: a GPU's compiler fuses, schedules and keeps bf16 copies differently, so "
          "its figure is unknown until a GPU measures one." if backend == "cpu" else "")
  return ("Per device. params and opt state are the float32 master weights and AdamW moments of "
          "the device's shards, counted from the abstract state (exact). temp is "
          f"XLA:{backend.upper()}'s temporary allocation for the step (compiled.memory_analysis())"
          f"{',' + lead if lead else '.'} The compile uses --attention as given; 'auto' is the "
          "reference path off a GPU, which materialises a dense bool [B, T, T] mask per step and "
          "float32 scores [B, H, 128, S] per block of 128 queries (its backward pass recomputes "
          "them), where a fused GPU kernel keeps neither. A mesh with context > 1 runs the "
          "per-shard all-gather attention instead on every backend: masks built per block from "
          "the tokens' ids, no [T, T] array. total = arguments + temp + outputs not aliased to the "
          "donated state.")


def plan_one(name: str, length: int, remat: str, mesh_dims: tuple[int, ...],
             attention: str, lora_rank: int = 0, base_dtype: str = "", grad_accum: int = 1) -> dict:
  """Compiles the trainer's step for shape ``name`` at ``length`` tokens on a mesh of (fake)
  devices and returns one device's bytes: parameters, optimizer state, XLA's temporaries and
  their total."""
  import jax
  from jaxrm import sharding
  from jaxrm.hf.loader import placed_abstract_model
  cfg = plan_config(name, remat, attention, lora_rank, base_dtype)
  devices = int(np.prod(mesh_dims))
  mesh = sharding.make_mesh(sharding.MeshConfig(*mesh_dims), devices=jax.devices()[:devices])
  built = planned_update(placed_abstract_model(cfg, mesh), mesh, grad_accum=grad_accum)
  state, batch = built.state, planned_batch(cfg, length, mesh)
  start = time.perf_counter()
  programs = compile_programs(built, batch)
  compile_s = time.perf_counter() - start
  figures = step_bytes(programs)
  return {
      "model": name + (f"+lora{lora_rank}" + (f"-{base_dtype}" if base_dtype else "") if lora_rank else ""),
      "params": sum(x.size for x in jax.tree.leaves((state["params"], state.get("frozen", {})))),
      "trainable": sum(x.size for x in jax.tree.leaves(state["params"])),
      "length": length, "remat": cfg.remat, "attention": cfg.attention_impl,
      "mesh": "x".join(map(str, mesh_dims)), "devices": devices, "grad_accum": grad_accum,
      "pairs": batch.margin.shape[0],
      "input_ids_per_device": list(batch.input_ids.sharding.shard_shape(batch.input_ids.shape)),
      "param_bytes": bytes_per_device((state["params"], state.get("frozen", {}))),
      "opt_state_bytes": bytes_per_device(state["opt_state"]),
      "batch_bytes": bytes_per_device(batch), **figures,
      "fits": {card: figures["total_bytes"] <= gib * 2**30 for card, gib in CARDS_GIB.items()},
      "compile_s": round(compile_s, 1),
  }


PLAN_COLUMNS = ("model", "T", "remat", "mesh", "accum", "params GiB", "opt GiB", "temp GiB", "total GiB",
                *CARDS_GIB, "compile s")


def plan_row(r: dict) -> str:
  """One row of the plan's Markdown table."""
  gib = lambda key: f"{r[key] / 2**30:.2f}"
  return _markdown([r["model"], str(r["length"]), r["remat"], r["mesh"], str(_grad_accum(r)),
                    gib("param_bytes"), gib("opt_state_bytes"), gib("temp_bytes"), gib("total_bytes"),
                    *("yes" if r["fits"][card] else "no" for card in CARDS_GIB),
                    f"{r['compile_s']:.0f}"])


def _markdown(cells) -> str:
  return "| " + " | ".join(cells) + " |"


def plan_table(rows: list[dict]) -> str:
  """The plan's rows as a Markdown table, by model, length, mesh, accumulation and remat."""
  shape = lambda r: r["model"].split("+")[0]
  order = lambda r: (list(SHAPES).index(shape(r)) if shape(r) in SHAPES else len(SHAPES), r["model"],
                     r["length"], r["devices"], r["mesh"], _grad_accum(r), PLAN_REMATS.index(r["remat"]))
  return "\n".join([_markdown(PLAN_COLUMNS), _markdown(["---"] * len(PLAN_COLUMNS)),
                    *map(plan_row, sorted(rows, key=order))])


def _grad_accum(row: dict) -> int:
  return row.get("grad_accum", 1)  # rows planned before accumulation was planned had none


def _setting(row: dict) -> tuple:
  return row["model"], row["length"], row["remat"], row["mesh"], row["attention"], _grad_accum(row)


def run_plan(args) -> dict:
  """Every setting of the --plan_* grid, one compile at a time; prints each row as it is done and
  rewrites ``--json`` after each, so an interrupted grid keeps what it measured. Rows already in
  ``--json`` for other settings are kept: a grid can be measured a part at a time."""
  import jax
  settings = [(m, t, r, mesh, k) for m in args.plan_models for t in args.plan_lengths
              for r in args.plan_remat for mesh in args.plan_meshes for k in args.plan_grad_accum]
  suffix = (f"+lora{args.plan_lora}" + (f"-{args.plan_base_dtype}" if args.plan_base_dtype else "")
            if args.plan_lora else "")
  wanted = {(m + suffix, t, r, "x".join(map(str, mesh)), args.attention, k) for m, t, r, mesh, k in settings}
  kept = []
  if args.json and os.path.exists(args.json):
    with open(args.json) as f:
      kept = [r for r in json.load(f).get("rows", []) if _setting(r) not in wanted]
  out = {"note": plan_note(jax.default_backend()), "dtype": "bfloat16 compute, float32 parameters and AdamW moments",
         "optimizer": "the default TrainSpec's AdamW after clipping, as update.build_update builds it",
         "batch": "one pair per data-parallel shard and micro-batch: unpacked rows, both completions "
                  "T tokens long, input_ids [2, T] per device (tensor-parallel devices share their "
                  "pair); accum > 1: the trainer's micro-batched step, the figures of its gradient "
                  "(with the sums it adds to) or update program, whichever totals more",
         "attention": args.attention, "backend": jax.default_backend(),
         "versions": f"jax {jax.__version__}", "cards_gib": CARDS_GIB, "rows": kept, "failed": []}
  print(out["note"])
  print(out["batch"])
  print(_markdown(PLAN_COLUMNS), flush=True)
  for name, length, remat, mesh, grad_accum in settings:
    try:
      row = plan_one(name, length, remat, mesh, args.attention, args.plan_lora, args.plan_base_dtype, grad_accum)
    except Exception as e:  # e.g. a mesh that does not divide the batch: say so, keep going
      where = f"{name} T={length} remat={remat} mesh={'x'.join(map(str, mesh))} accum={grad_accum}"
      out["failed"].append({"setting": where, "error": str(e).splitlines()[0][:300]})
      print(f"{where}: failed: {out['failed'][-1]['error']}", flush=True)
      continue
    out["rows"].append(row)
    print(plan_row(row), flush=True)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
  if kept:
    print(f"\nevery row of {args.json}:\n{plan_table(out['rows'])}")
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

  cfg = plan_config(args.model, args.remat, args.attention)
  out = {"model": args.model, "length": args.max_length, "remat": args.remat,
         "attention": args.attention, "backend": jax.default_backend(),
         "device": str(jax.devices()[0].device_kind), "versions": f"jax {jax.__version__}"}
  mesh = one_device_mesh()
  abstract_model = placed_abstract_model(cfg, mesh)
  abstract = planned_update(abstract_model, mesh, seed=args.seed)
  out["params"] = sum(x.size for x in jax.tree.leaves(abstract.state["params"]))
  out["param_bytes"] = bytes_per_device(abstract.state["params"])
  out["opt_state_bytes"] = bytes_per_device(abstract.state["opt_state"])
  start = time.perf_counter()
  compiled = abstract.train_step.compile(abstract.state, planned_batch(cfg, args.max_length, mesh))
  out["compile_s"] = round(time.perf_counter() - start, 1)
  m = compiled.memory_analysis()
  if m is not None:
    out.update(argument_bytes=m.argument_size_in_bytes, output_bytes=m.output_size_in_bytes,
               alias_bytes=m.alias_size_in_bytes, temp_bytes=m.temp_size_in_bytes)
  start = time.perf_counter()
  params = jax.jit(lambda: nnx.state(Decoder(cfg, rngs=nnx.Rngs(args.seed))),
                   out_shardings=jax.tree.map(lambda x: x.sharding, nnx.state(abstract_model)))()
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
  cfg = plan_config(args.model, args.remat, args.attention)
  mesh = one_device_mesh()
  state = planned_update(placed_abstract_model(cfg, mesh), mesh, seed=args.seed).state
  batch = planned_batch(cfg, args.max_length, mesh)
  return {"dry_run": True, "model": args.model, "length": args.max_length, "remat": args.remat,
          "attention": args.attention, "params": sum(x.size for x in jax.tree.leaves(state["params"])),
          "param_bytes": bytes_per_device((state["params"], state.get("frozen", {}))),
          "opt_state_bytes": bytes_per_device(state["opt_state"]),
          "input_ids": list(batch.input_ids.shape)}


def main(argv=None) -> None:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  if args.fit:
    result = fit(args) if not args.dry_run else fit_dry_run(args)
    print(json.dumps(result, indent=1))
    if args.json:
      with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return
  import jax
  if args.plan_backend == "cpu":  # fake CPU devices, before anything starts the backend
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", max(int(np.prod(m)) for m in args.plan_meshes))
  elif jax.default_backend() != args.plan_backend:
    sys.exit(f"--plan_backend={args.plan_backend}, but JAX's default backend is {jax.default_backend()}")
  result = run_plan(args)
  if not result["rows"]:
    sys.exit("memory plan: no setting compiled (the errors are above)")


if __name__ == "__main__":
  main()
