"""W&B (offline) and MLflow (a local file store) receive the JSONL's metrics, names and steps."""

import glob
import json
import struct
import sys

import pytest
import tiny_run

from jaxrm import metrics_writer
from jaxrm.config import LoggerSpec
from jaxrm.errors import ConfigError


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
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
  uri = f"file://{tmp_path}/mlruns"
  out = str(tmp_path / "run")
  tiny_run.train(
    tiny_run.config(
      model_dir,
      out,
      logger__wandb_enabled=True,
      logger__wandb__project="jaxrm-test",
      logger__mlflow_enabled=True,
      logger__mlflow__tracking_uri=uri,
      logger__mlflow__experiment_name="jaxrm-test",
      logger__mlflow__run_name="tiny",
    )
  )
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
