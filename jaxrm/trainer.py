"""The training loop: :func:`train_and_evaluate` trains and validates a reward model.

A run is set up in the order of its banner comments (mesh, checkpoint, model, input, update,
summary), then :func:`_loop` runs one jitted train step per global batch, validating, logging and
checkpointing on the way. Everything is told by a :class:`jaxrm.config.RunConfig`, so a notebook
needs no config file. The CLI is ``python -m jaxrm.train``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from jaxrm import checkpointing, optim, report, sharding, steps
from jaxrm.config import RunConfig
from jaxrm.data import cache, packing, pipeline, registry
from jaxrm.data.drops import DropReport
from jaxrm.data.packing import PackSpec
from jaxrm.data.tokenize import pad_id
from jaxrm.errors import ConfigError, UserError
from jaxrm import losses
from jaxrm.losses import RewardSpec, accumulate, finalize_metrics
from jaxrm.metrics_writer import MetricsWriter
from jaxrm.models import lora
from jaxrm.models.decoder import attention_summary

log = logging.getLogger("jaxrm.train")


@dataclasses.dataclass
class _Data:
  """The tokenized examples of a run and the rows dropped from each set."""

  train: Sequence  # a list, or the cache's memory-mapped examples
  validation: dict[str, Sequence]
  drops: dict[str, DropReport]  # "train", "validation-<name>"
  num_completions: int | None  # K of preference batches; None for stepwise and rated data


@dataclasses.dataclass
class _Input:
  """How the examples become global batches."""

  train_iter: Any  # grain iterator of this host's batches; its state is checkpointed
  stream: pipeline.TrainStream
  validation: dict[str, list]  # name -> this host's batches
  pack: PackSpec | None
  grad_accum: int

  @property
  def micro_batched(self) -> bool:
    """A training batch is a tuple of micro-batches, each padded to its own bucket."""
    return self.pack is None and self.grad_accum > 1


@dataclasses.dataclass
class _Run:
  """What the loop reads and updates."""

  config: RunConfig
  mesh: Any
  rm: Any
  data: _Data
  input: _Input
  total_steps: int
  state: dict[str, Any]
  train_step: steps.CompiledPerShape | steps.MicroBatchedStep
  eval_step: steps.CompiledPerShape
  ckpt: checkpointing.Checkpointer | None
  writer: MetricsWriter
  start_step: int
  last_val: dict[str, float]  # the latest validation results
  last_val_step: int | None = None
  steps_done: int = 0  # by this process, since it started
  train_seconds: float = 0.0  # in train steps
  train_tokens: float = 0.0  # real tokens, all processes together
  finished: bool = False  # the loop reached total_steps


@contextlib.contextmanager
def _config_errors():
  """A ValueError raised while a config value is used is the user's to fix."""
  try:
    yield
  except UserError:
    raise
  except ValueError as e:
    raise ConfigError(str(e)) from None


def train_and_evaluate(config: RunConfig, *, stop_after_steps: int | None = None) -> dict[str, float]:
  """Runs training as ``config`` says; returns the last validation metrics.

  Continues from the latest checkpoint in the checkpoint directory, if any. ``stop_after_steps``
  ends the run early, after saving a checkpoint, without marking it finished: running again
  continues it.

  Raises:
    UserError: a config value, the data or the model does not work (the message says why);
      also a non-finite loss or gradient norm, naming the step.
  """
  started = time.time()
  run = _prepare(config)
  try:
    last_val = _loop(run, stop_after_steps)
    if run.writer.enabled:
      print(_final_summary(run, time.time() - started), flush=True)
    return last_val
  finally:
    run.writer.close()
    if run.ckpt is not None:
      run.ckpt.close()


def _prepare(config: RunConfig) -> _Run:
  out_dir = os.path.abspath(config.output_dir)
  is_main = jax.process_index() == 0
  if is_main:
    os.makedirs(out_dir, exist_ok=True)
  # ------------------------------------------------------------------ mesh
  with _config_errors():
    mesh = sharding.make_mesh(config.mesh)
  # ------------------------------------------------------------------ checkpoint
  # An existing run resumes: known before the model loads, whose weights it then does not read
  # (unless LoRA trains over them: a LoRA checkpoint holds only the adapters and the head).
  # A new run's checkpoint directory is made only once its input has been read without error.
  lora_cfg = config.model.lora.lora_config()
  _check_lora_base(config, lora_cfg)
  existing = os.path.isdir(_checkpoint_dir(config, out_dir))
  ckpt = _checkpointer(config, out_dir) if existing else None
  resume_step = ckpt.latest_step() if ckpt is not None else None
  if resume_step is not None:
    _check_same_lora(out_dir, lora_cfg)
  # ------------------------------------------------------------------ model
  rm = _load_model(config, mesh, lora_cfg, weights=resume_step is None or lora_cfg.enabled)
  # ------------------------------------------------------------------ input
  data = _load_data(config, rm.tokenizer)
  inputs = _make_input(config, mesh, data, pad_id(rm.tokenizer, rm.config.pad_token_id))
  _count_unused(config, data, inputs)
  total_steps = min(config.train.max_steps, config.train.max_epochs * inputs.stream.steps_per_epoch)
  if ckpt is None:
    ckpt = _checkpointer(config, out_dir)
  # ------------------------------------------------------------------ update
  t = config.train
  with _config_errors():
    schedule = optim.make_schedule(learning_rate=t.learning_rate, warmup_steps=t.warmup_steps,
                                   total_steps=total_steps, scheduler=t.lr_scheduler, min_lr_ratio=t.min_lr_ratio)
  tx = optim.make_optimizer(schedule, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm,
                            b1=t.adam_beta1, b2=t.adam_beta2, eps=t.adam_epsilon)
  state, state_shardings = steps.init_state(nnx.state(rm.model), tx, seed=config.train.seed, mesh=mesh,
                                            trainable=lora.trainable_filter(lora_cfg))
  loss_fn = steps.make_loss_fn(rm.model, config.reward)
  if inputs.micro_batched:
    # Each micro-batch keeps its own length bucket; one compiled gradient per bucket.
    train_step = steps.MicroBatchedStep(loss_fn, tx, schedule, state_shardings=state_shardings, mesh=mesh)
  else:
    train_step = steps.CompiledPerShape("train step", steps.make_train_step(
        loss_fn, tx, schedule, grad_accum_steps=inputs.grad_accum, state_shardings=state_shardings, mesh=mesh))
  eval_loss_fn = steps.make_loss_fn(rm.model, config.reward, samples=True)
  eval_step = steps.CompiledPerShape("eval step", steps.make_eval_step(eval_loss_fn, mesh=mesh))
  start_step, last_val = 0, {}
  if resume_step is not None:
    state, last_val = _resume(ckpt, resume_step, state, inputs.train_iter)
    start_step = resume_step
  if ckpt is not None and is_main:
    checkpointing.write_run_files(out_dir, config_json=json.dumps(config.to_dict(), indent=2),
                                  model_config=rm.config, tokenizer=rm.tokenizer,
                                  base_model=_base_reference(config.model.name_or_path) if lora_cfg.enabled else None)
  # ------------------------------------------------------------------ summary
  writer = MetricsWriter(out_dir, tensorboard=config.logger.tensorboard,
                         log_dir=config.logger.log_dir or os.path.join(out_dir, "tensorboard"), enabled=is_main,
                         resume_step=start_step)
  run = _Run(config, mesh, rm, data, inputs, total_steps, state, train_step, eval_step, ckpt, writer,
             start_step, last_val)
  if is_main:
    _write_drops(out_dir, data)
    print(_summary(run, out_dir), flush=True)
  return run


def _checkpoint_dir(config: RunConfig, out_dir: str) -> str:
  return config.checkpointing.checkpoint_dir or os.path.join(out_dir, "checkpoints")


def _checkpointer(config: RunConfig, out_dir: str) -> checkpointing.Checkpointer | None:
  spec = config.checkpointing
  if not spec.enabled:
    return None
  with _config_errors():
    return checkpointing.Checkpointer(_checkpoint_dir(config, out_dir), metric_name=spec.metric,
                                      higher_is_better=spec.higher_is_better, keep_top_k=spec.keep_top_k)


def _load_model(config: RunConfig, mesh, lora_cfg: lora.LoraConfig, *, weights: bool):
  """The reward model on ``mesh``, with adapters as ``lora_cfg`` says; without ``weights`` (a
  resumed full run) its parameters stay abstract until the checkpoint fills them, and the
  checkpoint's weights are never read."""
  from jaxrm.reward_model import RewardModel
  regression = config.reward.type == "regression"
  with _config_errors():
    rm = RewardModel.from_pretrained(
        config.model.name_or_path, dtype=config.model.dtype, param_dtype=config.model.param_dtype,
        head="token" if config.stepwise else "sequence", mesh=mesh, seed=config.model.seed,
        num_labels=len(config.reward.attribute_names) if regression else None,
        remat=config.model.remat, scan_layers=config.model.scan_layers, attention_impl=config.model.attention,
        lora=lora_cfg, load_weights=weights)
  if rm.tokenizer is None:
    raise ConfigError(f"model.name_or_path={config.model.name_or_path!r} has no tokenizer files")
  return rm


def _check_lora_base(config: RunConfig, lora_cfg: lora.LoraConfig) -> None:
  """LoRA trains over HF or GGUF weights; a jaxrm run's own checkpoint has no adapters to resume."""
  path = config.model.name_or_path
  if lora_cfg.enabled and checkpointing.find_run(path) is not None:
    raise ConfigError(f"model.lora.rank={lora_cfg.rank} needs an HF checkpoint or .gguf file as model.name_or_path, "
                      f"but {path!r} is a jaxrm training run: export it first (python -m jaxrm.export) and "
                      "train the adapters over the export")


def _check_same_lora(out_dir: str, lora_cfg: lora.LoraConfig) -> None:
  """A run resumes with the adapters it was saved with (its checkpoint holds exactly those)."""
  if not checkpointing.is_run_dir(out_dir):
    return
  saved = checkpointing.find_run(out_dir).model_config().lora
  if (saved.enabled or lora_cfg.enabled) and saved != lora_cfg:
    describe = lambda c: _describe_lora(c) + (f", base {c.base_dtype}" if c.base_dtype else "")
    raise ConfigError(f"{out_dir} holds a run trained with {describe(saved)}, but model.lora asks for "
                      f"{describe(lora_cfg)}: resume with the run's settings, or use another output_dir")


def _describe_lora(cfg: lora.LoraConfig) -> str:
  """``LoRA rank 8 (alpha 16) on q_proj, v_proj``, ``... (alpha 16, dropout 0.05) ...``, or ``no LoRA``."""
  if not cfg.enabled:
    return "no LoRA"
  dropout = f", dropout {cfg.dropout:g}" if cfg.dropout else ""
  return f"LoRA rank {cfg.rank} (alpha {cfg.alpha:g}{dropout}) on {', '.join(cfg.targets)}"


def _base_reference(name_or_path: str) -> str:
  """How a LoRA run names its base: a local path made absolute, a hub or embedded name as given."""
  return os.path.abspath(name_or_path) if os.path.exists(name_or_path) else name_or_path


def _resume(ckpt: checkpointing.Checkpointer, step: int, state, train_iter):
  """The state saved at ``step`` (the data iterator moved to where it was) and its validation."""
  state, data_state, meta = ckpt.restore(step, state)
  state = steps.set_step_and_rng(state, meta["step"], meta["rng"])
  train_iter.set_state(data_state)
  log.info("resumed from step %d (%s)", step, ckpt.directory)
  return state, meta.get("metrics") or {}


# ------------------------------------------------------------------ input


def _load_data(config: RunConfig, tokenizer) -> _Data:
  spec = config.data
  kind = registry.kind(spec.dataset_name)
  if config.reward.type not in registry.KINDS[kind]:
    raise ConfigError(f"reward.type={config.reward.type!r} does not fit data.dataset_name={spec.dataset_name!r}, "
                      f"which holds {kind} data (for reward.type {' or '.join(registry.KINDS[kind])})")
  options = _read_options(config.reward, spec.dataset_name)

  def load(path: str, split: str, limit: int, limit_name: str, drops: DropReport) -> Sequence:
    path = path or None
    source = None
    if spec.cache_directory is not None:
      source = registry.source_key(spec.dataset_name, path, split=split, **options)
    if source is not None:
      source["max_records"] = limit
    read = lambda d: registry.iter_records(spec.dataset_name, path, split=split, drops=d, max_records=limit,
                                             limit_name=limit_name, **options)
    return cache.load_tokenized(read, tokenizer=tokenizer, options=spec.tokenize_options, drops=drops, source=source,
                                cache_dir=spec.cache_directory, num_proc=spec.tokenizer_processes)

  drops = {"train": DropReport()}
  train = load(spec.train_data_path, "train", spec.max_train_rows, "data.max_train_rows", drops["train"])
  validation = {}
  for name, path in spec.val_data_paths.items():
    registry.check_val_set_name(name)
    drops[f"validation-{name}"] = report = DropReport()
    validation[name] = load(path, "validation", spec.max_val_rows, "data.max_val_rows", report)
    if not validation[name]:
      raise ConfigError(f"validation set {name!r} has no usable rows\n{report.summary(name)}")
  if config.reward.preference_strength_scaling and all(e.strength is None for e in train):
    raise ConfigError(f"reward.preference_strength_scaling weighs each pair by its preference strength, but no "
                      f"training row of {spec.dataset_name} has one: give rows a 'strength' (HelpSteer3 has "
                      "overall_preference), or set reward.preference_strength_scaling=False")
  num_completions = None if kind != "preference" else max(
      pipeline.max_completions(train), *(pipeline.max_completions(v) for v in validation.values()))
  return _Data(train, validation, drops, num_completions)


def _read_options(reward: RewardSpec, dataset_name: str) -> dict:
  """What a rated dataset is read for: the attributes, in the head's order, and their range."""
  if reward.type != "regression":
    return {}
  options = {"attributes": reward.attribute_names}
  if registry.takes_option(dataset_name, "value_range"):
    options["value_range"] = reward.value_range
  elif reward.value_range is not None:
    log.warning("reward.attribute_range=%r is not used: %s checks its own range", reward.attribute_range,
                dataset_name)
  return options


def _make_input(config: RunConfig, mesh, data: _Data, pad: int) -> _Input:
  process_index, process_count = jax.process_index(), jax.process_count()
  data_parallel = sharding.data_parallel_size(mesh)
  gbs, mbs = config.train.global_batch_size, config.train.micro_batch_size
  if gbs % (mbs * data_parallel):
    raise ConfigError(f"train.global_batch_size={gbs} must be a multiple of micro_batch_size x data-parallel "
                      f"devices = {mbs} x {data_parallel}")
  if gbs % process_count:
    raise ConfigError(f"train.global_batch_size={gbs} must be divisible by the {process_count} processes")
  grad_accum = gbs // (mbs * data_parallel)
  # Packed row counts: equal rows on every data-parallel device, in steps of a quarter micro-batch
  # per device (few compiled shapes).
  pack = _pack_spec(config, data.num_completions, rows_multiple=(
      data_parallel // math.gcd(data_parallel, process_count) * max(mbs // 4, 1)))
  if pack is not None:
    _check_row_length(pack, {"train": data.train, **{f"validation set {n!r}": v for n, v in data.validation.items()}})
  buckets = pipeline.length_buckets(config.data.max_length, config.data.bucket_multiple)
  hosts = dict(pad_id=pad, num_completions=data.num_completions, process_index=process_index,
               process_count=process_count, pack=pack)
  with _config_errors():
    train_iter, stream = pipeline.make_train_iterator(
        data.train, batch_size=gbs // process_count, seed=config.data.shuffle_seed, buckets=buckets,
        num_workers=config.data.num_workers, micro_batches=grad_accum, group_by_length=config.data.group_by_length,
        **hosts)
  eval_bs = max(config.eval.batch_size // data_parallel, 1) * data_parallel
  validation = {name: pipeline.make_eval_batches(ex, batch_size=eval_bs // process_count, buckets=buckets, **hosts)
                for name, ex in data.validation.items()}
  return _Input(train_iter, stream, validation, pack, grad_accum)


def _count_unused(config: RunConfig, data: _Data, inputs: _Input) -> None:
  """Counts the rows that are read but never batched, as drops: each epoch's remainder of the
  last global batch, and the validation rows after ``eval.val_batches`` batches."""
  stream = inputs.stream
  left = stream.num_examples - stream.steps_per_epoch * stream.global_batch_size
  if left:
    data.drops["train"].drop(f"not trained in each epoch: the {left} after the last full global "
                             f"batch of {stream.global_batch_size} (train.global_batch_size; other "
                             f"rows each epoch)", f"{left} of each epoch's order", count=left)
  if not config.eval.val_batches:
    return
  for name, batches in inputs.validation.items():
    # Each batch holds the next example_mask.size groups of every host, in order.
    kept = config.eval.val_batches * batches[0].example_mask.shape[0] * jax.process_count()
    left = len(data.validation[name]) - kept
    if left > 0:
      data.drops[f"validation-{name}"].drop(
          f"not validated: after eval.val_batches={config.eval.val_batches} batches",
          f"the last {left} of {name}", count=left)


def _pack_spec(config: RunConfig, num_completions: int | None, rows_multiple: int) -> PackSpec | None:
  """The ``PackSpec`` that ``data.packing`` and ``data.packed_row_length`` ask for; None: unpacked.

  Args:
    config: the run's config.
    num_completions: K of preference data; None for stepwise data.
    rows_multiple: each host's row count is rounded up to a multiple of this.
  """
  spec = config.data
  if spec.packing == "none":
    return None
  # Automatic rows fit a group of K completions of max_length tokens, and are as long as each
  # batch's longest group, in steps of bucket_multiple (few compiled shapes).
  return PackSpec(row_length=spec.packed_row_length or spec.max_length * (num_completions or 1),
                  length_multiple=0 if spec.packed_row_length else spec.bucket_multiple,
                  shared_prompt=spec.packing == "shared_prompt", rows_multiple=rows_multiple)


def _check_row_length(pack: PackSpec, example_sets: dict[str, list]) -> None:
  """Stops before training if a group cannot fit in one packed row."""
  for name, examples in example_sets.items():
    need, source = max(((packing.packed_length(e, pack.shared_prompt), e.source) for e in examples),
                       default=(0, ""))
    if need > pack.row_length:
      raise ConfigError(f"data.packed_row_length={pack.row_length} is too short for {source} ({name}), "
                        f"which takes {need} tokens in one row: set data.packed_row_length >= {need}, "
                        "or 0 to size rows automatically")


# ------------------------------------------------------------------ summary


def _write_drops(out_dir: str, data: _Data) -> None:
  with open(os.path.join(out_dir, "dropped_rows.json"), "w") as f:
    json.dump({name: d.as_dict() for name, d in data.drops.items()}, f, indent=2)


def _summary(run: _Run, out_dir: str) -> str:
  """What the run is about to do, as printed at its start."""
  config, rm, data = run.config, run.rm, run.data
  gbs = config.train.global_batch_size
  num_params = sum(x.size for x in jax.tree.leaves(nnx.state(rm.model)))
  lora_cfg, trains = rm.config.lora, ""
  if lora_cfg.enabled:
    trained = sum(x.size for x in jax.tree.leaves(run.state["params"]))
    trains = (f"{_describe_lora(lora_cfg)}: {_count(trained)} trainable of {_count(num_params)} parameters"
              + (f", the base stored as {lora_cfg.base_dtype}" if lora_cfg.base_dtype else "") + "\n")
  tokens_per_step = gbs * sum(map(packing.packed_length, data.train)) / len(data.train)
  drops = "".join(f"{d.summary(name)}\n" for name, d in data.drops.items())
  return (
      f"jaxrm: {rm.config.family} model {config.model.name_or_path}, {num_params / 1e6:.1f}M parameters, "
      f"{rm.config.dtype} compute / {rm.config.param_dtype} weights, {config.reward.type} loss\n"
      f"{trains}"
      f"{attention_summary(rm.config)}\n"
      f"mesh: {dict(run.mesh.shape)} on {jax.device_count()} {jax.default_backend()} devices, "
      f"{jax.process_count()} process(es)\n"
      f"data: {len(data.train)} train examples ({run.input.stream.steps_per_epoch} steps/epoch), "
      + ", ".join(f"{n}: {len(v)}" for n, v in data.validation.items()) + " validation\n"
      + drops
      + f"steps: {run.start_step} -> {run.total_steps}, batch {gbs} groups (x{run.input.grad_accum} accumulation), "
      f"{tokens_per_step:.0f} tokens/step on average, {_describe_packing(run.input, data.train, gbs)}"
      + (", in length-grouped order (data.group_by_length)" if config.data.group_by_length else "") + "\n"
      f"output in {out_dir}")


def _count(n: int) -> str:
  return f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n / 1e3:.1f}K"


def _describe_packing(inputs: _Input, train_examples: Sequence, gbs: int) -> str:
  pack = inputs.pack
  if pack is None:
    return "one sequence per row (data.packing=none)" + (
        ", each micro-batch padded to its own length" if inputs.micro_batched else "")
  rows = f"up to {pack.row_length}" if pack.length_multiple else f"{pack.row_length}"
  text = f"packed into rows of {rows} tokens"
  if pack.shared_prompt:
    shared = gbs * sum(packing.packed_length(e, True) for e in train_examples) / len(train_examples)
    text += f", {shared:.0f} tokens/step once prompts are shared"
  return text


# ------------------------------------------------------------------ evals


def _evaluate(run: _Run, step: int) -> dict[str, float]:
  """Every validation set's metrics (``validation-<set>_<metric>``), logged at ``step``."""
  t0 = time.time()
  results = {}
  params = steps.model_params(run.state)
  for name, batches in run.input.validation.items():
    if run.config.eval.val_batches:
      batches = batches[:run.config.eval.val_batches]
    acc = None
    for b in batches:
      m = run.eval_step(params, pipeline.to_global_batch(b, run.mesh))
      if any(isinstance(v, losses.Samples) for v in m.values()):
        m = _samples_to_host(m)
      acc = m if acc is None else accumulate(acc, m)
    for k, v in finalize_metrics(jax.device_get(acc)).items():
      results[f"validation-{name}_{k}"] = v
  results["timing/validation/total_validation_time"] = time.time() - t0
  metric = run.config.checkpointing.metric
  if run.ckpt is not None and metric and metric not in results:
    raise ConfigError(f"checkpointing.metric_name={run.config.checkpointing.metric_name!r} is not a validation "
                      f"metric; available: {', '.join(sorted(results))}")
  run.writer.write(step, results)
  if run.writer.enabled:
    _say(report.validation_table(results, list(run.input.validation), step))
  return results


def _say(text: str) -> None:
  """Prints above the progress bar, if one is showing."""
  from tqdm import tqdm
  tqdm.write(text)


def _samples_to_host(metrics: losses.Metrics) -> losses.Metrics:
  """An eval step's metrics as numpy, batch by batch; Samples, split over hosts, are gathered whole
  on each."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    metrics = {k: multihost_utils.process_allgather(v, tiled=True) if isinstance(v, losses.Samples) else v
               for k, v in metrics.items()}
  return jax.device_get(metrics)


# ------------------------------------------------------------------ loop


def _loop(run: _Run, stop_after_steps: int | None) -> dict[str, float]:
  config = run.config
  progress = _progress(config, run.start_step, run.total_steps, run.writer.enabled)
  step = run.start_step
  try:
    if config.eval.val_at_start and step == 0:
      run.last_val = _evaluate(run, 0)
    if step >= run.total_steps:
      log.info("the run in %s has already reached step %d", config.output_dir, run.total_steps)
    while step < run.total_steps:
      step += 1
      metrics = _train_step(run, step)
      run.steps_done += 1
      run.train_seconds += metrics["timing/train/step_time"]
      run.train_tokens += metrics["train/tokens_per_second"] * metrics["timing/train/step_time"]
      if progress is not None:
        progress.update(1)
        accuracy = metrics.get("train/accuracy", metrics.get("train/step_accuracy", math.nan))
        progress.set_postfix(loss=f"{metrics['train/loss']:.4f}", acc=f"{accuracy:.3f}")
      if step % config.train.log_period == 0 or step == run.total_steps or step == run.start_step + 1:
        run.writer.write(step, metrics)
      stopping = stop_after_steps is not None and step >= run.start_step + stop_after_steps
      _validate_and_save(run, step, stopping)
      if stopping:
        break
    run.finished = step >= run.total_steps
  finally:
    if progress is not None:
      progress.close()
  return run.last_val


def _train_step(run: _Run, step: int) -> dict[str, float]:
  """Runs update number ``step`` on the next batch; returns its ``train/...`` metrics.

  Raises:
    UserError: a non-finite loss or gradient norm (the last good checkpoint stays).
  """
  t0 = time.time()
  local = next(run.input.train_iter)
  real_tokens, efficiency = pipeline.token_counts(local)
  stacked = run.input.pack is not None and run.input.grad_accum > 1  # [grad_accum, rows, ...]
  run.state, (metrics, extra) = run.train_step(run.state, pipeline.to_global_batch(local, run.mesh, stacked=stacked))
  m = finalize_metrics(jax.device_get(metrics))
  grad_norm, lr = (float(x) for x in jax.device_get((extra["grad_norm"], extra["learning_rate"])))
  step_time = time.time() - t0
  if not (math.isfinite(m["loss"]) and math.isfinite(grad_norm)):
    good = run.ckpt.latest_step() if run.ckpt is not None else None
    kept = f"step {good} in {run.ckpt.directory}" if good is not None else "none"
    raise UserError(
        f"non-finite loss ({m['loss']}) or gradient norm ({grad_norm}) at step {step}; stopping. "
        f"Last good checkpoint: {kept}. Try a lower train.learning_rate or train.max_grad_norm")
  row = {f"train/{k}": v for k, v in m.items()}
  row.update({"train/grad_norm": grad_norm, "train/learning_rate": lr, "timing/train/step_time": step_time,
              "train/tokens_per_second": real_tokens * jax.process_count() / max(step_time, 1e-9),
              "train/packing_efficiency": efficiency,
              "train/epoch": step / run.input.stream.steps_per_epoch})
  return row


def _validate_and_save(run: _Run, step: int, stopping: bool) -> None:
  """Validates and checkpoints at ``step`` when their periods (or the run's end) say so."""
  config, is_last = run.config, step == run.total_steps
  fresh_val = None
  if (config.eval.val_period and step % config.eval.val_period == 0) or (is_last and config.eval.val_at_end):
    run.last_val = fresh_val = _evaluate(run, step)
    run.last_val_step = step
  save_period = config.checkpointing.save_period
  if run.ckpt is not None and ((save_period and step % save_period == 0) or is_last or stopping):
    meta = {"step": step, "rng": jax.device_get(run.state["rng"]).tolist(),
            "reward_stats": _reward_stats(run.last_val), "metrics": fresh_val or {}, "config": config.to_dict()}
    run.ckpt.save(step, run.state, run.input.train_iter.get_state(), meta, metrics=fresh_val)


def _final_summary(run: _Run, wall_seconds: float) -> str:
  """What the run did and the commands that use it (:func:`jaxrm.report.run_summary`)."""
  config, best = run.config, None
  metric = config.checkpointing.metric
  if run.ckpt is not None and metric and run.ckpt.manager.best_step() is not None:
    step = run.ckpt.manager.best_step()
    best = (step, metric, (run.ckpt.manager.metrics(step) or {}).get(metric, math.nan))
  return report.run_summary(
      output_dir=config.output_dir, steps=run.steps_done, wall_seconds=wall_seconds, train_tokens=run.train_tokens,
      train_seconds=run.train_seconds, final_metrics=run.last_val, sets=list(config.data.val_data_paths),
      final_step=run.last_val_step, best=best, higher_is_better=config.checkpointing.higher_is_better,
      dataset_name=config.data.dataset_name, val_path=next(iter(config.data.val_data_paths.values()), ""),
      max_length=config.data.max_length, truncation=config.data.truncation, lora=run.rm.config.lora.enabled,
      finished=run.finished)


def _reward_stats(val: dict[str, float]) -> dict[str, float]:
  """Reward mean/std of the first validation set: scoring can normalise with them."""
  for key, value in val.items():
    if key.endswith("_reward_mean"):
      return {"mean": value, "std": val[key[:-len("mean")] + "std"], "from": key[:-len("_reward_mean")]}
  return {}


def _progress(config: RunConfig, start: int, total: int, enabled: bool):
  if not (enabled and config.logger.progress_bar):
    return None
  from tqdm import tqdm
  return tqdm(total=total, initial=start, desc="train", dynamic_ncols=True, file=sys.stderr)
