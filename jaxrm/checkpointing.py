"""A training run's Orbax checkpoints: saving, ranking and restoring them.

Each checkpoint holds four items: ``params`` (the trained parameters), ``opt_state``, ``data``
(the training iterator's state) and ``meta`` (step, RNG, reward statistics, metrics, config).
A LoRA run trains, and so saves, only its adapters and reward head (:mod:`jaxrm.loading` reads
its base from where it trained).
Orbax writes into a temporary directory and renames it when complete, so a crash mid-save leaves
the previous checkpoints intact; a checkpoint damaged afterwards (a truncated file, as a full disk
or a bad copy leaves it) raises :class:`DamagedCheckpointError` naming its step.
``best_checkpoint.json`` names the best step. What the run's other files say is
:mod:`jaxrm.loading`'s to read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxrm.errors import CheckpointError
from jaxrm.metrics import normalize_metric_name

log = logging.getLogger(__name__)

BEST_FILE = "best_checkpoint.json"
ITEMS = ("params", "opt_state", "data", "meta")


# What Orbax says when the restore target, not the files, is wrong (another model's shapes or tree).
_MISMATCH = ("not compatible with the stored shape", "tree structures do not match")


class DamagedCheckpointError(CheckpointError):
  """A checkpoint that Orbax lists but cannot read back; ``step`` names it."""

  def __init__(self, directory: str, step: int, cause: BaseException):
    super().__init__(
      f"{os.path.join(directory, str(step))}: the checkpoint of step {step} cannot be read "
      f"({_first_sentence(cause)}); it looks damaged (a truncated file, as a full disk or an "
      "interrupted copy leaves it)"
    )
    self.step = step


class _SettlingLoop(asyncio.SelectorEventLoop):
  """An event loop that, closed with tasks still pending, lets them finish first."""

  def close(self) -> None:
    pending = asyncio.all_tasks(self)
    if pending and not self.is_running():
      self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    super().close()


class _SettlingPolicy(asyncio.DefaultEventLoopPolicy):
  def new_event_loop(self) -> asyncio.AbstractEventLoop:
    return _SettlingLoop()


@contextlib.contextmanager
def _reads_settled():
  """Orbax restores in an event loop of its own and closes it as soon as one array's read fails,
  the other arrays' reads still in flight: they then end on tensorstore's threads in the closed
  loop, each printing a traceback ("Event loop is closed", "Exception ignored in: <coroutine
  _read_array_index_and_device_put>") after the error the user is to read. The loops Orbax makes
  within this block let those reads finish, their errors collected, before they close."""
  previous = asyncio.get_event_loop_policy()
  if isinstance(previous, _SettlingPolicy):  # a restore in another thread set it
    yield
    return
  asyncio.set_event_loop_policy(_SettlingPolicy())
  try:
    yield
  finally:
    asyncio.set_event_loop_policy(previous)


def _first_sentence(e: BaseException) -> str:
  text = (str(e).strip().splitlines() or [""])[0].split(" See full")[0]
  return f"{type(e).__name__}: {text[:160]}" if text else type(e).__name__


class Checkpointer:
  """Saves and restores training state under ``directory``.

  Keeps the latest checkpoint and the ``keep_top_k`` best by ``metric_name`` (lower is better
  unless ``higher_is_better``); without a metric, the ``keep_top_k`` latest. A checkpoint saved
  without metrics is kept only while it is the latest. ``metric_name`` is the metric's key in the
  validation results (``validation-default_loss``; NeMo RL's ``val:`` form too), which the
  trainer checks before each save.
  """

  def __init__(
    self,
    directory: str,
    *,
    metric_name: str | None = None,
    higher_is_better: bool = False,
    keep_top_k: int = 3,
  ):
    if keep_top_k < 1:
      raise ValueError(f"checkpointing.keep_top_k={keep_top_k} must be at least 1")
    self.directory = os.path.abspath(directory)
    self.metric_name = normalize_metric_name(metric_name)
    self.higher_is_better = higher_is_better
    best_fn = None
    policies: list[Any] = [ocp.checkpoint_managers.LatestN(n=1)]
    if self.metric_name:
      best_fn = lambda m: m[self.metric_name]
      policies.append(
        ocp.checkpoint_managers.BestN(
          get_metric_fn=best_fn,
          reverse=not higher_is_better,
          n=keep_top_k,
          keep_checkpoints_without_metrics=False,
        )
      )
    else:
      policies.append(ocp.checkpoint_managers.LatestN(n=keep_top_k))
    # best_fn also makes Orbax store each step's metrics, so the ranking survives a restart.
    options = ocp.CheckpointManagerOptions(
      preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
      best_fn=best_fn,
      best_mode="max" if higher_is_better else "min",
      enable_async_checkpointing=False,
      create=True,
    )
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

  def save(
    self, step: int, state: dict, data_state: dict, meta: dict, metrics: dict[str, float] | None = None
  ) -> None:
    """Saves ``state`` (``params``: nnx.State, ``opt_state``), the data iterator's state and ``meta``.

    ``metrics`` (validation results of this very step, or None) rank the checkpoint.
    """
    from flax import nnx

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
    info = {
      "step": best,
      "path": os.path.join(self.directory, str(best)),
      "metric_name": self.metric_name,
      "value": metrics.get(self.metric_name) if metrics else None,
      "higher_is_better": self.higher_is_better,
    }
    tmp = os.path.join(self.directory, BEST_FILE + ".tmp")
    with open(tmp, "w") as f:
      json.dump(info, f, indent=2)
    os.replace(tmp, os.path.join(self.directory, BEST_FILE))

  def restore(self, step: int, state: dict) -> tuple[dict, dict, dict]:
    """Restores into the structure and shardings of ``state`` (a live train state).

    Returns ``(state, data_state, meta)``; ``state["params"]`` is updated in place.
    """
    from flax import nnx

    restored = self._restore(
      step,
      params=ocp.args.StandardRestore(_abstract(nnx.to_pure_dict(state["params"]))),
      opt_state=ocp.args.StandardRestore(_abstract(state["opt_state"])),
      data=ocp.args.JsonRestore(),
      meta=ocp.args.JsonRestore(),
    )
    params = state["params"]
    nnx.replace_by_pure_dict(params, restored["params"])
    return dict(state, params=params, opt_state=restored["opt_state"]), restored["data"], restored["meta"]

  def restore_params(self, step: int, abstract_params: dict) -> tuple[dict, dict]:
    """Only the parameters (a pure dict shaped like ``abstract_params``) and ``meta``, for scoring."""
    restored = self._restore(
      step, params=ocp.args.StandardRestore(abstract_params), meta=ocp.args.JsonRestore()
    )
    return restored["params"], restored["meta"]

  def _restore(self, step: int, **items):
    try:
      with _reads_settled():
        return self.manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # tensorstore/Orbax errors of a file cut short or missing
      if any(m in str(e) for m in _MISMATCH):
        raise CheckpointError(
          f"{os.path.join(self.directory, str(step))} does not fit the model restored "
          f"into it ({_first_sentence(e)})"
        ) from None
      raise DamagedCheckpointError(self.directory, step, e) from None

  def set_aside(self, step: int) -> str:
    """Moves a damaged checkpoint out of Orbax's sight, to ``<step>.damaged``; returns its new path.

    Its step is then free for a new save; nothing is deleted.
    """
    path = os.path.join(self.directory, str(step))
    aside = f"{path}.damaged"
    if jax.process_index() == 0:
      n = 1
      while os.path.exists(aside):
        n += 1
        aside = f"{path}.damaged{n}"
      os.rename(path, aside)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      multihost_utils.sync_global_devices(f"jaxrm: set aside checkpoint {step}")
    self.manager.reload()
    return aside

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
