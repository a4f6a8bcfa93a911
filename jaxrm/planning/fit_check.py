"""Will this run fit on that hardware? Answered without the GPUs and without the weights.

:func:`check` builds a run's train and validation steps exactly as the trainer does (the model from
its ``config.json`` or GGUF header only, the mesh, micro-batches and accumulation, packing, remat,
dtypes, LoRA/QLoRA, context parallelism) over compile-only devices of a GPU target
(:mod:`jaxrm.planning.gpu_targets`), feeds them the largest batch the run's data pipeline can build (every
sequence ``data.max_length`` tokens long, no prompt shared), and reads XLA's GPU compiler: memory
per device, the attention route and its Triton kernels, the collectives. The CLI is
``python -m jaxrm.plan``.

The compile does not see everything a device holds. Its verdict keeps a margin
(:data:`MARGIN_FRACTION` of the memory JAX may use, at least :data:`MARGIN_MIN_BYTES`) for what lies
outside ``memory_analysis()``: cuBLAS, cuDNN and NCCL workspaces, and the different kernels an
on-device compile may autotune to (this one cannot autotune, and keeps Triton fusions where a GPU
might pick cuBLAS). It says nothing of numerics on the device. Its speed is an estimate from the
compiled program (:mod:`jaxrm.planning.step_time`: a roofline per kernel, scaled by the measured GPU steps of
its calibration), printed with its error against those steps.

:func:`choose` compiles a run again at other settings to fill the card: the remat policy that
recomputes least where it fits, and the largest micro-batch that fits, weighed by estimated tokens/s.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from typing import Any

import numpy as np

from jaxrm import sharding
from jaxrm.config import RunConfig
from jaxrm.data import pipeline
from jaxrm.data.example_types import of_example
from jaxrm.data.run_data import Batching, batching
from jaxrm.errors import ConfigError
from jaxrm.planning import gpu_targets, step_time
from jaxrm.planning.memory import ProgramMemory, bytes_per_device, gib, step_memory
from jaxrm.scoring import loading

# JAX preallocates this share of a GPU's memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise.
JAX_MEM_FRACTION = 0.75
MARGIN_FRACTION = 0.05  # kept free of the budget for what the compile does not see (module docstring)
MARGIN_MIN_BYTES = 2**30
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True)
class FitReport:
  """Per device, in bytes, and what was compiled."""

  target: gpu_targets.GpuTarget
  topology: str
  mesh_shape: dict[str, int]
  model: str
  params: int  # parameters of the model, all devices together
  trainable: int
  param_bytes: int  # this device's shards of the parameters (trained and frozen)
  opt_state_bytes: int
  train: ProgramMemory  # the train step's program with the larger total (micro-batched: two)
  train_programs: dict[str, ProgramMemory]
  eval: ProgramMemory | None  # None: the run has no validation set, nothing compiled for one
  eval_peak_bytes: int  # the validation step's total with the train state alive beside it (0: none)
  budget_bytes: int  # what JAX may use of the card
  mem_fraction: float
  margin_bytes: int
  batch: str  # the planned batch, in words
  attention: str  # the attention route, in words
  triton_kernels: dict[str, int]  # Pallas kernel name -> custom calls in the train step
  triton_fusions: int  # XLA's own Triton fusions (matmuls) in the train step
  collectives: dict[str, int]  # kind -> instructions in the train step
  model_flops: float  # per step: 6 N per token + 12 L H Dh per attended (query, key) pair
  compile_s: float
  estimate: step_time.StepEstimate  # one train step (every micro-batch and the update), uncalibrated
  tokens: int  # fed token slots per step, all devices together
  max_steps: int
  advice: tuple[str, ...] = ()

  @property
  def devices(self) -> int:
    return math.prod(self.mesh_shape.values())

  @property
  def step_s(self) -> float:
    """The estimated seconds of one train step, calibrated (:func:`jaxrm.planning.step_time.calibrated`)."""
    return step_time.calibrated(self.estimate.seconds)

  @property
  def mfu(self) -> float:
    """Model FLOPs (recomputation not counted) per second over the devices' dense bf16 peak."""
    return self.model_flops / (self.step_s * self.devices * self.target.peak_bf16_flops)

  @property
  def peak_bytes(self) -> int:
    return max(self.train.total_bytes, self.eval_peak_bytes)  # no validation: eval_peak_bytes 0

  @property
  def fits(self) -> bool:
    return self.peak_bytes + self.margin_bytes <= self.budget_bytes

  @property
  def exit_status(self) -> int:
    """``python -m jaxrm.plan``'s: 0 when the run fits, 1 when it does not (2 is a usage error)."""
    return 0 if self.fits else 1

  def lines(self) -> list[str]:
    """The report as the CLI prints it."""
    t = self.target
    mesh = " x ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
    out = [
      f"{self.model} on {t.description} ({t.name}), {self.topology} (hosts x GPUs), mesh {mesh}",
      f"batch: {self.batch}",
      self.attention,
      f"triton kernels: {_counts(self.triton_kernels) or 'none'}; XLA triton fusions: {self.triton_fusions}",
      f"collectives per train step: {_counts(self.collectives) or 'none'}",
      f"model FLOPs per step: {self.model_flops / 1e12:.2f} TFLOP (6 N per token + 12 L H Dh per "
      "attended key)",
      f"compile: {self.compile_s:.1f} s",
      *self.time_lines(),
      "per device:",
      f"  parameters      {gib(self.param_bytes)} ({self.params:,} parameters, {self.trainable:,} trained)",
      f"  optimizer state {gib(self.opt_state_bytes)}",
    ]
    for name, program in self.train_programs.items():
      out.append(f"  train {name + ':':9} {program.line()}")
    if self.eval is None:
      out.append(
        "  eval step:      none (the run does not validate: no data.val_data_paths, or no round in eval.*)"
      )
    else:
      out.append(
        f"  eval step:      {self.eval.line()}; with the train state beside it {gib(self.eval_peak_bytes)}"
      )
    out += [
      f"  peak            {gib(self.peak_bytes)}",
      f"  margin          {gib(self.margin_bytes)} (workspaces, NCCL buffers and autotuned kernels "
      "lie outside the compiler's figures)",
      f"  total           {gib(self.peak_bytes + self.margin_bytes)} of {gib(self.budget_bytes)} "
      f"({self.mem_fraction:.0%} of the card's {gib(t.memory_bytes)})",
      "FITS" if self.fits else "DOES NOT FIT",
    ]
    if not self.fits:
      out += ["to fit, change one of:", *(f"  {a}" for a in self.advice)]
    return out

  def time_lines(self) -> list[str]:
    """The step time estimated from the compiled program, with its calibration's error."""
    e, t = self.estimate, self.target
    recomputed = max(e.flops - self.model_flops / self.devices, 0.0) / max(e.flops, 1.0)
    gpus = f"{self.devices} GPU{'s' if self.devices > 1 else ''}"
    return [
      f"time (estimated from the compiled program, not measured): {self.step_s:.3f} s a step on {t.name}, "
      f"{self.tokens:,} token slots a step, {self.tokens / self.step_s:,.0f} tokens/s, "
      f"MFU {self.mfu:.1%} of {t.peak_bf16_flops / 1e12:.0f} TFLOP/s a GPU",
      f"  per device the program computes {e.flops / 1e12:.2f} TFLOP, {recomputed:.0%} of it beyond the "
      f"model's FLOPs (recomputation; MFU counts model FLOPs only), and moves {e.bytes / 1e9:.1f} GB in "
      f"{e.launches:,} kernels: matmuls {e.share('gemm'):.0%}, attention kernels {e.share('pallas'):.0%}, "
      f"other fusions {e.share('fusion') + e.share('other'):.0%}, collectives {e.share('collective'):.0%} "
      "of the time",
      f"  a run of {self.max_steps:,} steps (train.max_steps) takes about "
      f"{duration(self.max_steps * self.step_s)} on {gpus} (training steps only)",
      f"  {step_time.calibration_line()}",
    ]


def duration(seconds: float) -> str:
  """``seconds`` in the unit a person reads it in: seconds, minutes or hours."""
  if seconds < 90:
    return f"{seconds:.0f} s"
  if seconds < 5400:
    return f"{seconds / 60:.0f} minutes"
  return f"{seconds / 3600:.1f} hours"


def _counts(counts: dict[str, int]) -> str:
  return ", ".join(f"{k} {v}" for k, v in counts.items() if v)


def mem_fraction() -> float:
  """The share of a GPU's memory JAX will take: XLA_PYTHON_CLIENT_MEM_FRACTION, else JAX's default."""
  value = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
  if value is None:
    return JAX_MEM_FRACTION
  try:
    fraction = float(value)
  except ValueError:
    fraction = -1.0
  if not 0 < fraction <= 1:
    raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={value!r}: use a share of the memory in (0, 1]")
  return fraction


def check(
  config: RunConfig,
  target: str | gpu_targets.GpuTarget,
  topology: str = "1x1",
  *,
  completions: int = 2,
  fraction: float | None = None,
) -> FitReport:
  """Compiles ``config``'s train and validation steps for ``topology`` (hosts x GPUs per host) of
  ``target`` and reports their memory per device against the card.

  Args:
    config: the run, as ``python -m jaxrm.train`` reads it.
    target: a :data:`gpu_targets.TARGETS` name or target.
    topology: hosts x GPUs per host, e.g. "1x8" or "2x8".
    completions: K of a preference group (the data decides it at training time: 2 for pairs).
    fraction: the share of the card JAX may use (default: :func:`mem_fraction`).

  Raises:
    ConfigError: the config does not work on these devices (the message says why).
  """
  from jaxrm.run import trainer, update

  target = gpu_targets.get(target) if isinstance(target, str) else target
  hosts, _ = gpu_targets.parse_topology(topology)
  devices = gpu_targets.devices(target, topology)
  try:
    mesh = sharding.make_mesh(config.mesh, devices=devices)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  k = None if config.stepwise or config.reward.task.per_attribute else completions
  plan = batching(config, mesh, k, hosts)
  lora_cfg = config.model.lora.lora_config
  source = _model_source(config.model.name_or_path)
  loaded = loading.load(
    source, mesh=mesh, seed=config.model.seed, weights=False, **trainer.model_request(config, lora_cfg)
  )
  model, cfg = loaded.model, loaded.model.config
  built = update.build_update(
    model,
    config.reward,
    config.train,
    total_steps=config.train.max_steps,
    mesh=mesh,
    context_balance=config.mesh.context_balance,
    grad_accum=plan.grad_accum,
    micro_batched=plan.micro_batched,
  )
  state = built.state
  validates = validates_during(config)
  eval_n = plan.eval_per_host if validates else 0
  examples = _largest_examples(config, cfg, k, max(plan.per_host, eval_n) * hosts)
  stacked = plan.pack is not None and plan.grad_accum > 1
  train_batch = _abstract(_train_batch(examples, plan, cfg), mesh, hosts, stacked=stacked)
  eval_batch = _abstract(_eval_batch(examples, plan, cfg), mesh, hosts) if validates else None
  start = time.perf_counter()
  with gpu_targets.uncached():
    if plan.micro_batched:
      programs = built.train_step.compile_programs(state, train_batch)
    else:
      programs = {"step": built.train_step.compile(state, train_batch)}
    eval_compiled = built.eval_step.compile(_model_params(state), eval_batch) if validates else None
  compile_s = time.perf_counter() - start
  train, each = step_memory(programs, resident_bytes=bytes_per_device(state["opt_state"]))
  evaluation = ProgramMemory.of(eval_compiled) if validates else None
  state_bytes = bytes_per_device(state)
  sequences = config.train.global_batch_size * (k or 1)
  attended = _attended(config, sequences, train_batch, plan, stacked)
  estimate = step_time.estimate_step(programs, target, grad_accum=plan.grad_accum, attended=attended)
  fraction = mem_fraction() if fraction is None else fraction
  budget = int(target.memory_bytes * fraction)
  text = "\n".join(p.as_text() for p in programs.values())
  report = FitReport(
    target=target,
    topology=f"{hosts}x{len(devices) // hosts}",
    mesh_shape=sharding.logged_shape(mesh),
    model=f"{source.name} ({cfg.family}, {cfg.num_layers} layers)",
    params=sum(math.prod(x.shape) for x in _leaves(state["params"]) + _leaves(state.get("frozen", {}))),
    trainable=sum(math.prod(x.shape) for x in _leaves(state["params"])),
    param_bytes=bytes_per_device((state["params"], state.get("frozen", {}))),
    opt_state_bytes=bytes_per_device(state["opt_state"]),
    train=train,
    train_programs=each,
    eval=evaluation,
    eval_peak_bytes=0
    if evaluation is None
    else state_bytes + evaluation.temp_bytes + evaluation.output_bytes + bytes_per_device(eval_batch),
    budget_bytes=budget,
    mem_fraction=fraction,
    margin_bytes=max(int(budget * MARGIN_FRACTION), MARGIN_MIN_BYTES),
    batch=_describe_batch(config, plan, k, hosts, train_batch),
    attention=_attention_words(cfg, sharding.Placement.of(mesh, config.mesh)),
    triton_kernels=triton_kernels(text),
    triton_fusions=len(re.findall(r'"kind":"__triton', text)),
    collectives=collectives(text),
    model_flops=_model_flops(cfg, config, k, hosts),
    compile_s=compile_s,
    estimate=estimate,
    tokens=int(np.prod(train_batch.input_ids.shape)) * (1 if stacked else plan.grad_accum),
    max_steps=config.train.max_steps,
  )
  return dataclasses.replace(report, advice=tuple(advice(report, config)))


def validates_during(config: RunConfig) -> bool:
  """Whether the run validates at all: a validation set, and a round at some point."""
  e = config.eval
  return bool(config.data.val_data_paths) and (e.val_period > 0 or e.val_at_start or e.val_at_end)


# ------------------------------------------------------------------ the time


def _attended(config: RunConfig, sequences: int, batch, plan: Batching, stacked: bool) -> float:
  """The share of the fed rows' causal (query, key) pairs that the step's sequences attend: 1 for
  one sequence per row; less where a packed row holds several (the kernel skips the rest)."""
  t = config.data.max_length
  shape = batch.input_ids.shape
  rows, length = int(np.prod(shape[:-1])), shape[-1]
  programs = 1 if stacked else plan.grad_accum
  causal = rows * programs * length * (length + 1) / 2
  return min(sequences * t * (t + 1) / 2 / causal, 1.0)


# ------------------------------------------------------------------ the choice

# The remat policies the choice tries, least recomputation first: `elementwise` recomputes no
# product; `dots` and `full` recompute products and are taken only where the cheaper do not fit.
REMAT_ORDER = ("elementwise", "dots", "full")
MAX_GROWTH = 8  # the choice grows the micro-batch at most this many times over the config's


@dataclasses.dataclass(frozen=True)
class Choice:
  """The settings :func:`choose` picked, the report of the run with them, and why."""

  remat: str
  micro_batch_size: int
  global_batch_size: int
  report: FitReport | None  # None: nothing tried fits
  why: tuple[str, ...]

  @property
  def exit_status(self) -> int:
    """``python -m jaxrm.plan --choose``'s: 0 when the choice fits, 1 when nothing tried does."""
    return 1 if self.report is None else 0

  def overrides(self) -> str:
    """The choice as the command line's overrides."""
    return (
      f"--config.model.remat={self.remat} --config.train.micro_batch_size={self.micro_batch_size} "
      f"--config.train.global_batch_size={self.global_batch_size}"
    )

  def lines(self) -> list[str]:
    if self.report is None:
      return ["choice: nothing tried fits", *(f"  {w}" for w in self.why)]
    return ["choice: " + self.overrides(), *(f"  {w}" for w in self.why)]


def with_settings(config: RunConfig, remat: str, micro: int, global_batch: int) -> RunConfig:
  """``config`` with another remat policy, micro-batch and global batch."""
  return dataclasses.replace(
    config,
    model=dataclasses.replace(config.model, remat=remat),
    train=dataclasses.replace(config.train, micro_batch_size=micro, global_batch_size=global_batch),
  )


def choose(
  config: RunConfig,
  target: str | gpu_targets.GpuTarget,
  topology: str = "1x1",
  *,
  completions: int = 2,
  fraction: float | None = None,
  max_growth: int = MAX_GROWTH,
  check_fn=None,
) -> Choice:
  """The remat policy and micro-batch that fill the card.

  The policies of :data:`REMAT_ORDER` are tried at the config's micro-batch, least recomputation
  first. The first that fits is taken, its micro-batch doubled while it fits (up to ``max_growth``
  times the config's); the costlier policies are not tried. Each policy before it, which does not
  fit, is tried again on halved micro-batches; of all that fit, the one with the most estimated
  tokens/s wins (a smaller micro-batch that recomputes nothing against a larger one that recomputes
  the forward pass). The global batch grows where a whole micro-batch on each data-parallel device
  needs it, and is kept otherwise. Each try is a compile.

  ``check_fn`` stands in for :func:`check` (same arguments).
  """
  check_fn = check_fn or check
  micro = config.train.micro_batch_size
  dp = [1]  # data-parallel devices, known from the first report's mesh
  why: list[str] = []

  def run(remat: str, size: int):
    report = check_fn(
      with_settings(config, remat, size, _global_batch(config, size, dp[0])),
      target,
      topology,
      completions=completions,
      fraction=fraction,
    )
    dp[0] = report.mesh_shape.get("data", 1) * report.mesh_shape.get("fsdp", 1)
    return report

  found: list[tuple[str, int, Any]] = []  # (remat, micro-batch, report) of each policy's best fit
  last = None
  for remat in REMAT_ORDER:
    last = report = run(remat, micro)
    if report.fits:
      found.append((remat, *_grown(run, remat, micro, report, micro * max_growth, why)))
      break
    why.append(
      f"model.remat={remat} does not fit at micro_batch_size={micro} ({gib(report.peak_bytes)} a device)"
    )
    size = micro
    while size > 1 and not report.fits:
      size //= 2
      report = run(remat, size)
    if report.fits:
      why.append(f"model.remat={remat} fits at micro_batch_size={size}")
      found.append((remat, size, report))
  if not found:
    return Choice(REMAT_ORDER[-1], 1, _global_batch(config, 1, dp[0]), None, tuple(why + list(last.advice)))
  remat, micro, report = max(found, key=lambda f: f[2].tokens / f[2].step_s)  # the first of equals
  why.append(f"model.remat={remat}: {_remat_why(remat)}")
  if len(found) > 1:
    rates = ", ".join(f"{r} at {m}: {rep.tokens / rep.step_s:,.0f}" for r, m, rep in found)
    why.append(f"estimated tokens/s of each policy's largest micro-batch that fits: {rates}")
  gbs = _global_batch(config, micro, dp[0])
  if micro != config.train.micro_batch_size:
    why.append(
      f"train.micro_batch_size={micro} (was {config.train.micro_batch_size}): the largest that fits "
      f"with the margin{f' (tried up to {max_growth}x)' if micro > config.train.micro_batch_size else ''}"
    )
  if gbs != config.train.global_batch_size:
    why.append(
      f"train.global_batch_size={gbs} (was {config.train.global_batch_size}): a whole micro-batch on "
      "each data-parallel device; an update sees more groups (revisit the learning rate)"
    )
  why.append(
    f"{report.tokens:,} token slots a step, estimated {report.step_s:.3f} s a step, "
    f"{report.tokens / report.step_s:,.0f} tokens/s, MFU {report.mfu:.1%}"
  )
  return Choice(remat, micro, gbs, report, tuple(why))


def _grown(run, remat: str, micro: int, report, limit: int, why: list[str]) -> tuple[int, Any]:
  """``remat``'s micro-batch doubled from ``micro`` (which fits) while it fits, up to ``limit``."""
  best = (micro, report)
  while micro * 2 <= limit:
    micro *= 2
    trial = run(remat, micro)
    if not trial.fits:
      why.append(
        f"micro_batch_size={micro} does not fit with model.remat={remat} ({gib(trial.peak_bytes)} a device)"
      )
      break
    best = (micro, trial)
  return best


def _global_batch(config: RunConfig, micro: int, data_parallel: int) -> int:
  """The config's global batch, rounded up to whole micro-batches of ``micro`` on every
  data-parallel device."""
  per_update = micro * data_parallel
  return -(-config.train.global_batch_size // per_update) * per_update


def _remat_why(remat: str) -> str:
  return {
    "elementwise": "recomputes no product (norms, rope and activations only)",
    "dots": "keeps only the products' outputs: the cheaper policy does not fit",
    "full": "keeps only each layer's input: the cheaper policies do not fit",
  }[remat]


# ------------------------------------------------------------------ the model


def _model_source(name_or_path: str) -> loading.Source:
  """Where the model's settings are: a local directory needs only ``config.json``; a hub name
  fetches only that file."""
  if os.path.exists(name_or_path) or name_or_path.startswith(loading.EMBEDDED_PREFIX):
    return loading.locate(name_or_path)
  if name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/")):
    from huggingface_hub import hf_hub_download

    try:
      path = hf_hub_download(name_or_path, "config.json")
    except Exception as e:  # offline, unknown repo, gated...
      raise ConfigError(
        f"model.name_or_path={name_or_path!r}: not a local path, and its config.json could "
        f"not be fetched from the hub ({type(e).__name__}); point it at a directory holding "
        "the model's config.json"
      ) from None
    return loading.HFSource(os.path.dirname(path), name_or_path)
  return loading.locate(name_or_path)  # says what is missing


def _leaves(tree) -> list:
  import jax

  return jax.tree.leaves(tree)


def _model_params(state: dict[str, Any]):
  from jaxrm.run import steps

  return steps.model_params(state)


# ------------------------------------------------------------------ the largest batch


def _largest_examples(config: RunConfig, cfg, k: int | None, n: int) -> list:
  """``n`` groups whose every sequence is ``data.max_length`` tokens, sharing no prompt: the most
  tokens any batch of the run can hold."""
  length = config.data.max_length
  ids = lambda j: np.full(length, 1 + j % max(cfg.vocab_size - 1, 1), np.int32)
  kind = config.reward.task.example_types[0]
  return kind.largest(ids, n, k, config.reward.attribute_names if config.reward.task.per_attribute else None)


def _train_batch(examples: list, plan: Batching, cfg):
  """Host 0's training batch of the largest global batch (one micro-batch, if micro-batched)."""
  k = of_example(examples[0]).num_completions(examples)
  collate = pipeline.train_collator(
    examples,
    plan.per_host,
    plan.buckets,
    cfg.pad_token_id or 0,
    k,
    0,
    plan.process_count,
    plan.pack,
    plan.grad_accum,
  )
  batch = collate(examples[: plan.per_host * plan.process_count])
  return batch[0] if isinstance(batch, tuple) else batch


def _eval_batch(examples: list, plan: Batching, cfg):
  k = of_example(examples[0]).num_completions(examples)
  return pipeline.make_eval_batches(
    examples[: plan.eval_per_host * plan.process_count],
    batch_size=plan.eval_per_host,
    buckets=plan.buckets,
    pad_id=cfg.pad_token_id or 0,
    num_completions=k,
    process_count=plan.process_count,
    pack=plan.pack,
  )[0]


def _abstract(local_batch, mesh, hosts: int, *, stacked: bool = False):
  """The global batch that ``hosts`` hosts' ``local_batch``es make, as abstract arrays on ``mesh``."""
  import jax

  rows = 1 if stacked else 0

  def one(x):
    shape = list(x.shape)
    shape[rows] *= hosts
    return jax.ShapeDtypeStruct(
      tuple(shape), x.dtype, sharding=sharding.batch_sharding(mesh, x.ndim, stacked=stacked)
    )

  return jax.tree.map(one, local_batch)


def _describe_batch(config: RunConfig, plan: Batching, k: int | None, hosts: int, batch) -> str:
  groups = config.train.global_batch_size
  what = "sequences" if k is None else f"groups of {k}"
  words = (
    f"{groups} {what} per step, every sequence {config.data.max_length} tokens; "
    f"input_ids {list(batch.input_ids.shape)} ({plan.pack and 'packed rows' or 'one sequence per row'})"
  )
  if plan.grad_accum > 1:
    words += f", {plan.grad_accum} micro-batches per update"
  return words


# ------------------------------------------------------------------ what was compiled


def triton_kernels(hlo_text: str) -> dict[str, int]:
  """Pallas kernels lowered through Triton in compiled HLO text, by name."""
  out: dict[str, int] = {}
  for line in hlo_text.splitlines():
    if 'custom_call_target="__gpu$xla.gpu.triton"' in line:
      name = re.search(r"(jaxrm_\w+)", line)
      key = name.group(1) if name else "pallas_call"
      out[key] = out.get(key, 0) + 1
  return out


def collectives(hlo_text: str) -> dict[str, int]:
  """Collective instructions in compiled HLO text, by kind (an async pair counts once)."""
  return {kind: len(re.findall(rf"\s{kind}(?:-start)?\(", hlo_text)) for kind in COLLECTIVES}


def _attention_words(cfg, placement: sharding.Placement) -> str:
  from jaxrm.models.decoder import attention_summary

  return attention_summary(cfg, placement=placement)


def _model_flops(cfg, config: RunConfig, k: int | None, hosts: int) -> float:
  """6 N per token (N: parameters but the embedding) + 12 L H Dh per attended (query, key) pair,
  every sequence of the step ``data.max_length`` tokens long."""
  n_dense = cfg.num_layers * (
    cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    + cfg.num_heads * cfg.head_dim * cfg.hidden_size
    + 3 * cfg.hidden_size * cfg.intermediate_size
  )
  t = config.data.max_length
  sequences = config.train.global_batch_size * (k or 1)
  return sequences * (6 * n_dense * t + 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * t * (t + 1) / 2)


# ------------------------------------------------------------------ what to change


def advice(report: FitReport, config: RunConfig) -> list[str]:
  """What would make a run that does not fit fit, most likely first."""
  out = []
  need = report.peak_bytes + report.margin_bytes
  state = report.param_bytes + report.opt_state_bytes
  devices = math.prod(report.mesh_shape.values())
  fsdp = report.mesh_shape.get("fsdp", 1)
  if config.model.remat != "full":
    out.append(
      f"model.remat=full (now {config.model.remat!r}): activations are recomputed in the backward "
      "pass instead of kept"
    )
  if config.train.micro_batch_size > 1:
    out.append(
      f"train.micro_batch_size={config.train.micro_batch_size // 2} (now "
      f"{config.train.micro_batch_size}): more gradient accumulation, the same global batch"
    )
  if fsdp < devices:
    out.append(
      f"mesh.fsdp=-1 with mesh.data=1 (now fsdp={fsdp} of {devices} devices): parameters and AdamW "
      f"state ({gib(state)} per device) split over every device"
    )
  if config.mesh.context == 1 and config.data.max_length >= 8192 and devices > 1:
    out.append(f"mesh.context=2 (or more): each {config.data.max_length}-token row split over devices")
  if not config.model.lora.rank:
    out.append(
      "model.lora.rank=16 (model.lora.base_dtype=nf4 for QLoRA): train adapters; AdamW state only for them"
    )
  if report.mem_fraction < 0.95:
    out.append(
      f"XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (now {report.mem_fraction:g}): let JAX take more of the card"
    )
  more = math.ceil(need / report.budget_bytes)
  out.append(
    f"more GPUs: this needs {gib(need)} per device against {gib(report.budget_bytes)}; with fsdp "
    f"the parameters and optimizer state divide over about {more}x the devices"
  )
  return out
