"""Token and label layouts, truncation and drop rules, with SmolLM2's real ChatML tokenizer."""

import copy

import numpy as np
import pytest
from helpers import IM_END, IM_START, NL, assistant, pair_record, user

from jaxrm.data import tokenize as tk
from jaxrm.data.drops import DropReport
from jaxrm.data.pipeline import make_eval_batches
from jaxrm.data.records import PreferenceRecord, StepwiseRecord
from jaxrm.errors import DataError

# The SmolLM2 chat template adds this system turn when a conversation has none.
SYSTEM = (
  "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
  """SmolLM2's tokenizer (tests/conftest.py), by a short name; tests that change it change a copy."""
  return smollm2_tokenizer


@pytest.fixture(scope="module")
def llama3_like(tok):
  """SmolLM2's vocabulary made to behave like Llama 3: the tokenizer adds BOS to text, the
  template writes BOS too, and turns end with the eos token (also the pad token) with nothing
  after it."""
  t = copy.deepcopy(tok)
  t.bos_token = "<|endoftext|>"  # id 0
  t.add_bos_token = True
  t.chat_template = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
  )
  return t


def opts(**kw):
  return tk.TokenizeOptions(**kw)


def test_chat_pair_layout_best_first(tok):
  drops = DropReport()
  ex = tk.tokenize_preference(
    pair_record([user("2+3?")], [assistant("5")], [assistant("6")]), tok, opts(), drops
  )
  assert ex.ranks == (0, 1) and ex.margin == 0.0 and drops.total == 0
  chosen, rejected = ex.input_ids
  assert chosen.dtype == np.int32
  assert (
    tok.decode(chosen) == SYSTEM + "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
  )
  # "<|im_start|>" "assistant" "\n" "5" "<|im_end|>" "\n" -- "5" is 37, "6" is 38.
  assert chosen[-7:].tolist() == [IM_START, 520, 9531, NL, 37, IM_END, NL]
  assert rejected[-7:].tolist() == [IM_START, 520, 9531, NL, 38, IM_END, NL]
  # The prompt's tokens, rendered alone, are exactly the shared prefix: no boundary change.
  prompt = tok(tok.apply_chat_template([user("2+3?")], tokenize=False), add_special_tokens=False)["input_ids"]
  assert chosen[:-7].tolist() == prompt == rejected[:-7].tolist()


def test_reward_position_with_pad_equal_to_eos(tok):
  """The last attended token is the completion's end of turn, not the first eos in the row."""
  assert tok.pad_token_id == tok.eos_token_id == IM_END
  ex = tk.tokenize_preference(
    pair_record([user("2+3?")], [assistant("5")], [assistant("6")]), tok, opts(), DropReport()
  )
  [batch] = make_eval_batches([ex], batch_size=1, buckets=(64,), pad_id=tok.pad_token_id)
  ids, mask = batch.input_ids[0], batch.attention_mask[0]
  last = int(mask.sum()) - 1
  assert last == len(ex.input_ids[0]) - 1 and mask[last + 1 :].sum() == 0
  assert ids[last - 1 : last + 1].tolist() == [IM_END, NL]
  assert tok.decode(ids[last - 5 : last + 1]) == "assistant\n5<|im_end|>\n"
  first_eos = int(np.argmax(ids == tok.eos_token_id))
  assert first_eos < last - 1  # the system turn's end: reading there would score the prompt


def test_llama3_like_template_ends_on_eos_without_double_bos(llama3_like):
  t = llama3_like
  ex = tk.tokenize_preference(
    pair_record([user("hi")], [assistant("5")], [assistant("6")]), t, opts(), DropReport()
  )
  ids = ex.input_ids[0]
  assert ids.tolist() == [0, IM_START, 4093, NL, 6004, IM_END, IM_START, 520, 9531, NL, 37, IM_END]
  assert t.decode(ids) == "<|endoftext|><|im_start|>user\nhi<|im_end|><|im_start|>assistant\n5<|im_end|>"
  [batch] = make_eval_batches([ex], batch_size=1, buckets=(16,), pad_id=t.pad_token_id)
  last = int(batch.attention_mask[0].sum()) - 1
  assert last == 11 and batch.input_ids[0, last] == t.pad_token_id  # eos == pad, yet attended
  assert batch.input_ids[0, last - 1] == 37


def test_plain_text_gets_the_tokenizers_bos_and_keeps_it_when_cut(llama3_like):
  rec = pair_record("a b c d e f =", " 5", " 6")
  ex = tk.tokenize_preference(rec, llama3_like, opts(), DropReport())
  assert ex.input_ids[0].tolist() == [0, 81, 278, 265, 287, 297, 275, 446, 216, 37]
  cut = tk.tokenize_preference(rec, llama3_like, opts(max_length=6, truncation="left"), DropReport())
  # 4 context tokens cut ("a b c d"); the BOS stays first.
  assert cut.input_ids[0].tolist() == [0, 297, 275, 446, 216, 37]
  assert llama3_like.decode(cut.input_ids[1]) == "<|endoftext|> e f = 6"


def test_plain_text_pair(tok):
  ex = tk.tokenize_preference(pair_record("Q: 2+3=", " 5", " 6"), tok, opts(), DropReport())
  # "Q" ":" " " "2" "+" "3" "=" " " "5": SmolLM2 adds no BOS/EOS to plain text.
  assert ex.input_ids[0].tolist() == [65, 42, 216, 34, 27, 35, 45, 216, 37]
  assert ex.input_ids[1].tolist() == [65, 42, 216, 34, 27, 35, 45, 216, 38]


def test_ranked_group_sorted_and_margin_kept(tok):
  rec = PreferenceRecord(
    context="Q:",
    completions=(" b", " a", " c"),
    ranks=(5, 2, 9),
    source="r:0",
    margin=1.5,
    meta={"subset": "x"},
  )
  ex = tk.tokenize_preference(rec, tok, opts(), DropReport())
  assert ex.ranks == (2, 5, 9) and ex.margin == 1.5 and ex.meta == {"subset": "x"}
  assert [tok.decode(ids) for ids in ex.input_ids] == ["Q: a", "Q: b", "Q: c"]


def test_stepwise_plain_layout(tok):
  rec = StepwiseRecord(prompt="2+3*4?", steps=("3*4=12", "2+12=14"), labels=(True, False), source="s:0")
  ex = tk.tokenize_stepwise(rec, tok, opts(), DropReport())
  assert tok.convert_ids_to_tokens(ex.input_ids.tolist()) == [
    "2",
    "+",
    "3",
    "*",
    "4",
    "?",
    "Ċ",  # prompt + unlabelled separator
    "3",
    "*",
    "4",
    "=",
    "1",
    "2",
    "Ċ",  # step 1: label 1 on its separator
    "2",
    "+",
    "1",
    "2",
    "=",
    "1",
    "4",
    "Ċ",
  ]  # step 2: label 0
  expected = np.full(22, -100)
  expected[13], expected[21] = 1, 0
  assert ex.labels.dtype == np.int32 and ex.input_ids.dtype == np.int32
  np.testing.assert_array_equal(ex.labels, expected)


def test_stepwise_chat_layout_and_multi_token_separator(tok):
  rec = StepwiseRecord(
    prompt=[user("2+3*4?")], steps=("3*4=12", "2+12=14"), labels=(False, True), source="s:1"
  )
  ex = tk.tokenize_stepwise(rec, tok, opts(step_separator=" ки"), DropReport())
  assert tok.decode(ex.input_ids) == (
    SYSTEM + "<|im_start|>user\n2+3*4?<|im_end|>\n<|im_start|>assistant\n3*4=12 ки2+12=14 ки"
  )
  sep = tok(" ки", add_special_tokens=False)["input_ids"]
  assert len(sep) == 2
  labelled = np.flatnonzero(ex.labels != -100)
  assert ex.labels[labelled].tolist() == [0, 1]
  assert labelled[-1] == len(ex.input_ids) - 1
  for pos in labelled:  # each label sits on the separator's last token
    assert ex.input_ids[pos - 1 : pos + 1].tolist() == sep


def test_stepwise_last_step_only(tok):
  rec = StepwiseRecord(prompt="Q", steps=("a", "b", "c"), labels=(True, True, False), source="s")
  ex = tk.tokenize_stepwise(rec, tok, opts(train_on_last_step_only=True), DropReport())
  assert ex.labels[ex.labels != -100].tolist() == [0]
  assert ex.labels[-1] == 0


def test_stepwise_left_truncation_cuts_trailing_steps_with_labels(tok):
  # "Q" "\n" | "a" "\n" | "b" "\n" | "c" "\n": 8 tokens.
  rec = StepwiseRecord(prompt="Q", steps=("a", "b", "c"), labels=(True, False, True), source="s")
  ex = tk.tokenize_stepwise(rec, tok, opts(max_length=7, truncation="left"), DropReport())
  assert tok.decode(ex.input_ids) == "Q\na\nb\n"
  assert ex.labels.tolist() == [-100, -100, -100, 1, -100, 0]
  drops = DropReport()
  for o in (
    opts(max_length=7),
    opts(max_length=7, truncation="left", train_on_last_step_only=True),
    opts(max_length=3, truncation="left"),
    opts(max_length=2, truncation="left"),
  ):
    assert tk.tokenize_stepwise(rec, tok, o, drops) is None
  assert drops.counts == {
    tk.STEPS_TOO_LONG: 1,
    tk.LAST_STEP_CUT: 1,
    tk.NO_STEP_FITS: 1,
    tk.PROMPT_TOO_LONG: 1,
  }
  assert drops.examples[tk.STEPS_TOO_LONG] == ["s"]


def test_stepwise_left_truncation_drops_old_turns_first(tok):
  prompt = [user("first question " * 20), assistant("old answer"), user("2+2?")]
  rec = StepwiseRecord(prompt=prompt, steps=("4",), labels=(True,), source="s")
  full = tk.tokenize_stepwise(rec, tok, opts(), DropReport())
  ex = tk.tokenize_stepwise(
    rec, tok, opts(max_length=len(full.input_ids) - 1, truncation="left"), DropReport()
  )
  assert tok.decode(ex.input_ids) == SYSTEM + "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4\n"
  assert ex.labels[-1] == 1


def test_over_length_pair_dropped_and_counted(tok):
  drops = DropReport()
  rec = pair_record("Q: 2+3=", " 5 " * 10, " 6")
  assert tk.tokenize_preference(rec, tok, opts(max_length=12), drops) is None
  assert (
    tk.tokenize_preference(
      pair_record("Q " * 20, " 5", " 6", source="t.jsonl:9"), tok, opts(max_length=12), drops
    )
    is None
  )
  assert drops.counts == {tk.PAIR_TOO_LONG: 1, tk.PROMPT_TOO_LONG: 1}
  assert drops.examples[tk.PROMPT_TOO_LONG] == ["t.jsonl:9"]
  assert "prompt alone" in drops.summary()


def test_left_truncation_drops_oldest_turns_keeps_completions(tok):
  context = [
    {"role": "system", "content": "Be brief."},
    user("tell me a story " * 10),
    assistant("once upon a time"),
    user("2+3?"),
  ]
  rec = pair_record(context, [assistant("5")], [assistant("6")])
  ex = tk.tokenize_preference(rec, tok, opts(max_length=40, truncation="left"), DropReport())
  expected = (
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n"
    "<|im_start|>assistant\n{}<|im_end|>\n"
  )
  assert [tok.decode(ids) for ids in ex.input_ids] == [expected.format(5), expected.format(6)]


def test_left_truncation_cuts_oldest_context_tokens(tok):
  rec = pair_record("a b c d e f g h i j =", " 5", " 66")  # prompt 11 tokens, completions 2 and 3
  ex = tk.tokenize_preference(rec, tok, opts(max_length=8, truncation="left"), DropReport())
  # Both completions keep the same context: 6 tokens cut to make room for the longer one.
  assert [tok.decode(ids) for ids in ex.input_ids] == [" g h i j = 5", " g h i j = 66"]
  assert [len(ids) for ids in ex.input_ids] == [7, 8]
  drops = DropReport()
  long = pair_record("Q:", " 5" * 20, " 6")
  assert tk.tokenize_preference(long, tok, opts(max_length=8, truncation="left"), drops) is None
  assert drops.counts == {tk.COMPLETION_TOO_LONG: 1}


def test_identical_completions_dropped(tok):
  drops = DropReport()
  rec = pair_record([user("2+3?")], [assistant("5")], [assistant("5")], source="t.jsonl:4")
  assert tk.tokenize_preference(rec, tok, opts(), drops) is None
  assert drops.counts == {tk.IDENTICAL_COMPLETIONS: 1}
  assert drops.examples[tk.IDENTICAL_COMPLETIONS] == ["t.jsonl:4"]


def test_mixed_text_and_conversation_is_an_error(tok):
  rec = pair_record([user("2+3?")], "5", "6", source="t.jsonl:3")
  with pytest.raises(
    DataError,
    match=r"t.jsonl:3: field 'completions\[0\]': is plain text but "
    r"the context is a conversation",
  ):
    tk.tokenize_preference(rec, tok, opts(), DropReport())


def test_template_error_names_row(tok):
  t = copy.deepcopy(tok)
  t.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
  rec = StepwiseRecord(prompt=[user("q")], steps=("a",), labels=(True,), source="p.jsonl:2")
  with pytest.raises(
    DataError,
    match="p.jsonl:2: field 'prompt': the tokenizer's chat template "
    "rejected it: Conversation roles must alternate",
  ):
    tk.tokenize_stepwise(rec, t, opts(), DropReport())


def test_tokenize_all_skips_dropped(tok):
  drops = DropReport()
  records = [
    pair_record("Q", " a", " b"),
    pair_record("Q", " a", " a", source="dup"),
    StepwiseRecord(prompt="Q", steps=("a",), labels=(False,), source="s"),
  ]
  out = tk.tokenize_all(records, tok, opts(), drops)
  assert [type(e) for e in out] == [tk.PreferenceExample, tk.StepwiseExample]
  assert drops.counts == {tk.IDENTICAL_COMPLETIONS: 1}


def test_options_validated():
  with pytest.raises(ValueError, match="truncation='right'; use 'drop' or 'left'"):
    tk.TokenizeOptions(truncation="right")
