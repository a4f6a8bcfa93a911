r"""Trains a reward model.

  python -m jaxrm.train --config=configs/rm.py [--config.train.max_steps=200 ...]

Rerunning the same command continues from the latest checkpoint in the output directory.
Multi-host: under Slurm ``jax.distributed`` is initialised from the environment (see
``scripts/slurm_train.sh``); elsewhere pass ``--coordinator_address=host:port --num_processes=N
--process_id=i`` to every process.
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

from absl import app, flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Training config file (configs/rm.py, configs/prm.py...).",
                                lock_config=True)
flags.DEFINE_string("coordinator_address", None, "Multi-host: host:port of process 0.")
flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.")

log = logging.getLogger("jaxrm.train")

PACKING_MODES = ("none", "packed", "shared_prompt")


class UserError(Exception):
  """A problem with the user's config or data: printed without a traceback."""


@contextlib.contextmanager
def _config_errors():
  """ValueErrors raised while a config value is read are the user's to fix."""
  try:
    yield
  except ValueError as e:
    raise UserError(str(e)) from None


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> None:
  """Joins a multi-process run: with an explicit coordinator, or under Slurm from its environment.

  Must run before anything else touches JAX's devices. CPU processes exchange collectives
  through gloo.
  """
  import jax
  if coordinator_address:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
  elif int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
    jax.distributed.initialize()  # Slurm cluster auto-detection


def train_and_evaluate(config, *, stop_after_steps: int | None = None) -> dict[str, float]:
  """Runs training as ``config`` says; returns the last validation metrics.

  Library entry point (the CLI and notebooks call it). Continues from the latest checkpoint in
  the checkpoint directory, if any. ``stop_after_steps`` ends the run early, after saving a
  checkpoint, without marking it finished: running again continues it.

  Raises:
    UserError: a config value, the data or the model does not work (the message says why);
      also a non-finite loss or gradient norm, naming the step.
  """
  import jax
  from flax import nnx

  from jaxrm import checkpointing, optim, sharding, steps
  from jaxrm.data import registry, packing, pipeline
  from jaxrm.data.drops import DropReport
  from jaxrm.data import tokenize
  from jaxrm.data.tokenize import TokenizeOptions, tokenize_all
  from jaxrm.losses import accumulate, finalize_metrics
  from jaxrm.metrics_writer import MetricsWriter
  from jaxrm.reward_model import RewardModel

  process_index, process_count = jax.process_index(), jax.process_count()
  is_main = process_index == 0
  out_dir = os.path.abspath(config.output_dir)
  if is_main:
    os.makedirs(out_dir, exist_ok=True)

  # ------------------------------------------------------------------ mesh
  with _config_errors():
    mesh = sharding.make_mesh(sharding.MeshConfig(config.mesh.data, config.mesh.fsdp, config.mesh.tensor))
    spec = steps.RewardSpec(config.reward.type, config.reward.ranking_loss,
                            config.reward.center_rewards_coefficient)
  data_parallel = mesh.shape["data"] * mesh.shape["fsdp"]
  metric_name = checkpointing.normalize_metric_name(config.checkpointing.metric_name)
  if config.checkpointing.enabled:
    _check_checkpointing(config, metric_name)
  stepwise = spec.type == "stepwise"
  _check_packing(config, stepwise)

  # ------------------------------------------------------------------ model
  with _config_errors():
    rm = RewardModel.from_pretrained(
        config.model.name_or_path, dtype=config.model.dtype, param_dtype=config.model.param_dtype,
        head="token" if stepwise else "sequence", mesh=mesh, seed=config.model.seed,
        remat=config.model.remat)
  model, tokenizer = rm.model, rm.tokenizer
  if tokenizer is None:
    raise UserError(f"model.name_or_path={config.model.name_or_path!r} has no tokenizer files")
  num_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))

  # ------------------------------------------------------------------ input
  if registry.is_stepwise(config.data.dataset_name) != stepwise:
    raise UserError(f"reward.type={spec.type!r} does not fit data.dataset_name={config.data.dataset_name!r} "
                    f"({'stepwise' if not stepwise else 'preference'} data)")
  opts = TokenizeOptions(max_length=config.data.max_length, truncation=config.data.truncation,
                         step_separator=config.data.step_separator,
                         train_on_last_step_only=config.data.train_on_last_step_only)
  buckets = pipeline.length_buckets(config.data.max_length, config.data.bucket_multiple)
  pad_id = tokenize.pad_id(tokenizer, rm.config.pad_token_id)

  def load(path, split, limit, drops):
    records = registry.load_records(config.data.dataset_name, path or None, split=split, drops=drops)
    if limit:
      records = records[:limit]
    return tokenize_all(records, tokenizer, opts, drops)

  train_drops = DropReport()
  train_examples = load(config.data.train_data_path, "train", config.data.max_train_rows, train_drops)
  val_sets, val_drops = {}, {}
  for name, path in config.data.val_data_paths.items():
    registry.check_val_set_name(name)
    val_drops[name] = DropReport()
    val_sets[name] = load(path, "validation", config.data.max_val_rows, val_drops[name])
    if not val_sets[name]:
      raise UserError(f"validation set {name!r} has no usable rows\n{val_drops[name].summary(name)}")
  num_completions = None if stepwise else max(
      pipeline.max_completions(train_examples), *(pipeline.max_completions(v) for v in val_sets.values()))

  gbs, mbs = config.train.global_batch_size, config.train.micro_batch_size
  if gbs % (mbs * data_parallel):
    raise UserError(f"train.global_batch_size={gbs} must be a multiple of micro_batch_size x data-parallel "
                    f"devices = {mbs} x {data_parallel}")
  if gbs % process_count:
    raise UserError(f"train.global_batch_size={gbs} must be divisible by the {process_count} processes")
  grad_accum = gbs // (mbs * data_parallel)
  # Packed row counts: equal rows on every data-parallel device, in steps of a quarter micro-batch
  # per device (few compiled shapes).
  pack = _pack_spec(config, num_completions, rows_multiple=(
      data_parallel // math.gcd(data_parallel, process_count) * max(mbs // 4, 1)))
  if pack is not None:
    _check_row_length(pack, {"train": train_examples, **{f"validation set {n!r}": v for n, v in val_sets.items()}})
  with _config_errors():
    train_iter, stream = pipeline.make_train_iterator(
        train_examples, batch_size=gbs // process_count, seed=config.data.shuffle_seed, buckets=buckets,
        pad_id=pad_id, num_completions=num_completions, process_index=process_index,
        process_count=process_count, num_workers=config.data.num_workers, pack=pack,
        micro_batches=grad_accum if pack is not None else 1)
  total_steps = min(config.train.max_steps, config.train.max_epochs * stream.steps_per_epoch)
  eval_bs = max(config.eval.batch_size // data_parallel, 1) * data_parallel
  val_batches = {
      name: pipeline.make_eval_batches(ex, batch_size=eval_bs // process_count, buckets=buckets, pad_id=pad_id,
                                       num_completions=num_completions, process_index=process_index,
                                       process_count=process_count, pack=pack)
      for name, ex in val_sets.items()}

  def global_batch(local, stacked=False):
    return pipeline.to_global_batch(local, lambda k, v: sharding.batch_sharding(mesh, v.ndim, stacked=stacked))

  # Packed micro-batches come stacked: [grad_accum, rows, ...].
  stacked_train = pack is not None and grad_accum > 1

  # ------------------------------------------------------------------ update
  schedule_args = dict(learning_rate=config.train.learning_rate, warmup_steps=config.train.warmup_steps,
                       total_steps=total_steps, decay=config.train.lr_decay,
                       min_lr_ratio=config.train.min_lr_ratio)
  with _config_errors():
    schedule = optim.make_schedule(**schedule_args)
    tx = optim.make_optimizer(**schedule_args, weight_decay=config.train.weight_decay,
                              max_grad_norm=config.train.max_grad_norm)
  state, state_shardings = steps.init_state(nnx.state(model), tx, seed=config.train.seed, mesh=mesh)
  loss_fn = steps.make_loss_fn(model, spec)
  train_step = _CompiledPerShape("train step", steps.make_train_step(
      loss_fn, tx, schedule, grad_accum_steps=grad_accum, state_shardings=state_shardings, mesh=mesh))
  eval_step = _CompiledPerShape("eval step", steps.make_eval_step(loss_fn, mesh=mesh))

  # ------------------------------------------------------------------ checkpoint
  ckpt = None
  start_step = 0
  last_val: dict[str, float] = {}  # the latest validation results
  if config.checkpointing.enabled:
    with _config_errors():
      ckpt = checkpointing.Checkpointer(
          config.checkpointing.checkpoint_dir or os.path.join(out_dir, "checkpoints"),
          metric_name=metric_name, higher_is_better=config.checkpointing.higher_is_better,
          keep_top_k=config.checkpointing.keep_top_k)
    latest = ckpt.latest_step()
    if latest is not None:
      state, data_state, meta = ckpt.restore(latest, state)
      state = steps.set_step_and_rng(state, meta["step"], meta["rng"])
      train_iter.set_state(data_state)
      start_step, last_val = latest, meta.get("metrics") or {}
      log.info("resumed from step %d (%s)", latest, ckpt.directory)
    if is_main:
      _write_run_files(out_dir, config, rm)

  # ------------------------------------------------------------------ summary
  writer = MetricsWriter(out_dir, tensorboard=config.logger.tensorboard,
                         log_dir=config.logger.log_dir or os.path.join(out_dir, "tensorboard"), enabled=is_main,
                         resume_step=start_step)
  if is_main:
    all_drops = {"train": train_drops.as_dict(), **{f"validation-{n}": d.as_dict() for n, d in val_drops.items()}}
    with open(os.path.join(out_dir, "dropped_rows.json"), "w") as f:
      json.dump(all_drops, f, indent=2)
    tokens_per_step = gbs * sum(map(packing.packed_length, train_examples)) / len(train_examples)
    print(
        f"jaxrm: {rm.config.family} model {config.model.name_or_path}, {num_params / 1e6:.1f}M parameters, "
        f"{rm.config.dtype} compute / {rm.config.param_dtype} weights, {spec.type} loss\n"
        f"mesh: {dict(mesh.shape)} on {jax.device_count()} {jax.default_backend()} devices, {process_count} process(es)\n"
        f"data: {len(train_examples)} train examples ({stream.steps_per_epoch} steps/epoch), "
        + ", ".join(f"{n}: {len(v)}" for n, v in val_sets.items()) + " validation\n"
        f"{train_drops.summary('train')}\n"
        + "".join(f"{d.summary('validation-' + n)}\n" for n, d in val_drops.items())
        + f"steps: {start_step} -> {total_steps}, batch {gbs} groups (x{grad_accum} accumulation), "
        f"{tokens_per_step:.0f} tokens/step on average, {_describe_packing(pack, train_examples, gbs)}\n"
        f"output in {out_dir}", flush=True)

  # ------------------------------------------------------------------ evals
  def evaluate(step: int) -> dict[str, float]:
    t0 = time.time()
    results = {}
    for name, batches in val_batches.items():
      if config.eval.val_batches:
        batches = batches[:config.eval.val_batches]
      acc = None
      for b in batches:
        m = eval_step(state["params"], global_batch(b))
        acc = m if acc is None else accumulate(acc, m)
      for k, v in finalize_metrics(jax.device_get(acc)).items():
        results[f"validation-{name}_{k}"] = v
    results["timing/validation/total_validation_time"] = time.time() - t0
    if ckpt is not None and metric_name and metric_name not in results:
      raise UserError(f"checkpointing.metric_name={config.checkpointing.metric_name!r} is not a validation "
                      f"metric; available: {', '.join(sorted(results))}")
    writer.write(step, results)
    return results

  # ------------------------------------------------------------------ loop
  progress = _progress(config, start_step, total_steps, is_main)
  step = start_step
  try:
    if config.eval.val_at_start and start_step == 0:
      last_val = evaluate(0)
    if start_step >= total_steps:
      log.info("the run in %s has already reached step %d", out_dir, total_steps)
    while step < total_steps:
      t0 = time.time()
      local = next(train_iter)
      real_tokens, efficiency = _token_counts(local)
      state, (metrics, extra) = train_step(state, global_batch(local, stacked_train))
      step += 1
      m = finalize_metrics(jax.device_get(metrics))
      grad_norm, lr = (float(x) for x in jax.device_get((extra["grad_norm"], extra["learning_rate"])))
      step_time = time.time() - t0
      if not (math.isfinite(m["loss"]) and math.isfinite(grad_norm)):
        good = ckpt.latest_step() if ckpt is not None else None
        kept = f"step {good} in {ckpt.directory}" if good is not None else "none"
        raise UserError(
            f"non-finite loss ({m['loss']}) or gradient norm ({grad_norm}) at step {step}; stopping. "
            f"Last good checkpoint: {kept}. Try a lower train.learning_rate or train.max_grad_norm")
      if progress is not None:
        progress.update(1)
        progress.set_postfix(loss=f"{m['loss']:.4f}",
                             acc=f"{m.get('accuracy', m.get('step_accuracy', float('nan'))):.3f}")
      if step % config.train.log_period == 0 or step == total_steps or step == start_step + 1:
        row = {f"train/{k}": v for k, v in m.items()}
        row.update({"train/grad_norm": grad_norm, "train/learning_rate": lr, "timing/train/step_time": step_time,
                    "train/tokens_per_second": real_tokens * process_count / max(step_time, 1e-9),
                    "train/packing_efficiency": efficiency,
                    "train/epoch": step / stream.steps_per_epoch})
        writer.write(step, row)
      is_last = step == total_steps
      stopping = stop_after_steps is not None and step >= start_step + stop_after_steps
      fresh_val = None
      if (config.eval.val_period and step % config.eval.val_period == 0) or (is_last and config.eval.val_at_end):
        last_val = fresh_val = evaluate(step)
      save_period = config.checkpointing.save_period
      if ckpt is not None and ((save_period and step % save_period == 0) or is_last or stopping):
        meta = {"step": step, "rng": jax.device_get(state["rng"]).tolist(), "reward_stats": _reward_stats(last_val),
                "metrics": fresh_val or {}, "config": json.loads(config.to_json_best_effort())}
        ckpt.save(step, state, train_iter.get_state(), meta, metrics=fresh_val)
      if stopping:
        break
  finally:
    if progress is not None:
      progress.close()
    writer.close()
    if ckpt is not None:
      ckpt.close()
  return last_val


def _check_packing(config, stepwise: bool) -> None:
  mode, row_length = config.data.packing, config.data.packed_row_length
  if mode not in PACKING_MODES:
    raise UserError(f"data.packing must be one of {', '.join(PACKING_MODES)}; got {mode!r}")
  if row_length < 0:
    raise UserError(f"data.packed_row_length={row_length}: use a number of tokens per row, or 0 to "
                    "size rows from each batch's longest group")
  if mode == "none" and row_length:
    log.warning("data.packed_row_length=%d is ignored: data.packing is 'none'", row_length)
  if mode == "shared_prompt" and stepwise:
    raise UserError("data.packing='shared_prompt' writes a preference group's prompt once; stepwise "
                    "sequences have no group to share it: use data.packing='packed'")


def _pack_spec(config, num_completions: int | None, rows_multiple: int):
  """The ``PackSpec`` that ``data.packing`` and ``data.packed_row_length`` ask for; None: unpacked.

  Args:
    config: the run's config (checked by ``_check_packing``).
    num_completions: K of preference data; None for stepwise data.
    rows_multiple: each host's row count is rounded up to a multiple of this.
  """
  from jaxrm.data.packing import PackSpec
  mode, row_length = config.data.packing, config.data.packed_row_length
  if mode == "none":
    return None
  # Automatic rows fit a group of K completions of max_length tokens, and are as long as each
  # batch's longest group, in steps of bucket_multiple (few compiled shapes).
  return PackSpec(row_length=row_length or config.data.max_length * (num_completions or 1),
                  length_multiple=0 if row_length else config.data.bucket_multiple,
                  shared_prompt=mode == "shared_prompt", rows_multiple=rows_multiple)


def _check_row_length(pack, example_sets: dict[str, list]) -> None:
  """Stops before training if a group cannot fit in one packed row."""
  from jaxrm.data.packing import packed_length
  for name, examples in example_sets.items():
    need, source = max(((packed_length(e, pack.shared_prompt), e.source) for e in examples),
                       default=(0, ""))
    if need > pack.row_length:
      raise UserError(f"data.packed_row_length={pack.row_length} is too short for {source} ({name}), "
                      f"which takes {need} tokens in one row: set data.packed_row_length >= {need}, "
                      "or 0 to size rows automatically")


def _describe_packing(pack, train_examples, gbs: int) -> str:
  if pack is None:
    return "one sequence per row (data.packing=none)"
  rows = f"up to {pack.row_length}" if pack.length_multiple else f"{pack.row_length}"
  text = f"packed into rows of {rows} tokens"
  if pack.shared_prompt:
    from jaxrm.data.packing import packed_length
    shared = gbs * sum(packed_length(e, True) for e in train_examples) / len(train_examples)
    text += f", {shared:.0f} tokens/step once prompts are shared"
  return text


def _token_counts(batch) -> tuple[int, float]:
  """This host's batch: the tokens of its real sequences (each completion whole, shared prompt
  included, so that every data.packing counts alike), and the share of its token slots that hold
  a real token (the packing efficiency)."""
  import numpy as np
  mask = batch["attention_mask"]
  if "reward_positions" in batch:  # packed preferences: a completion ends at position length - 1
    ends = batch["reward_positions"]
    lengths = np.take_along_axis(batch["positions"], np.maximum(ends, 0), axis=-1) + 1
    return int(lengths[ends >= 0].sum()), float(mask.sum()) / mask.size
  if "token_index" in batch:  # packed sequences: fillers take no room
    return int(mask.sum()), float(mask.sum()) / mask.size
  # Unpacked: absent completions and filler groups repeat real rows; they are not counted.
  real_rows = batch["ranks"].reshape(-1) >= 0 if "ranks" in batch else batch["example_mask"] > 0
  tokens = int(mask[real_rows].sum())
  return tokens, tokens / mask.size


def _check_checkpointing(config, metric_name: str | None) -> None:
  if not metric_name:
    return
  sets = list(config.data.val_data_paths)
  if not any(metric_name.startswith(f"validation-{n}_") for n in sets):
    raise UserError(
        f"checkpointing.metric_name={config.checkpointing.metric_name!r} names no validation set; use "
        f"'validation-<set>_<metric>' with <set> one of {', '.join(sets) or '(none: data.val_data_paths is empty)'}, "
        "e.g. 'validation-default_loss' (or set it to '' to keep the latest checkpoints)")
  val_period, save_period = config.eval.val_period, config.checkpointing.save_period
  if save_period and (not val_period or save_period % val_period):
    log.warning("checkpointing.save_period=%d is not a multiple of eval.val_period=%d: checkpoints saved "
                "without a validation are kept only while they are the latest", save_period, val_period)


class _CompiledPerShape:
  """A jitted step compiled ahead of time once per batch shape, logging its memory use."""

  def __init__(self, name: str, jitted):
    self.name = name
    self._jitted = jitted
    self._compiled: dict[Any, Any] = {}

  def __call__(self, *args):
    batch = args[-1]
    key = tuple(sorted((k, v.shape) for k, v in batch.items()))
    compiled = self._compiled.get(key)
    if compiled is None:
      t0 = time.time()
      compiled = self._compiled[key] = self._jitted.lower(*args).compile()
      log.info("%s compiled for input_ids %s in %.1fs; %s", self.name, batch["input_ids"].shape,
               time.time() - t0, _memory(compiled))
    return compiled(*args)


def _memory(compiled) -> str:
  stats = compiled.memory_analysis()
  if stats is None:
    return "no memory analysis on this backend"
  mib = lambda n: f"{n / 2**20:.1f} MiB"
  return (f"per device: arguments {mib(stats.argument_size_in_bytes)}, outputs {mib(stats.output_size_in_bytes)}, "
          f"temporaries {mib(stats.temp_size_in_bytes)}, aliased {mib(stats.alias_size_in_bytes)}")


def _reward_stats(val: dict[str, float]) -> dict[str, float]:
  """Reward mean/std of the first validation set: scoring can normalise with them."""
  for key, value in val.items():
    if key.endswith("_reward_mean"):
      return {"mean": value, "std": val[key[:-len("mean")] + "std"], "from": key[:-len("_reward_mean")]}
  return {}


def _write_run_files(out_dir: str, config, rm) -> None:
  from jaxrm import checkpointing
  from jaxrm.models.config import to_hf_config
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  cfg = dataclasses.asdict(rm.config)
  with open(os.path.join(out_dir, checkpointing.RUN_MODEL_CONFIG), "w") as f:
    json.dump({"jaxrm": cfg, "hf": to_hf_config(rm.config)}, f, indent=2)
  tok_dir = os.path.join(out_dir, checkpointing.RUN_TOKENIZER_DIR)
  if not os.path.isdir(tok_dir):
    rm.tokenizer.save_pretrained(tok_dir)


def _progress(config, start: int, total: int, enabled: bool):
  if not (enabled and config.logger.progress_bar):
    return None
  from tqdm import tqdm
  return tqdm(total=total, initial=start, desc="train", dynamic_ncols=True, file=sys.stderr)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with config errors printed as one line naming the key."""
  _check_config_keys(argv)
  try:
    return FLAGS(argv)
  except flags.Error as e:  # a value of the wrong type, a config file that fails to load...
    message = str(e)
    if "Traceback" in message:  # the config file raised: keep the flag and the exception
      lines = [line.strip() for line in message.splitlines() if line.strip()]
      message = f"{lines[0]} {lines[-1]}"
    _exit_usage(message)


def _check_config_keys(argv: list[str]) -> None:
  """Stops at an override of a key the config lacks (config_flags would raise a bare KeyError)."""
  spec = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--config=")), None)
  if spec is None:
    return
  path, _, variant = spec.partition(":")
  if not os.path.isfile(path):
    _exit_usage(f"--config={spec}: no such config file {path!r}")
  try:
    config = _load_config(path, variant or None)
  except Exception:  # noqa: BLE001 -- reported by config_flags, with the file's own message
    return
  for arg in argv[1:]:
    name = arg.split("=", 1)[0]
    for prefix in ("--config.", "--noconfig."):
      if name.startswith(prefix):
        problem = _missing_key(config, name[len(prefix):])
        if problem:
          _exit_usage(f"{name}: {problem}")


def _load_config(path: str, variant: str | None):
  import importlib.util
  spec = importlib.util.spec_from_file_location("jaxrm_train_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant) if variant is not None else module.get_config()


def _missing_key(config, key: str) -> str | None:
  """Why ``key`` (dotted) is not a key of ``config``, or None if it is."""
  node, parts = config, key.split(".")
  for depth, part in enumerate(parts):
    if not hasattr(node, "keys") or part not in node:
      where = "config." + ".".join(parts[:depth]) if depth else "the config"
      has = ", ".join(sorted(node.keys())) if hasattr(node, "keys") else "no keys (it is a value)"
      return f"the config has no key {'.'.join(parts[:depth + 1])!r}; {where} has {has}"
    node = node[part]
  return None


def _exit_usage(message: str) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


def main(argv):
  if len(argv) > 1:
    _exit_usage(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
  for noisy in ("absl", "orbax", "jax._src", "tensorstore"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  if FLAGS.config is None:
    _exit_usage("--config is required, e.g. --config=configs/rm.py")
  initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  from jaxrm.errors import CheckpointError
  from jaxrm.errors import DataError
  from jaxrm.errors import UnsupportedModelError
  try:
    train_and_evaluate(FLAGS.config)
  except (UserError, DataError, CheckpointError, UnsupportedModelError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
