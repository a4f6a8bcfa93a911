"""A training run's Orbax checkpoints: saving, ranking and restoring them.

Each checkpoint holds four items: ``params`` (the trained parameters), ``opt_state``, ``data``
(the training iterator's state) and ``meta`` (step, RNG, reward statistics, metrics, config).
A LoRA run trains, and so saves, only its adapters and reward head (:mod:`jaxrm.scoring.loading` reads
its base from where it trained).
Orbax writes into a temporary directory and renames it when complete, so a crash mid-save leaves
the previous checkpoints intact; a save the file system refuses (no room, too many open files, no
permission) raises :class:`SaveRefusedError` (:class:`NoRoomError` for room) and leaves nothing of
itself. Each step's :data:`CHECKSUMS` file, written last, holds every other file's size and CRC32:
a checkpoint damaged afterwards (a truncated file, a flipped byte, an emptied value, as a full disk
or a bad copy leaves it) raises :class:`DamagedCheckpointError` naming its step and the file,
instead of loading wrong values. The checksums are never optional: a step's ``meta`` says it was
saved with them (:data:`WITH_CHECKSUMS`), so a step without its list (a process killed between
Orbax's commit and the list, or a copy that left it out) is damaged too. Only a checkpoint whose
``meta`` lacks that mark, saved before jaxrm wrote checksums, is read unverified.
``best_checkpoint.json`` names the best step. What the run's other files say is
:mod:`jaxrm.scoring.loading`'s to read.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import logging
import math
import os
import shutil
import tempfile
import time
import zlib
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxrm.errors import CheckpointError
from jaxrm.run import refused_writes
from jaxrm.run.metrics import normalize_metric_name

log = logging.getLogger(__name__)

BEST_FILE = "best_checkpoint.json"
# In each step's directory, written last: every other file's size and CRC32, checked before a
# restore (Orbax's files carry no checksum: a flipped byte in an array would load as a wrong value).
CHECKSUMS = "jaxrm_checksums.json"
# In each step's ``meta`` item (committed by Orbax with the step): the step has a CHECKSUMS list. A
# step whose meta has it and whose list is missing is damaged, never read unverified.
WITH_CHECKSUMS = "jaxrm_files_listed_in"
ITEMS = ("params", "opt_state", "data", "meta")


# What Orbax says when the restore target, not the files, is wrong (another model's shapes or tree).
_MISMATCH = ("not compatible with the stored shape", "tree structures do not match")


class DamagedCheckpointError(CheckpointError):
  """A checkpoint that Orbax lists but cannot read back; ``step`` names it."""

  def __init__(self, directory: str, step: int, cause: BaseException | str):
    why = cause if isinstance(cause, str) else _first_sentence(cause)
    super().__init__(
      f"{os.path.join(directory, str(step))}: the checkpoint of step {step} cannot be read "
      f"({why}); it looks damaged (a truncated file, as a full disk or an interrupted copy "
      "leaves it)"
    )
    self.step = step


class SaveRefusedError(CheckpointError):
  """A checkpoint the file system refused: too many open files, no permission (or no room:
  :class:`NoRoomError`). The message names the folder and what is needed."""


class NoRoomError(SaveRefusedError):
  """A checkpoint that the file system had no room for (a full disk, a quota, a file size limit)."""


class _Held(logging.Filter):
  """Holds back a logger's error records (Orbax's threads log each failed write with its traceback,
  then the save raises); :func:`_held_errors` logs them after all unless ``dropped``."""

  def __init__(self):
    super().__init__()
    self.records: list[logging.LogRecord] = []
    self.dropped = False

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno >= logging.ERROR:
      self.records.append(record)
      return False
    # A save without metrics (a signal's, stop_after_steps') is meant: it is kept while it is the
    # latest.
    return not str(record.msg).startswith("Requested `tracked_metric`; did not provide metrics")


@contextlib.contextmanager
def _held_errors(logger_name: str = "absl"):
  logger = logging.getLogger(logger_name)
  held = _Held()
  logger.addFilter(held)
  try:
    yield held
  finally:
    logger.removeFilter(held)
    if not held.dropped:
      for record in held.records:
        logger.handle(record)


class _Mentioning(logging.Filter):
  """Drops the error records that mention ``text``."""

  def __init__(self, text: str):
    super().__init__()
    self.text = text

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR or self.text not in record.getMessage()


def _remove_when_still(partial: str, quiet_seconds: float = 0.5, at_most: float = 30.0) -> None:
  """Removes the directory of a failed save once nothing has been written into it for
  ``quiet_seconds``: the first failed write ends the save while other writes are still under way.
  Those that fail afterwards, on the removed directory, are not reported again."""

  def listing():
    return sorted(
      (os.path.join(d, f), os.path.getsize(os.path.join(d, f)))
      for d, _, names in os.walk(partial)
      for f in names
      if os.path.exists(os.path.join(d, f))
    )

  last, still_since, started = None, time.time(), time.time()
  while time.time() - started < at_most:
    now = listing()
    if now != last:
      last, still_since = now, time.time()
    elif time.time() - still_since >= quiet_seconds:
      break
    time.sleep(0.05)
  for name in ("absl", "asyncio"):
    logging.getLogger(name).addFilter(_Mentioning(partial))
  shutil.rmtree(partial, ignore_errors=True)


class _SettlingLoop(asyncio.SelectorEventLoop):
  """An event loop that, closed with tasks still pending, lets them finish first."""

  def close(self) -> None:
    if not hasattr(self, "_ssock"):  # never built (no file descriptor left for its self-pipe)
      return
    pending = asyncio.all_tasks(self)
    if pending and not self.is_running():
      self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    super().close()


class _SettlingPolicy(asyncio.DefaultEventLoopPolicy):
  def new_event_loop(self) -> asyncio.AbstractEventLoop:
    return _SettlingLoop()


@contextlib.contextmanager
def _loops_settled():
  """Orbax restores (and saves) in event loops of its own and closes one as soon as one array's
  read (or write) fails, the others still in flight: they then end on tensorstore's threads in the
  closed loop, each printing a traceback ("Event loop is closed", "Exception ignored in: <coroutine
  _read_array_index_and_device_put>") after the error the user is to read. The loops Orbax makes
  within this block let those finish, their errors collected, before they close."""
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
  trainer checks before each save. ``check_writable`` (a training run's) tries a write into
  ``directory`` at once, so that a folder no checkpoint can be saved in stops the run at its start,
  not at its first save; it also removes what saves interrupted by a kill left behind.
  """

  def __init__(
    self,
    directory: str,
    *,
    metric_name: str | None = None,
    higher_is_better: bool = False,
    keep_top_k: int = 3,
    check_writable: bool = False,
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
      cleanup_tmp_directories=check_writable,
    )
    if check_writable and jax.process_index() == 0:
      _check_writable(self.directory)
    self._check_read_at_start()
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

  def _check_read_at_start(self) -> None:
    """Orbax reads each step's metrics and metadata as it starts (and stops at a damaged one with a
    bare JSON error): these are checked first."""
    if not os.path.isdir(self.directory):
      return
    for name in os.listdir(self.directory):
      if name.isdigit():
        damage = _damage(self._step_dir(int(name)), only=_READ_AT_START)
        if damage is not None:
          raise CheckpointError(
            f"{DamagedCheckpointError(self.directory, int(name), damage)}. Move "
            f"{self._step_dir(int(name))} out of {self.directory}, or remove it, to use the other "
            "checkpoints"
          )

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

    params = nnx.to_pure_dict(state["params"])
    args = ocp.args.Composite(
      params=ocp.args.StandardSave(params),
      opt_state=ocp.args.StandardSave(state["opt_state"]),
      data=ocp.args.JsonSave(data_state),
      meta=ocp.args.JsonSave({**meta, WITH_CHECKSUMS: CHECKSUMS}),
    )
    existed = os.path.isdir(self._step_dir(step))
    with _held_errors() as held, _loops_settled():
      try:
        self.manager.save(step, args=args, metrics=metrics, force=True)
        self.manager.wait_until_finished()
        if jax.process_index() == 0:
          _write_json(os.path.join(self._step_dir(step), CHECKSUMS), _checksums(self._step_dir(step)))
          self._write_best()
      except BaseException as e:  # a refused write, a bug, or a second Ctrl-C: nothing half-saved kept
        self._discard_unfinished(step, existed)
        code = refused_writes.refusal(e) if isinstance(e, Exception) else None
        if code is None:
          raise
        held.dropped = True  # the one message below says it all
        raise self._refused(step, code, params, state["opt_state"]) from None

  def _discard_unfinished(self, step: int, existed: bool) -> None:
    """Removes what a failed save of ``step`` left: Orbax's temporary folders, the step itself when
    Orbax committed it but its checksums were not written (it would never be used), and the JSON
    files' temporaries."""
    if jax.process_index() == 0:
      for partial in glob.glob(os.path.join(self.directory, f"{step}.orbax-checkpoint-tmp*")):
        _remove_when_still(partial)
      listed = os.path.join(self._step_dir(step), CHECKSUMS)
      if not existed and os.path.isdir(self._step_dir(step)) and not os.path.exists(listed):
        shutil.rmtree(self._step_dir(step), ignore_errors=True)
      for tmp in (os.path.join(self.directory, BEST_FILE), listed):
        with contextlib.suppress(OSError):
          os.remove(tmp + ".tmp")
    with contextlib.suppress(Exception):  # the save's own error is the one to see
      self.manager.reload()

  def _refused(self, step: int, code: int, params, opt_state) -> SaveRefusedError:
    """What a save that the file system refused tells, once its partial files are gone."""
    steps = self.all_steps()
    if step in steps:  # verified and kept; only the best step's file was refused
      what = f"the checkpoint of step {step} was saved, but not {BEST_FILE}"
      after = f"continues from step {step}"
    else:
      what = (
        f"no room to save the checkpoint of step {step}"
        if code in refused_writes.NO_ROOM
        else f"the checkpoint of step {step} could not be saved"
      ) + "; nothing of it was kept"
      after = f"continues from step {steps[-1]}" if steps else "starts from the beginning (no checkpoint yet)"
    need = refused_writes.what_is_needed(code, self.directory, "checkpointing.checkpoint_dir")
    if code in refused_writes.NO_ROOM:
      size = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))
      need_params, need_opt = size(params), size(opt_state)
      text = refused_writes.size_text
      need = (
        f"A checkpoint needs about {text(need_params + need_opt)} (parameters {text(need_params)}, "
        f"optimizer state {text(need_opt)}); {need}"
      )
    error = NoRoomError if code in refused_writes.NO_ROOM else SaveRefusedError
    return error(
      f"{self.directory}: {what} ({os.strerror(code)}). {need[0].upper()}{need[1:]}; then run the "
      f"same command again: it {after}"
    )

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
    _write_json(os.path.join(self.directory, BEST_FILE), info)

  def _step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

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
    return dict(state, params=params, opt_state=restored["opt_state"]), restored["data"], _meta(restored)

  def restore_params(self, step: int, abstract_params: dict) -> tuple[dict, dict]:
    """Only the parameters (a pure dict shaped like ``abstract_params``) and ``meta``, for scoring."""
    restored = self._restore(
      step, params=ocp.args.StandardRestore(abstract_params), meta=ocp.args.JsonRestore()
    )
    return restored["params"], _meta(restored)

  def _restore(self, step: int, **items):
    damage = self._damage(step)
    if damage is not None:
      raise DamagedCheckpointError(self.directory, step, damage)
    try:
      with _loops_settled():
        return self.manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # tensorstore/Orbax errors of a file cut short or missing
      if any(m in str(e) for m in _MISMATCH):
        raise CheckpointError(
          f"{os.path.join(self.directory, str(step))} does not fit the model restored "
          f"into it ({_first_sentence(e)})"
        ) from None
      raise DamagedCheckpointError(self.directory, step, e) from None

  def _damage(self, step: int) -> str | None:
    """What differs in step ``step``'s files from what was written (see :data:`CHECKSUMS`), or None.

    Process 0 reads the files; the others are told whether they differ."""
    damage = _damage(self._step_dir(step)) if jax.process_index() == 0 else None
    if jax.process_count() > 1:
      import numpy as np
      from jax.experimental import multihost_utils

      differs = multihost_utils.broadcast_one_to_all(np.int32(damage is not None))
      if differs and damage is None:
        damage = "process 0 found its files changed since they were written"
    return damage

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


def _meta(restored) -> dict:
  """The ``meta`` that was saved, without jaxrm's own mark."""
  return {k: v for k, v in restored["meta"].items() if k != WITH_CHECKSUMS}


def read_best(directory: str) -> dict | None:
  """``best_checkpoint.json`` of a checkpoint directory (step, path, metric), or None if absent."""
  path = os.path.join(directory, BEST_FILE)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      best = json.load(f)
    step, saved_at = (best.get("step"), best.get("path")) if isinstance(best, dict) else (best, None)
    # A file written by hand may name the step alone; a path, when there is one, must agree with it.
    if type(step) is not int or (saved_at is not None and os.path.basename(str(saved_at)) != str(step)):
      raise ValueError(f"its 'step' is {step!r} and its 'path' {saved_at!r}: they do not agree")
  except (ValueError, UnicodeDecodeError) as e:
    raise CheckpointError(
      f"{path} is damaged ({_first_sentence(e)}): remove it to load the latest checkpoint, or load "
      "one with step=N; training writes it again at its next checkpoint"
    ) from None
  return best


def _write_json(path: str, value) -> None:
  """Writes ``path`` whole or not at all."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(value, f, indent=2)
  os.replace(tmp, path)


def _files(step_dir: str) -> list[str]:
  return sorted(
    os.path.relpath(os.path.join(d, f), step_dir) for d, _, names in os.walk(step_dir) for f in names
  )


def _crc32(path: str) -> int:
  crc = 0
  with open(path, "rb") as f:
    while chunk := f.read(1 << 24):
      crc = zlib.crc32(chunk, crc)
  return crc


def _checksums(step_dir: str) -> dict:
  files = [f for f in _files(step_dir) if f != CHECKSUMS]
  crcs = {f: [os.path.getsize(os.path.join(step_dir, f)), _crc32(os.path.join(step_dir, f))] for f in files}
  return {"crc32": crcs, "crc32_of_crc32": _crc32_of(crcs)}  # the last: a damaged list is not believed


def _crc32_of(value) -> int:
  return zlib.crc32(json.dumps(value, sort_keys=True).encode())


_READ_AT_START = ("_CHECKPOINT_METADATA", os.path.join("metrics", "metrics"))


def _damage(step_dir: str, only: tuple[str, ...] | None = None) -> str | None:
  """The first file of ``step_dir`` (of ``only`` those) that differs from its :data:`CHECKSUMS`
  entry, said how; None when all agree, or when the checkpoint was saved before jaxrm wrote
  checksums. Without ``only``, a missing list is damage unless the step's meta predates it."""
  listed = os.path.join(step_dir, CHECKSUMS)
  if not os.path.exists(listed):
    return None if only is not None else _missing_list(step_dir)
  try:
    with open(listed) as f:
      saved = json.load(f)
    expected = saved["crc32"]
    if _crc32_of(expected) != saved["crc32_of_crc32"]:
      raise ValueError("its own CRC32 differs")
    items = [(name, int(size), int(crc)) for name, (size, crc) in expected.items()]
  except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as e:
    return f"{listed}, its files' checksums, cannot be read: {_first_sentence(e)}"
  for name, size, crc in items:
    if only is not None and name not in only:
      continue
    path = os.path.join(step_dir, name)
    if not os.path.isfile(path):
      return f"{path} is missing"
    actual = os.path.getsize(path)
    if actual != size:
      return f"{path} has {actual} bytes; {size} were written"
    if _crc32(path) != crc:
      return f"{path} differs from what was written (its CRC32)"
  return None


def _missing_list(step_dir: str) -> str | None:
  """Why a step without its :data:`CHECKSUMS` cannot be used; None when its meta says it was saved
  before jaxrm wrote them (it lacks :data:`WITH_CHECKSUMS`), and so is read unverified."""
  listed, meta = os.path.join(step_dir, CHECKSUMS), os.path.join(step_dir, "meta", "metadata")
  try:
    with open(meta) as f:
      marked = WITH_CHECKSUMS in json.load(f)
  except (OSError, ValueError, TypeError, UnicodeDecodeError) as e:
    return f"{listed}, its files' checksums, is missing, and {meta} cannot be read ({_first_sentence(e)})"
  if not marked:
    return None
  return (
    f"{listed}, its files' checksums, is missing: it is written as the step's save ends, so a "
    "process killed at that moment, or a copy that left it out, leaves the files unverifiable"
  )


def _check_writable(directory: str) -> None:
  """A file created and removed in ``directory`` (made if need be), as a save will."""
  try:
    os.makedirs(directory, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".jaxrm-write-check-", dir=directory)
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    code = refused_writes.refusal(e)
    if code is None:
      raise
    need = refused_writes.what_is_needed(code, directory, "checkpointing.checkpoint_dir")
    raise SaveRefusedError(
      f"{directory}: checkpoints cannot be written there ({os.strerror(code)}); {need} "
      "(or checkpointing.enabled=false to train without checkpoints)"
    ) from None


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
