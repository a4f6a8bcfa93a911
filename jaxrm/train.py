r"""Trains a reward model.

  python -m jaxrm.train --config=configs/rm.py [--config.train.max_steps=200 ...]

Rerunning the same command continues from the latest checkpoint in the output directory.
Multi-host: under Slurm ``jax.distributed`` is initialised from the environment; elsewhere pass
``--coordinator_address=host:port --num_processes=N --process_id=i``.
"""

from __future__ import annotations

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


class UserError(Exception):
  """A problem with the user's config or data: printed without a traceback."""


def _initialize_distributed(coordinator_address=None, num_processes=None, process_id=None) -> None:
  import jax
  if coordinator_address:
    if jax.default_backend() == "cpu" or os.environ.get("JAX_PLATFORMS", "") == "cpu":
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
  elif int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
    jax.distributed.initialize()  # Slurm cluster auto-detection


def train_and_evaluate(config, *, stop_after_steps: int | None = None) -> dict[str, Any]:
  """Runs training as ``config`` says; returns the last validation metrics.

  Library entry point (the CLI and notebooks call it). ``stop_after_steps`` ends the run early
  without marking it finished (used to test resumption).
  """
  import jax
  import numpy as np
  import optax
  from flax import nnx

  from jaxrm import checkpointing, optim, sharding, steps
  from jaxrm.data import datasets, pipeline
  from jaxrm.data.errors import DataError, DropReport
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
  mesh = sharding.make_mesh(sharding.MeshConfig(config.mesh.data, config.mesh.fsdp, config.mesh.tensor))
  data_parallel = mesh.shape["data"] * mesh.shape["fsdp"]

  # ------------------------------------------------------------------ model
  spec = steps.RewardSpec(config.reward.type, config.reward.ranking_loss, config.reward.center_rewards_coefficient)
  stepwise = spec.type == "stepwise"
  rm = RewardModel.from_pretrained(
      config.model.name_or_path, dtype=config.model.dtype, param_dtype=config.model.param_dtype,
      head="token" if stepwise else "sequence", mesh=mesh, seed=config.model.seed,
      remat=config.model.remat)
  model, tokenizer = rm.model, rm.tokenizer
  if tokenizer is None:
    raise UserError(f"model.name_or_path={config.model.name_or_path!r} has no tokenizer files")
  num_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))

  # ------------------------------------------------------------------ input
  if datasets.is_stepwise(config.data.dataset_name) != stepwise:
    raise UserError(f"reward.type={spec.type!r} does not fit data.dataset_name={config.data.dataset_name!r} "
                    f"({'stepwise' if not stepwise else 'preference'} data)")
  opts = TokenizeOptions(max_length=config.data.max_length, truncation=config.data.truncation,
                         step_separator=config.data.step_separator,
                         train_on_last_step_only=config.data.train_on_last_step_only)
  buckets = pipeline.length_buckets(config.data.max_length, config.data.bucket_multiple)
  pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

  def load(path, split, limit, drops):
    records = datasets.load_records(config.data.dataset_name, path or None, split=split, drops=drops)
    if limit:
      records = records[:limit]
    return tokenize_all(records, tokenizer, opts, drops)

  train_drops = DropReport()
  train_examples = load(config.data.train_data_path, "train", config.data.max_train_rows, train_drops)
  val_sets, val_drops = {}, {}
  for name, path in config.data.val_data_paths.items():
    datasets.check_val_set_name(name)
    val_drops[name] = DropReport()
    val_sets[name] = load(path, "validation", config.data.max_val_rows, val_drops[name])
  num_completions = None if stepwise else max(
      pipeline.max_completions(train_examples), *(pipeline.max_completions(v) for v in val_sets.values() if v))

  gbs, mbs = config.train.global_batch_size, config.train.micro_batch_size
  if gbs % (mbs * data_parallel):
    raise UserError(f"train.global_batch_size={gbs} must be a multiple of micro_batch_size x data-parallel "
                    f"devices = {mbs} x {data_parallel}")
  if gbs % process_count:
    raise UserError(f"train.global_batch_size={gbs} must be divisible by the {process_count} processes")
  grad_accum = gbs // (mbs * data_parallel)
  train_iter, stream = pipeline.make_train_iterator(
      train_examples, batch_size=gbs // process_count, seed=config.data.shuffle_seed, buckets=buckets,
      pad_id=pad_id, num_completions=num_completions, process_index=process_index,
      process_count=process_count, num_workers=config.data.num_workers)
  total_steps = min(config.train.max_steps, config.train.max_epochs * stream.steps_per_epoch)
  eval_bs = max(config.eval.batch_size // data_parallel, 1) * data_parallel
  val_batches = {
      name: pipeline.make_eval_batches(ex, batch_size=eval_bs // process_count, buckets=buckets, pad_id=pad_id,
                                       num_completions=num_completions, process_index=process_index,
                                       process_count=process_count)
      for name, ex in val_sets.items() if ex}
  for name, ex in val_sets.items():
    if not ex:
      raise UserError(f"validation set {name!r} has no usable rows\n{val_drops[name].summary(name)}")

  def global_batch(local):
    return pipeline.to_global_batch(local, lambda k, v: sharding.batch_sharding(mesh, v.ndim))

  # ------------------------------------------------------------------ update
  schedule = optim.make_schedule(learning_rate=config.train.learning_rate, warmup_steps=config.train.warmup_steps,
                                 total_steps=total_steps, decay=config.train.lr_decay,
                                 min_lr_ratio=config.train.min_lr_ratio)
  tx = optim.make_optimizer(learning_rate=config.train.learning_rate, warmup_steps=config.train.warmup_steps,
                            total_steps=total_steps, decay=config.train.lr_decay,
                            min_lr_ratio=config.train.min_lr_ratio, weight_decay=config.train.weight_decay,
                            max_grad_norm=config.train.max_grad_norm)
  params = nnx.state(model)
  state = {
      "params": params,
      "opt_state": jax.jit(tx.init)(params),
      "step": jax.numpy.zeros((), jax.numpy.int32),
      "rng": jax.random.key_data(jax.random.key(config.train.seed)),
  }
  state_shardings = jax.tree.map(lambda x: x.sharding, state)
  loss_fn = steps.make_loss_fn(model, spec)
  train_step = steps.make_train_step(loss_fn, tx, schedule, grad_accum_steps=grad_accum,
                                     state_shardings=state_shardings)
  eval_step = steps.make_eval_step(loss_fn)

  # ------------------------------------------------------------------ checkpoint
  ckpt = None
  start_step = 0
  if config.checkpointing.enabled:
    ckpt = checkpointing.Checkpointer(
        config.checkpointing.checkpoint_dir or os.path.join(out_dir, "checkpoints"),
        metric_name=config.checkpointing.metric_name, higher_is_better=config.checkpointing.higher_is_better,
        keep_top_k=config.checkpointing.keep_top_k)
    latest = ckpt.latest_step()
    if latest is not None:
      state, data_state, meta = ckpt.restore(latest, state)
      train_iter.set_state(data_state)
      start_step = latest
      log.info("resumed from step %d (%s)", latest, ckpt.directory)
    if is_main:
      _write_run_files(out_dir, config, rm)

  # ------------------------------------------------------------------ summary
  writer = MetricsWriter(out_dir, tensorboard=config.logger.tensorboard,
                         log_dir=config.logger.log_dir or os.path.join(out_dir, "tensorboard"), enabled=is_main)
  all_drops = {"train": train_drops.as_dict(), **{f"validation-{n}": d.as_dict() for n, d in val_drops.items()}}
  if is_main:
    with open(os.path.join(out_dir, "dropped_rows.json"), "w") as f:
      json.dump(all_drops, f, indent=2)
    tokens_per_step = gbs * (num_completions or 1) * config.data.max_length
    print(
        f"jaxrm: {rm.config.family} model {config.model.name_or_path}, {num_params / 1e6:.1f}M parameters, "
        f"{rm.config.dtype} compute / {rm.config.param_dtype} weights, {spec.type} loss\n"
        f"mesh: {dict(mesh.shape)} on {jax.device_count()} {jax.default_backend()} devices, {process_count} process(es)\n"
        f"data: {len(train_examples)} train examples ({stream.steps_per_epoch} steps/epoch), "
        + ", ".join(f"{n}: {len(v)}" for n, v in val_sets.items()) + " validation\n"
        f"{train_drops.summary('train')}\n"
        + "".join(f"{d.summary('validation-' + n)}\n" for n, d in val_drops.items())
        + f"steps: {start_step} -> {total_steps}, batch {gbs} groups (x{grad_accum} accumulation), "
        f"up to {tokens_per_step} tokens/step, output in {out_dir}", flush=True)

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
    writer.write(step, results)
    return results

  # ------------------------------------------------------------------ loop
  last_val: dict[str, float] = {}
  if config.eval.val_at_start and start_step == 0:
    last_val = evaluate(0)
  progress = _progress(config, start_step, total_steps, is_main)
  t_last = time.time()
  step = start_step
  while step < total_steps:
    local = next(train_iter)
    real_tokens = int(local["attention_mask"].sum()) * process_count
    batch = global_batch(local)
    state, (metrics, extra) = train_step(state, batch)
    step += 1
    m = finalize_metrics(jax.device_get(metrics))
    extra = jax.device_get(extra)
    if not (math.isfinite(m["loss"]) and math.isfinite(float(extra["grad_norm"]))):
      raise UserError(
          f"non-finite loss ({m['loss']}) or gradient norm ({float(extra['grad_norm'])}) at step {step}; "
          f"stopping. The last good checkpoint is kept in {ckpt.directory if ckpt else out_dir} "
          "(try a lower train.learning_rate or train.max_grad_norm)")
    now = time.time()
    if progress is not None:
      progress.update(1)
      progress.set_postfix(loss=f"{m['loss']:.4f}",
                           acc=f"{m.get('accuracy', m.get('step_accuracy', float('nan'))):.3f}")
    if step % config.train.log_period == 0 or step == total_steps or step == start_step + 1:
      row = {f"train/{k}": v for k, v in m.items()}
      row.update({"train/grad_norm": float(extra["grad_norm"]), "train/learning_rate": float(extra["learning_rate"]),
                  "timing/train/step_time": now - t_last, "train/tokens_per_second": real_tokens / max(now - t_last, 1e-9),
                  "train/epoch": step / stream.steps_per_epoch})
      writer.write(step, row)
    t_last = now
    is_last = step == total_steps
    if (config.eval.val_period and step % config.eval.val_period == 0) or (is_last and config.eval.val_at_end):
      last_val = evaluate(step)
    if ckpt is not None and ((config.checkpointing.save_period and step % config.checkpointing.save_period == 0)
                             or is_last):
      meta = {"step": step, "reward_stats": _reward_stats(last_val), "metrics": last_val}
      ckpt.save(step, state, train_iter.get_state(), meta, metrics=last_val or None)
    if stop_after_steps is not None and step >= start_step + stop_after_steps:
      break
  if progress is not None:
    progress.close()
  writer.close()
  if ckpt is not None:
    ckpt.close()
  return last_val


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


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
  for noisy in ("absl", "orbax", "jax._src", "tensorstore"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  if FLAGS.config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/rm.py")
  _initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  from jaxrm.checkpoints.weight_map import CheckpointError
  from jaxrm.data.errors import DataError
  from jaxrm.models.config import UnsupportedModelError
  try:
    train_and_evaluate(FLAGS.config)
  except (UserError, DataError, CheckpointError, UnsupportedModelError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
