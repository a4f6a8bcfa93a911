"""Public-dataset adapters on rows in their published schema, and the dataset registry."""

import copy

import pytest
from helpers import assistant, user, write_jsonl

from jaxrm.data import adapters, registry
from jaxrm.data.drops import DropReport
from jaxrm.data.records import PreferenceRecord, StepwiseRecord
from jaxrm.errors import DataError

SRC = "raw.jsonl:3"


def error_of(fn, *args, **kwargs) -> str:
  with pytest.raises(DataError) as e:
    fn(*args, **kwargs)
  return str(e.value)


# --- HelpSteer3 -----------------------------------------------------------------------------------

HELPSTEER3 = {
  "domain": "general",
  "language": "english",
  "context": [user("Name a prime."), assistant("7."), user("Another one?")],
  "response1": "11.",
  "response2": "9.",
  "overall_preference": -2,
  "individual_preference": [
    {"score": -2, "reasoning": "9 is not prime.", "feedback1": "Right.", "feedback2": "Wrong."},
  ],
}


def helpsteer3(**changes):
  return {**copy.deepcopy(HELPSTEER3), **changes}


@pytest.mark.parametrize(
  "preference, chosen, rejected", [(-3, "11.", "9."), (-1, "11.", "9."), (1, "9.", "11."), (3, "9.", "11.")]
)
def test_helpsteer3_sign_picks_the_preferred_response(preference, chosen, rejected):
  record = adapters.helpsteer3(
    helpsteer3(overall_preference=preference), SRC, DropReport(), subset_field="domain"
  )
  assert record == PreferenceRecord(
    context=HELPSTEER3["context"],
    completions=([assistant(chosen)], [assistant(rejected)]),
    ranks=(0, 1),
    source=SRC,
    meta={"subset": "general"},
    strength=float(abs(preference)),
  )


def test_helpsteer3_string_context_is_a_user_turn():
  record = adapters.helpsteer3(helpsteer3(context="Name a prime."), SRC, DropReport())
  assert record.context == [user("Name a prime.")]


def test_helpsteer3_tie_is_dropped_and_counted():
  drops = DropReport()
  assert adapters.helpsteer3(helpsteer3(overall_preference=0), SRC, drops) is None
  assert drops.counts == {adapters.DROP_HELPSTEER3_TIE: 1}
  assert drops.examples[adapters.DROP_HELPSTEER3_TIE] == [SRC]


def test_helpsteer3_identical_responses_are_dropped():
  drops = DropReport()
  assert adapters.helpsteer3(helpsteer3(response2="11."), SRC, drops) is None
  assert set(drops.counts) == {"identical completions (chosen == rejected)"}


@pytest.mark.parametrize(
  "changes, message",
  [
    (
      {"overall_preference": 4},
      "field 'overall_preference': expected an integer in -3..3, got 4 (an integer)",
    ),
    (
      {"overall_preference": "-1"},
      "field 'overall_preference': expected an integer in -3..3, got '-1' (a string)",
    ),
    ({"response2": ""}, "field 'response2': completion text is empty"),
    (
      {"response1": None},
      "field 'response1': is missing; have ['context', 'domain', "
      "'individual_preference', 'language', 'overall_preference', 'response1', 'response2']",
    ),
  ],
)
def test_helpsteer3_bad_rows(changes, message):
  row = helpsteer3(**changes)
  assert error_of(adapters.helpsteer3, row, SRC, DropReport()) == f"{SRC}: {message}"


# --- UltraFeedback --------------------------------------------------------------------------------

PROMPT = "Write a haiku about rain."
ULTRAFEEDBACK = {
  "prompt": PROMPT,
  "prompt_id": "5a6e0c0f3e1b7a4b8f2c9d1e0a3b5c7d9e1f2a4b6c8d0e2f4a6b8c0d2e4f6a8b",
  "chosen": [user(PROMPT), assistant("Soft rain on the roof...")],
  "rejected": [user(PROMPT), assistant("Rain is water.")],
  "messages": [user(PROMPT), assistant("Soft rain on the roof...")],
  "score_chosen": 8.5,
  "score_rejected": 4.0,
}


def test_ultrafeedback_prompt_is_the_shared_user_turn():
  record = adapters.ultrafeedback(ULTRAFEEDBACK, SRC, DropReport())
  assert record == PreferenceRecord(
    context=[user(PROMPT)],
    completions=([assistant("Soft rain on the roof...")], [assistant("Rain is water.")]),
    ranks=(0, 1),
    source=SRC,
  )


def test_ultrafeedback_equal_scores_are_a_dropped_tie():
  drops = DropReport()
  row = {**ULTRAFEEDBACK, "score_rejected": 8.5}
  assert adapters.ultrafeedback(row, SRC, drops) is None
  assert drops.counts == {adapters.DROP_ULTRAFEEDBACK_TIE: 1}


@pytest.mark.parametrize(
  "changes, message",
  [
    (
      {"score_chosen": 3},
      "field 'score_chosen': 3.0 is below score_rejected 4.0; expected the "
      "chosen response to score at least as high",
    ),
    (
      {"score_rejected": None},
      "field 'score_rejected': is missing; have ['chosen', 'messages', "
      "'prompt', 'prompt_id', 'rejected', 'score_chosen', 'score_rejected']",
    ),
    ({"chosen": PROMPT}, "field 'chosen': expected a list of messages, got a string"),
    ({"rejected": [user(PROMPT)]}, "field 'rejected': has no messages; a completion needs at least one"),
    (
      {"rejected": [user(PROMPT), {"role": "gpt", "content": "x"}]},
      "field 'rejected[1].role': unknown role 'gpt'; use one of system, user, assistant, tool",
    ),
  ],
)
def test_ultrafeedback_bad_rows(changes, message):
  row = {**ULTRAFEEDBACK, **changes}
  assert error_of(adapters.ultrafeedback, row, SRC, DropReport()) == f"{SRC}: {message}"


# --- PRM800K --------------------------------------------------------------------------------------


def rated(text, rating, flagged=None):
  return {"text": text, "rating": rating, "flagged": flagged}


def step(*completions, chosen=0, human=None):
  return {"completions": list(completions), "human_completion": human, "chosen_completion": chosen}


def prm800k_row(steps, finish_reason="found_error"):
  """A phase-2 line of prm800k/data/phase2_train.jsonl, shortened."""
  return {
    "labeler": "340d89bc-f5b7-45e9-b272-909ba68ee363",
    "timestamp": "2023-01-22T04:34:27.052924",
    "generation": 9,
    "is_quality_control_question": False,
    "is_initial_screening_question": False,
    "question": {
      "problem": "What is $2^3 + 1$?",
      "ground_truth_answer": "9",
      "pre_generated_steps": ["I compute $2^3 = 8$.", "Adding one gives $8 + 1 = 10$.", "# Answer\n\n10"],
      "pre_generated_answer": "10",
      "pre_generated_verifier_score": 0.0107,
    },
    "label": {"steps": steps, "total_time": 278270, "finish_reason": finish_reason},
  }


FOUND_ERROR = prm800k_row(
  [
    step(rated("Let me think about powers.", 0)),
    step(rated("I compute $2^3 = 8$.", 1)),
    # The labeller stops at the error: no completion chosen; the alternatives are rated too.
    step(rated("Adding one gives $8 + 1 = 10$.", -1), rated("So the sum is $9$.", 1, False), chosen=None),
  ]
)
PROBLEM = "What is $2^3 + 1$?"
STEPS = ("Let me think about powers.", "I compute $2^3 = 8$.", "Adding one gives $8 + 1 = 10$.")


@pytest.mark.parametrize(
  "neutral, labels", [("correct", (True, True, False)), ("incorrect", (False, True, False))]
)
def test_prm800k_found_error_row(neutral, labels):
  record = adapters.prm800k(FOUND_ERROR, SRC, DropReport(), neutral=neutral)
  assert record == StepwiseRecord(prompt=PROBLEM, steps=STEPS, labels=labels, source=SRC)


def test_prm800k_neutral_drop_drops_the_row():
  drops = DropReport()
  assert adapters.prm800k(FOUND_ERROR, SRC, drops, neutral="drop") is None
  assert drops.counts == {adapters.DROP_PRM800K_NEUTRAL: 1}
  row = prm800k_row(
    [step(rated("I compute $2^3 = 8$.", 1)), step(rated("So $9$.", 1))], finish_reason="solution"
  )
  assert adapters.prm800k(row, SRC, drops, neutral="drop").labels == (True, True)


def test_prm800k_stops_at_the_first_error_and_takes_human_steps():
  row = prm800k_row(
    [
      step(rated("I compute $2^3 = 6$.", -1), rated("I compute $2^3 = 8$.", 1), chosen=1),
      step(rated("So the sum is $10$.", -1), chosen=None, human={"text": "So the sum is $9$."}),
      step(rated("# Answer\n\n10", -1)),
      step(rated("Never reached.", 1)),
    ]
  )
  record = adapters.prm800k(row, SRC, DropReport())
  assert record.steps == ("I compute $2^3 = 8$.", "So the sum is $9$.", "# Answer\n\n10")
  assert record.labels == (True, True, False)


def test_prm800k_row_without_rated_steps_is_dropped():
  drops = DropReport()
  for steps in ([], [step(rated("Hmm.", 0), chosen=None)]):
    assert adapters.prm800k(prm800k_row(steps, "give_up"), SRC, drops) is None
  assert drops.counts == {adapters.DROP_PRM800K_NO_STEP: 2}


@pytest.mark.parametrize(
  "steps, message",
  [
    (
      [step(rated("a", 1), chosen=2)],
      "field 'label.steps[0].chosen_completion': 2 is not an index into its 1 completions",
    ),
    (
      [step(rated("a", 1)), step(rated("b", 2))],
      "field 'label.steps[1].completions[0].rating': expected -1, 0 or 1, got 2",
    ),
    (
      [step(rated("a", None))],
      "field 'label.steps[0].completions[0].rating': is missing; have ['flagged', 'rating', 'text']",
    ),
    (
      [step(rated(" ", 1))],
      "field 'label.steps[0].completions[0].text': expected a non-empty step string, got ' '",
    ),
  ],
)
def test_prm800k_bad_rows(steps, message):
  assert error_of(adapters.prm800k, prm800k_row(steps), SRC, DropReport()) == f"{SRC}: {message}"


def test_prm800k_bad_question_and_option():
  row = prm800k_row([])
  del row["question"]["problem"]
  assert error_of(adapters.prm800k, row, SRC, DropReport()).startswith(
    f"{SRC}: field 'question.problem': is missing"
  )
  assert error_of(adapters.prm800k, FOUND_ERROR, SRC, DropReport(), neutral="skip") == (
    "PRM800K: neutral='skip'; use one of 'correct', 'incorrect', 'drop'"
  )


# --- Math-Shepherd --------------------------------------------------------------------------------

QUESTION = "Janet has 3 apples and buys 2 more. How many apples does she have?"
SOLUTION = (
  "Step 1: She starts with 3 apples. {}\nStep 2: She buys 2, so 3 + 2 = 6. {}\nStep 3: The answer is: 6 {}"
)
SHEPHERD = {
  "input": f"{QUESTION} {SOLUTION.format('ки', 'ки', 'ки')}",
  "label": f"{QUESTION} {SOLUTION.format('+', '-', '-')}",
  "task": "GSM8K",
}


def test_math_shepherd_row():
  record = adapters.math_shepherd(SHEPHERD, SRC, DropReport(), subset_field="task")
  assert record == StepwiseRecord(
    prompt=QUESTION,
    steps=(
      "Step 1: She starts with 3 apples.",
      "Step 2: She buys 2, so 3 + 2 = 6.",
      "Step 3: The answer is: 6",
    ),
    labels=(True, False, False),
    source=SRC,
    meta={"subset": "GSM8K"},
  )


def test_math_shepherd_without_step_one_is_dropped():
  row = {"input": "How many? ки\nStep 2: Four. ки", "label": "How many? +\nStep 2: Four. +"}
  drops = DropReport()
  assert adapters.math_shepherd(row, SRC, drops) is None
  assert drops.counts == {adapters.DROP_SHEPHERD_NO_FIRST_STEP: 1}


EXPECTED = "expected the same text with each 'ки' replaced by '+' or '-'"


@pytest.mark.parametrize(
  "changes, message",
  [
    (
      {"label": SHEPHERD["label"].replace("6. -", "6. ?")},
      f"field 'label': differs from 'input' at step tag 2; {EXPECTED}",
    ),
    (
      {"label": SHEPHERD["label"].replace("3 apples.", "three apples.")},
      f"field 'label': differs from 'input' at step tag 1; {EXPECTED}",
    ),
    (
      {"label": SHEPHERD["label"] + " extra"},
      f"field 'label': differs from 'input' after the last step tag; {EXPECTED}",
    ),
    ({"input": QUESTION, "label": QUESTION}, "field 'input': has no 'ки' step tag"),
    (
      {"input": SHEPHERD["input"] + " Done.", "label": SHEPHERD["label"] + " Done."},
      "field 'input': has text after its last 'ки' step tag",
    ),
    (
      {"input": SHEPHERD["input"] + " ки", "label": SHEPHERD["label"] + " +"},
      "field 'input': step 4 is empty",
    ),
    ({"label": 5}, "field 'label': expected a string, got an integer"),
  ],
)
def test_math_shepherd_bad_rows(changes, message):
  row = {**SHEPHERD, **changes}
  assert error_of(adapters.math_shepherd, row, SRC, DropReport()) == f"{SRC}: {message}"


# --- Registry -------------------------------------------------------------------------------------


def test_names_and_kinds():
  assert registry.DATASET_NAMES == (
    "PreferenceDataset",
    "HelpSteer3",
    "UltraFeedback",
    "PRM800K",
    "MathShepherd",
    "StepwiseDataset",
    "RatedDataset",
    "HelpSteer2",
    "demo_arithmetic",
    "demo_arithmetic_steps",
    "demo_attributes",
  )
  assert [n for n in registry.DATASET_NAMES if registry.is_stepwise(n)] == [
    "PRM800K",
    "MathShepherd",
    "StepwiseDataset",
    "demo_arithmetic_steps",
  ]
  assert [n for n in registry.DATASET_NAMES if registry.rows_of(n) == "rated"] == [
    "RatedDataset",
    "HelpSteer2",
    "demo_attributes",
  ]
  assert error_of(registry.is_stepwise, "HelpSteer4") == (
    "data.dataset_name 'HelpSteer4' is not known; use one of " + ", ".join(registry.DATASET_NAMES)
  )


def test_preference_dataset_from_jsonl_counts_drops(tmp_path):
  path = write_jsonl(
    tmp_path / "train.jsonl",
    [
      {"prompt": "Q1", "chosen": "A", "rejected": "B", "subset": "x"},
      {"prompt": "Q2", "chosen": "C", "rejected": "C"},
      {"prompt": "Q3", "chosen": "D", "rejected": "E"},
    ],
  )
  drops = DropReport()
  drops.drop("earlier reason", "other.jsonl:1")
  records = registry.load_records("PreferenceDataset", path, drops=drops)
  assert [(r.source, r.context, r.meta) for r in records] == [
    (f"{path}:1", "Q1", {"subset": "x"}),
    (f"{path}:3", "Q3", {}),
  ]
  assert drops.counts == {"earlier reason": 1, "identical completions (chosen == rejected)": 1}
  assert drops.examples["identical completions (chosen == rejected)"] == [f"{path}:2"]


def test_error_names_file_line_and_field(tmp_path):
  bad = {"context": "Q", "completions": [{"rank": 0, "completion": "A"}, {"rank": 1.5, "completion": "B"}]}
  path = write_jsonl(tmp_path / "val.jsonl", [{"prompt": "Q", "chosen": "A", "rejected": "B"}, bad])
  assert error_of(registry.load_records, "PreferenceDataset", path, drops=DropReport()) == (
    f"{path}:2: field 'completions[1].rank': expected an integer rank, got 1.5 (a number)"
  )


def test_stepwise_dataset_and_all_rows_dropped(tmp_path):
  path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "Q", "completions": ["a"], "labels": [1]}])
  assert registry.load_records("StepwiseDataset", path, drops=DropReport())[0].labels == (True,)
  path = write_jsonl(tmp_path / "ties.jsonl", [{"chosen": "A", "rejected": "A"}] * 2)
  message = error_of(registry.load_records, "PreferenceDataset", path, drops=DropReport())
  assert message.startswith(f"{path}: all 2 rows were dropped\n{path}: 2 rows dropped\n")


@pytest.fixture
def hub(monkeypatch):
  """Records datasets.load_dataset calls and answers each with the rows given."""
  import datasets as hf  # pylint: disable=g-import-not-at-top

  calls, answers = [], []
  monkeypatch.setattr(hf, "load_dataset", lambda *a, **kw: calls.append((a, kw)) or answers.pop())
  return calls, answers


def test_public_datasets_read_their_usual_place(hub):
  calls, answers = hub
  answers[:] = [[FOUND_ERROR], [SHEPHERD], [ULTRAFEEDBACK], [HELPSTEER3]]
  kwargs = {"drops": DropReport()}
  records = registry.load_records("HelpSteer3", None, split="validation", **kwargs)
  assert records[0].meta == {"subset": "general"} and records[0].source == (
    "nvidia/HelpSteer3:validation[row 0]"
  )
  registry.load_records("UltraFeedback", None, split="validation", **kwargs)
  records = registry.load_records("MathShepherd", None, **kwargs)
  assert records[0].meta == {"subset": "GSM8K"}
  records = registry.load_records("PRM800K", None, split="validation", neutral="incorrect", **kwargs)
  assert records[0].labels == (False, True, False)
  url = "https://github.com/openai/prm800k/raw/refs/heads/main/prm800k/data/phase2_test.jsonl"
  assert calls == [
    (("nvidia/HelpSteer3", "preference"), {"split": "validation"}),
    (("HuggingFaceH4/ultrafeedback_binarized", None), {"split": "test_prefs"}),
    (("peiyi9979/Math-Shepherd", None), {"split": "train"}),
    (("json",), {"data_files": url, "split": "train"}),
  ]


def test_subset_field_option_and_local_path(tmp_path):
  path = write_jsonl(tmp_path / "hs3.jsonl", [HELPSTEER3])
  records = registry.load_records("HelpSteer3", path, drops=DropReport(), subset_field="language")
  assert records[0].meta == {"subset": "english"}


@pytest.mark.parametrize(
  "name, path, options, message",
  [
    (
      "PreferenceDataset",
      None,
      {},
      "PreferenceDataset needs a path: set data.train_data_path (and "
      "data.val_data_paths) to a .jsonl, .json or .parquet file, a save_to_disk directory or a hub "
      "name",
    ),
    (
      "HelpSteer3",
      None,
      {"neutral": "drop"},
      "HelpSteer3: unknown option(s) ['neutral']; it takes ['config', 'subset_field']",
    ),
    (
      "demo_arithmetic",
      None,
      {"config": "x"},
      "demo_arithmetic: unknown option(s) ['config']; it takes ['num_rows', 'seed', 'subset_field']",
    ),
    (
      "demo_arithmetic",
      "data/train.jsonl",
      {},
      "demo_arithmetic makes its own rows: give no path, "
      "or one of ('train', 'validation') to choose the split (got 'data/train.jsonl')",
    ),
    ("demo_arithmetic_steps", None, {"num_rows": 0}, "demo_arithmetic_steps:train: has no rows"),
  ],
)
def test_registry_errors(name, path, options, message):
  assert error_of(registry.load_records, name, path, drops=DropReport(), **options) == message


def test_demo_sets_take_the_split_as_path():
  records = registry.load_records("demo_arithmetic", "validation", drops=DropReport(), num_rows=3, seed=1)
  assert [r.source for r in records] == [f"demo_arithmetic:validation[row {i}]" for i in range(3)]
  assert all(r.meta["subset"] for r in records)


@pytest.mark.parametrize("name", ["held_out", "HelpSteer3-val", "v1.2", "0"])
def test_val_set_names_usable_in_metric_names(name):
  assert registry.check_val_set_name(name) == name


@pytest.mark.parametrize(
  "name, message",
  [
    (
      "my set",
      "validation set name 'my set' cannot be used in metric names such as "
      "'validation-my set_loss': it contains ' '; use only letters, digits, '_', '-' and '.'",
    ),
    (
      "a/b:c",
      "validation set name 'a/b:c' cannot be used in metric names such as "
      "'validation-a/b:c_loss': it contains '/', ':'; use only letters, digits, '_', '-' and '.'",
    ),
    ("", "validation set name '': must be a non-empty string"),
    (3, "validation set name 3: must be a non-empty string"),
  ],
)
def test_val_set_names_unusable_in_metric_names(name, message):
  assert error_of(registry.check_val_set_name, name) == message
