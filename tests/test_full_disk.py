"""A checkpoint the disk has no room for: one message naming the folder and the bytes a checkpoint
needs, no traceback, and no partial checkpoint left to be taken for a good one.

The writes fail where Orbax makes them: tensorstore's array writes (after writing part of the
data, reporting the error as tensorstore does) and the JSON items' ``write_text``; and, through the
command line, a real file system refusal (a file size limit: the same write path and text as a
full disk, ``File too large`` instead of ``No space left on device``).
"""

import errno
import gc
import logging
import os
import re
import resource
import signal

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from orbax.checkpoint._src.handlers import json_checkpoint_handler
from orbax.checkpoint._src.serialization import serialization

from jaxrm.run import checkpointing

METRIC = "validation-default_loss"


def _state(value):
  params = nnx.state(nnx.Linear(64, 32, rngs=nnx.Rngs(0)))  # 64x32 + 32 float32: 8,320 bytes
  params = jax.tree.map(lambda x: jnp.full_like(x, value), params)
  return {"params": params, "opt_state": {"mu": jnp.full((1000,), value)}}  # 4,000 bytes


def _array_writes_fail(monkeypatch, code=errno.ENOSPC):
  write = serialization.async_serialize_from_host

  async def fails_midway(*args, **kwargs):
    await write(*args, **kwargs)  # part of the checkpoint is on disk, then the disk is full
    raise ValueError(
      'OUT_OF_RANGE: Error writing "kernel/0.0" in OCDBT database at local file "...": Failed to '
      f"write 8192 bytes to file 22: {os.strerror(code)} [os_error_code='{code}']"
    )

  monkeypatch.setattr(serialization, "async_serialize_from_host", fails_midway)


def _json_writes_fail(monkeypatch):
  async def fails_midway(self, x, directory):
    path = directory / self._filename
    with open(path, "w") as f:
      f.write('{"step": ')
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

  monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", fails_midway)


@pytest.mark.parametrize("where", [_array_writes_fail, _json_writes_fail])
def test_a_full_disk_is_one_message_and_leaves_no_partial_checkpoint(where, tmp_path, monkeypatch, caplog):
  directory = str(tmp_path / "checkpoints")
  ckpt = checkpointing.Checkpointer(directory, metric_name=METRIC)
  ckpt.save(1, _state(1.0), {"position": 1}, {"step": 1}, metrics={METRIC: 0.5})
  where(monkeypatch)
  with caplog.at_level(logging.ERROR), pytest.raises(checkpointing.NoRoomError) as e:
    ckpt.save(2, _state(2.0), {"position": 2}, {"step": 2}, metrics={METRIC: 0.1})
  message = str(e.value)
  assert re.fullmatch(
    re.escape(
      f"{directory}: no room to save the checkpoint of step 2; nothing of it was kept (No space left on device). A checkpoint needs about 12.3 kB (12,320 bytes) (parameters 8.3 kB (8,320 bytes), optimizer state 4.0 kB (4,000 bytes)); "
    )
    + r"[\d.]+ [kMG]B \([\d,]+ bytes\) are free there\. "
    + re.escape(
      "Free some space, or set checkpointing.checkpoint_dir to a disk with room; then run the same "
      "command again: it continues from step 1"
    ),
    message,
  ), message
  assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # Orbax's tracebacks held back
  assert sorted(os.listdir(directory)) == ["1", checkpointing.BEST_FILE]
  assert ckpt.all_steps() == [1] and checkpointing.read_best(directory)["step"] == 1
  ckpt.close()
  monkeypatch.undo()
  again = checkpointing.Checkpointer(directory, metric_name=METRIC)
  _, data, meta = again.restore(1, _state(0.0))
  assert data == {"position": 1} and meta == {"step": 1}
  again.save(2, _state(2.0), {"position": 2}, {"step": 2}, metrics={METRIC: 0.1})  # room again
  assert again.all_steps() == [1, 2]


def test_a_real_refusal_from_the_file_system(tmp_path, caplog):
  """Tensorstore's own report of a write the file system refuses: files over 1 MB fail here (a file
  size limit, EFBIG, through the same write path as a full disk); the parameters take 4 MB."""
  directory = str(tmp_path / "checkpoints")
  ckpt = checkpointing.Checkpointer(directory)
  state = {
    "params": nnx.state(nnx.Linear(1000, 1000, rngs=nnx.Rngs(0))),
    "opt_state": {"count": jnp.zeros((), jnp.int32)},
  }
  limits = resource.getrlimit(resource.RLIMIT_FSIZE)
  handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a refused write, not a killed process
  resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, limits[1]))
  try:
    with caplog.at_level(logging.ERROR), pytest.raises(checkpointing.NoRoomError) as e:
      ckpt.save(1, state, {}, {})
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    signal.signal(signal.SIGXFSZ, handler)
  assert str(e.value).startswith(
    f"{directory}: no room to save the checkpoint of step 1; nothing of it was kept (File too "
    "large). A checkpoint needs about 4.0 MB (4,004,004 bytes) (parameters 4.0 MB (4,004,000 "
    "bytes), optimizer state 4 bytes); "
  )
  assert str(e.value).endswith("it starts from the beginning (no checkpoint yet)")
  assert not [r for r in caplog.records if "File too large" in r.getMessage()]
  assert os.listdir(directory) == []


def test_another_save_failure_keeps_its_traceback(tmp_path, monkeypatch, caplog):
  """Only a lack of room is the user's to fix; any other failure is a bug and stays as it is."""
  ckpt = checkpointing.Checkpointer(str(tmp_path))
  _array_writes_fail(monkeypatch, code=errno.EIO)
  with caplog.at_level(logging.ERROR), pytest.raises(ValueError, match=r"os_error_code='5'"):
    ckpt.save(1, _state(1.0), {}, {})
  assert any(r.levelno >= logging.ERROR for r in caplog.records)


# ------------------------------------------------------------------ other refused writes


# The coroutines of event loops that could not be built are collected unawaited.
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts its open files in /proc (Linux)")
def test_too_few_file_descriptors_is_one_message_and_leaves_no_partial_checkpoint(tmp_path, caplog):
  """A save that runs out of file descriptors (once an AttributeError traceback from an event loop
  that could not be built, and a temporary folder left behind) says what the process needs."""
  directory = str(tmp_path / "checkpoints")
  ckpt = checkpointing.Checkpointer(directory)
  ckpt.save(1, _state(1.0), {"position": 1}, {"step": 1})
  limits = resource.getrlimit(resource.RLIMIT_NOFILE)
  allowed = len(os.listdir("/proc/self/fd")) + 2  # a save opens tens of files; these two are taken at once
  resource.setrlimit(resource.RLIMIT_NOFILE, (allowed, limits[1]))
  try:
    with caplog.at_level(logging.ERROR), pytest.raises(checkpointing.SaveRefusedError) as e:
      ckpt.save(2, _state(2.0), {"position": 2}, {"step": 2})
  finally:
    resource.setrlimit(resource.RLIMIT_NOFILE, limits)
  assert str(e.value).startswith(
    f"{directory}: the checkpoint of step 2 could not be saved; nothing of it was kept (Too many "
    f"open files). This process may open {allowed} files at once (ulimit -n; "
  )
  assert str(e.value).endswith("then run the same command again: it continues from step 1")
  assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
  assert sorted(os.listdir(directory)) == ["1", checkpointing.BEST_FILE]
  ckpt.save(2, _state(2.0), {"position": 2}, {"step": 2})  # descriptors again
  assert ckpt.all_steps() == [1, 2]
  del e
  gc.collect()  # those coroutines, here, where their warning is expected


def test_a_folder_no_checkpoint_can_be_written_in_is_refused_at_start(tmp_path, monkeypatch):
  """A training run's checkpointer tries a write into its folder as it is made, before anything
  trains (before, a read-only folder was found at the first save). Root writes whatever a folder's
  mode says, so the refusal is made where the file system is asked: creating a file there."""
  import tempfile

  directory = str(tmp_path / "checkpoints")

  def refused(*args, dir=None, **kwargs):
    raise PermissionError(errno.EROFS, os.strerror(errno.EROFS), dir)

  monkeypatch.setattr(tempfile, "mkstemp", refused)
  with pytest.raises(checkpointing.SaveRefusedError) as e:
    checkpointing.Checkpointer(directory, check_writable=True)
  assert str(e.value) == (
    f"{directory}: checkpoints cannot be written there (Read-only file system); the folder must be "
    "writable: make it so, or set checkpointing.checkpoint_dir to a folder this user can write (or "
    "checkpointing.enabled=false to train without checkpoints)"
  )
  checkpointing.Checkpointer(directory).close()  # reading needs no write


def test_a_second_ctrl_c_during_a_save_leaves_no_temporary_folder(tmp_path, monkeypatch):
  """Ctrl-C twice stops at once, as Python does, even in a save: what the save had written is
  removed, the earlier checkpoints stay."""
  directory = str(tmp_path / "checkpoints")
  ckpt = checkpointing.Checkpointer(directory)
  ckpt.save(1, _state(1.0), {"position": 1}, {"step": 1})
  write = serialization.async_serialize_from_host
  sent = []

  async def interrupted(*args, **kwargs):
    await write(*args, **kwargs)
    if not sent:  # once, after the first array: others are still being written
      sent.append(os.kill(os.getpid(), signal.SIGINT))

  monkeypatch.setattr(serialization, "async_serialize_from_host", interrupted)
  handler = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    with pytest.raises(KeyboardInterrupt):
      ckpt.save(2, _state(2.0), {"position": 2}, {"step": 2})
  finally:
    signal.signal(signal.SIGINT, handler)
  assert sorted(os.listdir(directory)) == ["1", checkpointing.BEST_FILE]
  assert ckpt.all_steps() == [1]


def test_a_full_disk_for_the_metrics_is_one_message(tmp_path):
  """metrics.jsonl refused (a file size limit: the same refusal as a full disk): one message
  naming the file and what is needed, and closing the writer tries nothing more (before, the
  OSError's text alone, then tracebacks from the writers flushing again at exit)."""
  from jaxrm.run.metrics_writer import MetricsWriteError, MetricsWriter

  writer = MetricsWriter(str(tmp_path), tensorboard=False)
  writer.write(1, {"train/loss": 0.5})
  path = str(tmp_path / "metrics.jsonl")
  limits = resource.getrlimit(resource.RLIMIT_FSIZE)
  handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + 8, limits[1]))
  try:
    with pytest.raises(MetricsWriteError) as e:
      writer.write(2, {"train/loss": 0.25})
    writer.close()
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    signal.signal(signal.SIGXFSZ, handler)
  assert re.fullmatch(
    re.escape(f"{path}: File too large (writing the metrics of step 2); ")
    + r".+ are free there\. Free some space\. Then run the same command again: it "
    r"continues from the run's last checkpoint",
    str(e.value),
  ), str(e.value)
