"""A preference row's prompt is tokenized once: every completion's ids equal the whole text's.

The reference is the encoding every completion got before: its whole rendered conversation
tokenized at once (``continued_ids`` replaced by that). The five families' chat templates are
written here around SmolLM2's byte-level vocabulary with each family's turn tokens added, and
around a SentencePiece-style tokenizer trained here (Metaspace, "first" prepend scheme: the one
pre-tokenizer that looks at where a piece starts).
"""

import copy

import pytest
import tokenizers
import transformers
from helpers import assistant, user
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxrm.data import tokenize as tk
from jaxrm.data.drops import DropReport
from jaxrm.data.records import PreferenceRecord, RatedRecord

# Turn tokens of each family, and a template that renders turns the way the family's does at the
# boundary between the prompt and a completion.
FAMILIES = {
  "llama": (
    ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}",
  ),
  # Mistral v0.1: the reply follows " [/INST]" directly, with no added token to split at.
  "mistral": (
    [],
    "<s>{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}"
    " [/INST]{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}",
  ),
  "qwen2": (
    [],
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen, created "
    "by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
  ),
  # Qwen3: the last assistant turn opens with an (empty) think block; <think> is a non-special
  # added token.
  "qwen3": (
    ["<think>", "</think>"],
    "{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}<|im_start|>"
    "assistant\n<think>\n\n</think>\n\n{{ m['content'] | trim }}<|im_end|>\n{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
  ),
  "gemma2": (
    ["<bos>", "<start_of_turn>", "<end_of_turn>"],
    "<bos>{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] | trim }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
    "{% endif %}",
  ),
}
NON_SPECIAL = {"<think>", "</think>"}
# Families whose completion turn opens on an added token: every completion is split from its
# prompt. Mistral's only where the reply itself starts with one.
SPLIT_ALWAYS = {"llama", "qwen2", "qwen3", "gemma2"}

# Completions that open on what a BPE merge or a pre-tokenizer could join to the text before:
# spaces, digits, newlines, punctuation, an apostrophe suffix, a special token's text and its
# fragments, the Metaspace marker, non-ASCII.
ADVERSARIAL = [
  " 5",
  "5",
  "12345",
  "  two spaces",
  "\n\nnewlines",
  "'s it",
  "ing",
  ".",
  "!?",
  "\t",
  "<|im_end|>",
  "|>x",
  "<|im_start|>assistant\n",
  "im_start",
  "\u2581word",
  "é",
  "日本",
  " ",
  "\n",
  "<end_of_turn>",
  "</think>y",
  "[/INST]",
]
CONTEXTS = [
  [user("2+3?")],
  [user("What is 7*6?  ")],
  [{"role": "system", "content": "Be brief."}, user("hi"), assistant("hello"), user("and?")],
  [user("ends with a space ")],
  [user("ends in a digit 4")],
  [user("<|im_start|>")],
  [user("x"), assistant("y\n"), user("z\n")],
  # Over max_length=40 however tokenized: drops, turn cuts and token cuts.
  [user("a long first question " * 6), assistant("a long answer " * 6), user("and then?")],
  [user("one long question with nothing to cut but tokens " * 2)],
]


def _with_tokens(tok, family):
  t = (
    copy.deepcopy(tok)
    if isinstance(tok, transformers.PreTrainedTokenizerFast)
    else transformers.AutoTokenizer.from_pretrained(tok)
  )
  added, template = FAMILIES[family]
  t.add_tokens([tokenizers.AddedToken(a, special=a not in NON_SPECIAL, normalized=False) for a in added])
  t.chat_template = template
  return t


def _metaspace_tokenizer(texts):
  """A SentencePiece-style BPE (Mistral/Llama 2 layout) trained on ``texts``."""
  specials = sorted(
    {a for added, _ in FAMILIES.values() for a in added}
    | {"<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"}
  )
  raw = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
  raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
  raw.decoder = decoders.Metaspace(prepend_scheme="first")
  raw.train_from_iterator(
    texts, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False)
  )
  return transformers.PreTrainedTokenizerFast(
    tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
  )


def _records(k, contexts=CONTEXTS):
  out = []
  for c, context in enumerate(contexts):
    for a in range(0, len(ADVERSARIAL), k):
      texts = [ADVERSARIAL[(a + j) % len(ADVERSARIAL)] + f" {j}" * (c % 3) for j in range(k)]
      out.append(
        PreferenceRecord(
          context=context,
          completions=tuple([assistant(t)] for t in texts),
          ranks=tuple(range(k))[::-1],
          source=f"row {c}.{a}",
        )
      )
  return out


def _whole(tok, prefix_text, prefix_ids, text):
  """Before: every completion's conversation tokenized whole."""
  return tk.text_ids(tok, text, special=False)


def _tokenized(records, tok, opts):
  drops = DropReport()
  examples = tk.tokenize_all(records, tok, opts, drops)
  ids = [[x.tolist() for x in e.input_ids] if hasattr(e, "ranks") else e.input_ids.tolist() for e in examples]
  return ids, dict(drops.counts)


@pytest.fixture(scope="module")
def tokenizers_by_family(smollm2_tokenizer):
  texts = [m["content"] for c in CONTEXTS for m in c] + ADVERSARIAL * 3
  metaspace = _metaspace_tokenizer(texts)
  return {
    (kind, family): _with_tokens(base, family)
    for kind, base in (("bytelevel", smollm2_tokenizer.name_or_path), ("metaspace", metaspace))
    for family in FAMILIES
  }


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(
  "opts",
  [
    tk.TokenizeOptions(max_length=4096),
    tk.TokenizeOptions(max_length=40),
    tk.TokenizeOptions(max_length=40, truncation="left"),
  ],
  ids=["fits", "drop", "left"],
)
def test_ids_and_drops_equal_whole_encoding(tokenizers_by_family, family, kind, opts, monkeypatch):
  tok = tokenizers_by_family[kind, family]
  records = (
    _records(2)
    + _records(4, CONTEXTS[::3])
    + [
      RatedRecord(context=c, completion=[assistant(t)], ratings=(1.0,), source="rated")
      for c in CONTEXTS[::2]
      for t in ADVERSARIAL[:3]
    ]
  )
  tried = []
  real_splits_at = tk.splits_at

  def recording(t, prefix, rest):
    tried.append((rest, real_splits_at(t, prefix, rest)))
    return tried[-1][1]

  monkeypatch.setattr(tk, "splits_at", recording)
  ids, drops = _tokenized(records, tok, opts)
  monkeypatch.setattr(tk, "continued_ids", _whole)
  assert (ids, drops) == _tokenized(records, tok, opts)
  added = tuple(t.content for t in tok.added_tokens_decoder.values())
  if family in SPLIT_ALWAYS:
    assert tried and all(taken for _, taken in tried)
  else:
    assert {rest.startswith(added) for rest, _ in tried} == {True, False}
    assert all(taken == rest.startswith(added) for rest, taken in tried)
  # The over-length paths are exercised: rows dropped, or cut.
  if opts.truncation == "drop" and opts.max_length < 4096:
    assert sum(drops.values()) > 0
  if opts.truncation == "left":
    assert ids != _tokenized(records, tok, tk.TokenizeOptions(max_length=4096))[0]


def test_a_pair_encodes_the_prompt_once(smollm2_tokenizer, monkeypatch):
  tok = smollm2_tokenizer
  context = [user("a long question " * 20)]
  record = PreferenceRecord(
    context=context, completions=([assistant("yes")], [assistant("no")]), ranks=(0, 1), source="row"
  )
  encoded = []
  real = tk.text_ids
  monkeypatch.setattr(
    tk, "text_ids", lambda t, text, special: encoded.append(text) or real(t, text, special=special)
  )
  ex = tk.tokenize_preference(record, tok, tk.TokenizeOptions(), DropReport())
  prompt = tok.apply_chat_template(context, tokenize=False)
  assert encoded == [
    prompt,
    "<|im_start|>assistant\nyes<|im_end|>\n",
    "<|im_start|>assistant\nno<|im_end|>\n",
  ]
  for ids, reply in zip(ex.input_ids, ("yes", "no")):
    whole = tok.apply_chat_template(context + [assistant(reply)], tokenize=False)
    assert ids.tolist() == real(tok, whole, special=False)


def _naive(tok, prefix, rest):
  return tk.text_ids(tok, prefix, special=False) + tk.text_ids(tok, rest, special=False)


@pytest.mark.parametrize(
  "token, prefix, rest",
  [
    # An added token straddling the boundary: the whole text takes it, the halves cannot.
    (tokenizers.AddedToken("\n<|im_start|>", normalized=False), "a<|im_end|>\n", "<|im_start|>assistant\n5"),
    # An opener that takes the whitespace before it.
    (tokenizers.AddedToken("<|x|>", lstrip=True, normalized=False), "a  ", "<|x|>b"),
    # An opener matched only as a whole word.
    (tokenizers.AddedToken("<|x|>", single_word=True, normalized=False), "a", "<|x|> b"),
    # An opener that starts with whitespace, after a token that takes the whitespace after it.
    (tokenizers.AddedToken(" <|x|>", normalized=False), "a<|y|>", " <|x|>b"),
  ],
)
def test_boundaries_that_do_not_split_are_encoded_whole(smollm2_tokenizer, token, prefix, rest):
  tok = copy.deepcopy(smollm2_tokenizer)
  tok.add_tokens([token], special_tokens=True)
  if token.content == " <|x|>":
    tok.add_tokens([tokenizers.AddedToken("<|y|>", rstrip=True, normalized=False)], special_tokens=True)
  whole = tk.text_ids(tok, prefix + rest, special=False)
  assert not tk.splits_at(tok, prefix, rest)
  prefix_ids = tk.text_ids(tok, prefix, special=False)
  assert tk.continued_ids(tok, prefix, prefix_ids, prefix + rest) == whole
  if token.content != " <|x|>":  # the halves would differ from the whole: the rule is needed
    assert _naive(tok, prefix, rest) != whole


def test_a_token_added_later_is_seen(smollm2_tokenizer):
  tok = copy.deepcopy(smollm2_tokenizer)
  prefix, rest = "a<|im_end|>\n", "<|im_start|>b"
  assert tk.splits_at(tok, prefix, rest)
  tok.add_tokens([tokenizers.AddedToken("\n<|im_start|>", normalized=False)], special_tokens=True)
  assert not tk.splits_at(tok, prefix, rest)


def test_a_slow_tokenizer_or_split_special_tokens_is_encoded_whole(smollm2_tokenizer):
  tok = copy.deepcopy(smollm2_tokenizer)
  tok.split_special_tokens = True
  assert not tk.splits_at(tok, "a<|im_end|>\n", "<|im_start|>b")
