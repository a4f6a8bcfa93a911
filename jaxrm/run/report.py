"""What a training run prints: what it is about to do, each validation round as a table, and a
summary at its end.

Pure functions of plain values, the model's and packing's small config dataclasses and the
metrics dicts the trainer logs (``validation-<set>_<metric>`` keys, as ``metrics.jsonl`` holds
them); they return text and print nothing.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from jaxrm.data.registry import SPLIT_NAMES

if TYPE_CHECKING:
  from jaxrm.data.drops import DropReport
  from jaxrm.data.packing import PackSpec
  from jaxrm.models.config import ModelConfig
  from jaxrm.models.lora import LoraConfig

VALIDATION_PREFIX = "validation-"
VALIDATION_TIME = "timing/validation/total_validation_time"
# Shown first, in this order, when a set has them; every other metric follows by name.
LEADING_METRICS = (
  "loss",
  "accuracy",
  "margin",
  "step_accuracy",
  "f1_error",
  "recall_error",
  "first_error_found",
  "positive_rate",
)
# Sets that name a split of a dataset read by name rather than a path.
DEFAULT_FORMAT = "PreferenceDataset"  # evaluate's --dataset_name when none is given


def run_start(
  *,
  model_name: str,
  model: ModelConfig,
  reward_type: str,
  num_params: int,
  trained_params: int,
  attention: str,
  mesh_shape: Mapping[str, int],
  devices: int,
  backend: str,
  processes: int,
  train_examples: int,
  steps_per_epoch: int,
  validation_sizes: Mapping[str, int],
  drops: Mapping[str, DropReport],
  start_step: int,
  total_steps: int,
  ends_by: str,
  global_batch_size: int,
  grad_accum: int,
  tokens_per_step: float,
  pack: PackSpec | None,
  micro_batched: bool,
  shared_tokens_per_step: float | None,
  group_by_length: bool,
  output_dir: str,
) -> str:
  """What a run is about to do, as it prints at its start.

  Args:
    model_name: ``model.name_or_path``; ``model`` its config (family, dtypes, LoRA).
    num_params, trained_params: the model's parameters, and those the optimizer updates.
    attention: the attention route (``models.decoder.attention_summary``).
    mesh_shape, devices, backend, processes: where it trains.
    train_examples, steps_per_epoch, validation_sizes: the examples of each set.
    drops: each set's dropped rows (``"train"``, ``"validation-<set>"``).
    start_step, total_steps: where the loop starts and ends; ``ends_by`` the key that ends it
      (:data:`MAX_STEPS` or :data:`MAX_EPOCHS`, with what it says).
    global_batch_size, grad_accum: groups per update, and the micro-batches they come in.
    tokens_per_step: real tokens per update on average, each group's prompt counted per sequence;
      ``shared_tokens_per_step`` the same with prompts written once (given with
      ``pack.shared_prompt``).
    pack: the packing of rows; None: one sequence per row, each micro-batch padded to its own
      length if ``micro_batched``.
    group_by_length: the training order is length-grouped.
    output_dir: the run directory.
  """
  trains = ""
  if model.lora.enabled:
    trains = (
      f"{describe_lora(model.lora)}: {_params(trained_params)} trainable of {_params(num_params)} parameters"
      + (f", the base stored as {model.lora.base_dtype}" if model.lora.base_dtype else "")
      + "\n"
    )
  packing = describe_packing(pack, micro_batched, shared_tokens_per_step)
  return (
    f"jaxrm: {model.family} model {model_name}, {num_params / 1e6:.1f}M parameters, "
    f"{model.dtype} compute / {model.param_dtype} weights, {reward_type} loss\n"
    f"{trains}"
    f"{attention}\n"
    f"mesh: {dict(mesh_shape)} on {devices} {backend} devices, {processes} process(es)\n"
    f"data: {train_examples} train examples ({steps_per_epoch} steps/epoch), "
    + (", ".join(f"{n}: {k}" for n, k in validation_sizes.items()) or "no")
    + " validation\n"
    + "".join(f"{d.summary(name)}\n" for name, d in drops.items())
    + f"steps: {_steps(start_step, total_steps, ends_by)}, batch {global_batch_size} groups (x{grad_accum} accumulation), "
    f"{tokens_per_step:.0f} tokens/step on average, {packing}"
    + (", in length-grouped order (data.group_by_length)" if group_by_length else "")
    + "\n"
    f"output in {output_dir}"
  )


def _steps(start_step: int, total_steps: int, ends_by: str) -> str:
  """``0 -> 120 (train.max_steps)``, ``resumed from step 60 -> 120 (...)``, or ``already finished
  at step 120 (raise train.max_steps to train on)``."""
  if start_step >= total_steps:
    return f"already finished at step {start_step} ({_train_on(ends_by)})"
  steps = f"resumed from step {start_step} -> {total_steps}" if start_step else f"0 -> {total_steps}"
  return f"{steps} ({ends_by})"


def progress_line(
  step: int, total_steps: int, loss: float, accuracy: float | None, step_seconds: float
) -> str:
  """A training step as a plain line, for a log that is not a terminal:
  ``step 10/120: loss 0.6931, accuracy 0.500, 0.42 s/step``. An ``accuracy`` of None or NaN (a
  task that has none: regression) is left out rather than printed as ``nan``."""
  shown = accuracy is not None and math.isfinite(accuracy)
  return (
    f"step {step}/{total_steps}: loss {_number(loss)}"
    + (f", accuracy {accuracy:.3f}" if shown else "")
    + f", {step_seconds:.2f} s/step"
  )


def _train_on(ends_by: str) -> str:
  return f"raise {ends_by.split('=', 1)[0].split(' ', 1)[0]} to train on"


def describe_lora(cfg: LoraConfig) -> str:
  """``LoRA rank 8 (alpha 16) on q_proj, v_proj``, ``... (alpha 16, dropout 0.05) ...``, or ``no LoRA``."""
  if not cfg.enabled:
    return "no LoRA"
  dropout = f", dropout {cfg.dropout:g}" if cfg.dropout else ""
  return f"LoRA rank {cfg.rank} (alpha {cfg.alpha:g}{dropout}) on {', '.join(cfg.targets)}"


def describe_packing(pack: PackSpec | None, micro_batched: bool, shared_tokens_per_step: float | None) -> str:
  """How groups become rows: ``one sequence per row (data.packing=none)``, ``packed into rows of
  up to 512 tokens``..."""
  if pack is None:
    return "one sequence per row (data.packing=none)" + (
      ", each micro-batch padded to its own length" if micro_batched else ""
    )
  rows = f"up to {pack.row_length}" if pack.length_multiple else f"{pack.row_length}"
  text = f"packed into rows of {rows} tokens"
  if pack.shared_prompt:
    text += f", {shared_tokens_per_step:.0f} tokens/step once prompts are shared"
  return text


def split_validation_metrics(
  metrics: Mapping[str, float], sets: Sequence[str]
) -> dict[str, dict[str, float]]:
  """``{set: {metric: value}}`` from ``validation-<set>_<metric>`` keys; other keys are ignored.

  A set's name may hold ``_`` (``train_sample``), so keys are matched against the run's set names,
  the longest first.
  """
  out: dict[str, dict[str, float]] = {name: {} for name in sets}
  names = sorted(sets, key=len, reverse=True)
  for key, value in metrics.items():
    if not key.startswith(VALIDATION_PREFIX):
      continue
    rest = key[len(VALIDATION_PREFIX) :]
    name = next((n for n in names if rest.startswith(f"{n}_")), None)
    if name is not None:
      out[name][rest[len(name) + 1 :]] = value
  return {name: m for name, m in out.items() if m}


def validation_table(metrics: Mapping[str, float], sets: Sequence[str], step: int) -> str:
  """One validation round: a row per metric, a column per validation set.

  Every metric any set has is shown (``-`` where a set lacks it): the leading ones of
  :data:`LEADING_METRICS` first, then the rest by name.
  """
  per_set = split_validation_metrics(metrics, sets)
  seconds = metrics.get(VALIDATION_TIME)
  title = f"validation at step {step}" + (f" ({seconds:.1f} s)" if seconds is not None else "")
  if not per_set:
    return f"{title}: no metrics"
  names = metric_order({m for values in per_set.values() for m in values})
  rows = [["", *per_set]] + [[m, *(_number(values.get(m)) for values in per_set.values())] for m in names]
  return f"{title}\n{_table(rows)}"


def run_summary(
  *,
  output_dir: str,
  steps: int,
  wall_seconds: float,
  train_tokens: int,
  train_seconds: float,
  final_metrics: Mapping[str, float],
  sets: Sequence[str],
  final_step: int | None,
  best: tuple[int, str, float] | None,
  higher_is_better: bool,
  dataset_name: str,
  val_path: str,
  files_only: bool = False,
  truncation: str = "drop",
  lora: bool = False,
  finished: bool = True,
  start_step: int = 0,
  final_shown: bool = False,
  ends_by: str = "train.max_steps",
  uses: Sequence[str] = (),
) -> str:
  """What a run did and how to use it.

  Args:
    output_dir: the run directory.
    steps: the updates this run made (not counting those before a resume).
    wall_seconds: the run's time from start to end.
    train_tokens: real (unpadded) tokens trained on in those steps.
    train_seconds: time spent in train steps.
    final_metrics: the last validation round's metrics; ``final_step`` its step.
    sets: the validation set names.
    best: ``(step, metric name, value)`` of the best checkpoint; None when not ranked.
    higher_is_better: how ``best`` was ranked.
    dataset_name, val_path: ``data.dataset_name`` and the first validation set's path, for the
      evaluation command; ``files_only``: the dataset reads only the paths it is given.
    truncation: the run's, for the evaluation command (whose max_length is the run's own).
    lora: the run trained LoRA adapters (the export command can write them alone).
    finished: the run reached its last step; False: it stopped early and running it again
      continues it.
    start_step: the step the run resumed from (0: a new run).
    final_shown: the run printed the final validation's table already; the summary points at it
      instead of printing it again.
    ends_by: the key that set the run's length (as :func:`run_start` takes it).
    uses: the Python lines its task adds to the loading line (:attr:`jaxrm.tasks.Task.uses`: a
      pairwise judge's compare responses).
  """
  rate = f", {_count(train_tokens / train_seconds)} tokens/s in train steps" if train_seconds > 0 else ""
  ended = "run finished" if finished else "run stopped early (run again to continue)"
  resumed = f", resumed from step {start_step}" if start_step else ""
  lines = [f"{ended}: {steps} steps in {_duration(wall_seconds)}{resumed}{rate}"]
  if finished and not steps:
    lines = [f"run already finished at step {start_step}: nothing left to train ({_train_on(ends_by)})"]
  if best is not None:
    step, name, value = best
    lines.append(
      f"best checkpoint: step {step}, {name} = {_number(value)} "
      f"({'higher' if higher_is_better else 'lower'} is better)"
    )
  if final_step is not None and split_validation_metrics(final_metrics, sets):
    if final_shown:
      lines.append(f"final validation: the table at step {final_step} above")
    else:
      lines.append("final " + validation_table(final_metrics, sets, final_step))
  lines += [
    "use it:",
    *(
      "  " + c
      for c in usage_commands(
        output_dir,
        dataset_name=dataset_name,
        val_path=val_path,
        files_only=files_only,
        truncation=truncation,
        lora=lora,
        uses=uses,
      )
    ),
  ]
  return "\n".join(lines)


def usage_commands(
  output_dir: str,
  *,
  dataset_name: str,
  val_path: str,
  files_only: bool = False,
  truncation: str = "drop",
  lora: bool = False,
  uses: Sequence[str] = (),
) -> list[str]:
  """Python and shell lines that load, evaluate and export the run in ``output_dir``, with the
  Python lines that ``uses`` it after loading (its task's, :attr:`jaxrm.tasks.Task.uses`: a pairwise
  judge's compare responses).

  The evaluation takes the run's own ``data.max_length`` (its default for a model jaxrm trained).
  Without ``val_path``, a dataset that reads only given paths (``files_only``) is evaluated on
  ``HELD_OUT.jsonl``, a file for the user to name.
  """
  run = shlex.quote(output_dir)
  if files_only and (not val_path or val_path in SPLIT_NAMES):
    val_path = "HELD_OUT.jsonl"
  if not val_path or val_path in SPLIT_NAMES:
    data = [f"--data={shlex.quote(dataset_name)}"] + ([f"--split={val_path}"] if val_path else [])
  else:
    data = [f"--data={shlex.quote(val_path)}"]
    data += [f"--dataset_name={shlex.quote(dataset_name)}"] if dataset_name != DEFAULT_FORMAT else []
  evaluate = ["python -m jaxrm.evaluate", f"--model={run}", *data]
  evaluate += [f"--truncation={truncation}"] if truncation != "drop" else []
  exported = shlex.quote(output_dir.rstrip("/") + "-hf")
  lines = [
    f"from jaxrm import RewardModel; rm = RewardModel.from_pretrained({output_dir!r})  # the best checkpoint",
    *uses,
    " ".join(evaluate),
    f"python -m jaxrm.export --model={run} --out={exported}",
  ]
  if lora:
    lines.append(
      f"python -m jaxrm.export --model={run} --out={shlex.quote(output_dir.rstrip('/') + '-adapters')}"
      " --adapters_only"
    )
  return lines


def metric_order(names: Iterable[str]) -> list[str]:
  """``names`` as tables show them: :data:`LEADING_METRICS` first, then the rest by name."""
  names = set(names)
  leading = [m for m in LEADING_METRICS if m in names]
  return leading + sorted(names - set(leading))


def _table(rows: list[list[str]]) -> str:
  """Left-aligned first column, right-aligned others, two spaces apart."""
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return "\n".join(
    "  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    for r in rows
  )


def _number(value) -> str:
  if value is None:
    return "-"
  if isinstance(value, int) and not isinstance(value, bool):
    return str(value)
  value = float(value)
  if not math.isfinite(value):
    return str(value)  # nan: nothing was counted (e.g. no error step in the set)
  if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
    return f"{value:.3e}"
  return f"{value:.4f}"


def _params(n: int) -> str:
  return f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n / 1e3:.1f}K"


def _count(n: float) -> str:
  for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
    if n >= scale:
      return f"{n / scale:.1f}{suffix}"
  return f"{n:.0f}"


def _duration(seconds: float) -> str:
  seconds = int(round(seconds))
  hours, rest = divmod(seconds, 3600)
  minutes, secs = divmod(rest, 60)
  if hours:
    return f"{hours}h{minutes:02d}m{secs:02d}s"
  return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
