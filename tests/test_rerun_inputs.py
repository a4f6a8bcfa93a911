"""A rerun is compared with the saved run whatever its checkpoints, and with the files it read: a
data file replaced at its path, a LoRA base changed in place, another checkpoint folder or
checkpointing turned off over a finished run, and a checkpoint folder of another output folder
are each refused before the model loads; ``train.max_steps`` given alone wins over the epochs
(the data repeated), as TRL's ``max_steps``."""

import json
import os
import shutil

import pytest
import tiny_run
from helpers import write_jsonl

from jaxrm.config import TrainSpec
from jaxrm.data import cache
from jaxrm.errors import ConfigError
from jaxrm.run import rerun, run_files, run_lock


def pair(i):
  return {"prompt": f"what is {i} + {i}?", "chosen": f"It is {2 * i}.", "rejected": f"It is {2 * i + 1}."}


def saved_files(out):
  """Each file under ``out`` with its bytes."""
  found = {}
  for d, _, names in os.walk(out):
    for n in names:
      with open(os.path.join(d, n), "rb") as f:
        found[os.path.relpath(os.path.join(d, n), out)] = f.read()
  return found


@pytest.fixture
def finished(baseline, tmp_path):
  """A copy of the baseline: 4 steps done, its checkpoint at step 4."""
  out = str(tmp_path / "run")
  shutil.copytree(baseline, out)
  return out


@pytest.fixture(scope="module")
def lora_run(model_dir, tmp_path_factory):
  """2 LoRA steps over a copy of the tiny model, on 16 pairs of a JSON Lines file; the run's
  config (a function of overrides), its folder, the base folder and the training file."""
  d = tmp_path_factory.mktemp("inputs")
  base = str(d / "base")
  shutil.copytree(model_dir, base)
  train = write_jsonl(d / "train.jsonl", [pair(i) for i in range(16)])
  val = write_jsonl(d / "val.jsonl", [pair(100 + i) for i in range(8)])
  out = str(d / "run")

  def config(**overrides):
    return tiny_run.config(
      base,
      out,
      data__train_data_path=train,
      data__val_data_paths={"default": val},
      train__max_steps=2,
      model__lora__rank=4,
      model__lora__target_modules="q_proj,v_proj",
      logger__tensorboard=False,
      **overrides,
    )

  tiny_run.train(config())
  return config, out, base, train


def test_a_data_file_replaced_at_its_path_is_refused_naming_it(lora_run):
  config, out, _, train = lora_run
  with open(train) as f:
    rows = f.read()
  before = saved_files(out)
  swapped = [
    {**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in map(json.loads, rows.splitlines())
  ]
  write_jsonl(train, swapped)  # the same size: known by its content hash
  try:
    with pytest.raises(ConfigError) as e:
      tiny_run.train(config())
  finally:
    with open(train, "w") as f:
      f.write(rows)
  message = str(e.value)
  assert f"{out} holds a run (checkpoint at step 2) that read files which have changed since:" in message
  assert f"data.train_data_path: {train} changed: other content of the same size" in message
  assert "To resume it, put its files back; " in message
  assert "--config.changed_settings=start_fresh_keep_old" in message
  assert saved_files(out) == before
  # The same bytes written again (a newer modification time): the file is as the run read it.
  with pytest.raises(ConfigError) as e:
    tiny_run.train(config(train__learning_rate=0.5))
  assert "train.learning_rate  0.001 when saved, 0.5 now" in str(e.value)
  assert "changed since" not in str(e.value)


def test_a_lora_base_changed_in_place_is_refused_naming_the_file(lora_run):
  config, out, base, _ = lora_run
  weights = os.path.join(base, "model.safetensors")
  with open(weights, "rb") as f:
    original = f.read()
  with open(weights, "wb") as f:
    f.write(original[:-4] + bytes(4) + b"\0")  # one byte longer
  try:
    with pytest.raises(ConfigError, match=rf"model\.name_or_path: {weights} changed: \d+ bytes"):
      tiny_run.train(config())
  finally:
    with open(weights, "wb") as f:
      f.write(original)


def test_a_new_checkpoint_folder_with_a_new_rate_is_refused(finished, model_dir, tmp_path):
  """Resuming the old checkpoint later at the new rate, or training over the saved run's files."""
  before = saved_files(finished)
  elsewhere = tmp_path / "elsewhere"
  config = tiny_run.config(
    model_dir, finished, checkpointing__checkpoint_dir=str(elsewhere), train__learning_rate=0.01
  )
  with pytest.raises(ConfigError) as e:
    tiny_run.train(config)
  message = str(e.value)
  assert f"{finished} holds a run (no checkpoint in {elsewhere}) trained with other settings" in message
  assert f'checkpointing.checkpoint_dir  "" when saved, "{elsewhere}" now' in message
  assert "train.learning_rate           0.001 when saved, 0.01 now" in message
  assert saved_files(finished) == before
  assert not elsewhere.exists()  # made for its lock, removed: the run stopped before it began


def test_checkpointing_turned_off_over_a_finished_run_is_refused(finished, model_dir):
  before = saved_files(finished)
  with pytest.raises(
    ConfigError,
    match=rf"^{finished} holds a run trained with other settings than this one's:\n"
    r"  checkpointing.enabled  true when saved, false now\n",
  ):
    tiny_run.train(tiny_run.config(model_dir, finished, checkpointing__enabled=False))
  assert saved_files(finished) == before


def test_a_run_whose_checkpoints_were_set_aside_as_damaged_is_still_compared(finished, model_dir):
  checkpoints = os.path.join(finished, "checkpoints")
  for step in [d for d in os.listdir(checkpoints) if d.isdigit()]:
    os.rename(os.path.join(checkpoints, step), os.path.join(checkpoints, f"{step}.damaged"))
  with pytest.raises(
    ConfigError, match=r"\(no checkpoint in .*\n  train.learning_rate  0.001 when saved, 0.01 now"
  ):
    tiny_run.train(tiny_run.config(model_dir, finished, train__learning_rate=0.01))


def test_a_checkpoint_folder_of_another_output_folder_is_refused(finished, model_dir, tmp_path):
  other = str(tmp_path / "other")
  mine = os.path.join(finished, "checkpoints")
  with pytest.raises(
    ConfigError,
    match=rf"checkpointing\.checkpoint_dir={mine} holds the checkpoints of the run in {finished}, not of {other}",
  ):
    tiny_run.train(tiny_run.config(model_dir, other, checkpointing__checkpoint_dir=mine))
  assert not os.path.exists(other)
  # An outside folder names its output folder; one a live run holds is refused by its lock.
  shared = str(tmp_path / "shared")
  rerun.claim_checkpoint_dir(finished, shared)
  with pytest.raises(ConfigError, match=f"holds the checkpoints of the run in {finished}"):
    tiny_run.train(tiny_run.config(model_dir, other, checkpointing__checkpoint_dir=shared))
  fresh = str(tmp_path / "fresh")
  lock = run_lock.hold(fresh, "checkpointing.checkpoint_dir")
  try:
    with pytest.raises(
      ConfigError, match=r"is in use by another run: .* train into another checkpointing\.checkpoint_dir"
    ):
      tiny_run.train(tiny_run.config(model_dir, other, checkpointing__checkpoint_dir=fresh))
    assert os.listdir(fresh) == [run_lock.FILE]
  finally:
    lock.release()
  assert not os.path.exists(other)


def test_max_steps_given_alone_trains_past_an_epoch(model_dir, tmp_path, capsys):
  """60 rows are 7 steps of 8 an epoch; 20 steps repeat the data, as TRL's max_steps does."""
  out = str(tmp_path / "run")
  tiny_run.train(
    tiny_run.config(
      model_dir,
      out,
      data__max_train_rows=60,
      data__val_data_paths={"default": "validation"},
      train__max_steps=20,
      train__max_epochs=TrainSpec.max_epochs,  # as a config that does not set it
      train__log_period=20,
      eval__val_period=0,
      eval__val_at_end=False,
      checkpointing__enabled=False,
      logger__tensorboard=False,
    )
  )
  assert list(tiny_run.train_losses(out)) == [1, 20]
  assert (
    "steps: 0 -> 20 (train.max_steps=20: 2.9 epochs of 7 steps, the data repeated" in capsys.readouterr().out
  )
  assert json.loads(open(os.path.join(out, rerun.RECORD)).read())["config"]["train"]["max_steps"] == 20
  assert not os.path.exists(os.path.join(out, run_files.RUN_CONFIG))  # checkpointing off: the record holds it


def test_a_files_hash_is_computed_once_per_version_and_kept_beside_the_cache(tmp_path, monkeypatch):
  path = write_jsonl(tmp_path / "train.jsonl", [pair(i) for i in range(4)])
  cache_dir = str(tmp_path / "tokenized")
  first = cache.file_hash(path, cache_dir)
  assert os.listdir(tmp_path / "tokenized-file_hashes")

  def hashed_again(path):
    raise AssertionError(f"{path} was hashed again")

  monkeypatch.setattr(cache, "file_fingerprint", hashed_again)
  assert cache.file_hash(path, cache_dir) == first
  os.utime(path, ns=(first["mtime_ns"] + 10**9, first["mtime_ns"] + 10**9))  # a new version
  with pytest.raises(AssertionError, match="hashed again"):
    cache.file_hash(path, cache_dir)
