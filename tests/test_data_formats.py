"""Row sources and the NeMo RL / TRL row formats: what they accept, and what they refuse."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import assistant, user

from jaxrm.data import formats, sources
from jaxrm.data.drops import DropReport
from jaxrm.data.formats import DROP_IDENTICAL
from jaxrm.data.records import PreferenceRecord, StepwiseRecord
from jaxrm.errors import DataError

SRC = "train.jsonl:7"


def nemo_row(**changes):
  row = {
    "context": [user("Capital of Germany?")],
    "completions": [
      {"rank": 0, "completion": [assistant("Berlin.")]},
      {"rank": 1, "completion": [assistant("Munich.")]},
    ],
  }
  row.update(changes)
  return row


def with_completion(i, **changes):
  row = nemo_row()
  row["completions"][i].update(changes)
  return row


# --- Sources --------------------------------------------------------------------------------------


def write_lines(path, *lines):
  path.write_bytes(b"\n".join(lines) + b"\n")
  return str(path)


def test_jsonl_sources_are_one_based_lines_and_skip_blank_lines(tmp_path):
  path = write_lines(tmp_path / "t.jsonl", b'\xef\xbb\xbf{"a": 1}', b"", b'{"a": 2}\r')
  assert list(sources.read_rows(path)) == [(f"{path}:1", {"a": 1}), (f"{path}:3", {"a": 2})]


@pytest.mark.parametrize("data", [[{"a": 1}, {"a": 2}], {"data": [{"a": 1}, {"a": 2}]}])
def test_json_list_or_data_object(tmp_path, data):
  path = tmp_path / "t.json"
  path.write_text(json.dumps(data))
  rows = list(sources.read_rows(str(path)))
  assert rows == [(f"{path}[row 0]", {"a": 1}), (f"{path}[row 1]", {"a": 2})]


def test_parquet_rows_keep_nested_messages(tmp_path):
  path = str(tmp_path / "t.parquet")
  pq.write_table(pa.Table.from_pylist([nemo_row(margin=0.5), nemo_row()]), path)
  rows = list(sources.read_rows(path))
  assert [s for s, _ in rows] == [f"{path}[row 0]", f"{path}[row 1]"]
  assert rows[0][1]["margin"] == 0.5 and rows[0][1]["context"] == nemo_row()["context"]
  assert rows[1][1]["margin"] is None  # a column absent from a row reads as null: not an error
  record = formats.parse_preference(rows[1][1], rows[1][0], DropReport())
  assert record.margin is None and record.completions[1] == [assistant("Munich.")]


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
  import datasets  # pylint: disable=g-import-not-at-top

  datasets.Dataset.from_list([{"a": 1}]).save_to_disk(str(tmp_path / "one"))
  datasets.DatasetDict(
    {
      "train": datasets.Dataset.from_list([{"a": 1}]),
      "validation": datasets.Dataset.from_list([{"a": 2}, {"a": 3}]),
    }
  ).save_to_disk(str(tmp_path / "dict"))
  one, both = str(tmp_path / "one"), str(tmp_path / "dict")
  assert list(sources.read_rows(one)) == [(f"{one}[row 0]", {"a": 1})]
  assert list(sources.read_rows(both, split="validation")) == [
    (f"{both}:validation[row 0]", {"a": 2}),
    (f"{both}:validation[row 1]", {"a": 3}),
  ]
  with pytest.raises(DataError, match=r"has no split 'test'; it has \['train', 'validation'\]"):
    sources.read_rows(both, split="test")


def test_hub_name_goes_to_load_dataset(monkeypatch):
  import datasets  # pylint: disable=g-import-not-at-top

  calls = []
  monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: calls.append((a, kw)) or [{"a": 1}])
  rows = list(sources.read_rows("org/name", split="validation", config="pairs"))
  assert calls == [(("org/name", "pairs"), {"split": "validation"})]
  assert rows == [("org/name:validation[row 0]", {"a": 1})]
  rows = list(sources.read_rows("https://example.org/x.parquet"))
  assert calls[-1] == (("parquet",), {"data_files": "https://example.org/x.parquet", "split": "train"})


def test_hub_failure_is_a_data_error(monkeypatch):
  import datasets  # pylint: disable=g-import-not-at-top

  def fail(*args, **kwargs):
    raise ConnectionError("offline")

  monkeypatch.setattr(datasets, "load_dataset", fail)
  with pytest.raises(DataError) as e:
    sources.read_rows("org/name")
  assert str(e.value) == (
    "org/name: not a local path, and reading it as a hub dataset (split 'train', config None) failed: offline"
  )


def read_error(path, **kwargs) -> str:
  with pytest.raises(DataError) as e:
    list(sources.read_rows(str(path), **kwargs))
  return str(e.value)


def test_malformed_json_line_names_line_and_json_error(tmp_path):
  path = write_lines(tmp_path / "bad.jsonl", b'{"a": 1}', b'{"a": 1 "b": 2}')
  assert read_error(path) == f"{path}:2: not valid JSON: Expecting ',' delimiter at column 9"


def test_invalid_utf8_names_the_line(tmp_path):
  path = write_lines(tmp_path / "bad.jsonl", b'{"a": "ok"}', b'{"a": "caf\xe9"}')
  assert read_error(path) == f"{path}:2: not valid UTF-8 (byte 11 of the line)"
  path = tmp_path / "bad.json"
  path.write_bytes(b'[\n{"a": "ok"},\n{"a": "caf\xe9"}\n]')
  assert read_error(path) == f"{path}:3: not valid UTF-8"


def test_malformed_json_file_names_the_line(tmp_path):
  path = tmp_path / "bad.json"
  path.write_text('[\n{"a": 1},\n{"a": }\n]')
  assert read_error(path) == f"{path}:3: not valid JSON: Expecting value at column 7"


def test_missing_file(tmp_path):
  path = tmp_path / "nope.jsonl"
  assert read_error(path) == f"{path}: no such file or directory"
  assert read_error("./data/train") == "./data/train: no such file or directory"


@pytest.mark.parametrize(
  "name, content, message",
  [
    ("e.jsonl", b"", "the file is empty"),
    ("e.jsonl", b"\n  \n", "has no rows"),
    ("e.json", b"[]", "has no rows"),
    ("e.json", b'{"rows": []}', "expected a JSON list of rows, or an object with a 'data' list"),
    ("e.csv", b"a,b\n", "has no rows"),
    (
      "e.tsv",
      b"a\tb\n",
      "unknown file type; use .jsonl, .json, .parquet, .csv or a directory written by datasets' save_to_disk",
    ),
  ],
)
def test_empty_or_unusable_file(tmp_path, name, content, message):
  path = tmp_path / name
  path.write_bytes(content)
  assert read_error(path) == f"{path}: {message}"


def test_empty_parquet_and_plain_directory(tmp_path):
  path = tmp_path / "e.parquet"
  pq.write_table(pa.table({"a": pa.array([], pa.int64())}), str(path))
  assert read_error(path) == f"{path}: has no rows"
  assert read_error(tmp_path) == (
    f"{tmp_path}: a directory, but not one written by datasets' "
    "save_to_disk (no dataset_dict.json or state.json)"
  )


def test_row_that_is_not_an_object(tmp_path):
  path = write_lines(tmp_path / "t.jsonl", b'{"a": 1}', b'["a", 1]')
  assert read_error(path) == f"{path}:2: a row must be a JSON object, got a list"


# --- Preference rows ------------------------------------------------------------------------------


def parse(row, drops=None):
  return formats.parse_preference(row, SRC, drops if drops is not None else DropReport())


def test_nemo_row():
  row = nemo_row(subset="geo")
  row["context"] = [user("Capital of France?"), assistant("Paris."), user("And Germany?")]
  assert parse(row) == PreferenceRecord(
    context=row["context"],
    completions=([assistant("Berlin.")], [assistant("Munich.")]),
    ranks=(0, 1),
    source=SRC,
    meta={"subset": "geo"},
  )


def test_nemo_ranked_list_keeps_given_order_and_ranks():
  row = nemo_row(margin=2)
  row["completions"] = [
    {"rank": 7, "completion": [assistant("Munich.")]},
    {
      "rank": -1,
      "completion": [assistant("Let me check."), {"role": "tool", "content": "Berlin"}, assistant("Berlin.")],
    },
    {"rank": 3, "completion": [assistant("Bonn, formerly.")]},
  ]
  record = parse(row)
  assert record.ranks == (7, -1, 3) and record.margin == 2.0
  assert record.completions[1][1] == {"role": "tool", "content": "Berlin"}
  assert record.completions[0] == [assistant("Munich.")]


def test_plain_strings_stay_text_and_mixed_rows_become_chat():
  row = nemo_row(context="Q: capital of Germany?\nA:")
  row["completions"] = [{"rank": 0, "completion": " Berlin"}, {"rank": 1, "completion": " Munich"}]
  assert parse(row).context == "Q: capital of Germany?\nA:"
  assert parse(row).completions == (" Berlin", " Munich")
  row["context"] = [user("Capital of Germany?")]
  assert parse(row).completions == ([assistant(" Berlin")], [assistant(" Munich")])


def test_extra_message_keys_are_left_out():
  row = nemo_row(context=[{"role": "user", "content": "Hi", "name": "ann"}])
  assert parse(row).context == [user("Hi")]


def test_trl_standard_explicit_and_implicit_prompt():
  record = parse({"prompt": "The sky is", "chosen": " blue.", "rejected": " green.", "margin": 1.5})
  assert (record.context, record.completions, record.ranks, record.margin) == (
    "The sky is",
    (" blue.", " green."),
    (0, 1),
    1.5,
  )
  record = parse({"chosen": "The sky is blue.", "rejected": "The sky is green."})
  assert (record.context, record.completions) == ("", ("The sky is blue.", "The sky is green."))


def test_trl_conversational_explicit_and_implicit_prompt():
  prompt = [user("What color is the sky?")]
  record = parse({"prompt": prompt, "chosen": [assistant("Blue.")], "rejected": [assistant("Green.")]})
  assert record.context == prompt
  assert record.completions == ([assistant("Blue.")], [assistant("Green.")])
  shared = [user("Hi"), assistant("Hello!"), user("What color is the sky?")]
  record = parse({"chosen": shared + [assistant("Blue.")], "rejected": shared + [assistant("Green.")]})
  assert record.context == shared
  assert record.completions == ([assistant("Blue.")], [assistant("Green.")])


def test_trl_string_prompt_with_conversation_completions_becomes_chat():
  record = parse({"prompt": "Sky color?", "chosen": [assistant("Blue.")], "rejected": "Green."})
  assert record.context == [user("Sky color?")]
  assert record.completions == ([assistant("Blue.")], [assistant("Green.")])


@pytest.mark.parametrize("subset_field, meta", [("subset", {}), ("category", {"subset": "7"}), (None, {})])
def test_subset_passthrough(subset_field, meta):
  record = formats.parse_preference(nemo_row(category=7), SRC, DropReport(), subset_field=subset_field)
  assert record.meta == meta


@pytest.mark.parametrize(
  "row",
  [
    {"chosen": "Same.", "rejected": "Same."},
    {"chosen": [user("Q"), assistant("A")], "rejected": [user("Q"), assistant("A")]},
    nemo_row(
      completions=[
        {"rank": 0, "completion": [assistant("A")]},
        {"rank": 1, "completion": [assistant("B")]},
        {"rank": 2, "completion": [assistant("A")]},
      ]
    ),
    nemo_row(completions=[{"rank": 0, "completion": "A"}, {"rank": 1, "completion": [assistant("A")]}]),
  ],
)
def test_identical_completions_are_dropped_and_counted(row):
  drops = DropReport()
  assert parse(row, drops) is None
  assert drops.counts == {DROP_IDENTICAL: 1} and drops.examples[DROP_IDENTICAL] == [SRC]


ROLE_LIST = "system, user, assistant, tool"


@pytest.mark.parametrize(
  "row, field, message",
  [
    # missing field
    ({"completions": nemo_row()["completions"]}, "context", "is missing; have ['completions']"),
    (with_completion(1, rank=None), "completions[1].rank", "is missing; have ['completion', 'rank']"),
    ({"prompt": "Q", "chosen": "A"}, "rejected", "is missing; have ['chosen', 'prompt']"),
    # wrong type
    (
      nemo_row(completions="A > B"),
      "completions",
      "expected a list of {'rank', 'completion'} objects, got a string",
    ),
    (nemo_row(context=5), "context", "expected a string or a list of messages, got an integer"),
    (
      nemo_row(completions=[1, 2]),
      "completions[0]",
      "expected an object with 'rank' and 'completion', got an integer",
    ),
    (
      nemo_row(context=[user("Hi"), "there"]),
      "context[1]",
      "expected a message object with 'role' and 'content', got a string",
    ),
    (
      nemo_row(context=[{"role": "user", "content": ["part"]}]),
      "context[0].content",
      "expected a string, got a list",
    ),
    (nemo_row(margin="big"), "margin", "expected a finite number, got 'big' (a string)"),
    (nemo_row(margin=float("nan")), "margin", "expected a finite number, got nan (a number)"),
    # too few completions
    (
      nemo_row(completions=[]),
      "completions",
      "has 0 entries; a preference needs at least 2 ranked completions",
    ),
    (
      nemo_row(completions=nemo_row()["completions"][:1]),
      "completions",
      "has 1 entry; a preference needs at least 2 ranked completions",
    ),
    # empty completion text
    (
      with_completion(1, completion=[assistant("  ")]),
      "completions[1].completion",
      "completion text is empty",
    ),
    (with_completion(1, completion=""), "completions[1].completion", "completion text is empty"),
    (
      with_completion(0, completion=[]),
      "completions[0].completion",
      "has no messages; a completion needs at least one",
    ),
    ({"prompt": "Q", "chosen": "A", "rejected": " "}, "rejected", "completion text is empty"),
    # ranks: ties and non-integers
    (
      with_completion(1, rank=0),
      "completions[1].rank",
      "rank 0 is also the rank of completions[0]; ranks must be distinct (remove the tied "
      "completions, or the row)",
    ),
    (with_completion(1, rank=1.5), "completions[1].rank", "expected an integer rank, got 1.5 (a number)"),
    (with_completion(1, rank="1"), "completions[1].rank", "expected an integer rank, got '1' (a string)"),
    (with_completion(1, rank=True), "completions[1].rank", "expected an integer rank, got True (a boolean)"),
    # messages
    (
      nemo_row(context=[{"role": "human", "content": "Hi"}]),
      "context[0].role",
      f"unknown role 'human'; use one of {ROLE_LIST}",
    ),
    (
      with_completion(0, completion=[{"role": "assistant"}]),
      "completions[0].completion[0]",
      "message has no 'content'; each message needs 'role' and 'content'",
    ),
    (
      nemo_row(context=[{"content": "Hi"}]),
      "context[0]",
      "message has no 'role'; each message needs 'role' and 'content'",
    ),
    # an implicit prompt that swallows a whole conversation
    (
      {"chosen": [user("Q")], "rejected": [user("Q"), assistant("A")]},
      "chosen",
      "has no message after the prompt it shares with 'rejected'; give a 'prompt' or a final differing turn",
    ),
  ],
)
def test_bad_preference_row(row, field, message):
  with pytest.raises(DataError) as e:
    parse(row)
  assert str(e.value) == f"{SRC}: field '{field}': {message}"


def test_row_of_neither_format():
  with pytest.raises(DataError) as e:
    parse({"question": "Q", "answer": "A"})
  assert str(e.value) == (
    f"{SRC}: not a preference row: expected NeMo RL keys ('context', 'completions'), TRL keys "
    "('prompt', 'chosen', 'rejected'), a judgment's ('prompt', 'response_a', 'response_b', 'label') "
    "or a labelled item's ('prompt', 'completion', 'label'); got ['answer', 'question']"
  )


def judgment(**changes):
  return {"prompt": "2 + 2?", "response_a": "5", "response_b": "4", "label": "B", **changes}


def test_a_judgment_is_a_preference_with_the_better_response_first():
  b_better = parse(judgment())
  assert (b_better.context, b_better.completions, b_better.ranks) == ("2 + 2?", ("5", "4"), (1, 0))
  for label in ("A", " a ", "A>B"):
    assert parse(judgment(label=label)).ranks == (0, 1)
  assert parse(judgment(label="b>a")).ranks == (1, 0)
  chat = parse(judgment(prompt=[{"role": "user", "content": "2 + 2?"}]))
  assert chat.completions[1] == [{"role": "assistant", "content": "4"}]


def test_a_judged_tie_is_dropped_and_a_bad_label_refused():
  drops = DropReport()
  assert parse(judgment(label="tie"), drops=drops) is None
  assert dict(drops.counts) == {formats.DROP_TIE: 1}
  with pytest.raises(
    DataError,
    match=rf"^{re.escape(SRC)}: field 'label': expected 'A' or 'B' \(the better response\), got 1 \(an integer\); a number is ambiguous",
  ):
    parse(judgment(label=1))
  with pytest.raises(
    DataError, match=rf"^{re.escape(SRC)}: field 'label': expected 'A' or 'B'.*got 'C' \(a string\)$"
  ):
    parse(judgment(label="C"))
  with pytest.raises(DataError, match="field 'response_b'"):
    parse({k: v for k, v in judgment().items() if k != "response_b"})


# --- Stepwise rows --------------------------------------------------------------------------------


def stepwise(**changes):
  row = {"prompt": "2 + 3 × 4?", "completions": ["3 × 4 = 12", "2 + 12 = 15"], "labels": [1, False]}
  row.update(changes)
  return row


def parse_steps(row):
  return formats.parse_stepwise(row, SRC, DropReport())


def test_stepwise_row():
  assert parse_steps(stepwise(subset="easy")) == StepwiseRecord(
    prompt="2 + 3 × 4?",
    steps=("3 × 4 = 12", "2 + 12 = 15"),
    labels=(True, False),
    source=SRC,
    meta={"subset": "easy"},
  )
  record = parse_steps(stepwise(prompt=[{"role": "system", "content": "Be brief."}, user("2+2?")]))
  assert record.prompt[1] == user("2+2?") and type(record.labels[0]) is bool


@pytest.mark.parametrize(
  "row, field, message",
  [
    (stepwise(labels=[True]), "labels", "has 1 labels for 2 steps in 'completions'; give one label per step"),
    (stepwise(labels=[True, 2]), "labels[1]", "expected true/false or 0/1, got 2 (an integer)"),
    (stepwise(labels=[True, "yes"]), "labels[1]", "expected true/false or 0/1, got 'yes' (a string)"),
    (stepwise(labels=[1.0, 0]), "labels[0]", "expected true/false or 0/1, got 1.0 (a number)"),
    (stepwise(completions=[], labels=[]), "completions", "has no steps; a stepwise row needs at least one"),
    (stepwise(completions="3 × 4 = 12"), "completions", "expected a list of step strings, got a string"),
    (stepwise(completions=["3 × 4 = 12", 15]), "completions[1]", "expected a step string, got an integer"),
    (stepwise(completions=["3 × 4 = 12", "\n"]), "completions[1]", "step text is empty"),
    (stepwise(labels="10"), "labels", "expected a list of booleans, got a string"),
    ({"prompt": "Q", "completions": ["a"]}, "labels", "is missing; have ['completions', 'prompt']"),
    (
      stepwise(prompt=[{"role": "robot", "content": "Q"}]),
      "prompt[0].role",
      f"unknown role 'robot'; use one of {ROLE_LIST}",
    ),
  ],
)
def test_bad_stepwise_row(row, field, message):
  with pytest.raises(DataError) as e:
    parse_steps(row)
  assert str(e.value) == f"{SRC}: field '{field}': {message}"
