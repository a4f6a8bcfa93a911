"""Orbax checkpoints of a training run: the latest (to resume) and the best k (by a metric).

Each checkpoint holds four items: ``params`` (the model's parameters), ``opt_state``, ``data``
(the training iterator's state) and ``meta`` (step, RNG, reward statistics, metrics, config).
Orbax writes into a temporary directory and renames it when complete, so a crash mid-save leaves
the previous checkpoints intact. ``best_checkpoint.json`` names the best step.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint._src.checkpoint_managers import preservation_policy as pp

RUN_MODEL_CONFIG = "model_config.json"
RUN_TOKENIZER_DIR = "tokenizer"
BEST_FILE = "best_checkpoint.json"
ITEMS = ("params", "opt_state", "data", "meta")


def normalize_metric_name(name: str | None) -> str | None:
  """Accepts NeMo RL's ``val:validation-default_loss`` form as well as ``validation-default_loss``."""
  if not name:
    return None
  for prefix in ("val:", "val/", "validation/"):
    if name.startswith(prefix):
      name = name[len(prefix):]
  return name


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
