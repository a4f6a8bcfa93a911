"""A run started again into an output directory that holds a run: what it may change and resume.

A rerun resumes the saved run only where its settings compute what the saved run computed; the
settings that say how the run is logged, validated, checkpointed, placed on devices or how long it
goes on may change (:data:`FREE`). Any other difference stops the run before the model loads,
naming each key with both values, unless ``changed_settings`` says to start afresh in the folder,
keeping the old run's files aside or removing them.
"""

from __future__ import annotations

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
from jaxrm.errors import ConfigError

log = logging.getLogger("jaxrm.train")

# Keys (and sections, ending in ".") whose change leaves what the run computes as it was, up to
# float roundings: where it writes, logs and checkpoints, when it validates, how its batches are
# split over devices and micro-batches, how its data is read, and how long it goes on.
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
  "checkpointing.enabled",
  "checkpointing.checkpoint_dir",
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


def resumes(config: RunConfig, run_dir: str, step: int, checkpoint_dir: str) -> bool:
  """Whether a rerun into ``run_dir`` (whose latest checkpoint is at ``step``) resumes the saved
  run: yes when no key that changes what it computes differs (the free keys that changed are
  said); else it stops, or starts afresh there as ``changed_settings`` says (process 0 clears the
  old run's files, the others wait).

  Raises:
    ConfigError: ``changed_settings="refuse"`` and a key differs: naming each with both values,
      and the ways on.
  """
  saved = _saved(run_dir)
  if saved is None:
    return True
  changed = dict(_differences(saved, _as_saved(config.to_dict()), _as_saved(RunConfig().to_dict())))
  refused = {k: v for k, v in changed.items() if not _free(k)}
  if refused and config.changed_settings == "refuse":
    raise ConfigError(_refusal(run_dir, step, refused))
  if refused:
    if jax.process_index() == 0:
      _start_fresh(config.changed_settings, run_dir, checkpoint_dir)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("jaxrm: the old run's files cleared")
    return False
  for key, (was, now) in changed.items():
    if key in _LENGTH and config.train.lr_scheduler != "constant_with_warmup":
      log.warning(
        "%s: %s when saved, %s now: the run resumes at step %d and its %s learning-rate schedule "
        "now spans the new length (the steps before followed the old one)",
        key,
        was,
        now,
        step,
        config.train.lr_scheduler,
      )
    else:
      log.info("%s: %s when saved, %s now (resuming is unaffected)", key, was, now)
  return True


def _start_fresh(how: str, run_dir: str, checkpoint_dir: str) -> None:
  """Clears the way for a new run in ``run_dir``, as ``how`` (a ``changed_settings``) says: the
  old run's files moved into ``run_dir/old-<time>/`` (an outside checkpoint directory renamed
  beside itself), or removed."""
  keep = how == "start_fresh_keep_old"
  stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
  aside = os.path.join(run_dir, f"old-{stamp}")
  inside = os.path.commonpath([os.path.abspath(run_dir), os.path.abspath(checkpoint_dir)]) == os.path.abspath(
    run_dir
  )
  if not inside:
    _clear(checkpoint_dir, f"{checkpoint_dir.rstrip(os.sep)}-old-{stamp}" if keep else None)
  for name in sorted(os.listdir(run_dir)):
    if name == "run.lock" or name.startswith("old-"):
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


def _saved(run_dir: str) -> dict[str, Any] | None:
  """The saved run's settings (its ``config.json``); None, said so, when there is none to read."""
  from jaxrm.loading import RUN_CONFIG

  path = os.path.join(run_dir, RUN_CONFIG)
  try:
    with open(path) as f:
      saved = json.load(f)
  except FileNotFoundError:
    log.warning(
      "%s: no %s to compare this run's settings with; resuming with them as given", run_dir, RUN_CONFIG
    )
    return None
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


def _free(key: str) -> bool:
  return any(key == f or (f.endswith(".") and key.startswith(f)) for f in FREE)


_WAYS = (
  "to train with these settings, write into another folder (--config.output_dir=<new folder>), or "
  "start afresh in {run_dir} with --config.changed_settings=start_fresh_keep_old (the old run's "
  "files move into {run_dir}/old-<time>/) or --config.changed_settings=start_fresh_remove_old "
  "(they are deleted; TRL's flags: --overwrite_output_dir)"
)


def _refusal(run_dir: str, step: int, refused: dict[str, tuple[str, str]]) -> str:
  width = max(map(len, refused))
  lines = "\n".join(f"  {k.ljust(width)}  {was} when saved, {now} now" for k, (was, now) in refused.items())
  return (
    f"{run_dir} holds a run (checkpoint at step {step}) trained with other settings than this one's:\n"
    f"{lines}\n"
    f"To resume it, run with its settings (they are in {run_dir}/config.json); "
    + _WAYS.format(run_dir=run_dir)
  )
