"""A new user's first runs: own files with the obvious flags, short runs, mistakes found before the
model loads, and the messages each run prints (resumed, already finished, rows not used)."""

import http.server
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import tiny_run
from helpers import write_jsonl

from jaxrm.errors import ConfigError, DataError
from jaxrm.run import trainer

RM = "--config=configs/rm.py"
# configs/rm.py as a short run: rm.py's warmup (5 steps) would outlast 2 steps of its cosine schedule.
SHORT = [
  "--config.train.max_steps=2",
  "--config.train.warmup_steps=1",
  "--config.data.cache=false",
  "--config.logger.tensorboard=false",
]


def pair(i):
  return {"prompt": f"what is {i} + {i}?", "chosen": f"It is {2 * i}.", "rejected": f"It is {2 * i + 1}."}


def start(args, **kwargs):
  return subprocess.Popen(
    args,
    cwd=tiny_run.ROOT,
    env=tiny_run.subprocess_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    **kwargs,
  )


def finish(procs):
  results = {}
  for name, p in procs.items():
    stdout, stderr = p.communicate(timeout=400)
    results[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
  return results


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("own")
  return {
    "dir": d,
    "train": write_jsonl(d / "train.jsonl", [pair(i) for i in range(24)]),
    "val": write_jsonl(d / "val.jsonl", [pair(100 + i) for i in range(8)]),
  }


@pytest.fixture(scope="module")
def runs(model_dir, files):
  """configs/rm.py on own files, and the mistakes of a first run, started together."""
  d, model = files["dir"], f"--config.model.name_or_path={model_dir}"
  own = [RM, f"--config.data.train_data_path={files['train']}", model, *SHORT]
  train = [sys.executable, "-m", "jaxrm.train"]
  procs = {
    "own": start(train + own + [f"--config.output_dir={d / 'own'}"]),
    # A second validation set named on the command line, as NeMo RL's configs name theirs.
    "two_sets": start(
      train
      + own
      + [f"--config.output_dir={d / 'two_sets'}", f"--config.data.val_data_paths.held_out={files['val']}"]
    ),
    "short": start(train + [RM, "--config.train.max_steps=3", f"--config.output_dir={d / 'short'}"]),
    "hub_name": start(
      train
      + [
        RM,
        "--config.data.dataset_name=trl-lib/ultrafeedback_binarized",
        model,
        f"--config.output_dir={d / 'hub_name'}",
      ]
    ),
  }
  results = finish(procs)
  results["dir"] = d
  return results


def ok(result):
  assert result.returncode == 0, tiny_run.describe(result)
  return result.stdout


def error_line(result, code=1):
  assert result.returncode == code, tiny_run.describe(result)
  assert "Traceback" not in result.stderr, result.stderr
  [line] = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
  return line


def test_own_file_trains_with_only_its_path(runs):
  out = ok(runs["own"])
  # No hub lookup of the demo's "validation" split, no checkpoint metric to rank by.
  assert "data: 24 train examples (3 steps/epoch), no validation\n" in out
  assert "run finished: 2 steps in " in out
  assert "\nbest checkpoint:" not in out
  assert "2" in os.listdir(runs["dir"] / "own" / "checkpoints")
  assert "is read as PreferenceDataset rows (data.dataset_name='demo_arithmetic' makes its own rows)" in (
    runs["own"].stderr
  )


def test_a_second_validation_set_on_the_command_line(runs):
  out = ok(runs["two_sets"])
  assert "data: 24 train examples (3 steps/epoch), held_out: 8 validation\n" in out
  # The set is ranked by its own loss: the demo's "default" set is not there.
  assert "best checkpoint: step 2, validation-held_out_loss = " in out
  assert (
    f"python -m jaxrm.evaluate --model={runs['dir'] / 'two_sets'} --data={runs['dir'] / 'val.jsonl'}\n" in out
  )


def test_off_a_terminal_progress_is_plain_lines(runs):
  out = ok(runs["own"])
  assert [line.split(":")[0] for line in out.splitlines() if line.startswith("step ")] == [
    "step 1/2",
    "step 2/2",
  ]
  assert "\r" not in runs["own"].stderr and "\r" not in out


def test_a_short_run_names_the_keys_to_change_before_anything_loads(runs):
  assert error_line(runs["short"], code=2) == (
    "error: train.max_steps=3 ends the run within train.warmup_steps=5, leaving train.lr_scheduler='cosine' "
    "no steps to decay: lower train.warmup_steps (e.g. --config.train.warmup_steps=1), or use "
    "--config.train.lr_scheduler=constant_with_warmup"
  )
  assert not os.path.exists(runs["dir"] / "short")


def test_a_hub_name_as_dataset_name_says_where_it_belongs(runs):
  line = error_line(runs["hub_name"])
  assert line.startswith(
    "error: data.dataset_name 'trl-lib/ultrafeedback_binarized' is not known; use one of "
  )
  assert line.endswith(
    "give it as data.train_data_path='trl-lib/ultrafeedback_binarized', with "
    "data.dataset_name the format of its rows (PreferenceDataset, StepwiseDataset or RatedDataset)"
  )
  assert not os.path.exists(runs["dir"] / "hub_name")


def test_export_takes_model_as_evaluate_and_serve_do(runs, tmp_path):
  ok(runs["two_sets"])
  run = runs["dir"] / "two_sets"
  procs = {
    flag: start([sys.executable, "-m", "jaxrm.export", f"--{flag}={run}", f"--out={tmp_path / flag}"])
    for flag in ("model", "checkpoint")
  }  # --checkpoint: a former name, no longer a flag
  procs["evaluate"] = start(
    [
      sys.executable,
      "-m",
      "jaxrm.evaluate",
      f"--model={run}",
      f"--data={runs['dir'] / 'val.jsonl'}",
      "--batch_size=2",
    ]
  )
  procs["help"] = start([sys.executable, "-m", "jaxrm.evaluate", "--help"])
  results = finish(procs)
  help_text = " ".join(results["help"].stdout.split())
  assert (
    "Directory for eval.json, rewards.png (not with --benchmark) and, for preference data, "
    "length_bias.png (default: print only)."
  ) in help_text
  assert "default: the training run's data.max_length" in help_text
  # Which checkpoint each command takes, and why, before anything loads.
  chosen = re.compile(
    rf"checkpoint: step 2 of {re.escape(str(run))}, the best by validation-held_out_loss = "
    r"[0-9.e-]+ \(lowest\), also the latest\n"
  )
  exported = ok(results["model"])
  assert chosen.match(exported), exported
  assert f"exported {run} (llama, sequence head) to {tmp_path / 'model'}" in exported
  refused = results["checkpoint"]
  assert refused.returncode == 1 and "Traceback" not in refused.stderr
  assert "FATAL Flags parsing error: Unknown command line flag 'checkpoint'" in refused.stderr
  out = ok(results["evaluate"])
  assert chosen.match(out), out
  # The run's data.max_length (configs/rm.py: 128), and how fast scoring went.
  assert f"\njaxrm evaluate: model {run}, data {runs['dir'] / 'val.jsonl'}, max_length 128\n" in out
  assert "\nscored 8 examples in " in out and " examples/s, compiles included)\n" in out
  log = results["evaluate"].stderr
  assert "INFO jaxrm.evaluation.core: scoring 8 preference examples in 4 batches of 2\n" in log
  progress = [line for line in log.splitlines() if line.startswith("INFO jaxrm.evaluation.core: scored ")]
  assert [line.split(" (")[0] for line in progress[:3]] == [
    f"INFO jaxrm.evaluation.core: scored {i} of 4 batches" for i in (1, 2, 3)
  ]
  assert len(progress) == 4 and progress[3].startswith("INFO jaxrm.evaluation.core: scored 8 examples in ")


def test_a_missing_step_names_the_steps_and_a_busy_port_is_found_before_the_model_loads(runs, tmp_path):
  ok(runs["two_sets"])
  run = runs["dir"] / "two_sets"
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    results = finish(
      {
        "export": start(
          [sys.executable, "-m", "jaxrm.export", f"--model={run}", "--step=1", f"--out={tmp_path / 'out'}"]
        ),
        # Before the model (which would load: the step exists) and before the checkpoint is chosen.
        "serve": start([sys.executable, "-m", "jaxrm.serve", f"--model={run}", "--step=2", f"--port={port}"]),
      }
    )
  assert error_line(results["export"]) == (
    f"error: {run}/checkpoints: no checkpoint for step 1; available steps: 2"
  )
  assert not os.path.exists(tmp_path / "out")
  assert error_line(results["serve"]) == (
    f"error: --port={port}: 127.0.0.1:{port} is in use (another server?); stop what listens there, "
    "or choose another --port (--port=0: any free port)"
  )
  assert "checkpoint:" not in results["serve"].stdout


@pytest.fixture
def hub(monkeypatch):
  """A hub that answers every request 503, counting them."""
  from huggingface_hub import constants

  asked = []

  class Unavailable(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
      asked.append(self.path)
      self.send_response(503)
      self.send_header("Content-Length", "0")
      self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
  threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
  monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
  yield asked
  server.shutdown()
  server.server_close()


def test_a_hub_name_the_hub_cannot_give_is_one_line_at_once(hub, tmp_path, monkeypatch, caplog):
  from huggingface_hub import constants

  from jaxrm import RewardModel
  from jaxrm.errors import CheckpointError

  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
  monkeypatch.chdir(tmp_path)
  started = time.monotonic()
  with pytest.raises(CheckpointError) as e:
    RewardModel.from_pretrained("jaxrm-tests/no-such-model")
  assert time.monotonic() - started < 5  # no retries with growing waits
  assert str(e.value) == (
    f"jaxrm-tests/no-such-model: no such file or folder ({tmp_path / 'jaxrm-tests/no-such-model'}), "
    "and as a hub model name it could not be fetched: the hub answered HTTP 503, and the model is "
    "not in the local hub cache"
  )
  assert [p for p in hub if "no-such-model" in p] == ["/api/models/jaxrm-tests/no-such-model"]  # asked once
  assert "huggingface_hub" not in caplog.text  # its warnings stay quiet


# ------------------------------------------------------------------ in process, on the tiny run


def test_resumed_and_finished_runs_say_so(model_dir, tmp_path, capsys):
  out = str(tmp_path / "run")
  tiny_run.train(tiny_run.config(model_dir, out, train__max_steps=2))
  capsys.readouterr()
  tiny_run.train(tiny_run.config(model_dir, out, train__max_steps=4))
  printed = capsys.readouterr().out
  assert "\nsteps: resumed from step 2 -> 4 (train.max_steps), batch 8 groups" in printed
  assert re.search(r"\nrun finished: 2 steps in \S+, resumed from step 2\b", printed)
  tiny_run.train(tiny_run.config(model_dir, out, train__max_steps=4))
  printed = capsys.readouterr().out
  assert "\nsteps: already finished at step 4 (raise train.max_steps to train on), batch 8 groups" in printed
  assert (
    "\nrun already finished at step 4: nothing left to train (raise train.max_steps to train on)\n" in printed
  )


@pytest.fixture
def no_model(monkeypatch):
  """Fails the test if a run gets as far as loading its model."""

  def load(*args, **kwargs):
    raise AssertionError("the model was loaded before the data was checked")

  monkeypatch.setattr(trainer, "_load_model", load)


@pytest.mark.parametrize(
  "name, content, message",
  [
    (
      "bad.jsonl",
      '{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": \n',
      "bad.jsonl:2: not valid JSON: ",
    ),
    ("rows.txt", "prompt,chosen\n", "rows.txt: unknown file type; use .jsonl, .json, .parquet, .csv or a "),
    ("missing.jsonl", None, "missing.jsonl: no such file or directory"),
  ],
)
def test_data_mistakes_stop_the_run_before_the_model_loads(
  model_dir, tmp_path, no_model, name, content, message
):
  path = tmp_path / name
  if content is not None:
    path.write_text(content)
  out = tmp_path / "run"
  with pytest.raises(DataError) as e:
    tiny_run.train(
      tiny_run.config(
        model_dir,
        str(out),
        data__train_data_path=str(path),
        data__val_data_paths={},
        checkpointing__metric_name="",
      )
    )
  assert message in str(e.value)
  assert not os.path.exists(out)


def test_a_bad_validation_set_name_stops_the_run_before_the_model_loads(model_dir, tmp_path, no_model):
  with pytest.raises(DataError, match="validation set name 'a b' cannot be used in metric names"):
    tiny_run.train(
      tiny_run.config(
        model_dir,
        str(tmp_path / "run"),
        data__val_data_paths={"a b": "validation"},
        checkpointing__metric_name="",
      )
    )
  assert not os.path.exists(tmp_path / "run")


def test_a_csv_file_trains(model_dir, tmp_path):
  path = tmp_path / "train.csv"
  path.write_text(
    "prompt,chosen,rejected\n"
    + "".join(f'"what is {i}, doubled?",{2 * i} it is,{2 * i + 1} it is\n' for i in range(16))
  )
  out = str(tmp_path / "run")
  tiny_run.train(
    tiny_run.config(
      model_dir,
      out,
      data__train_data_path=str(path),
      data__val_data_paths={},
      checkpointing__metric_name="",
      train__max_steps=1,
      data__max_train_rows=0,
    )
  )
  assert sorted(tiny_run.train_losses(out)) == [1]


def test_epochs_that_end_within_warmup_name_the_keys_and_leave_no_directory(model_dir, tmp_path):
  out = tmp_path / "run"
  # 16 rows in global batches of 8: an epoch is 2 steps, within 2 warmup steps.
  with pytest.raises(ConfigError) as e:
    tiny_run.train(
      tiny_run.config(
        model_dir, str(out), data__max_train_rows=16, train__max_epochs=1, train__lr_scheduler="cosine"
      )
    )
  assert str(e.value).startswith(
    "train.max_epochs=1 of 2 steps each (16 train examples, train.global_batch_size=8) ends the run within "
    "train.warmup_steps=2, leaving train.lr_scheduler='cosine' no steps to decay: "
  )
  assert not os.path.exists(out)
