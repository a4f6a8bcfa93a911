"""Request bodies built to cost the server much for little, or to slip past its checks: each is
refused, or scored, as a plain one is. No server runs: the parsing and token checks are called as
the endpoints call them."""

import json

import pytest
from helpers import SERVER_CONFIG

from jaxrm.server.bodies import Encoder, RequestError, parse_json


@pytest.fixture(scope="module")
def enc(tiny_rm):
  return Encoder(tiny_rm, SERVER_CONFIG.resolved(tiny_rm.config.max_position_embeddings))


def refused(fn, *args) -> str:
  with pytest.raises(RequestError) as e:
    fn(*args)
  assert e.value.status == 400
  return str(e.value)


@pytest.mark.parametrize(
  "raw, where",
  [
    # Numbers are skipped at C speed; the text after them is still found, and named.
    (b'{"input": [' + b"5," * 100_000 + b'"\\ud800"]}', "field 'input[100000]'"),
    (b'{"input": [1, true, null, [2, "ok", {"a": [3, "\\udfff"]}]]}', "field 'input[3][2].a[1]'"),
    (b'{"input": [1, [2, {"ok": 1, "\\ud800": 2}]]}', "a key of field 'input[1][1]'"),
    (b'{"\\udc00": [1, 2]}', "a key of the body"),
  ],
)
def test_lone_surrogate_named_among_numbers(raw, where):
  assert refused(parse_json, raw).startswith(f"{where} holds a lone surrogate")


def test_surrogate_pairs_and_numbers_are_text():
  body = {"input": [[5] * 1000, "\U0001f600 caf\u00e9"], "n": [1.5, None, True]}
  assert parse_json(json.dumps(body).encode()) == body  # json.dumps writes the emoji as a pair


def test_token_ids_checked_at_the_vocabulary_bounds(enc, tiny_rm):
  vocab = tiny_rm.config.vocab_size
  assert enc.given_ids("input", [0, vocab - 1]) == [0, vocab - 1]
  assert refused(enc.given_ids, "input", [0, vocab]) == (
    f"input[1] is {vocab}, not a token id of this model (0 to {vocab - 1})"
  )
  assert refused(enc.given_ids, "input", [3, -1]).startswith("input[1] is -1, not a token id")
  assert refused(enc.given_ids, "input", [3, 10**30]).startswith(f"input[1] is {10**30}, not a token id")
  # Neither a boolean nor a float is an id, though Python compares them as numbers.
  assert (
    refused(enc.given_ids, "input", [1, True]) == "input[1] is a boolean; expected a token id (an integer)"
  )
  assert refused(enc.given_ids, "input", [1, 2.0]) == "input[1] is a number; expected a token id (an integer)"


def test_a_prompt_cut_to_fit_is_counted_as_truncated(enc, tiny_rm):
  """A prompt over max_length loses its oldest context, as training's truncation="left" does: the
  reward's health counts it (before, only cuts a request asked for were counted)."""
  request = enc.for_request(float("inf"), lambda: False)
  long_prompt = " ".join(["word"] * 400)  # far over the tiny model's 128 tokens
  rows = request.score({"prompts": [long_prompt, "2 + 2?"], "completions": ["4", "4"]})
  assert len(rows[0]) <= SERVER_CONFIG.resolved(tiny_rm.config.max_position_embeddings).max_length
  assert request.truncated == 1
