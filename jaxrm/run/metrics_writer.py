"""Training and validation metrics: ``<output_dir>/metrics.jsonl``, and as the config's
``logger`` says, TensorBoard events, a Weights & Biases run and an MLflow run (NeMo RL's
``logger.wandb_enabled`` / ``mlflow_enabled`` / ``tensorboard_enabled``), each under the JSONL's
names and steps. W&B and MLflow are optional extras (``pip install 'jaxrm[wandb]'``,
``'jaxrm[mlflow]'``), imported only when enabled; MLflow records into ``<output_dir>/mlruns``
unless given a tracking URI.

A tracker that fails (to start, to log a row, to close) is reported in one warning line and left
out for the rest of the run: training goes on and ``metrics.jsonl`` keeps every row. A missing
package or a tracking URI this MLflow cannot use is refused before anything starts
(:func:`check_loggers`). A ``metrics.jsonl`` the file system refuses (no room, no permission, too
many open files) stops the run with one :class:`MetricsWriteError` naming the folder and what is
needed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from typing import Any
from urllib.parse import urlparse

from jaxrm.errors import ConfigError, UserError
from jaxrm.run import refused_writes

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
MLFLOW_DIR = "mlruns"  # MLflow's file store under the output directory, where no URI is given
_GOES_ON = "the run goes on without it ({key}); metrics.jsonl has every row"


class MetricsWriteError(UserError):
  """``metrics.jsonl`` could not be written: no room, no permission or too many open files."""


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
    self._trackers: list[_Tracker] = []
    self._monitor_devices = bool(logger is not None and logger.monitor_gpus)
    if not enabled:
      return
    if logger is not None:  # before any file is touched: a missing extra stops the run at once
      check_loggers(logger)
    path = os.path.join(output_dir, METRICS_FILE)
    with _refused(path, "opening it"):
      os.makedirs(output_dir, exist_ok=True)
      _keep_rows_up_to(path, resume_step)
      self._jsonl = open(path, "a")
    if logger is not None:
      name = os.path.basename(os.path.abspath(output_dir))
      if logger.wandb_enabled:
        self._start(
          "W&B", "logger.wandb_enabled", lambda: _WandbRun(logger.wandb, name, output_dir, run_config)
        )
      if logger.mlflow_enabled:
        self._start(
          "MLflow", "logger.mlflow_enabled", lambda: _MlflowRun(logger.mlflow, name, output_dir, run_config)
        )
    if tensorboard:
      self._start(
        "TensorBoard",
        "logger.tensorboard",
        lambda: _TensorBoard(log_dir or os.path.join(output_dir, "tensorboard"), resume_step),
      )

  def _start(self, name: str, key: str, start) -> None:
    """Starts a tracker; one that fails is reported in a line and left out, the run goes on."""
    try:
      self._trackers.append(_Tracker(name, key, start()))
    except Exception as e:  # pylint: disable=broad-except  (a tracker never stops the run)
      log.warning("%s could not start (%s); %s", name, _one_line(e), _GOES_ON.format(key=key))

  def write(self, step: int, metrics: dict[str, float]) -> None:
    """Records ``metrics`` at ``step`` everywhere the run logs to (process 0 only)."""
    if not self.enabled:
      return
    if self._monitor_devices and not any(k.startswith("validation-") for k in metrics):
      metrics = {**metrics, **device_memory()}
    row = {"step": int(step)}
    row.update({k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()})
    with _refused(self._jsonl.name, f"writing the metrics of step {step}", self._give_up):
      self._jsonl.write(json.dumps(row) + "\n")
      self._jsonl.flush()
    values = {k: float(v) for k, v in metrics.items()}
    for tracker in self._trackers:
      tracker.call("log", int(step), values)

  def close(self) -> None:
    if self.enabled:
      for tracker in self._trackers:
        tracker.call("close")
      if not self._jsonl.closed:
        with _refused(self._jsonl.name, "closing it", self._give_up):
          self._jsonl.close()

  def _give_up(self) -> None:
    """After a refused write: the file closed without another try at its buffered rows, and the
    trackers that write beside it (TensorBoard) stopped, so that nothing tries again as the process
    exits; W&B and MLflow still close their runs."""
    with contextlib.suppress(OSError):
      self._jsonl.close()  # closes the file even when its last flush fails
    for tracker in self._trackers:
      if tracker.writes_files:
        tracker.abandon()


@contextlib.contextmanager
def _refused(path: str, doing: str, give_up=None):
  """A write to ``path`` that the file system refuses becomes one :class:`MetricsWriteError`."""
  try:
    yield
  except OSError as e:
    code = refused_writes.refusal(e)
    if code is None:
      raise
    if give_up is not None:
      give_up()
    need = refused_writes.what_is_needed(code, os.path.dirname(path), None)
    raise MetricsWriteError(
      f"{path}: {os.strerror(code)} ({doing}); {need}. Then run the same command again: it "
      "continues from the run's last checkpoint"
    ) from None


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


def check_loggers(logger) -> None:
  """What the loggers ``logger`` (a :class:`jaxrm.config.LoggerSpec`) enables need, checked before
  anything starts: their packages, and a tracking URI this MLflow can write to.

  Raises:
    ConfigError: a package is missing, or MLflow's URI needs a store this MLflow lacks.
  """
  if logger.wandb_enabled:
    _import("wandb", "wandb", "logger.wandb_enabled")
  if logger.mlflow_enabled:
    _import("mlflow", "mlflow", "logger.mlflow_enabled")
    _check_mlflow_uri(logger.mlflow)


def _import(module: str, extra: str, key: str):
  import importlib

  try:
    return importlib.import_module(module)
  except ImportError:
    raise ConfigError(
      f"{key}=True needs the {module} package: pip install 'jaxrm[{extra}]' (or set {key}=False)"
    ) from None


def _one_line(e: BaseException) -> str:
  """An exception as one short line: its type and the first line of its message."""
  text = str(e).strip().splitlines()
  text = text[0] if text else ""
  text = text if len(text) <= 300 else text[:297] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


class _Tracker:
  """A logger the run mirrors its metrics to; its first failure is one warning line, and the run
  goes on without it."""

  def __init__(self, name: str, key: str, impl):
    self.name, self.key, self._impl = name, key, impl
    self.writes_files = hasattr(impl, "abandon")  # local files, which a full disk refuses too

  def call(self, method: str, *args) -> None:
    if self._impl is None:
      return
    try:
      getattr(self._impl, method)(*args)
    except Exception as e:  # pylint: disable=broad-except  (a tracker never stops the run)
      what = f"step {args[0]}" if method == "log" else "closing"
      log.warning("%s failed at %s (%s); %s", self.name, what, _one_line(e), _GOES_ON.format(key=self.key))
      self.abandon()

  def abandon(self) -> None:
    """Left out for the rest of the run, without another write (see :meth:`_TensorBoard.abandon`)."""
    impl, self._impl = self._impl, None
    if hasattr(impl, "abandon"):
      with contextlib.suppress(Exception):
        impl.abandon()


class _TensorBoard:
  """TensorBoard events under ``log_dir``; a run resumed from ``resume_step`` purges the later
  steps its previous attempt wrote. A value that is not finite (a metric with nothing counted) is
  left out, as ``metrics.jsonl`` writes it as null, instead of tensorboardX warning of it."""

  def __init__(self, log_dir: str, resume_step: int):
    from tensorboardX import SummaryWriter

    self._writer = SummaryWriter(log_dir, purge_step=resume_step + 1 if resume_step else 0)

  def log(self, step: int, metrics: dict[str, float]) -> None:
    for k, v in metrics.items():
      if math.isfinite(v):
        self._writer.add_scalar(k, v, step)
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()

  def abandon(self) -> None:
    """After a failed write (a full disk): tensorboardX's events writer stopped without flushing
    again. Its exit handler would flush what is still buffered, its thread would read a queue
    closed at exit, and its file would flush as it is collected: each would print a traceback
    after the run's own message."""
    events = getattr(getattr(self._writer, "file_writer", None), "event_writer", None)
    if events is None or getattr(events, "_closed", True):
      return
    events._closed = True  # its exit handler then does nothing
    worker = getattr(events, "_worker", None)
    if worker is not None:
      worker.stop()
    records = getattr(getattr(events, "_ev_writer", None), "_py_recordio_writer", None)
    with contextlib.suppress(OSError):
      records.close()  # the file is closed even when its flush fails


class _WandbRun:
  """A W&B run (``logger.wandb``): the config recorded once, each row logged at its step.

  ``WANDB_MODE=offline`` (W&B's own setting) keeps the run on disk, under ``WANDB_DIR`` or the
  output directory.
  """

  def __init__(self, spec, default_name: str, output_dir: str, run_config: dict | None):
    import wandb

    try:
      self._run = wandb.init(
        project=spec.project,
        name=spec.name or default_name,
        config=run_config,
        dir=os.environ.get("WANDB_DIR") or output_dir,
        reinit="create_new",
      )
    except wandb.errors.Error as e:  # not logged in, no network...
      raise RuntimeError(
        f"{_one_line(e)}; run `wandb login`, or set WANDB_MODE=offline to keep the run on disk"
      ) from None

  def log(self, step: int, metrics: dict[str, float]) -> None:
    self._run.log(metrics, step=step)

  def close(self) -> None:
    self._run.finish()


def mlflow_tracking_uri(spec, output_dir: str) -> str:
  """Where an MLflow run is recorded: ``logger.mlflow.tracking_uri``, else MLflow's own
  ``MLFLOW_TRACKING_URI``, else a file store in ``<output_dir>/mlruns`` (``mlflow ui
  --backend-store-uri <output_dir>/mlruns`` shows it)."""
  uri = spec.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
  return uri or os.path.abspath(os.path.join(output_dir, MLFLOW_DIR))


def _check_mlflow_uri(spec) -> None:
  """A database URI needs SQLAlchemy, which ``jaxrm[mlflow]`` (mlflow-skinny) leaves out."""
  import importlib.util

  from mlflow.store.db.db_types import DATABASE_ENGINES

  key = "logger.mlflow.tracking_uri" if spec.tracking_uri else "MLFLOW_TRACKING_URI"
  uri = spec.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
  scheme = urlparse(uri).scheme.split("+")[0]
  if scheme in DATABASE_ENGINES and importlib.util.find_spec("sqlalchemy") is None:
    raise ConfigError(
      f"{key}={uri!r}: MLflow's {scheme} store needs SQLAlchemy, which this MLflow lacks: pip "
      "install mlflow (the full package), use a tracking server (http://...), or leave "
      f"{key} unset to record the run under its output directory ({MLFLOW_DIR}/)"
    )


@contextlib.contextmanager
def _file_store_allowed(uri: str):
  """MLflow 3 keeps its file store (a path or ``file:`` URI) behind ``MLFLOW_ALLOW_FILE_STORE``;
  a run that asks for one (or the default, under its output directory) is allowed it while its
  calls run, and the process's environment is left as it was."""
  if urlparse(uri).scheme not in ("", "file") or "MLFLOW_ALLOW_FILE_STORE" in os.environ:
    yield
    return
  os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
  try:
    yield
  finally:
    os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)


class _MlflowRun:
  """An MLflow run (``logger.mlflow``) in its experiment, at :func:`mlflow_tracking_uri`: the
  config as parameters, each row's metrics at its step. Uses MLflow's client, so no process-wide
  active run is left behind."""

  def __init__(self, spec, default_name: str, output_dir: str, run_config: dict | None):
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    self._uri = mlflow_tracking_uri(spec, output_dir)
    with _file_store_allowed(self._uri):
      self._client = MlflowClient(tracking_uri=self._uri)
      experiment = self._client.get_experiment_by_name(spec.experiment_name)
      experiment_id = (
        experiment.experiment_id
        if experiment is not None
        else self._client.create_experiment(spec.experiment_name)
      )
      run = self._client.create_run(experiment_id, run_name=spec.run_name or default_name)
      self._run_id = run.info.run_id
      items = [Param(k, str(v)[:6000]) for k, v in _flat(run_config or {}).items()]
      for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters per batch
        self._client.log_batch(self._run_id, params=items[i : i + 100])

  def log(self, step: int, metrics: dict[str, float]) -> None:
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    with _file_store_allowed(self._uri):
      self._client.log_batch(self._run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

  def close(self) -> None:
    with _file_store_allowed(self._uri):
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
