"""A training run's directory: its Orbax checkpoints, and the files that say how to load them.

A run's output directory holds ``config.json`` (the training config), ``model_config.json``
(the :class:`~jaxrm.models.config.ModelConfig` and its HF form), ``tokenizer/`` and the checkpoint
directory (``checkpoints/`` unless ``checkpointing.checkpoint_dir``). :func:`write_run_files` writes
the first three; :func:`find_run` and :func:`restore_for_scoring` read them back.

Each checkpoint holds four items: ``params`` (the trained parameters), ``opt_state``, ``data``
(the training iterator's state) and ``meta`` (step, RNG, reward statistics, metrics, config).
A LoRA run trains, and so saves, only its adapters and reward head: its frozen base stays in the
HF checkpoint or GGUF file that ``model_config.json`` names (``base_model``), and is read from
there on resume and for scoring.
Orbax writes into a temporary directory and renames it when complete, so a crash mid-save leaves
the previous checkpoints intact. ``best_checkpoint.json`` names the best step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint._src.checkpoint_managers import preservation_policy as pp

from jaxrm.config import normalize_metric_name
from jaxrm.errors import CheckpointError
from jaxrm.models.config import ModelConfig, config_from_dict, to_hf_config

log = logging.getLogger(__name__)

RUN_CONFIG = "config.json"
RUN_MODEL_CONFIG = "model_config.json"
RUN_TOKENIZER_DIR = "tokenizer"
BEST_FILE = "best_checkpoint.json"
ITEMS = ("params", "opt_state", "data", "meta")


class Checkpointer:
  """Saves and restores training state under ``directory``.

  Keeps the latest checkpoint and the ``keep_top_k`` best by ``metric_name`` (lower is better
  unless ``higher_is_better``); without a metric, the ``keep_top_k`` latest. A checkpoint saved
  without metrics is kept only while it is the latest.
  """

  def __init__(self, directory: str, *, metric_name: str | None = None, higher_is_better: bool = False,
               keep_top_k: int = 3):
    if keep_top_k < 1:
      raise ValueError(f"checkpointing.keep_top_k={keep_top_k} must be at least 1")
    self.directory = os.path.abspath(directory)
    self.metric_name = normalize_metric_name(metric_name)
    self.higher_is_better = higher_is_better
    best_fn = None
    policies: list[Any] = [pp.LatestN(n=1)]
    if self.metric_name:
      best_fn = lambda m: m[self.metric_name]
      policies.append(pp.BestN(get_metric_fn=best_fn, reverse=not higher_is_better, n=keep_top_k,
                               keep_checkpoints_without_metrics=False))
    else:
      policies.append(pp.LatestN(n=keep_top_k))
    # best_fn also makes Orbax store each step's metrics, so the ranking survives a restart.
    options = ocp.CheckpointManagerOptions(
        preservation_policy=pp.AnyPreservationPolicy(policies), best_fn=best_fn,
        best_mode="max" if higher_is_better else "min", enable_async_checkpointing=False, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def best_step(self) -> int | None:
    """The best step by the metric; the latest when no metric is set or none was recorded yet."""
    if self.metric_name:
      best = self.manager.best_step()
      if best is not None:
        return best
    return self.latest_step()

  def best_by_metric(self) -> tuple[int, float] | None:
    """(step, value of the metric) of the best ranked checkpoint; None when none is ranked yet."""
    step = self.manager.best_step() if self.metric_name else None
    if step is None:
      return None
    return step, (self.manager.metrics(step) or {}).get(self.metric_name, math.nan)

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state: dict, data_state: dict, meta: dict,
           metrics: dict[str, float] | None = None) -> None:
    """Saves ``state`` (``params``: nnx.State, ``opt_state``), the data iterator's state and ``meta``.

    ``metrics`` (validation results of this very step, or None) rank the checkpoint.
    """
    from flax import nnx
    if self.metric_name and metrics is not None and self.metric_name not in metrics:
      raise ValueError(
          f"checkpointing.metric_name {self.metric_name!r} is not a validation metric; "
          f"available: {', '.join(sorted(metrics))}")
    args = ocp.args.Composite(
        params=ocp.args.StandardSave(nnx.to_pure_dict(state["params"])),
        opt_state=ocp.args.StandardSave(state["opt_state"]),
        data=ocp.args.JsonSave(data_state),
        meta=ocp.args.JsonSave(meta),
    )
    self.manager.save(step, args=args, metrics=metrics, force=True)
    self.manager.wait_until_finished()
    if jax.process_index() == 0:
      self._write_best()

  def _write_best(self) -> None:
    best = self.best_step()
    if best is None:
      return
    metrics = self.manager.metrics(best) if self.metric_name else None
    info = {"step": best, "path": os.path.join(self.directory, str(best)), "metric_name": self.metric_name,
            "value": metrics.get(self.metric_name) if metrics else None,
            "higher_is_better": self.higher_is_better}
    tmp = os.path.join(self.directory, BEST_FILE + ".tmp")
    with open(tmp, "w") as f:
      json.dump(info, f, indent=2)
    os.replace(tmp, os.path.join(self.directory, BEST_FILE))

  def restore(self, step: int, state: dict) -> tuple[dict, dict, dict]:
    """Restores into the structure and shardings of ``state`` (a live train state).

    Returns ``(state, data_state, meta)``; ``state["params"]`` is updated in place.
    """
    from flax import nnx
    restored = self.manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(_abstract(nnx.to_pure_dict(state["params"]))),
        opt_state=ocp.args.StandardRestore(_abstract(state["opt_state"])),
        data=ocp.args.JsonRestore(),
        meta=ocp.args.JsonRestore(),
    ))
    params = state["params"]
    nnx.replace_by_pure_dict(params, restored["params"])
    return dict(state, params=params, opt_state=restored["opt_state"]), restored["data"], restored["meta"]

  def restore_params(self, step: int, abstract_params: dict) -> tuple[dict, dict]:
    """Only the parameters (a pure dict shaped like ``abstract_params``) and ``meta``, for scoring."""
    restored = self.manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_params), meta=ocp.args.JsonRestore()))
    return restored["params"], restored["meta"]

  def close(self) -> None:
    self.manager.close()


def read_best(directory: str) -> dict | None:
  """``best_checkpoint.json`` of a checkpoint directory (step, path, metric), or None if absent."""
  path = os.path.join(directory, BEST_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


# ------------------------------------------------------------------ run directories


def write_run_files(out_dir: str, *, config_json: str, model_config: ModelConfig, tokenizer: Any,
                    base_model: str | None = None) -> None:
  """Writes what loading a run needs besides its checkpoints.

  Args:
    out_dir: the run's output directory.
    config_json: the training config as JSON (``config.json``).
    model_config: the model trained (``model_config.json``: ``{"jaxrm": asdict, "hf": to_hf_config}``).
    tokenizer: saved under ``tokenizer/`` unless a resumed run already saved it there.
    base_model: a LoRA run's frozen base (an HF directory, .gguf file or hub name), whose weights
      its checkpoints leave out (``model_config.json``'s ``base_model``).
  """
  with open(os.path.join(out_dir, RUN_CONFIG), "w") as f:
    f.write(config_json)
  saved = {"jaxrm": dataclasses.asdict(model_config), "hf": to_hf_config(model_config)}
  if base_model is not None:
    saved["base_model"] = base_model
  with open(os.path.join(out_dir, RUN_MODEL_CONFIG), "w") as f:
    json.dump(saved, f, indent=2)
  tok_dir = os.path.join(out_dir, RUN_TOKENIZER_DIR)
  if not os.path.isdir(tok_dir):
    tokenizer.save_pretrained(tok_dir)


def is_run_dir(path: str) -> bool:
  """Whether ``path`` is a training output directory (it holds ``model_config.json``)."""
  return os.path.isfile(os.path.join(path, RUN_MODEL_CONFIG))


@dataclasses.dataclass(frozen=True)
class RunCheckpoint:
  """Where a training run keeps its files, and the step a checkpoint path names (if any).

  Attributes:
    run_dir: has ``model_config.json`` and ``tokenizer/``.
    checkpoint_dir: the Orbax directory: ``<step>/{params,opt_state,data,meta}``.
    step: the step of a path naming one checkpoint, else None.
    settings: the run's training config (``config.json``), or {} when it is missing.
  """

  run_dir: str
  checkpoint_dir: str
  step: int | None = None
  settings: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

  @property
  def tokenizer_dir(self) -> str:
    return os.path.join(self.run_dir, RUN_TOKENIZER_DIR)

  def model_config(self) -> ModelConfig:
    """The :class:`ModelConfig` the run trained (from ``model_config.json``)."""
    path = os.path.join(self.run_dir, RUN_MODEL_CONFIG)
    return config_from_dict(self._saved_model()["jaxrm"], path)

  def base_model(self) -> str:
    """Where a LoRA run's frozen base is (its checkpoints hold only the adapters and the head)."""
    base = self._saved_model().get("base_model") or self.settings.get("model", {}).get("name_or_path")
    if not base:
      raise CheckpointError(f"{self.run_dir}: {RUN_MODEL_CONFIG} names no base model for the LoRA adapters "
                            "(and config.json has no model.name_or_path)")
    return base

  def _saved_model(self) -> dict[str, Any]:
    with open(os.path.join(self.run_dir, RUN_MODEL_CONFIG)) as f:
      return json.load(f)


def find_run(path: str) -> RunCheckpoint | None:
  """The run behind ``path`` when it is a training output directory or one of its checkpoints."""
  if is_run_dir(path):
    return _run(path)
  norm = os.path.normpath(os.path.abspath(path))
  if os.path.basename(norm).isdigit() and os.path.isdir(os.path.join(norm, "params")):
    checkpoint_dir = os.path.dirname(norm)
    run_dir = os.path.dirname(checkpoint_dir)
    if not is_run_dir(run_dir):
      raise CheckpointError(
          f"{path} is a training checkpoint, but {run_dir} has no {RUN_MODEL_CONFIG}; load the run's "
          f"output directory (the one holding {RUN_MODEL_CONFIG}) with step={os.path.basename(norm)}")
    return dataclasses.replace(_run(run_dir), checkpoint_dir=checkpoint_dir, step=int(os.path.basename(norm)))
  return None


def _run(run_dir: str) -> RunCheckpoint:
  settings = _run_settings(run_dir)
  custom = settings.get("checkpointing", {}).get("checkpoint_dir")
  return RunCheckpoint(run_dir, custom or os.path.join(run_dir, "checkpoints"), settings=settings)


def _run_settings(run_dir: str) -> dict[str, Any]:
  path = os.path.join(run_dir, RUN_CONFIG)
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    return json.load(f)


def restore_for_scoring(run: RunCheckpoint, step: int | None, target: dict) -> tuple[dict, dict]:
  """The saved parameters and ``meta`` of one checkpoint of ``run``.

  Args:
    run: from :func:`find_run`.
    step: the step to load; default: the step ``run`` names, else the best (``best_checkpoint.json``,
      else Orbax's best by the run's metric, else the latest).
    target: pure dict of ``jax.ShapeDtypeStruct``s (with shardings) shaped like the saved
      parameters: the whole model's, or for a LoRA run only the trained ones (adapters and head,
      ``lora.trainable_filter``).
  """
  if not os.path.isdir(run.checkpoint_dir):
    raise CheckpointError(f"{run.run_dir}: no checkpoint directory {run.checkpoint_dir} "
                          "(training writes checkpoints there when checkpointing.enabled is true)")
  ckpt_settings = run.settings.get("checkpointing", {})
  ckpt = Checkpointer(run.checkpoint_dir, metric_name=ckpt_settings.get("metric_name"),
                      higher_is_better=bool(ckpt_settings.get("higher_is_better", False)))
  try:
    return ckpt.restore_params(_pick_step(ckpt, run, step), target)
  finally:
    ckpt.close()


def _pick_step(ckpt: Checkpointer, run: RunCheckpoint, step: int | None) -> int:
  if run.step is not None and step is not None and step != run.step:
    raise CheckpointError(f"{run.checkpoint_dir}/{run.step} is the checkpoint of step {run.step}, "
                          f"but step={step} was asked for; pass one or the other")
  steps = ckpt.all_steps()
  if not steps:
    raise CheckpointError(f"{run.checkpoint_dir}: no complete checkpoint yet (training saves one every "
                          "checkpointing.save_period steps and at the end)")
  step = run.step if run.step is not None else step
  if step is None:
    best = read_best(ckpt.directory)
    # Without the file: Orbax's best by the run's metric, or the latest when none has it.
    step = int(best["step"]) if best is not None else ckpt.best_step()
    log.info("loading the best checkpoint of %s: step %s", run.run_dir, step)
  if step not in steps:
    raise CheckpointError(f"{run.checkpoint_dir}: no checkpoint for step {step}; available steps: "
                          f"{', '.join(map(str, steps))}")
  return step
