"""A run started again into an output directory that holds a run: what it may change and resume.

A folder holds a run once a run has written its settings (``config.json``, or :data:`RECORD`) or
its metrics there, whatever its checkpoints. A rerun resumes it only where its settings compute
what the saved run computed; the settings that say how the run is logged, validated, checkpointed,
placed on devices or how long it goes on may change (:data:`FREE`), and the files it read (each
data file, the model it started from) must hold what they held (:data:`RECORD` keeps each one's
size, modification time and content hash). Any other difference stops the run before the model
loads, naming each key with both values and each changed file, unless ``changed_settings`` says to
start afresh in the folder, keeping the old run's files aside or removing them.

A checkpoint directory outside the output directory names its output directory
(:data:`OWNER`): a run into another output directory is refused there.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
from collections.abc import Iterator
from typing import Any

import jax
from jax.experimental import multihost_utils

from jaxrm.config import RunConfig
from jaxrm.data import cache, registry
from jaxrm.errors import ConfigError
from jaxrm.run import run_lock

log = logging.getLogger("jaxrm.train")

RECORD = "run_inputs.json"  # the run's settings and the fingerprints of the files it read
OWNER = "output_dir.json"  # in a checkpoint directory outside its output directory: which one
METRICS = "metrics.jsonl"
# Keys (and sections, ending in ".") whose change leaves what the run computes as it was, up to
# float roundings: where it writes and logs, when it validates and saves, how its batches are split
# over devices and micro-batches, how its data is read, and how long it goes on. Where its
# checkpoints are, and whether it keeps any, are not: a run that does not find its checkpoints
# would start again over the saved run's files (tests/test_rerun.py lists every key).
FREE = (
  "output_dir",
  "changed_settings",
  "logger.",
  "mesh.",
  "model.remat",
  "model.scan_layers",
  "model.attention",
  "train.max_steps",
  "train.max_epochs",
  "train.micro_batch_size",
  "train.log_period",
  "eval.val_period",
  "eval.val_at_start",
  "eval.val_at_end",
  "eval.batch_size",
  "checkpointing.save_period",
  "checkpointing.keep_top_k",
  "data.num_workers",
  "data.num_proc",
  "data.cache",
  "data.cache_dir",
  "data.bucket_multiple",
)
# Free keys that change the learning-rate schedule of the steps still to come.
_LENGTH = ("train.max_steps", "train.max_epochs")
_ABSENT = "(not set)"


def holds_run(run_dir: str) -> bool:
  """Whether a run has written its settings or its metrics into ``run_dir``."""
  from jaxrm.run.run_files import RUN_CONFIG

  return any(os.path.exists(os.path.join(run_dir, name)) for name in (RUN_CONFIG, RECORD, METRICS))


def resumes(
  config: RunConfig, run_dir: str, step: int | None, checkpoint_dir: str, model_path: str | None = None
) -> bool:
  """Whether a rerun into ``run_dir`` (whose latest checkpoint is at ``step``; None: it has none)
  resumes the saved run: yes when no key that changes what it computes differs (the free keys that
  changed are said) and no file it read has changed (``model_path``: the local file or folder of
  the model it starts from, as :func:`record` is given it); else it stops, or starts afresh there
  as ``changed_settings`` says (process 0 clears the old run's files, the others wait). A checkpoint
  directory that is another run's is refused first (:func:`check_checkpoint_owner`).

  Raises:
    ConfigError: ``changed_settings="refuse"`` and a key or a file differs: naming each, with both
      values, and the ways on; or ``checkpoint_dir`` is another run's.
  """
  check_checkpoint_owner(run_dir, checkpoint_dir)
  if step is None and not holds_run(run_dir):
    return True  # a new run
  saved, inputs = _saved(run_dir)
  if saved is None:
    return True
  changed = dict(_differences(saved, _as_saved(config.to_dict()), _as_saved(RunConfig().to_dict())))
  refused = {k: v for k, v in changed.items() if not is_free(k)}
  files = _changed_files(inputs, _input_files(config, model_path), config.data.cache_directory)
  if (refused or files) and config.changed_settings == "refuse":
    if step is not None:
      where = f" (checkpoint at step {step})"
    else:
      where = f" (no checkpoint in {checkpoint_dir})" if config.checkpointing.enabled else ""
    raise ConfigError(_refusal(run_dir, where, refused, files))
  if refused or files:
    if jax.process_index() == 0:
      start_fresh(config.changed_settings, run_dir, checkpoint_dir)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("jaxrm: the old run's files cleared")
    return False
  for key, (was, now) in changed.items():
    if key in _LENGTH and config.train.lr_scheduler != "constant_with_warmup":
      log.warning(
        "%s: %s when saved, %s now: the run resumes at step %s and its %s learning-rate schedule "
        "now spans the new length (the steps before followed the old one)",
        key,
        was,
        now,
        step or 0,
        config.train.lr_scheduler,
      )
    else:
      log.info("%s: %s when saved, %s now (resuming is unaffected)", key, was, now)
  return True


def is_free(key: str) -> bool:
  """Whether a rerun may change the dotted config ``key`` and still resume (:data:`FREE`)."""
  return any(key == f or (f.endswith(".") and key.startswith(f)) for f in FREE)


# ------------------------------------------------------------------ the files a run reads


def record(config: RunConfig, run_dir: str, model_path: str | None) -> None:
  """Writes :data:`RECORD` into ``run_dir``: the run's settings and, by the key that names it,
  each local file it reads (a data folder's files each, the model's files: ``model_path``) with
  its size, modification time and content hash (computed once per file version and kept beside
  the tokenized cache, :func:`jaxrm.data.cache.file_hash`; a file whose size and time are those
  the folder's record holds keeps its hash from there, so a resumed run hashes nothing)."""
  before = {}
  with contextlib.suppress(OSError, ValueError, AttributeError, KeyError, TypeError):  # none yet, or odd
    with open(os.path.join(run_dir, RECORD)) as f:
      before = {name: v for was in json.load(f)["inputs"].values() for name, v in was["files"].items()}
  hashed = {
    key: {"path": given, "files": {f: _hash(f, before.get(f), config.data.cache_directory) for f in names}}
    for key, (given, names) in _input_files(config, model_path).items()
  }
  tmp = os.path.join(run_dir, f".{RECORD}.tmp")
  with open(tmp, "w") as f:
    json.dump({"config": config.to_dict(), "inputs": hashed}, f, indent=1)
  os.replace(tmp, os.path.join(run_dir, RECORD))


def _hash(path: str, recorded: dict | None, cache_dir: str | None) -> dict[str, Any]:
  stat = os.stat(path)
  if isinstance(recorded, dict) and (recorded.get("size"), recorded.get("mtime_ns")) == (
    stat.st_size,
    stat.st_mtime_ns,
  ):
    return recorded
  return cache.file_hash(path, cache_dir)


def _input_files(config: RunConfig, model_path: str | None) -> dict[str, tuple[str, list[str]]]:
  """key -> (its value, the local files it names): each data file of a set read from the local
  disk (every file under a folder), and the model's files (those at the top of its folder)."""
  spec, found = config.data, {}
  if not registry.is_demo(spec.dataset_name):
    named = {"data.train_data_path": spec.train_data_path}
    named.update({f"data.val_data_paths.{n}": p for n, p in spec.val_data_paths.items()})
    for key, given in named.items():
      local = os.path.abspath(os.path.expanduser(given)) if given else ""
      if local and os.path.exists(local):
        found[key] = (given, _files(local, nested=True))
  if model_path is not None:
    found["model.name_or_path"] = (
      config.model.name_or_path,
      _files(os.path.abspath(model_path), nested=False),
    )
  return found


def _files(path: str, *, nested: bool) -> list[str]:
  if not os.path.isdir(path):
    return [path]
  if not nested:
    names = (os.path.join(path, n) for n in os.listdir(path) if not n.startswith("."))
    return sorted(n for n in names if os.path.isfile(n))
  return sorted(
    os.path.join(d, n)
    for d, dirs, names in os.walk(path)
    for n in names
    if not n.startswith(".")
    and not any(p.startswith(".") for p in os.path.relpath(d, path).split(os.sep)[1:])
  )


def _changed_files(
  saved: dict[str, Any], now: dict[str, tuple[str, list[str]]], cache_dir: str | None
) -> list[str]:
  """A line for each file the saved run read that is gone, was added, or holds other bytes (known
  by size, else, where its modification time moved, by its content hash)."""
  lines = []
  for key, was in saved.items():
    if key not in now or now[key][0] != was.get("path"):
      continue  # read from elsewhere: a setting that changed, said as one
    before, names = was.get("files", {}), now[key][1]
    for name in sorted({*before, *names}):
      if name not in names:
        lines.append(f"{key}: {name} is gone")
      elif name not in before:
        lines.append(f"{key}: {name} was added")
      else:
        why = _file_change(name, before[name], cache_dir)
        if why:
          lines.append(f"{key}: {name} {why}")
  return lines


def _file_change(path: str, was: dict[str, Any], cache_dir: str | None) -> str | None:
  """How the file at ``path`` differs from its fingerprint ``was``; None: not at all."""
  stat = os.stat(path)
  when = lambda ns: datetime.datetime.fromtimestamp(ns / 1e9).strftime("%Y-%m-%d %H:%M:%S")
  if stat.st_size != was.get("size"):
    return (
      f"changed: {was.get('size')} bytes (modified {when(was.get('mtime_ns', 0))}) when saved, "
      f"{stat.st_size} bytes (modified {when(stat.st_mtime_ns)}) now"
    )
  if stat.st_mtime_ns == was.get("mtime_ns"):
    return None
  if cache.file_hash(path, cache_dir)["xxh3_128"] == was.get("xxh3_128"):
    return None  # touched, or copied back: the same bytes
  return (
    f"changed: other content of the same size, modified {when(was.get('mtime_ns', 0))} when saved, "
    f"{when(stat.st_mtime_ns)} now"
  )


# ------------------------------------------------------------------ the checkpoint directory


def check_checkpoint_owner(run_dir: str, checkpoint_dir: str) -> None:
  """Refuses a checkpoint directory outside ``run_dir`` that belongs to another output directory's
  run: named by its :data:`OWNER`, while that directory exists, or lying in a folder that holds a
  run (another run's ``checkpoints/``).

  Raises:
    ConfigError: naming both directories, and what to do.
  """
  if run_lock.inside(checkpoint_dir, run_dir):
    return
  parent = os.path.dirname(os.path.abspath(checkpoint_dir))
  owner = _owner(checkpoint_dir) or (parent if holds_run(parent) else None)
  if owner is None or os.path.abspath(owner) == os.path.abspath(run_dir):
    return
  if not os.path.isdir(owner):
    log.warning(
      "%s held the checkpoints of a run in %s, which no longer exists (moved here?): this run "
      "into %s takes them over",
      checkpoint_dir,
      owner,
      run_dir,
    )
    return
  raise ConfigError(
    f"checkpointing.checkpoint_dir={checkpoint_dir} holds the checkpoints of the run in {owner}, not "
    f"of {run_dir}: give this run a checkpoint folder of its own (--config.checkpointing.checkpoint_dir"
    f"=<new folder>), or train into {owner} to go on with that run"
  )


def claim_checkpoint_dir(run_dir: str, checkpoint_dir: str) -> None:
  """Writes :data:`OWNER` into a checkpoint directory outside ``run_dir``, naming ``run_dir``."""
  if run_lock.inside(checkpoint_dir, run_dir) or _owner(checkpoint_dir) == os.path.abspath(run_dir):
    return
  os.makedirs(checkpoint_dir, exist_ok=True)
  tmp = os.path.join(checkpoint_dir, f".{OWNER}.tmp")
  with open(tmp, "w") as f:
    json.dump({"output_dir": os.path.abspath(run_dir)}, f)
  os.replace(tmp, os.path.join(checkpoint_dir, OWNER))


def _owner(checkpoint_dir: str) -> str | None:
  try:
    with open(os.path.join(checkpoint_dir, OWNER)) as f:
      owner = json.load(f).get("output_dir")
  except (OSError, ValueError, AttributeError):
    return None
  return owner if isinstance(owner, str) else None


# ------------------------------------------------------------------ starting afresh


def start_fresh(how: str, run_dir: str, checkpoint_dir: str) -> None:
  """Clears the way for a new run in ``run_dir``, as ``how`` (a ``changed_settings``) says: the
  old run's files moved into ``run_dir/old-<time>/`` (an outside checkpoint directory's into a
  folder beside it, ``<checkpoint_dir>-old-<time>``), or removed. The runs' locks stay."""
  from jaxrm.run.run_lock import FILE as LOCK

  keep = how == "start_fresh_keep_old"
  stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
  aside = os.path.join(run_dir, f"old-{stamp}")
  if not run_lock.inside(checkpoint_dir, run_dir) and os.path.isdir(checkpoint_dir):
    beside = f"{checkpoint_dir.rstrip(os.sep)}-old-{stamp}"
    for name in sorted(os.listdir(checkpoint_dir)):
      if name != LOCK:
        _clear(os.path.join(checkpoint_dir, name), os.path.join(beside, name) if keep else None)
  for name in sorted(os.listdir(run_dir)):
    if name == LOCK or name.startswith("old-"):
      continue
    _clear(os.path.join(run_dir, name), os.path.join(aside, name) if keep else None)
  log.warning(
    "changed_settings=%s: the run in %s %s; this run starts at step 0",
    how,
    run_dir,
    f"was moved into {aside}" if keep else "was removed",
  )


def _clear(path: str, to: str | None) -> None:
  if to is not None:
    os.makedirs(os.path.dirname(to), exist_ok=True)
    os.replace(path, to)
  elif os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path)
  else:
    os.remove(path)


# ------------------------------------------------------------------ the saved settings


def _saved(run_dir: str) -> tuple[dict[str, Any] | None, dict[str, Any]]:
  """The saved run's settings (its ``config.json``, else its :data:`RECORD`'s) and its files'
  fingerprints; (None, {}), said so, when there are no settings to read."""
  from jaxrm.run.run_files import RUN_CONFIG

  record_path = os.path.join(run_dir, RECORD)
  kept = _read_json(record_path, run_dir) if os.path.exists(record_path) else {}
  inputs = kept.get("inputs") if isinstance(kept.get("inputs"), dict) else {}
  path = os.path.join(run_dir, RUN_CONFIG)
  if os.path.exists(path):
    return _read_json(path, run_dir), inputs
  if isinstance(kept.get("config"), dict):
    return kept["config"], inputs
  log.warning(
    "%s: no %s to compare this run's settings with; resuming with them as given", run_dir, RUN_CONFIG
  )
  return None, {}


def _read_json(path: str, run_dir: str) -> dict[str, Any]:
  try:
    with open(path) as f:
      saved = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(
      f"{path}: the saved settings of the run in {run_dir} cannot be read ({e}), so this run cannot "
      f"tell whether it may resume it; {_WAYS.format(run_dir=run_dir)}"
    ) from None
  if not isinstance(saved, dict):
    raise ConfigError(
      f"{path}: expected the run's settings as a JSON object; {_WAYS.format(run_dir=run_dir)}"
    )
  return saved


def _as_saved(d: dict[str, Any]) -> dict[str, Any]:
  """The settings as ``config.json`` holds them (tuples as lists)."""
  return json.loads(json.dumps(d))


def _differences(
  saved: dict[str, Any], now: dict[str, Any], defaults: dict[str, Any], prefix: str = ""
) -> Iterator[tuple[str, tuple]]:
  """(dotted key, (saved value, value now)) for each key whose value differs. A key the saved run
  has not (a jaxrm before it had none) is no change while it keeps its default: that was what
  the older jaxrm did."""
  for key in [*now, *(k for k in saved if k not in now)]:
    was, is_ = saved.get(key, _ABSENT), now.get(key, _ABSENT)
    default = defaults.get(key, _ABSENT) if isinstance(defaults, dict) else _ABSENT
    if isinstance(was, dict) and isinstance(is_, dict) and key != "val_data_paths":
      yield from _differences(was, is_, default, f"{prefix}{key}.")
    elif was != is_ and not (was is _ABSENT and is_ == default):
      yield f"{prefix}{key}", (_show(was), _show(is_))


def _show(value: Any) -> str:
  return value if value is _ABSENT else json.dumps(value)


_WAYS = (
  "to train with these settings, write into another folder (--config.output_dir=<new folder>), or "
  "start afresh in {run_dir} with --config.changed_settings=start_fresh_keep_old (the old run's "
  "files move into {run_dir}/old-<time>/) or --config.changed_settings=start_fresh_remove_old "
  "(they are deleted; TRL's flags: --overwrite_output_dir)"
)


def _refusal(run_dir: str, where: str, refused: dict[str, tuple[str, str]], files: list[str]) -> str:
  parts = []
  if refused:
    width = max(map(len, refused))
    lines = "\n".join(f"  {k.ljust(width)}  {was} when saved, {now} now" for k, (was, now) in refused.items())
    parts.append(f"{run_dir} holds a run{where} trained with other settings than this one's:\n{lines}\n")
  if files:
    lines = "\n".join(f"  {line}" for line in files)
    parts.append(f"{run_dir} holds a run{where} that read files which have changed since:\n{lines}\n")
  back = "run with its settings (they are in {run_dir}/config.json)" if refused else "put its files back"
  return "".join(parts) + f"To resume it, {back.format(run_dir=run_dir)}; " + _WAYS.format(run_dir=run_dir)
