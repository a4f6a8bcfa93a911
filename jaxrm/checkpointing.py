"""Orbax checkpoints of a training run: the latest (to resume) and the best k (by a metric).

Each checkpoint holds four items: ``params`` (the model's parameters), ``opt_state``, ``data``
(the training iterator's state) and ``meta`` (step, RNG, reward statistics, metrics). Orbax writes
into a temporary directory and renames it when complete, so a crash mid-save leaves the previous
checkpoints intact.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint._src.checkpoint_managers import preservation_policy as pp

from jaxrm.data.errors import DataError

RUN_MODEL_CONFIG = "model_config.json"
RUN_TOKENIZER_DIR = "tokenizer"
BEST_FILE = "best_checkpoint.json"


def normalize_metric_name(name: str | None) -> str | None:
  """Accepts NeMo RL's ``val:validation-default_loss`` form as well as ``validation-default_loss``."""
  if not name:
    return None
  for prefix in ("val:", "val/", "validation/"):
    if name.startswith(prefix):
      name = name[len(prefix):]
  return name


class Checkpointer:
  """Saves and restores training state under ``directory``."""

  def __init__(self, directory: str, *, metric_name: str | None = None, higher_is_better: bool = False,
               keep_top_k: int = 3, save_period: int = 0):
    self.directory = os.path.abspath(directory)
    self.metric_name = normalize_metric_name(metric_name)
    self.higher_is_better = higher_is_better
    self.save_period = save_period
    policies: list[Any] = [pp.LatestN(n=1)]
    if self.metric_name:
      policies.append(pp.BestN(get_metric_fn=lambda m: m[self.metric_name], reverse=not higher_is_better,
                               n=keep_top_k, keep_checkpoints_without_metrics=False))
    else:
      policies.append(pp.LatestN(n=keep_top_k))
    options = ocp.CheckpointManagerOptions(preservation_policy=pp.AnyPreservationPolicy(policies),
                                           enable_async_checkpointing=False, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("params", "opt_state", "data", "meta"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def best_step(self) -> int | None:
    return self.manager.best_step() if self.metric_name else self.latest_step()

  def save(self, step: int, state: dict, data_state: dict, meta: dict, metrics: dict | None = None) -> None:
    from flax import nnx
    if self.metric_name and metrics is not None and self.metric_name not in metrics:
      raise DataError(
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
    info = {"step": best, "path": os.path.join(self.directory, str(best)), "metric_name": self.metric_name}
    tmp = os.path.join(self.directory, BEST_FILE + ".tmp")
    with open(tmp, "w") as f:
      json.dump(info, f, indent=2)
    os.replace(tmp, os.path.join(self.directory, BEST_FILE))

  def restore(self, step: int, state: dict) -> tuple[dict, dict, dict]:
    """Restores into the structure and shardings of ``state`` (a live or abstract train state)."""
    from flax import nnx
    abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    params_target = abstract(nnx.to_pure_dict(state["params"]))
    restored = self.manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(params_target),
        opt_state=ocp.args.StandardRestore(abstract(state["opt_state"])),
        data=ocp.args.JsonRestore(),
        meta=ocp.args.JsonRestore(),
    ))
    params = state["params"]
    nnx.replace_by_pure_dict(params, restored["params"])
    new_state = dict(state, params=params, opt_state=restored["opt_state"])
    return new_state, restored["data"], restored["meta"]

  def restore_params(self, step: int, abstract_params_dict: dict) -> dict:
    """Only the parameters (as a pure dict), for scoring and export."""
    restored = self.manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_params_dict), meta=ocp.args.JsonRestore()))
    return restored["params"], restored["meta"]

  def close(self) -> None:
    self.manager.close()
