"""Training and validation metrics: ``<output_dir>/metrics.jsonl``, and as the config's
``logger`` says, TensorBoard events, a Weights & Biases run and an MLflow run (NeMo RL's
``logger.wandb_enabled`` / ``mlflow_enabled`` / ``tensorboard_enabled``), each under the JSONL's
names and steps. W&B and MLflow are optional extras (``pip install 'jaxrm[wandb]'``,
``'jaxrm[mlflow]'``), imported only when enabled.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from jaxrm.errors import ConfigError

METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
  """Appends one JSON object per event (with its ``step``) and mirrors scalars to TensorBoard, W&B
  and MLflow as ``logger`` enables them; with ``logger.monitor_gpus``, each training row also
  carries the devices' memory (:func:`device_memory`).

  A run resumed from step ``resume_step`` first drops the rows its previous attempt wrote after
  that step (they are about to be recomputed), and TensorBoard purges the same steps; a run that
  starts at step 0 starts the file afresh. Non-finite values are written as ``null``.
  """

  def __init__(
    self,
    output_dir: str,
    *,
    tensorboard: bool = True,
    log_dir: str | None = None,
    enabled: bool = True,
    resume_step: int = 0,
    logger=None,
    run_config: dict | None = None,
  ):
    # logger: a jaxrm.config.LoggerSpec, which then decides tensorboard and log_dir;
    # run_config: the run's whole config (RunConfig.to_dict()), for loggers that record it.
    if logger is not None:
      tensorboard, log_dir = logger.tensorboard, logger.log_dir or None
    self.enabled = enabled
    self._tb = None
    self._trackers: list[Any] = []
    self._monitor_devices = bool(logger is not None and logger.monitor_gpus)
    if not enabled:
      return
    if logger is not None:  # before any file is touched: a missing extra stops the run at once
      name = os.path.basename(os.path.abspath(output_dir))
      if logger.wandb_enabled:
        self._trackers.append(_WandbRun(logger.wandb, name, output_dir, run_config))
      if logger.mlflow_enabled:
        self._trackers.append(_MlflowRun(logger.mlflow, name, run_config))
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, METRICS_FILE)
    _keep_rows_up_to(path, resume_step)
    self._jsonl = open(path, "a")
    if tensorboard:
      from tensorboardX import SummaryWriter

      self._tb = SummaryWriter(
        log_dir or os.path.join(output_dir, "tensorboard"), purge_step=resume_step + 1 if resume_step else 0
      )

  def write(self, step: int, metrics: dict[str, float]) -> None:
    """Records ``metrics`` at ``step`` everywhere the run logs to (process 0 only)."""
    if not self.enabled:
      return
    if self._monitor_devices and not any(k.startswith("validation-") for k in metrics):
      metrics = {**metrics, **device_memory()}
    row = {"step": int(step)}
    row.update({k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()})
    self._jsonl.write(json.dumps(row) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for k, v in metrics.items():
        self._tb.add_scalar(k, float(v), int(step))
      self._tb.flush()
    for tracker in self._trackers:
      tracker.log(int(step), {k: float(v) for k, v in metrics.items()})

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      if self._tb is not None:
        self._tb.close()
      for tracker in self._trackers:
        tracker.close()


def device_memory() -> dict[str, float]:
  """Each local accelerator's memory in use and its peak, in GiB (``device_memory/<i>_in_use_gib``,
  ``device_memory/<i>_peak_gib``); empty where devices do not report it (CPUs)."""
  import jax

  out = {}
  for i, device in enumerate(jax.local_devices()):
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats:
      continue
    for key, name in (("bytes_in_use", "in_use"), ("peak_bytes_in_use", "peak")):
      if key in stats:
        out[f"device_memory/{i}_{name}_gib"] = stats[key] / 2**30
  return out


def _import(module: str, extra: str, key: str):
  import importlib

  try:
    return importlib.import_module(module)
  except ImportError:
    raise ConfigError(
      f"{key}=True needs the {module} package: pip install 'jaxrm[{extra}]' (or set {key}=False)"
    ) from None


class _WandbRun:
  """A W&B run (``logger.wandb``): the config recorded once, each row logged at its step.

  ``WANDB_MODE=offline`` (W&B's own setting) keeps the run on disk, under ``WANDB_DIR`` or the
  output directory.
  """

  def __init__(self, spec, default_name: str, output_dir: str, run_config: dict | None):
    wandb = _import("wandb", "wandb", "logger.wandb_enabled")
    try:
      self._run = wandb.init(
        project=spec.project,
        name=spec.name or default_name,
        config=run_config,
        dir=os.environ.get("WANDB_DIR") or output_dir,
        reinit="create_new",
      )
    except wandb.errors.Error as e:  # not logged in, no network...
      raise ConfigError(
        f"logger.wandb_enabled=True: W&B could not start a run ({e}); run `wandb login`, or "
        "set WANDB_MODE=offline to keep the run on disk"
      ) from None

  def log(self, step: int, metrics: dict[str, float]) -> None:
    self._run.log(metrics, step=step)

  def close(self) -> None:
    self._run.finish()


class _MlflowRun:
  """An MLflow run (``logger.mlflow``) in its experiment: the config as parameters, each row's
  metrics at its step. Uses MLflow's client, so no process-wide active run is left behind."""

  def __init__(self, spec, default_name: str, run_config: dict | None):
    _import("mlflow", "mlflow", "logger.mlflow_enabled")
    from mlflow.tracking import MlflowClient

    self._client = MlflowClient(tracking_uri=spec.tracking_uri or None)
    experiment = self._client.get_experiment_by_name(spec.experiment_name)
    experiment_id = (
      experiment.experiment_id
      if experiment is not None
      else self._client.create_experiment(spec.experiment_name)
    )
    self._run_id = self._client.create_run(experiment_id, run_name=spec.run_name or default_name).info.run_id
    params = _flat(run_config or {})
    from mlflow.entities import Param

    items = [Param(k, str(v)[:6000]) for k, v in params.items()]
    for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters per batch
      self._client.log_batch(self._run_id, params=items[i : i + 100])

  def log(self, step: int, metrics: dict[str, float]) -> None:
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    self._client.log_batch(self._run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

  def close(self) -> None:
    self._client.set_terminated(self._run_id)


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def _keep_rows_up_to(path: str, step: int) -> None:
  """Rewrites ``path`` with its complete rows of steps <= ``step`` (none when ``step`` is 0)."""
  if not os.path.exists(path):
    return
  kept = []
  if step:
    with open(path) as f:
      for line in f:
        if not line.endswith("\n"):  # cut short by a kill
          break
        if json.loads(line)["step"] <= step:
          kept.append(line)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.writelines(kept)
  os.replace(tmp, path)
