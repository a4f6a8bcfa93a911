"""The training loop: :func:`train_and_evaluate` trains and validates a reward model.

A run is set up in the order of its banner comments (mesh, checkpoint, model, input, update,
summary), then :func:`_loop` runs one jitted train step per global batch, validating, logging and
checkpointing on the way. Its examples come from :func:`jaxrm.data.run_data.load_run_data`, its
optimizer, state and steps from :func:`jaxrm.run.update.build_update`, and what it prints from
:mod:`jaxrm.run.report`. Everything is told by a :class:`jaxrm.config.RunConfig`, so a notebook
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
from typing import Any

import jax
from flax import nnx

from jaxrm import compat, sharding
from jaxrm.config import RunConfig, check_run_settings
from jaxrm.data import packing, pipeline, registry
from jaxrm.data.packing import PackSpec
from jaxrm.data.run_data import RunData, batching, check_data, load_run_data
from jaxrm.data.tokenize import pad_id
from jaxrm.errors import CheckpointError, ConfigError, UserError
from jaxrm.models import lora
from jaxrm.models.decoder import attention_summary
from jaxrm.run import checkpointing, preemption, report, rerun, run_files, run_lock, steps, update
from jaxrm.run.metrics import Metrics, Samples, accumulate, finalize_metrics
from jaxrm.run.metrics_writer import MetricsWriter
from jaxrm.scoring import loading

log = logging.getLogger("jaxrm.train")


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
  data: RunData
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
  shown_val_step: int | None = None  # the step of the last validation table this process printed
  steps_done: int = 0  # by this process, since it started
  train_seconds: float = 0.0  # in train steps
  last_step_done: float | None = None  # when the last step's metrics were read (time.time())
  train_tokens: float = 0.0  # real tokens, all processes together
  finished: bool = False  # the loop reached total_steps
  ends_by: str = "train.max_steps"  # the key that sets total_steps, with what it says


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
  continues it. SIGTERM or SIGINT (received in the main thread once training has begun) does the
  same at the end of the step under way, on every process at the same step, then raises
  :class:`preemption.Stopped`.

  Raises:
    UserError: a config value, the data or the model does not work (the message says why);
      also a non-finite loss or gradient norm, naming the step.
    preemption.Stopped: a signal stopped the run; its message says where the checkpoint is.
  """
  started = time.time()
  run, held = _prepare(config)
  # From here on a signal stops the run at a step boundary; during the set-up, with nothing
  # trained to save, it stops the process at once, as it would any program. After the last step
  # it lets the run end as it would have: its last checkpoint may still be being written.
  with preemption.watch() as signals:
    try:
      last_val = _loop(run, stop_after_steps, signals)
      if run.writer.enabled:
        print(_final_summary(run, time.time() - started), flush=True)
    finally:
      run.writer.close()
      if run.ckpt is not None:
        run.ckpt.close()
      held.release()
    if signals.received is not None:
      log.warning(
        "%s received after the last step: the run ended as it would have, its checkpoints saved", signals.name
      )
  return last_val


def _prepare(config: RunConfig) -> tuple[_Run, run_lock.Held]:
  """The run set up, holding the locks of its output directory and of a checkpoint directory
  outside it (process 0; :func:`jaxrm.run.run_lock.hold_run`). A new run that stops with a UserError
  leaves no directory behind."""
  out = os.path.abspath(config.output_dir)
  main = jax.process_index() == 0
  held = run_lock.hold_run(out, _checkpoint_dir(config, out), config.checkpointing.enabled, main=main)
  try:
    return _set_up(config), held
  except BaseException as e:
    held.give_back(remove_made=isinstance(e, UserError))
    raise


def _set_up(config: RunConfig) -> _Run:
  out_dir = os.path.abspath(config.output_dir)
  is_main = jax.process_index() == 0
  # ------------------------------------------------------------------ mesh
  with _config_errors():
    mesh = sharding.make_mesh(config.mesh)
  # ------------------------------------------------------------------ checkpoint
  # An existing run resumes: known before the model loads, whose weights it then does not read
  # (unless LoRA trains over them: a LoRA checkpoint holds only the adapters and the head).
  # A new run's directories are made only once its input has been read without error.
  lora_cfg = config.model.lora.lora_config
  source = _locate_model(config, lora_cfg)
  ckpt, resume_step = _existing_run(config, out_dir, _model_path(source))
  if resume_step is not None:
    _check_same_lora(out_dir, lora_cfg)
  check_data(config)  # what needs no model fails before one loads
  check_run_settings(config)
  # ------------------------------------------------------------------ model
  rm = _load_model(config, source, mesh, lora_cfg, weights=resume_step is None or lora_cfg.enabled)
  # ------------------------------------------------------------------ input
  data = load_run_data(config, rm.tokenizer)
  inputs = _make_input(config, mesh, data, pad_id(rm.tokenizer, rm.config.pad_token_id))
  _count_unused(config, data, inputs)
  total_steps, ends_by = planned_steps(config, inputs.stream)
  # ------------------------------------------------------------------ update
  built = update.build_update(
    rm.model,
    config.reward,
    config.train,
    total_steps=total_steps,
    mesh=mesh,
    context_balance=config.mesh.context_balance,
    grad_accum=inputs.grad_accum,
    micro_batched=inputs.micro_batched,
  )
  if is_main:
    os.makedirs(out_dir, exist_ok=True)
  if ckpt is None:
    ckpt = _checkpointer(config, out_dir)
  state, start_step, last_val = built.state, 0, {}
  if resume_step is not None:
    state, last_val, start_step = _resume(ckpt, resume_step, state, inputs.train_iter)
  if is_main and start_step < total_steps:  # a finished run's files stay as they are
    rerun.record(config, out_dir, _model_path(source))
    if ckpt is not None:
      rerun.claim_checkpoint_dir(out_dir, ckpt.directory)
      base = run_files.base_reference(config.model.name_or_path) if lora_cfg.enabled else None
      run_files.RunFiles(out_dir, rm.config, config, base).write(rm.tokenizer)
  # ------------------------------------------------------------------ summary
  writer = MetricsWriter(
    out_dir, logger=config.logger, run_config=config.to_dict(), enabled=is_main, resume_step=start_step
  )
  run = _Run(
    config,
    mesh,
    rm,
    data,
    inputs,
    total_steps,
    state,
    built.train_step,
    built.eval_step,
    ckpt,
    writer,
    start_step,
    last_val,
    ends_by=ends_by,
  )
  if is_main:
    _write_drops(out_dir, data)
    print(_summary(run, out_dir), flush=True)
  return run


def planned_steps(config: RunConfig, stream: pipeline.TrainStream) -> tuple[int, str]:
  """``train.max_steps`` (the data repeated as needed, as TRL's max_steps), or fewer where
  ``train.max_epochs`` is set and ends the run first (as NeMo RL's); and which of the two ends it,
  as the run's start says."""
  spec, per_epoch = config.train, stream.steps_per_epoch
  if not spec.max_epochs or spec.max_epochs * per_epoch >= spec.max_steps:
    # Said where max_steps alone sets the length (max_epochs unset, or TRL's --max_steps).
    if spec.max_epochs not in (0, compat.UNTIL_EPOCHS) or spec.max_steps <= per_epoch:
      return spec.max_steps, "train.max_steps"
    return spec.max_steps, (
      f"train.max_steps={spec.max_steps}: {spec.max_steps / per_epoch:.1f} epochs of {per_epoch} "
      "steps, the data repeated (train.max_epochs=N would end it after N)"
    )
  epochs = spec.max_epochs * per_epoch
  why = (
    f"train.max_epochs={spec.max_epochs} of {per_epoch} steps each "
    f"({stream.num_examples} train examples, train.global_batch_size={stream.global_batch_size})"
  )
  spec.check_steps(epochs, why)
  if spec.max_steps < compat.UNTIL_EPOCHS:
    why += f", before train.max_steps={spec.max_steps}"
  return epochs, why


def _checkpoint_dir(config: RunConfig, out_dir: str) -> str:
  return config.checkpointing.checkpoint_dir or os.path.join(out_dir, "checkpoints")


def _existing_run(
  config: RunConfig, out_dir: str, model_path: str | None
) -> tuple[checkpointing.Checkpointer | None, int | None]:
  """The checkpointer of the run already in ``out_dir`` and the step it resumes from (None: it
  has no checkpoint), when this run resumes it (:func:`jaxrm.run.rerun.resumes`, asked whenever the
  folder holds a run or checkpoints); (None, None) for a new run."""
  ckpt_dir = _checkpoint_dir(config, out_dir)
  ckpt = _checkpointer(config, out_dir) if os.path.isdir(ckpt_dir) else None
  step = ckpt.latest_step() if ckpt is not None else None
  if rerun.resumes(config, out_dir, step, ckpt_dir, model_path):
    return ckpt, step
  if ckpt is not None:
    ckpt.close()
  return None, None


def _model_path(source: loading.Source) -> str | None:
  """The local file or folder of the model a run starts from, whose files the run records; None
  for a jaxrm run (its checkpoints are its own record)."""
  return None if isinstance(source, loading.RunSource) else source.path


def _checkpointer(config: RunConfig, out_dir: str) -> checkpointing.Checkpointer | None:
  spec = config.checkpointing
  if not spec.enabled:
    return None
  with _config_errors():
    return checkpointing.Checkpointer(
      _checkpoint_dir(config, out_dir),
      metric_name=spec.metric,
      higher_is_better=spec.higher_is_better,
      keep_top_k=spec.keep_top_k,
      check_writable=True,
    )


def _load_model(
  config: RunConfig, source: loading.Source, mesh, lora_cfg: lora.LoraConfig, *, weights: bool
) -> loading.Loaded:
  """The reward model on ``mesh``, with adapters as ``lora_cfg`` says; without ``weights`` (a
  resumed full run) its parameters stay abstract until the checkpoint fills them, and the
  checkpoint's weights are never read."""
  request = model_request(config, lora_cfg)
  with _config_errors():
    asker = config.reward.verifier
    if asker is not None and asker.check_tokenizer is not None:
      request["tokenizer"] = _checked_tokenizer(config, source, mesh, request, asker)
    loaded = loading.load(source, mesh=mesh, seed=config.model.seed, weights=weights, **request)
  _with_chat_template(config, loaded.tokenizer)
  return loaded


def _with_chat_template(config: RunConfig, tokenizer: Any) -> Any:
  """``tokenizer`` with ``model.chat_template`` set on it, if given; refused if there is none."""
  if tokenizer is None:
    raise ConfigError(f"model.name_or_path={config.model.name_or_path!r} has no tokenizer files")
  if config.model.chat_template:
    tokenizer.chat_template = config.model.chat_template
  return tokenizer


def _checked_tokenizer(
  config: RunConfig, source: loading.Source, mesh, request: dict[str, Any], asker: Any
) -> Any:
  """The run's tokenizer, checked by its task's ``asker`` before any weight is read (a judge's: a
  chat template, one-token answers): the model is loaded abstract for it."""
  abstract = loading.load(source, mesh=mesh, weights=False, **request)
  tokenizer = _with_chat_template(config, abstract.tokenizer)
  asker.check_tokenizer(tokenizer)
  return tokenizer


def model_request(config: RunConfig, lora_cfg: lora.LoraConfig) -> dict[str, Any]:
  """What ``loading.load`` is asked for the run's model: the config's overrides of the
  checkpoint's settings, and the head the reward type's task needs (a verifier's question and
  answers)."""
  task = config.reward.task
  overrides = dict(
    dtype=config.model.dtype,
    param_dtype=config.model.param_dtype,
    remat=config.model.remat,
    scan_layers=config.model.scan_layers,
    attention_impl=config.model.attention,
    lora=lora_cfg,
  )
  return dict(
    overrides=overrides,
    head=task.head,
    num_labels=len(config.reward.attribute_names) if task.per_attribute else None,
    verifier=config.reward.verifier,
  )


def _locate_model(config: RunConfig, lora_cfg: lora.LoraConfig) -> loading.Source:
  """Where ``model.name_or_path`` is. LoRA trains over HF or GGUF weights; a jaxrm run's own
  checkpoint has no adapters to resume."""
  path = config.model.name_or_path
  with _config_errors():
    source = loading.locate(path)
  if isinstance(source, loading.RunSource) and lora_cfg.enabled:
    raise ConfigError(
      f"model.lora.rank={lora_cfg.rank} needs an HF checkpoint or .gguf file as model.name_or_path, "
      f"but {path!r} is a jaxrm training run: export it first (python -m jaxrm.export) and "
      "train the adapters over the export"
    )
  return source


def _check_same_lora(out_dir: str, lora_cfg: lora.LoraConfig) -> None:
  """A run resumes with the adapters it was saved with (its checkpoint holds exactly those)."""
  files = run_files.RunFiles.find(out_dir)
  if files is None:
    return
  saved = files.model_config.lora
  if (saved.enabled or lora_cfg.enabled) and saved != lora_cfg:
    describe = lambda c: report.describe_lora(c) + (f", base {c.base_dtype}" if c.base_dtype else "")
    raise ConfigError(
      f"{out_dir} holds a run trained with {describe(saved)}, but model.lora asks for "
      f"{describe(lora_cfg)}: resume with the run's settings, or use another output_dir"
    )


def _resume(ckpt: checkpointing.Checkpointer, step: int, state, train_iter):
  """The state of the newest intact checkpoint up to ``step`` (the data iterator moved to where it
  was), its validation and its step. A damaged checkpoint is set aside (``<step>.damaged``) and
  said so; with none intact, the run stops naming the damaged steps."""
  damaged, reasons = [], []
  for candidate in sorted((s for s in ckpt.all_steps() if s <= step), reverse=True):
    try:
      restored, data_state, meta = ckpt.restore(candidate, state)
    except checkpointing.DamagedCheckpointError as e:
      damaged.append(candidate)
      reasons.append(str(e))
      log.warning("%s: skipped, and moved to %s", e, ckpt.set_aside(candidate))
      continue
    restored = steps.set_step_and_rng(restored, meta["step"], meta["rng"])
    train_iter.set_state(data_state)
    log.info(
      "resumed from step %d (%s)%s",
      candidate,
      ckpt.directory,
      f", skipping the damaged step(s) {', '.join(map(str, damaged))}" if damaged else "",
    )
    return restored, meta.get("last_validation", meta.get("metrics")) or {}, candidate
  raise CheckpointError(
    f"{ckpt.directory}: no intact checkpoint to resume from; step(s) "
    f"{', '.join(map(str, damaged))} are damaged (moved to <step>.damaged): {'; '.join(reasons)}. "
    "Remove the checkpoint directory to start over, or use another output_dir"
  )


# ------------------------------------------------------------------ input


def _make_input(config: RunConfig, mesh, data: RunData, pad: int) -> _Input:
  plan = batching(config, mesh, data.num_completions, jax.process_count())
  hosts = dict(
    pad_id=pad,
    num_completions=data.num_completions,
    process_index=jax.process_index(),
    process_count=plan.process_count,
    pack=plan.pack,
  )
  # A packing the examples cannot take (packing.check_packable) is the config's to change.
  with _config_errors():
    if plan.pack is not None:
      _check_row_length(
        plan.pack, {"train": data.train, **{f"validation set {n!r}": v for n, v in data.validation.items()}}
      )
    train_iter, stream = pipeline.make_train_iterator(
      data.train,
      batch_size=plan.per_host,
      seed=config.data.shuffle_seed,
      buckets=plan.buckets,
      num_workers=config.data.num_workers,
      micro_batches=plan.grad_accum,
      group_by_length=config.data.group_by_length,
      **hosts,
    )
    validation = {
      name: pipeline.make_eval_batches(ex, batch_size=plan.eval_per_host, buckets=plan.buckets, **hosts)
      for name, ex in data.validation.items()
    }
  return _Input(train_iter, stream, validation, plan.pack, plan.grad_accum)


def _count_unused(config: RunConfig, data: RunData, inputs: _Input) -> None:
  """Counts the rows that are read but never batched, as not used: each epoch's remainder of the
  last global batch, and the validation rows after ``eval.val_batches`` batches."""
  stream = inputs.stream
  left = stream.num_examples - stream.steps_per_epoch * stream.global_batch_size
  if left:
    data.drops["train"].leave_out(
      f"the {left} after each epoch's last full global batch of "
      f"{stream.global_batch_size} (train.global_batch_size; other rows each epoch)",
      f"{left} of each epoch's order",
      count=left,
    )
  if not config.eval.val_batches:
    return
  for name, batches in inputs.validation.items():
    # Each batch holds the next example_mask.size groups of every host, in order.
    kept = config.eval.val_batches * batches[0].example_mask.shape[0] * jax.process_count()
    left = len(data.validation[name]) - kept
    if left > 0:
      data.drops[f"validation-{name}"].leave_out(
        f"after eval.val_batches={config.eval.val_batches} batches (not validated)",
        f"the last {left} of {name}",
        count=left,
      )


def _check_row_length(pack: PackSpec, example_sets: dict[str, list]) -> None:
  """Stops before training if a group cannot fit in one packed row."""
  for name, examples in example_sets.items():
    need, source = max(
      ((packing.packed_length(e, pack.shared_prompt), e.source) for e in examples), default=(0, "")
    )
    if need > pack.row_length:
      raise ConfigError(
        f"data.packed_row_length={pack.row_length} is too short for {source} ({name}), "
        f"which takes {need} tokens in one row: set data.packed_row_length >= {need}, "
        "or 0 to size rows automatically"
      )


# ------------------------------------------------------------------ summary


def _write_drops(out_dir: str, data: RunData) -> None:
  with open(os.path.join(out_dir, "dropped_rows.json"), "w") as f:
    json.dump({name: d.as_dict() for name, d in data.drops.items()}, f, indent=2)


def _summary(run: _Run, out_dir: str) -> str:
  """What the run is about to do (:func:`jaxrm.run.report.run_start`)."""
  config, rm, data, pack = run.config, run.rm, run.data, run.input.pack
  gbs = config.train.global_batch_size
  shared = (
    gbs * data.mean_train_tokens(shared_prompt=True) if pack is not None and pack.shared_prompt else None
  )
  return report.run_start(
    model_name=config.model.name_or_path,
    model=rm.config,
    reward_type=config.reward.type,
    num_params=sum(x.size for x in jax.tree.leaves(nnx.state(rm.model))),
    trained_params=sum(x.size for x in jax.tree.leaves(run.state["params"])),
    attention=attention_summary(rm.config, placement=sharding.Placement.of(run.mesh, config.mesh)),
    mesh_shape=sharding.logged_shape(run.mesh),
    devices=jax.device_count(),
    backend=sharding.platform(run.mesh),
    processes=jax.process_count(),
    train_examples=len(data.train),
    steps_per_epoch=run.input.stream.steps_per_epoch,
    validation_sizes={n: len(v) for n, v in data.validation.items()},
    drops=data.drops,
    start_step=run.start_step,
    total_steps=run.total_steps,
    ends_by=run.ends_by,
    global_batch_size=gbs,
    grad_accum=run.input.grad_accum,
    tokens_per_step=gbs * data.mean_train_tokens(),
    pack=pack,
    micro_batched=run.input.micro_batched,
    shared_tokens_per_step=shared,
    group_by_length=config.data.group_by_length,
    output_dir=out_dir,
  )


# ------------------------------------------------------------------ evals


def _evaluate(run: _Run, step: int) -> dict[str, float]:
  """Every validation set's metrics (``validation-<set>_<metric>``), logged at ``step``."""
  t0 = time.time()
  results = {}
  params = steps.model_params(run.state)
  for name, batches in run.input.validation.items():
    if run.config.eval.val_batches:
      batches = batches[: run.config.eval.val_batches]
    acc = None
    for b in batches:
      m = run.eval_step(params, pipeline.to_global_batch(b, run.mesh))
      if any(isinstance(v, Samples) for v in m.values()):
        m = _samples_to_host(m)
      acc = m if acc is None else accumulate(acc, m)
    for k, v in finalize_metrics(jax.device_get(acc)).items():
      results[f"validation-{name}_{k}"] = v
  results["timing/validation/total_validation_time"] = time.time() - t0
  metric = run.config.checkpointing.metric
  if run.ckpt is not None and metric and metric not in results:
    raise ConfigError(
      f"checkpointing.metric_name={run.config.checkpointing.metric_name!r} is not a validation "
      f"metric; available: {', '.join(sorted(results))}"
    )
  run.writer.write(step, results)
  if run.writer.enabled:
    _say(report.validation_table(results, list(run.input.validation), step))
    run.shown_val_step = step
  return results


def _say(text: str) -> None:
  """Prints above the progress bar, if one is showing."""
  from tqdm import tqdm

  tqdm.write(text)


def _samples_to_host(metrics: Metrics) -> Metrics:
  """An eval step's metrics as numpy, batch by batch; Samples, split over hosts, are gathered whole
  on each."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    metrics = {
      k: multihost_utils.process_allgather(v, tiled=True) if isinstance(v, Samples) else v
      for k, v in metrics.items()
    }
  return jax.device_get(metrics)


# ------------------------------------------------------------------ loop


def _loop(run: _Run, stop_after_steps: int | None, signals: preemption.Watch) -> dict[str, float]:
  config = run.config
  progress = _progress(config, run.start_step, run.total_steps, run.writer.enabled)
  step = run.start_step
  try:
    if config.eval.val_at_start and step == 0 and run.input.validation:
      run.last_val = _evaluate(run, 0)
    # Step N+1 is launched before step N's metrics are read, so the host reads and sends the next
    # batch while the device computes. A step after which the state is read (validated, saved,
    # the last, stopped at) is finished before the next one starts: that one would consume it.
    pending = None
    while step < run.total_steps:
      step += 1
      launched = _dispatch(run, step)
      if pending is not None:
        _record(run, progress, pending)
      pending = launched
      signalled = signals.reached(step)
      stopping = signalled or (stop_after_steps is not None and step >= run.start_step + stop_after_steps)
      validate, save = _due(run, step, stopping)
      if not (stopping or validate or save or step == run.total_steps):
        continue
      _record(run, progress, pending)
      pending = None
      _validate_and_save(run, step, validate, save)
      if signalled and step < run.total_steps:
        raise _stopped(run, step, signals)
      if stopping:
        break
    run.finished = step >= run.total_steps
  finally:
    if progress is not None:
      progress.close()
  return run.last_val


def _stopped(run: _Run, step: int, signals: preemption.Watch) -> preemption.Stopped:
  """What a run stopped by a signal after ``step`` tells: where its checkpoint is, how to go on."""
  name = signals.name
  if run.ckpt is None:
    message = (
      f"stopped by {name} after step {step} of {run.total_steps}; nothing saved "
      "(checkpointing.enabled is false)"
    )
  else:
    message = (
      f"stopped by {name} after step {step} of {run.total_steps}: checkpoint saved in "
      f"{os.path.join(run.ckpt.directory, str(step))}; run the same command again (the same "
      "config and output_dir) to continue from it"
    )
  return preemption.Stopped(message, signals.signum, step)


def _show_progress(run: _Run, progress, step: int, metrics: dict[str, float], logged: bool) -> None:
  """Moves the progress bar; without one (off a terminal), prints a plain line at each logged step."""
  accuracy = metrics.get("train/accuracy", metrics.get("train/step_accuracy", math.nan))
  if progress is not None:
    progress.update(1)
    shown = {"acc": f"{accuracy:.3f}"} if math.isfinite(accuracy) else {}  # regression has none
    progress.set_postfix(loss=f"{metrics['train/loss']:.4f}", **shown)
  elif logged and run.writer.enabled and run.config.logger.progress_bar:
    print(
      report.progress_line(
        step, run.total_steps, metrics["train/loss"], accuracy, metrics["timing/train/step_time"]
      ),
      flush=True,
    )


@dataclasses.dataclass
class _Launched:
  """A training step sent to the devices, its metrics not read yet."""

  step: int
  started: float
  real_tokens: int
  efficiency: float
  metrics: Any
  extra: Any


def _dispatch(run: _Run, step: int) -> _Launched:
  """Sends update number ``step`` on the next batch to the devices, without waiting for it."""
  started = time.time()
  local = next(run.input.train_iter)
  real_tokens, efficiency = pipeline.token_counts(local)
  stacked = run.input.pack is not None and run.input.grad_accum > 1  # [grad_accum, rows, ...]
  run.state, (metrics, extra) = run.train_step(
    run.state, pipeline.to_global_batch(local, run.mesh, stacked=stacked)
  )
  return _Launched(step, started, real_tokens, efficiency, metrics, extra)


def _record(run: _Run, progress, launched: _Launched) -> None:
  """Reads a launched step's metrics (waiting for it), counts, shows and logs them."""
  metrics = _finish(run, launched)
  step = launched.step
  run.steps_done += 1
  run.train_seconds += metrics["timing/train/step_time"]
  run.train_tokens += metrics["train/tokens_per_second"] * metrics["timing/train/step_time"]
  logged = step % run.config.train.log_period == 0 or step == run.total_steps or step == run.start_step + 1
  _show_progress(run, progress, step, metrics, logged)
  if logged:
    run.writer.write(step, metrics)


def _finish(run: _Run, launched: _Launched) -> dict[str, float]:
  """The ``train/...`` metrics of a launched step, once it is done. Its time runs from its launch,
  or from the end of the step before where that ended later (the device's time on it).

  Raises:
    UserError: a non-finite loss or gradient norm (the last good checkpoint stays).
  """
  m = finalize_metrics(jax.device_get(launched.metrics))
  extra = launched.extra
  grad_norm, lr = (float(x) for x in jax.device_get((extra["grad_norm"], extra["learning_rate"])))
  done = time.time()
  step_time = done - max(launched.started, run.last_step_done or 0.0)
  run.last_step_done = done
  step = launched.step
  if not (math.isfinite(m["loss"]) and math.isfinite(grad_norm)):
    good = run.ckpt.latest_step() if run.ckpt is not None else None
    kept = f"step {good} in {run.ckpt.directory}" if good is not None else "none"
    raise UserError(
      f"non-finite loss ({m['loss']}) or gradient norm ({grad_norm}) at step {step}; stopping. "
      f"Last good checkpoint: {kept}. Try a lower train.learning_rate or train.max_grad_norm"
    )
  row = {f"train/{k}": v for k, v in m.items()}
  row.update(
    {
      "train/grad_norm": grad_norm,
      "train/learning_rate": lr,
      "timing/train/step_time": step_time,
      "train/tokens_per_second": launched.real_tokens * jax.process_count() / max(step_time, 1e-9),
      "train/packing_efficiency": launched.efficiency,
      "train/epoch": step / run.input.stream.steps_per_epoch,
    }
  )
  return row


def _due(run: _Run, step: int, stopping: bool) -> tuple[bool, bool]:
  """Whether ``step`` is validated, and whether it is checkpointed: at their periods, at the
  run's end, and (a checkpoint) where the run stops."""
  config, is_last = run.config, step == run.total_steps
  validate = bool(
    run.input.validation
    and (
      (config.eval.val_period and step % config.eval.val_period == 0) or (is_last and config.eval.val_at_end)
    )
  )
  save_period = config.checkpointing.save_period
  save = run.ckpt is not None and bool((save_period and step % save_period == 0) or is_last or stopping)
  return validate, save


def _validate_and_save(run: _Run, step: int, validate: bool, save: bool) -> None:
  """Validates and checkpoints at ``step`` as :func:`_due` says."""
  fresh_val = None
  if validate:
    run.last_val = fresh_val = _evaluate(run, step)
    run.last_val_step = step
  if save:
    meta = {
      "step": step,
      "rng": jax.device_get(run.state["rng"]).tolist(),
      "reward_stats": _reward_stats(run.last_val),
      "metrics": fresh_val or {},
      # What a run resumed from here reads as its latest validation (a checkpoint between two
      # validations, such as a signal's, has no metrics of its own).
      "last_validation": run.last_val,
      "config": run.config.to_dict(),
    }
    run.ckpt.save(step, run.state, run.input.train_iter.get_state(), meta, metrics=fresh_val)


def _final_summary(run: _Run, wall_seconds: float) -> str:
  """What the run did and the commands that use it (:func:`jaxrm.run.report.run_summary`)."""
  config = run.config
  ranked = run.ckpt.best_by_metric() if run.ckpt is not None else None
  best = (ranked[0], config.checkpointing.metric, ranked[1]) if ranked is not None else None
  return report.run_summary(
    output_dir=config.output_dir,
    steps=run.steps_done,
    wall_seconds=wall_seconds,
    train_tokens=run.train_tokens,
    train_seconds=run.train_seconds,
    final_metrics=run.last_val,
    sets=list(config.data.val_data_paths),
    final_step=run.last_val_step,
    best=best,
    higher_is_better=config.checkpointing.higher_is_better,
    dataset_name=config.data.dataset_name,
    val_path=next(iter(config.data.val_data_paths.values()), ""),
    files_only=registry.reads_paths_only(config.data.dataset_name),
    truncation=config.data.truncation,
    lora=run.rm.config.lora.enabled,
    finished=run.finished,
    start_step=run.start_step,
    final_shown=run.last_val_step is not None and run.last_val_step == run.shown_val_step,
    ends_by=run.ends_by,
    uses=config.reward.task.uses,
  )


def _reward_stats(val: dict[str, float]) -> dict[str, float]:
  """Reward mean/std of the first validation set: scoring can normalise with them; and its min/max,
  the range a policy's rewards are watched against (jaxrm.scoring.reward_health)."""
  for key, value in val.items():
    if key.endswith("_reward_mean"):
      stem = key[: -len("mean")]
      extremes = {k: val[stem + k] for k in ("min", "max") if stem + k in val}
      return {"mean": value, "std": val[stem + "std"], **extremes, "from": key[: -len("_reward_mean")]}
  return {}


def _progress(config: RunConfig, start: int, total: int, enabled: bool):
  """A progress bar where stderr is a terminal; elsewhere its ``\r`` redraws would garble a log."""
  if not (enabled and config.logger.progress_bar and sys.stderr.isatty()):
    return None
  from tqdm import tqdm

  return tqdm(total=total, initial=start, desc="train", dynamic_ncols=True, file=sys.stderr)
