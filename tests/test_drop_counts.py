"""Nothing is left out silently: rows cut by the row limits, each epoch's remainder and the
validation batches left out are counted in dropped_rows.json and the start-up summary; a second
start on the same files reads the tokenized-example cache and counts the same."""

import json
import os

import pytest
import tiny_run
from helpers import assistant, user, write_jsonl

from jaxrm.data import cache
from jaxrm.data.drops import DropReport


def pair_row(i, bad=False):
  """A pair; ``bad``: both completions the same text, which parsing drops."""
  chosen, rejected = f"It is {2 * i}.", f"It is {2 * i + 1}."
  return {
    "context": [user(f"what is {i} + {i}?")],
    "completions": [
      {"rank": 0, "completion": [assistant(chosen)]},
      {"rank": 1, "completion": [assistant(chosen if bad else rejected)]},
    ],
  }


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("rows")
  # 16 train rows, row 2 bad: 11 records kept by data.max_train_rows=11 (rows 0-11 read and parsed),
  # rows 12-15 not used; 11 examples make 2 global batches of 4, leaving 3 each epoch.
  train = write_jsonl(d / "train.jsonl", [pair_row(i, bad=i == 2) for i in range(16)])
  # 9 validation rows: 7 kept by data.max_val_rows=7, 2 not used; eval.val_batches=3 batches of 2
  # validate 6 of the 7.
  val = write_jsonl(d / "val.jsonl", [pair_row(100 + i) for i in range(9)])
  return train, val


def run_config(model_dir, out, files, **overrides):
  train, val = files
  return tiny_run.config(
    model_dir,
    out,
    data__dataset_name="PreferenceDataset",
    data__train_data_path=train,
    data__val_data_paths={"held_out": val},
    data__max_train_rows=11,
    data__max_val_rows=7,
    train__global_batch_size=4,
    train__micro_batch_size=4,
    train__max_steps=2,
    eval__batch_size=2,
    eval__val_batches=3,
    checkpointing__metric_name="validation-held_out_loss",
    **overrides,
  )


EPOCH_REASON = (
  "not used: the 3 after each epoch's last full global batch of 4 "
  "(train.global_batch_size; other rows each epoch)"
)
TRAIN_LIMIT = "not used: after the first 11 records (data.max_train_rows=11)"
VAL_LIMIT = "not used: after the first 7 records (data.max_val_rows=7)"
VAL_BATCHES = "not used: after eval.val_batches=3 batches (not validated)"


def test_every_row_left_out_is_counted(model_dir, files, tmp_path, capsys):
  out = str(tmp_path / "run")
  tiny_run.train(run_config(model_dir, out, files))
  with open(os.path.join(out, "dropped_rows.json")) as f:
    drops = json.load(f)
  train, val = files
  counts = {name: {r: v["count"] for r, v in d["reasons"].items()} for name, d in drops.items()}
  assert counts["train"] == {TRAIN_LIMIT: 4, EPOCH_REASON: 3, "identical completions (chosen == rejected)": 1}
  assert counts["validation-held_out"] == {VAL_LIMIT: 2, VAL_BATCHES: 1}
  # Only the bad row is dropped; the rows the limits leave out are good rows, not used.
  assert (drops["train"]["total"], drops["train"]["unused"]) == (1, 7)
  assert (drops["validation-held_out"]["total"], drops["validation-held_out"]["unused"]) == (0, 3)
  assert drops["train"]["reasons"][TRAIN_LIMIT]["examples"] == [f"{train}:{n}" for n in (13, 14, 15, 16)]
  assert drops["validation-held_out"]["reasons"][VAL_BATCHES]["examples"] == ["the last 1 of held_out"]
  printed = capsys.readouterr().out
  assert (
    "data: 11 train examples (2 steps/epoch), held_out: 7 validation\n"
    "train: 1 rows dropped, 7 not used (limits)\n" in printed
  )
  assert "validation-held_out: no rows dropped, 3 not used (limits)\n" in printed
  assert f"        4  {TRAIN_LIMIT}  (e.g. {train}:13, {train}:14, {train}:15)" in printed.splitlines()
  assert f"        1  {VAL_BATCHES}  (e.g. the last 1 of held_out)" in printed.splitlines()


def test_second_start_reads_the_cache(model_dir, files, tmp_path, capsys, monkeypatch):
  cache_dir = str(tmp_path / "cache")
  first, second = str(tmp_path / "first"), str(tmp_path / "second")
  tiny_run.train(run_config(model_dir, first, files, data__cache=True, data__cache_dir=cache_dir))
  entries = sorted(e for e in os.listdir(cache_dir) if not e.endswith(".lock"))
  assert len(entries) == 2  # the train and validation files
  printed = capsys.readouterr().out

  def rebuilt(*args, **kwargs):
    raise AssertionError("the second start tokenized again instead of reading the cache")

  monkeypatch.setattr(cache, "_build", rebuilt)
  tiny_run.train(run_config(model_dir, second, files, data__cache=True, data__cache_dir=cache_dir))
  assert sorted(e for e in os.listdir(cache_dir) if not e.endswith(".lock")) == entries
  again = capsys.readouterr().out
  summary = lambda text: text[text.index("data: ") : text.index("steps: ")]
  assert summary(again) == summary(printed)
  for name in ("dropped_rows.json",):
    with open(os.path.join(first, name)) as a, open(os.path.join(second, name)) as b:
      assert json.load(a) == json.load(b)
  # Examples equal to the token: the same validation results and tokens trained on.
  val = lambda out: [
    {k: v for k, v in r.items() if k.startswith("validation-")}
    for r in tiny_run.read_metrics(out)
    if "validation-held_out_loss" in r
  ]
  assert val(first) == val(second) and len(val(first)) == 1
  tokens = lambda out: [
    r["train/packing_efficiency"] for r in tiny_run.read_metrics(out) if "train/loss" in r
  ]
  assert tokens(first) == tokens(second)


def test_console_shows_validation_tables_and_the_end_summary(model_dir, tmp_path, capsys):
  out = str(tmp_path / "run")
  tiny_run.train(tiny_run.config(model_dir, out))
  lines = capsys.readouterr().out.splitlines()
  tables = [i for i, line in enumerate(lines) if line.startswith("validation at step ")]
  assert [lines[i].split(" (")[0] for i in tables] == ["validation at step 2", "validation at step 4"]
  for i in tables:
    assert lines[i + 1].split() == ["default", "train_sample"]
    assert [lines[i + 2 + j].split()[0] for j in range(3)] == ["loss", "accuracy", "margin"]
  end = next(i for i, line in enumerate(lines) if line.startswith("run finished: 4 steps in "))
  assert " tokens/s in train steps" in lines[end]
  assert (
    lines[end + 1].startswith("best checkpoint: step ") and "validation-default_loss = " in lines[end + 1]
  )
  assert lines[end + 1].endswith("(lower is better)")
  assert lines[end + 2] == "final validation: the table at step 4 above"  # printed once, not again
  use = lines.index("use it:")
  assert (
    lines[use + 1]
    == f"  from jaxrm import RewardModel; rm = RewardModel.from_pretrained({out!r})  # the best checkpoint"
  )
  # evaluate's --max_length is the run's data.max_length unless given
  assert (
    lines[use + 2] == f"  python -m jaxrm.evaluate --model={out} --data=demo_arithmetic --split=validation"
  )
  assert lines[use + 3] == f"  python -m jaxrm.export --model={out} --out={out}-hf"


def test_rows_dropped_together_count_each_and_name_one_example():
  report = DropReport()
  report.drop("too long", "row 3")
  report.drop("left over", "the last 7 of train", count=7)
  for i in range(DropReport.max_examples + 2):
    report.drop("too long", f"row {10 + i}")
  assert report.total == 1 + 7 + DropReport.max_examples + 2 and report.unused == 0
  assert report.as_dict()["reasons"]["left over"] == {"count": 7, "examples": ["the last 7 of train"]}
  assert report.examples["too long"] == ["row 3"] + [
    f"row {10 + i}" for i in range(DropReport.max_examples - 1)
  ]
