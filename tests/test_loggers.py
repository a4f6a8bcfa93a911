"""W&B (offline) and MLflow (a local file store) receive the JSONL's metrics, names and steps."""

import glob
import importlib.util
import json
import logging
import math
import os
import socket
import struct
import sys

import pytest
import start_checks
import tiny_run

from jaxrm.config import LoggerSpec, MlflowSpec
from jaxrm.errors import ConfigError
from jaxrm.run import metrics_writer


def wandb_history(wandb_dir: str) -> dict[tuple[int, str], float]:
  """(step, name) -> value of an offline W&B run's history, read from its ``run-*.wandb`` file: the
  LevelDB log format (32 KiB blocks of 7-byte-headed chunks) after a 7-byte ``:W&B`` header, each
  record a ``wandb_internal_pb2.Record``."""
  from wandb.proto import wandb_internal_pb2

  (path,) = glob.glob(f"{wandb_dir}/wandb/offline-run-*/run-*.wandb")
  with open(path, "rb") as f:
    data = f.read()
  assert data[:4] == b":W&B"
  history, pos, pending, block = {}, 7, b"", 32768
  while pos + 7 <= len(data):
    left = block - pos % block
    _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
    if kind == 0:  # a block's zero-filled tail
      pos += left
      continue
    pending += data[pos + 7 : pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):  # a whole record, or its last chunk
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      pending = b""
      if record.WhichOneof("record_type") == "history":
        # a name with "/" is kept split into nested_key
        items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
        step = items.pop("_step", record.history.step.num)
        history.update({(step, k): v for k, v in items.items() if not k.startswith("_")})
  return history


def jsonl_metrics(output_dir: str) -> dict[tuple[int, str], float]:
  return {
    (row["step"], k): v for row in tiny_run.read_metrics(output_dir) for k, v in row.items() if k != "step"
  }


@pytest.mark.slow
def test_wandb_and_mlflow_receive_every_metric_at_its_step(model_dir, tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_DIR", str(tmp_path))
  monkeypatch.setenv("WANDB_SILENT", "true")
  # MLflow with no tracking URI and none of its switches set: a file store under the run's folder.
  for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.chdir(tmp_path)
  out = str(tmp_path / "run")
  tiny_run.train(
    tiny_run.config(
      model_dir,
      out,
      logger__wandb_enabled=True,
      logger__wandb__project="jaxrm-test",
      logger__mlflow_enabled=True,
      logger__mlflow__experiment_name="jaxrm-test",
      logger__mlflow__run_name="tiny",
    )
  )
  assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ
  assert not (tmp_path / "mlruns").exists() and not (tmp_path / "mlflow.db").exists()
  uri = os.path.join(out, "mlruns")
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read the store back here
  expected = jsonl_metrics(out)
  steps = sorted({s for s, _ in expected})
  assert steps == [1, 2, 3, 4]
  assert {s for s, k in expected if k == "validation-default_loss"} == {2, 4}
  assert wandb_history(str(tmp_path)) == expected

  from mlflow.tracking import MlflowClient

  client = MlflowClient(tracking_uri=uri)
  (run,) = client.search_runs([client.get_experiment_by_name("jaxrm-test").experiment_id])
  assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
  assert run.data.params["train.learning_rate"] == "0.001"
  logged = {
    (m.step, name): m.value
    for name in run.data.metrics
    for m in client.get_metric_history(run.info.run_id, name)
  }
  assert logged == expected


def test_a_missing_extra_is_named(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
  with pytest.raises(
    ConfigError,
    match=r"^logger\.wandb_enabled=True needs the wandb package: pip install "
    r"'jaxrm\[wandb\]' \(or set logger\.wandb_enabled=False\)$",
  ):
    metrics_writer.MetricsWriter(str(tmp_path), logger=LoggerSpec(wandb_enabled=True))
  monkeypatch.setitem(sys.modules, "mlflow", None)
  with pytest.raises(ConfigError, match=r"pip install 'jaxrm\[mlflow\]'"):
    metrics_writer.MetricsWriter(str(tmp_path), logger=LoggerSpec(mlflow_enabled=True))


def test_only_process_zero_logs(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # a disabled writer does not even import it
  writer = metrics_writer.MetricsWriter(
    str(tmp_path / "run"), logger=LoggerSpec(wandb_enabled=True), enabled=False
  )
  writer.write(1, {"train/loss": 1.0})
  writer.close()
  assert not (tmp_path / "run").exists()


def test_device_memory_is_empty_on_cpu():
  import jax

  if jax.default_backend() != "cpu":
    pytest.skip("CPU devices report no memory")
  assert metrics_writer.device_memory() == {}


@pytest.mark.gpu
def test_monitor_gpus_logs_device_memory_each_step(model_dir, tmp_path):
  out = str(tmp_path / "run")
  tiny_run.train(tiny_run.config(model_dir, out, logger__monitor_gpus=True))
  rows = tiny_run.read_metrics(out)
  train_rows = [r for r in rows if "train/loss" in r]
  assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
  for row in train_rows:
    assert row["device_memory/0_in_use_gib"] > 0
    assert row["device_memory/0_peak_gib"] >= row["device_memory/0_in_use_gib"]
  assert all("device_memory/0_in_use_gib" not in r for r in rows if "validation-default_loss" in r)


def mlflow_history(uri: str) -> dict[tuple[int, str], float]:
  from mlflow.tracking import MlflowClient

  client = MlflowClient(tracking_uri=uri)
  (run,) = client.search_runs([client.get_experiment_by_name("jaxrm").experiment_id])
  assert run.info.status == "FINISHED"
  return {
    (m.step, n): m.value for n in run.data.metrics for m in client.get_metric_history(run.info.run_id, n)
  }


@pytest.mark.parametrize("where", ["default", "file_uri"])
def test_mlflow_records_with_no_switch_set(tmp_path, monkeypatch, where):
  for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.chdir(tmp_path)
  uri = f"file://{tmp_path}/store" if where == "file_uri" else ""
  spec = LoggerSpec(mlflow_enabled=True, tensorboard=False, mlflow=MlflowSpec(tracking_uri=uri))
  writer = metrics_writer.MetricsWriter("run", logger=spec, run_config={"train": {"learning_rate": 0.5}})
  writer.write(1, {"train/loss": 0.5})
  writer.write(2, {"train/loss": 0.25})
  writer.close()
  assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ  # the process's environment is left as it was
  assert sorted(os.listdir(tmp_path)) == (["run", "store"] if uri else ["run"])  # nothing in the cwd
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
  assert mlflow_history(uri or str(tmp_path / "run" / "mlruns")) == {
    (1, "train/loss"): 0.5,
    (2, "train/loss"): 0.25,
  }


def test_a_failing_logger_is_one_line_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
  from mlflow.exceptions import MlflowException

  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

  def fail(self, step, metrics):
    raise MlflowException("API request to http://tracking/api failed\nTraceback (most recent call last): ...")

  monkeypatch.setattr("jaxrm.run.metrics_writer._MlflowRun.log", fail)  # a tracking server that fails
  spec = LoggerSpec(mlflow_enabled=True, mlflow=MlflowSpec(tracking_uri=str(tmp_path / "store")))
  out = tmp_path / "run"
  with caplog.at_level(logging.WARNING):
    writer = metrics_writer.MetricsWriter(str(out), logger=spec)
    for step in (1, 2, 3):
      writer.write(step, {"train/loss": 1.0 / step, "train/nothing_counted": math.nan})
    writer.close()
  assert [r.getMessage() for r in caplog.records] == [
    "MLflow failed at step 1 (MlflowException: API request to http://tracking/api failed); the run goes "
    "on without it (logger.mlflow_enabled); metrics.jsonl has every row"
  ]  # nor tensorboardX's "NaN or Inf found in input tensor"
  assert [r["step"] for r in tiny_run.read_metrics(str(out))] == [1, 2, 3]
  (events,) = glob.glob(str(out / "tensorboard" / "events.out.tfevents.*"))
  with open(events, "rb") as f:
    data = f.read()
  # TensorBoard went on; a NaN (a metric with nothing counted) is left out of it, as the JSONL's null.
  assert data.count(b"train/loss") == 3 and b"train/nothing_counted" not in data


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_loggers_that_cannot_start_lose_nothing(model_dir, tmp_path, monkeypatch, caplog):
  # A tracking server that is down, and a TensorBoard folder that cannot be made (a file is in the
  # way): one line each, and the run trains, validates and checkpoints as it would without them.
  monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
  (tmp_path / "taken").write_text("")
  out = str(tmp_path / "run")
  c = tiny_run.config(
    model_dir,
    out,
    train__max_steps=2,
    logger__mlflow_enabled=True,
    logger__mlflow__tracking_uri=f"http://127.0.0.1:{free_port()}",
    logger__log_dir=str(tmp_path / "taken" / "tensorboard"),
  )
  with caplog.at_level(logging.WARNING, logger="jaxrm.run.metrics_writer"):
    tiny_run.train(c)
  lines = [r.getMessage() for r in caplog.records if r.name == "jaxrm.run.metrics_writer"]
  assert len(lines) == 2 and all("\n" not in line for line in lines), lines
  assert lines[0].startswith("MLflow could not start (MlflowException: ")
  assert lines[0].endswith(
    "; the run goes on without it (logger.mlflow_enabled); metrics.jsonl has every row"
  )
  assert lines[1].startswith("TensorBoard could not start (NotADirectoryError: ")
  steps = {r["step"] for r in tiny_run.read_metrics(out) if "validation-default_loss" in r}
  assert steps == {2} and os.path.isdir(os.path.join(out, "checkpoints", "2"))


def test_a_database_uri_this_mlflow_cannot_use_is_refused_before_the_model_loads(
  model_dir, tmp_path, monkeypatch
):
  if importlib.util.find_spec("sqlalchemy") is not None:
    pytest.skip("this MLflow has its database stores")
  monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
  c = tiny_run.config(model_dir, str(tmp_path / "run"), logger__mlflow_enabled=True)
  monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")  # MLflow 3's own default
  assert start_checks.refusal(c, monkeypatch) == (
    "MLFLOW_TRACKING_URI='sqlite:///mlflow.db': MLflow's sqlite store needs SQLAlchemy, which this "
    "MLflow lacks: pip install mlflow (the full package), use a tracking server (http://...), or "
    "leave MLFLOW_TRACKING_URI unset to record the run under its output directory (mlruns/)"
  )
