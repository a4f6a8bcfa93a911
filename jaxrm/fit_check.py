"""Will this run fit on that hardware? Answered without the GPUs and without the weights.

:func:`check` builds a run's train and validation steps exactly as the trainer does (the model from
its ``config.json`` or GGUF header only, the mesh, micro-batches and accumulation, packing, remat,
dtypes, LoRA/QLoRA, context parallelism) over compile-only devices of a GPU target
(:mod:`jaxrm.gpu_targets`), feeds them the largest batch the run's data pipeline can build (every
sequence ``data.max_length`` tokens long, no prompt shared), and reads XLA's GPU compiler: memory
per device, the attention route and its Triton kernels, the collectives. The CLI is
``python -m jaxrm.plan``.

The compile does not see everything a device holds. Its verdict keeps a margin
(:data:`MARGIN_FRACTION` of the memory JAX may use, at least :data:`MARGIN_MIN_BYTES`) for what lies
outside ``memory_analysis()``: cuBLAS, cuDNN and NCCL workspaces, and the different kernels an
on-device compile may autotune to (this one cannot autotune, and keeps Triton fusions where a GPU
might pick cuBLAS). It says nothing of speed or of numerics on the device.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from typing import Any

import numpy as np

from jaxrm import gpu_targets, loading, sharding
from jaxrm.config import RunConfig
from jaxrm.data import pipeline
from jaxrm.data.run_data import Batching, batching
from jaxrm.data.tokenize import PreferenceExample, RatedExample, StepwiseExample
from jaxrm.errors import ConfigError
from jaxrm.memory import ProgramMemory, bytes_per_device, gib, step_memory

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
  eval: ProgramMemory
  eval_peak_bytes: int  # the validation step's total with the train state alive beside it
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
  advice: tuple[str, ...] = ()

  @property
  def peak_bytes(self) -> int:
    return max(self.train.total_bytes, self.eval_peak_bytes)

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
      "per device:",
      f"  parameters      {gib(self.param_bytes)} ({self.params:,} parameters, {self.trainable:,} trained)",
      f"  optimizer state {gib(self.opt_state_bytes)}",
    ]
    for name, program in self.train_programs.items():
      out.append(f"  train {name + ':':9} {program.line()}")
    out += [
      f"  eval step:      {self.eval.line()}; with the train state beside it {gib(self.eval_peak_bytes)}",
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
  from jaxrm import trainer, update

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
  examples = _largest_examples(config, cfg, k, max(plan.per_host, plan.eval_per_host) * hosts)
  train_batch = _abstract(
    _train_batch(examples, plan, cfg), mesh, hosts, stacked=plan.pack is not None and plan.grad_accum > 1
  )
  eval_batch = _abstract(_eval_batch(examples, plan, cfg), mesh, hosts)
  start = time.perf_counter()
  with gpu_targets.uncached():
    if plan.micro_batched:
      programs = built.train_step.compile_programs(state, train_batch)
    else:
      programs = {"step": built.train_step.compile(state, train_batch)}
    eval_compiled = built.eval_step.compile(_model_params(state), eval_batch)
  compile_s = time.perf_counter() - start
  train, each = step_memory(programs, resident_bytes=bytes_per_device(state["opt_state"]))
  evaluation = ProgramMemory.of(eval_compiled)
  state_bytes = bytes_per_device(state)
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
    eval_peak_bytes=state_bytes
    + evaluation.temp_bytes
    + evaluation.output_bytes
    + bytes_per_device(eval_batch),
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
  )
  return dataclasses.replace(report, advice=tuple(advice(report, config)))


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
  from jaxrm import steps

  return steps.model_params(state)


# ------------------------------------------------------------------ the largest batch


def _largest_examples(config: RunConfig, cfg, k: int | None, n: int) -> list:
  """``n`` groups whose every sequence is ``data.max_length`` tokens, sharing no prompt: the most
  tokens any batch of the run can hold."""
  length = config.data.max_length
  ids = lambda j: np.full(length, 1 + j % max(cfg.vocab_size - 1, 1), np.int32)
  if config.stepwise:
    labels = np.full(length, -100, np.int32)
    labels[-1] = 1
    return [StepwiseExample(ids(0), labels, "plan", {}) for _ in range(n)]
  if config.reward.task.per_attribute:
    a = len(config.reward.attribute_names)
    return [
      RatedExample(ids(0), np.zeros(a, np.float32), np.ones(a, np.float32), i, "plan", {}) for i in range(n)
    ]
  # Completions that differ from their first token share no prompt to write once.
  return [
    PreferenceExample(tuple(ids(j) for j in range(k)), tuple(range(k)), 0.0, "plan", {}) for _ in range(n)
  ]


def _train_batch(examples: list, plan: Batching, cfg):
  """Host 0's training batch of the largest global batch (one micro-batch, if micro-batched)."""
  k = len(examples[0].input_ids) if isinstance(examples[0], PreferenceExample) else None
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
  k = len(examples[0].input_ids) if isinstance(examples[0], PreferenceExample) else None
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
