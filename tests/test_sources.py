"""Reading rows lazily: a row limit stops reading, and a source's fingerprint follows its content."""

import json
import os
import shutil

import pytest
from helpers import write_jsonl

from jaxrm.data import sources
from jaxrm.errors import DataError

ROWS = [{"prompt": f"p{i}", "chosen": "a", "rejected": "b"} for i in range(10)]


def test_jsonl_limit_reads_no_further(tmp_path):
  # Line 5 is blank (not a row) and line 12 is broken: a limit that stops before it never sees it.
  lines = [json.dumps(r) for r in ROWS[:4]] + [""] + [json.dumps(r) for r in ROWS[4:]] + ["{broken"]
  path = str(tmp_path / "t.jsonl")
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  rows = list(sources.read_rows(path, max_rows=6))
  assert [r["prompt"] for _, r in rows] == [f"p{i}" for i in range(6)]
  assert [s for s, _ in rows][-2:] == [f"{path}:6", f"{path}:7"]  # line numbers of the file
  with pytest.raises(DataError, match=r"t.jsonl:12: not valid JSON"):
    list(sources.read_rows(path))
  with pytest.raises(DataError, match="max_rows=-1; use a number of rows, or 0 for all"):
    sources.read_rows(path, max_rows=-1)


def test_parquet_limit(tmp_path):
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq

  path = str(tmp_path / "t.parquet")
  pq.write_table(pa.Table.from_pylist(ROWS), path, row_group_size=3)
  assert [r["prompt"] for _, r in sources.read_rows(path, max_rows=4)] == ["p0", "p1", "p2", "p3"]
  assert [s for s, _ in sources.read_rows(path)][-1] == f"{path}[row 9]"
  assert len(list(sources.read_rows(path, max_rows=100))) == 10


def test_saved_dataset_limit(tmp_path):
  datasets = pytest.importorskip("datasets")
  path = str(tmp_path / "saved")
  datasets.Dataset.from_list(ROWS).save_to_disk(path)
  assert [r["prompt"] for _, r in sources.read_rows(path, max_rows=2)] == ["p0", "p1"]


def test_fingerprint_follows_content_not_mtime(tmp_path):
  path = write_jsonl(tmp_path / "t.jsonl", ROWS)
  first = sources.fingerprint(path)
  assert first["file"] == path and first["size"] == os.path.getsize(path)
  os.utime(path, (1, 1))
  assert sources.fingerprint(path) == first
  write_jsonl(path, ROWS[::-1])  # same size, other bytes
  assert sources.fingerprint(path)["size"] == first["size"]
  assert sources.fingerprint(path) != first
  directory = tmp_path / "dir"
  directory.mkdir()
  shutil.copy(path, directory / "a.jsonl")
  before = sources.fingerprint(str(directory))
  write_jsonl(directory / "a.jsonl", ROWS)
  assert sources.fingerprint(str(directory)) != before
  with pytest.raises(DataError, match="missing.jsonl: no such file or directory"):
    sources.fingerprint(str(tmp_path / "missing.jsonl"))


def test_csv_rows_stream_with_their_row_index(tmp_path):
  path = tmp_path / "pairs.csv"
  path.write_text('prompt,chosen,rejected\n"a, quoted","b\nwith a newline",c\nd,e,f\n')
  assert list(sources.read_rows(str(path))) == [
    (f"{path}[row 0]", {"prompt": "a, quoted", "chosen": "b\nwith a newline", "rejected": "c"}),
    (f"{path}[row 1]", {"prompt": "d", "chosen": "e", "rejected": "f"}),
  ]
  assert [s for s, _ in sources.read_rows(str(path), max_rows=1)] == [f"{path}[row 0]"]


def test_a_split_name_reads_that_split_of_a_public_dataset():
  from jaxrm.data import registry

  # The demo configs' data.val_data_paths={"default": "validation"} on UltraFeedback: its test_prefs,
  # not a hub dataset named "validation".
  key = registry.resolve("UltraFeedback", "validation", split="validation")
  assert key == ("HuggingFaceH4/ultrafeedback_binarized", "test_prefs", {"config": None})


def test_a_lone_surrogate_is_named_by_file_row_and_field(tmp_path):
  """JSON's escapes can spell half a surrogate pair, which no tokenizer reads: the row is refused
  where it is read, naming it; a whole pair, or the escape's text itself, reads as before."""
  from jaxrm.data import registry
  from jaxrm.data.drops import DropReport

  good = {"context": "p", "completions": [{"rank": 0, "completion": "a"}, {"rank": 1, "completion": "b"}]}
  lines = [json.dumps(good), json.dumps({**good, "context": "smile \ud83d\ude00"}), json.dumps(good)]
  lines.append(json.dumps({**good, "context": "a backslash: \\ud800"}))
  bad = json.loads(json.dumps(good))
  bad["completions"][1]["completion"] = [{"role": "assistant", "content": "x\ud800y"}]
  path = str(tmp_path / "train.jsonl")
  with open(path, "w") as f:
    f.write("\n".join([*lines, json.dumps(bad)]) + "\n")
  field = r"field 'completions\[1\]\.completion\[0\]\.content' holds a lone surrogate"
  with pytest.raises(DataError, match=rf"^{path}:5: {field}"):
    registry.load_records("PreferenceDataset", path, drops=DropReport())
  assert len(list(sources.read_rows(path, max_rows=4))) == 4
  as_json = str(tmp_path / "train.json")
  with open(as_json, "w") as f:
    f.write("[" + ",".join([lines[0], json.dumps({"context": "p", "\udfff": 1})]) + "]")
  with pytest.raises(DataError, match=r"train\.json\[row 1\]: a key of the row holds a lone surrogate"):
    list(sources.read_rows(as_json))
