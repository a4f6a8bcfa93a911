"""Left truncation of long conversations: the oldest turns are cut in a number of chat-template
renders that grows with the log of the conversation, and the rows are those that cutting one turn
more at a time gives (the reference below), for preference and stepwise rows alike."""

import copy
import dataclasses
import random

import pytest
from helpers import assistant, pair_record, user

from jaxrm.data import tokenize as tk
from jaxrm.data.drops import DropReport
from jaxrm.data.records import StepwiseRecord


@pytest.fixture(scope="module")
def counting_tok(smollm2_tokenizer):
  """SmolLM2's tokenizer, counting the messages its chat template renders (``rendered``)."""
  tok = copy.deepcopy(smollm2_tokenizer)
  render = tok.apply_chat_template
  tok.rendered = 0

  def counted(messages, **kw):
    tok.rendered += len(messages)
    return render(messages, **kw)

  tok.apply_chat_template = counted
  return tok


def conversation(rng, turns, system=True):
  words = ["alpha", "beta", "gamma", "delta", "omega"]
  out = [{"role": "system", "content": "Be brief."}] if system else []
  for i in range(turns):
    out.append(user(" ".join(rng.choices(words, k=rng.randint(1, 12))) + f" {i}?"))
    if i < turns - 1:
      out += [assistant(" ".join(rng.choices(words, k=rng.randint(1, 30))))] * rng.randint(1, 2)
  return out


def reference_pair(tok, record, max_length):
  """Cutting one turn more at a time until the row fits (or only the last turn is left, whose
  oldest tokens are then cut): the rule the truncation keeps."""
  context, (head, starts) = record.context, tk.turn_starts(record.context)
  for k in [None, *range(len(starts))]:
    shorter = context if k is None else context[:head] + context[starts[k] :]
    candidate = dataclasses.replace(record, context=shorter)
    example = tk.tokenize_preference(candidate, tok, tk.TokenizeOptions(max_length), DropReport())
    if example is not None:
      return example
  return tk.tokenize_preference(candidate, tok, tk.TokenizeOptions(max_length, "left"), DropReport())


def reference_steps(tok, record, max_length):
  head, starts = tk.turn_starts(record.prompt)
  prompts = [record.prompt] + [record.prompt[:head] + record.prompt[s:] for s in starts]
  for k, shorter in enumerate(prompts):
    candidate = StepwiseRecord(prompt=shorter, steps=record.steps, labels=record.labels, source="s")
    opts = tk.TokenizeOptions(max_length, "left" if k == len(prompts) - 1 else "drop")
    example = tk.tokenize_stepwise(candidate, tok, opts, DropReport())
    if example is not None:
      return example
  return None


def test_cut_conversations_equal_one_turn_at_a_time(smollm2_tokenizer):
  tok, rng = smollm2_tokenizer, random.Random(0)
  for trial in range(24):
    context = conversation(rng, rng.randint(1, 9), system=trial % 2 == 0)
    record = pair_record(context, [assistant("five")], [assistant("six is it")])
    max_length = rng.randint(30, 160)
    got = tk.tokenize_preference(record, tok, tk.TokenizeOptions(max_length, "left"), DropReport())
    want = reference_pair(tok, record, max_length)
    assert (got is None) == (want is None), trial
    if got is not None:
      assert [ids.tolist() for ids in got.input_ids] == [ids.tolist() for ids in want.input_ids], trial
    steps = StepwiseRecord(prompt=context, steps=("a b", "c"), labels=(True, False), source="s")
    got = tk.tokenize_stepwise(steps, tok, tk.TokenizeOptions(max_length, "left"), DropReport())
    want = reference_steps(tok, steps, max_length)
    assert (got is None) == (want is None), trial
    if got is not None:
      assert got.input_ids.tolist() == want.input_ids.tolist(), trial
      assert got.labels.tolist() == want.labels.tolist(), trial


@pytest.mark.parametrize("kind", ["preference", "stepwise"])
def test_a_long_conversation_is_rendered_a_few_times_over(counting_tok, kind):
  # 2,000 turns; cutting one turn at a time rendered about 2,000 conversations of 2,000 turns on
  # average (millions of messages), which took minutes. Now: the whole once (the context, then the
  # context with each completion), then a few renders of about what is kept.
  tok = counting_tok
  context = conversation(random.Random(1), 1000)
  tok.rendered = 0
  if kind == "preference":
    record = pair_record(context, [assistant("5")], [assistant("6")])
    example = tk.tokenize_preference(record, tok, tk.TokenizeOptions(200, "left"), DropReport())
    assert max(map(len, example.input_ids)) <= 200
    assert tok.decode(example.input_ids[0]).endswith("999?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n")
  else:
    record = StepwiseRecord(prompt=context, steps=("4",), labels=(True,), source="s")
    example = tk.tokenize_stepwise(record, tok, tk.TokenizeOptions(200, "left"), DropReport())
    assert len(example.input_ids) <= 200 and example.labels[-1] == 1
  wholes = 3 if kind == "preference" else 1
  assert wholes * len(context) < tok.rendered < (wholes + 1) * len(context)
