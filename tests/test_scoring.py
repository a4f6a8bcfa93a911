"""Loading training runs and checkpoints; scoring and step scoring laid out exactly as training."""

import json
import os
import re
import shutil

import hf_tiny
import jax
import numpy as np
import pytest
import tiny_run
import torch
import transformers
from flax import nnx
from helpers import NL, PARITY_ATOL, assert_same_params, params, right_padded

from jaxrm import RewardModel
from jaxrm.data import registry
from jaxrm.data.drops import DropReport
from jaxrm.data.tokenize import TokenizeOptions, tokenize_all
from jaxrm.errors import CheckpointError, DataError
from jaxrm.run import checkpointing, run_files
from jaxrm.scoring import loading
from jaxrm.scoring.loading import ScoringInfo
from jaxrm.server import make_server

# score() sorts rows by length and pads each batch to its own bucket, while the references below pad
# to one fixed length: the same float32 rewards through sums over other padded lengths. Rewards are
# O(1); on CPU they usually come out bit-equal.
REBATCHED_ATOL = 1e-5

CHATS = [
  [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
  [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue, or maybe a deep shade of green on a good day."},
  ],
  [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
]


@pytest.fixture(scope="module")
def run_dir(model_dir, tmp_path_factory):
  """Two training steps, validated and checkpointed after each."""
  out = str(tmp_path_factory.mktemp("run"))
  tiny_run.train(
    tiny_run.config(
      model_dir,
      out,
      train__max_steps=2,
      eval__val_period=1,
      checkpointing__save_period=1,
      checkpointing__keep_top_k=2,
      data__max_train_rows=16,
    )
  )
  return out


@pytest.fixture
def run_copy(run_dir, tmp_path):
  """A copy of the run that a test may change."""
  return shutil.copytree(run_dir, tmp_path / "run")


@pytest.fixture(scope="module")
def rm(run_dir):
  """The run's best checkpoint (trained, with the reward stats its validation recorded); not the
  untrained ``tiny_rm``."""
  return RewardModel.from_pretrained(run_dir)


@pytest.fixture(scope="module")
def prm(smollm2_tokenizer, tmp_path_factory):
  """A random 2-layer Qwen2 token-classification model with SmolLM2's tokenizer."""
  tok = smollm2_tokenizer
  out = tmp_path_factory.mktemp("prm")
  hf_tiny.build(
    "qwen2", "token", vocab_size=len(tok), num_hidden_layers=2, pad_token_id=tok.pad_token_id
  ).save_pretrained(out)
  tok.save_pretrained(out)
  return RewardModel.from_pretrained(out)


def meta(run_dir, step):
  with open(os.path.join(run_dir, "checkpoints", str(step), "meta", "metadata")) as f:
    return json.load(f)


# ------------------------------------------------------------------ loading runs


def test_run_dir_loads_the_best_checkpoint_named_by_best_file(run_copy):
  with open(run_copy / "checkpoints" / "best_checkpoint.json") as f:
    assert json.load(f)["step"] in (1, 2)
  for best in (1, 2):
    (run_copy / "checkpoints" / "best_checkpoint.json").write_text(json.dumps({"step": best}))
    rm = RewardModel.from_pretrained(run_copy)
    assert_same_params(rm, RewardModel.from_pretrained(run_copy / "checkpoints" / str(best)))
    assert rm.reward_stats == meta(run_copy, best)["reward_stats"]
    assert rm.reward_stats["from"] == "validation-default" and rm.reward_stats["std"] > 0


def test_without_best_file_orbax_picks_the_lowest_validation_loss(run_copy):
  os.remove(run_copy / "checkpoints" / "best_checkpoint.json")
  losses = {s: meta(run_copy, s)["metrics"]["validation-default_loss"] for s in (1, 2)}
  assert losses[1] != losses[2]
  best = min(losses, key=losses.get)
  assert_same_params(RewardModel.from_pretrained(run_copy), RewardModel.from_pretrained(run_copy, step=best))


def test_step_and_checkpoint_paths(run_dir, model_dir):
  one = RewardModel.from_pretrained(run_dir, step=1)
  assert_same_params(one, RewardModel.from_pretrained(os.path.join(run_dir, "checkpoints", "1")))
  two = RewardModel.from_pretrained(os.path.join(run_dir, "checkpoints", "2"))
  assert not np.array_equal(params(one)[("score",)], params(two)[("score",)])  # training moved it
  assert one.config.family == "llama" and one.config.num_layers == 2 and one.config.head == "sequence"
  assert one.config.rope.type == "llama3" and one.config.eos_token_id == 2
  assert one.tokenizer.chat_template == transformers.AutoTokenizer.from_pretrained(model_dir).chat_template
  # The restore target's dtype is honoured.
  bf16 = RewardModel.from_pretrained(run_dir, step=1, dtype="bfloat16")
  assert bf16.model.embed[...].dtype == np.dtype("bfloat16")
  np.testing.assert_array_equal(
    np.asarray(bf16.model.embed[...], np.float32),
    np.asarray(one.model.embed[...].astype("bfloat16"), np.float32),
  )


def test_run_errors(run_dir, run_copy, model_dir, tmp_path):
  ckpts = os.path.join(run_dir, "checkpoints")
  with pytest.raises(
    CheckpointError, match=re.escape(f"{ckpts}: no checkpoint for step 9; available steps: 1, 2")
  ):
    RewardModel.from_pretrained(run_dir, step=9)
  with pytest.raises(
    CheckpointError, match=re.escape("is the checkpoint of step 1, but step=2 was asked for")
  ):
    RewardModel.from_pretrained(os.path.join(ckpts, "1"), step=2)
  with pytest.raises(
    CheckpointError,
    match=re.escape(f"{run_dir} was trained with head='sequence'; it cannot be loaded with head='token'"),
  ):
    RewardModel.from_pretrained(run_dir, head="token")
  with pytest.raises(
    CheckpointError,
    match=re.escape(
      f"step=1 selects a checkpoint of a training output directory, but {model_dir} is not one"
    ),
  ):
    RewardModel.from_pretrained(model_dir, step=1)
  missing = str(tmp_path / "nowhere")
  with pytest.raises(CheckpointError, match=re.escape(f"{missing}: no such file or directory")):
    RewardModel.from_pretrained(missing)

  # A checkpoint moved away from its run.
  moved = shutil.copytree(os.path.join(ckpts, "1"), tmp_path / "loose" / "7")
  with pytest.raises(
    CheckpointError,
    match=re.escape(
      f"{moved} is a training checkpoint, but {tmp_path} has no model_config.json; load the run's "
      "output directory (the one holding model_config.json) with step=7"
    ),
  ):
    RewardModel.from_pretrained(moved)

  ckpt_dir = run_copy / "checkpoints"
  shutil.rmtree(ckpt_dir / "1")
  shutil.rmtree(ckpt_dir / "2")
  with pytest.raises(CheckpointError, match=re.escape(f"{ckpt_dir}: no complete checkpoint yet")):
    RewardModel.from_pretrained(run_copy)
  shutil.rmtree(ckpt_dir)
  with pytest.raises(CheckpointError, match=re.escape(f"{run_copy}: no checkpoint directory {ckpt_dir}")):
    RewardModel.from_pretrained(run_copy)


def test_run_loads_abstract_without_opening_checkpoints(rm, run_dir, monkeypatch):
  def no_restoring(*args, **kwargs):
    raise AssertionError("a checkpoint was restored")

  monkeypatch.setattr(checkpointing.Checkpointer, "restore_params", no_restoring)
  abstract = RewardModel.from_pretrained(run_dir, load_weights=False)
  assert abstract.config == rm.config and abstract.reward_stats is None
  assert abstract.tokenizer.chat_template == rm.tokenizer.chat_template
  want = {k: (v.shape, v.dtype, v.sharding) for k, v in nnx.to_flat_state(nnx.state(rm.model))}
  got = {k: v.get_value() for k, v in nnx.to_flat_state(nnx.state(abstract.model))}
  assert all(isinstance(v, jax.ShapeDtypeStruct) for v in got.values())
  assert {k: (v.shape, v.dtype, v.sharding) for k, v in got.items()} == want


def test_step_separator_comes_from_the_run_config(run_copy):
  config = json.loads((run_copy / "config.json").read_text())
  assert config["data"]["step_separator"] == "\n"
  config["data"]["step_separator"] = " ки\n"
  (run_copy / "config.json").write_text(json.dumps(config))
  assert RewardModel.from_pretrained(run_copy, step=1).step_separator == " ки\n"


# ------------------------------------------------------------------ scoring


def test_score_tokenizes_and_scores_as_training(rm):
  records = registry.load_records("demo_arithmetic", None, split="validation", drops=DropReport())[:6]
  examples = tokenize_all(records, rm.tokenizer, TokenizeOptions(max_length=96), DropReport())
  assert len(examples) == 6
  prompts, completions, rows = [], [], []
  for record, example in zip(records, examples):
    best_first = sorted(range(len(record.ranks)), key=record.ranks.__getitem__)  # the examples' order
    for i, ids in zip(best_first, example.input_ids):
      prompts.append(record.context)
      completions.append(record.completions[i])
      rows.append(ids.tolist())
  assert [rm.encode(p, c) for p, c in zip(prompts, completions)] == rows
  assert [rm.encode(p + c) for p, c in zip(prompts, completions)] == rows
  # Each row ends "<|im_end|>\n": the eos (== pad) token is inside the row, not mistaken for padding.
  assert rows[0][-2:] == [rm.tokenizer.pad_token_id, NL]
  # Reference: rows in their own order, four per batch, padded to 64 (score() sorts them by length).
  expected = np.concatenate(
    [rm.score_tokens(*right_padded(rows[i : i + 4], pad=2, length=64)) for i in range(0, 12, 4)]
  )
  np.testing.assert_allclose(
    rm.score(prompts=prompts, completions=completions, batch_size=4), expected, atol=REBATCHED_ATOL, rtol=0
  )
  np.testing.assert_allclose(
    rm.score([p + c for p, c in zip(prompts, completions)], batch_size=4),
    expected,
    atol=REBATCHED_ATOL,
    rtol=0,
  )


def test_plain_text_layout_and_batching(rm):
  tok = rm.tokenizer
  texts = ["a", "The quick brown fox jumps over the lazy dog. " * 3, "1 + 1 = 2", "Hello"]
  assert rm.encode("1 + 1 = 2") == tok("1 + 1 = 2")["input_ids"]
  assert rm.encode("Q: 1 + 1?", " A: 2") == tok("Q: 1 + 1? A: 2")["input_ids"]  # joined, then tokenized
  got = rm.score(texts, batch_size=4)
  np.testing.assert_allclose(
    got,
    rm.score_tokens(*right_padded([rm.encode(t) for t in texts], pad=2, length=64)),
    atol=REBATCHED_ATOL,
    rtol=0,
  )
  assert got.dtype == np.float32 and got.shape == (4,)
  assert rm.score([]).shape == (0,)


def test_normalize_uses_validation_stats(rm, model_dir):
  raw = rm.score(CHATS)
  mean, std = rm.reward_stats["mean"], rm.reward_stats["std"]
  # One float32 subtraction and division against numpy's: a rounding or two apart.
  np.testing.assert_allclose(rm.score(CHATS, normalize=True), (raw - mean) / std, rtol=1e-6)
  untrained = RewardModel.from_pretrained(model_dir)
  assert untrained.reward_stats is None
  with pytest.raises(ValueError, match="normalize=True needs the reward mean/std recorded at validation"):
    untrained.score(CHATS, normalize=True)


def test_scoring_encoded_rows(rm, prm):
  """score_ids / outputs_of_ids / normalized: what score() and score_steps() compute, on rows the
  caller encoded (the benchmarks and the server call these)."""
  encoded = [rm.encode(c) for c in CHATS]
  np.testing.assert_array_equal(rm.score_ids(encoded, batch_size=2), rm.score(CHATS, batch_size=2))
  np.testing.assert_array_equal(rm.normalized(rm.score(CHATS)), rm.score(CHATS, normalize=True))
  assert rm.score_ids([]).shape == (0,)
  ids, positions = prm.encode_steps("Add 1 and 1.", ["1 + 1 = 2", "The answer is 2."])
  short = prm.tokenizer("Hi")["input_ids"]
  logits = prm.outputs_of_ids([ids, short], batch_size=2, bucket=16)
  assert [x.shape for x in logits] == [(len(ids), 2), (len(short), 2)]  # each row's own length
  np.testing.assert_allclose(
    logits[0], prm.score_tokens([ids], [[1] * len(ids)])[0], atol=REBATCHED_ATOL, rtol=0
  )


def test_score_argument_errors(rm):
  with pytest.raises(ValueError, match="pass either items, or prompts and completions"):
    rm.score(CHATS, prompts=["a"], completions=["b"])
  with pytest.raises(ValueError, match=r"as many entries each \(got 2 and 1\)"):
    rm.score(prompts=["a", "b"], completions=["c"])
  with pytest.raises(
    DataError,
    match=re.escape(
      "prompts[1] + completions[1]: the prompt is a conversation but the completion is plain text"
    ),
  ):
    rm.score(prompts=["a", CHATS[0][:1]], completions=["b", "c"])
  with pytest.raises(
    DataError, match=re.escape("items[0]: the completion alone is longer than max_length=4")
  ):
    rm.score(["a b c d e f g h"], max_length=4)
  with pytest.raises(DataError, match=re.escape("items[1]: no tokens to score")):
    rm.score(["a", ""])


def test_misuse_is_refused_at_the_door(rm, prm):
  """What a newcomer passes by mistake is named, with what belongs there, before any tokenizing."""
  conversation = CHATS[0]
  one = re.escape(
    "score: items is one conversation (a list of messages), where a list of texts or "
    "conversations belongs: for one, wrap it in a list (rm.score([...]))"
  )
  with pytest.raises(DataError, match=one):
    rm.score(conversation)
  with pytest.raises(DataError, match="score: items is one string, where a list of texts"):
    rm.score("a text")
  with pytest.raises(DataError, match="score: completions is one message, where a list"):
    rm.score(prompts=["a"], completions={"role": "assistant", "content": "b"})
  with pytest.raises(
    DataError,
    match=re.escape("score: field 'items[1]': expected a string or a list of messages, got an integer"),
  ):
    rm.score(["a", 3])
  with pytest.raises(
    DataError, match=re.escape("encode: field 'item': expected a string or a list of messages, got an object")
  ):
    rm.encode(conversation[0])
  with pytest.raises(DataError, match=re.escape("encode: field 'item[0].role': unknown role 'robot'")):
    rm.encode([{"role": "robot", "content": "hi"}])
  # Steps as one string would be scored one character per step.
  with pytest.raises(
    DataError,
    match=re.escape(
      "score_steps: steps is one string; pass a list of steps (e.g. "
      "jaxrm.scoring.step_rewards.split_steps(text, rm.step_separator)"
    ),
  ):
    prm.score_steps("What is 3 * 4 + 2?", "3 * 4 = 12\n12 + 2 = 14")
  with pytest.raises(
    DataError, match=re.escape("score_steps: steps_lists[1] holds an integer; expected a list")
  ):
    prm.score_steps_batch(["p", "q"], [["a"], ["b", 2]])
  with pytest.raises(DataError, match="score_steps_batch takes a list of prompts and a list of step lists"):
    prm.score_steps_batch("p", [["a"]])


def test_long_context_loses_oldest_turns_as_in_training(rm):
  turns = [{"role": "user", "content": "word " * 20}, {"role": "assistant", "content": "ok"}] * 3
  chat = turns + [{"role": "user", "content": "Last?"}, {"role": "assistant", "content": "Yes."}]
  full = rm.encode(chat, max_length=1000)
  assert len(full) > rm.config.max_position_embeddings == 128
  assert len(rm.encode(chat[2:])) < 128
  # The first (user, assistant) turn goes; by default max_length is the model's context.
  assert rm.encode(chat) == rm.encode(chat, max_length=len(full) - 1) == rm.encode(chat[2:])


# ------------------------------------------------------------------ step scoring


def softmax1(logits_tc):
  e = np.exp(logits_tc - logits_tc.max(-1, keepdims=True))
  return e[:, 1] / e.sum(-1)


def test_score_steps_layout_and_probabilities(prm):
  tok = prm.tokenizer
  ids_of = lambda text: tok(text, add_special_tokens=False)["input_ids"]
  steps = ["2 + 2 = 4", "4 * 3 = 13", "The answer is 13."]
  ids, positions = prm.encode_steps("Compute (2 + 2) * 3.", steps)
  expected = tok("Compute (2 + 2) * 3.")["input_ids"] + [NL]
  for s in steps:
    expected += ids_of(s) + [NL]
  assert ids == expected
  lengths = [len(ids_of(s)) + 1 for s in steps]
  prefix = len(tok("Compute (2 + 2) * 3.")["input_ids"]) + 1
  assert positions == list(prefix + np.cumsum(lengths) - 1)
  assert all(ids[p] == NL for p in positions)
  logits = prm.score_tokens([ids], [[1] * len(ids)])[0]
  probs = prm.score_steps("Compute (2 + 2) * 3.", steps)
  # The same logits through jaxrm's softmax and numpy's: probabilities in (0, 1), where float32's
  # spacing is at most 6e-8.
  np.testing.assert_allclose(probs, softmax1(logits[positions]), atol=1e-6, rtol=0)
  assert len(probs) == 3 and all(0 < p < 1 for p in probs)


def test_score_steps_batch_and_chat_prompts(prm):
  chat = [{"role": "user", "content": "What is 3 * 3?"}]
  prompts = ["Add 1 and 1.", chat, "Nothing to do."]
  steps_lists = [["1 + 1 = 2", "The answer is 2."], ["3 * 3 = 9", "So 9.", "The answer is 9."], []]
  batch = prm.score_steps_batch(prompts, steps_lists, batch_size=2, bucket=16)
  assert [len(b) for b in batch] == [2, 3, 0]
  for got, p, s in zip(batch, prompts, steps_lists):
    np.testing.assert_allclose(got, prm.score_steps(p, s), atol=REBATCHED_ATOL, rtol=0)
  # A chat prompt ends with the generation prompt: the steps are the assistant's open turn.
  ids, positions = prm.encode_steps(chat, steps_lists[1])
  opening = prm.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
  assert opening.endswith("<|im_start|>assistant\n")
  prefix = prm.tokenizer(opening, add_special_tokens=False)["input_ids"]
  first = prm.tokenizer("3 * 3 = 9", add_special_tokens=False)["input_ids"]
  assert ids[: len(prefix) + len(first) + 1] == prefix + first + [NL]
  assert positions[0] == len(prefix) + len(first) and positions[-1] == len(ids) - 1


def test_step_separator_is_the_models(prm):
  prm2 = RewardModel(prm.model, prm.tokenizer, ScoringInfo(step_separator="\n\n"))
  ids, positions = prm2.encode_steps("Q", ["a", "b"])
  sep = prm.tokenizer("\n\n", add_special_tokens=False)["input_ids"]
  assert len(sep) == 1 and sep != [NL]
  assert [ids[p] for p in positions] == sep * 2


def test_head_mismatch_errors(rm, prm):
  with pytest.raises(
    ValueError,
    match=re.escape(
      "score_steps needs a token-head (process reward) model with 2 "
      "labels (step in error, step correct); this model has a "
      "sequence head with 1 output"
    ),
  ):
    rm.score_steps("Q", ["a"])
  with pytest.raises(
    ValueError,
    match=re.escape("score() needs a sequence-head reward model")
    + ".*"
    + re.escape(
      "this model has a token head with 2 labels; a process reward model scores steps: rm.score_steps"
    ),
  ):
    prm.score(["a"])
  with pytest.raises(
    DataError, match=re.escape("prompts[0]: the prompt and its 2 steps are longer than max_length=5")
  ):
    prm.score_steps("A long question about many things", ["a", "b"], max_length=5)


# ------------------------------------------------------------------ export of a run


def test_run_export_scores_like_jaxrm_in_transformers(rm, run_dir, tmp_path):
  rm.save_pretrained(tmp_path)
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype=torch.float32).eval()
  rows = [rm.encode(c) for c in CHATS]
  for r in rows:
    assert r[-1] != hf.config.pad_token_id  # transformers pools at the last non-pad token: the same one
  ids, mask = right_padded(rows, pad=rm.tokenizer.pad_token_id, dtype=np.int64)
  with torch.no_grad():
    theirs = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits[:, 0].numpy()
  np.testing.assert_allclose(rm.score(CHATS), theirs, atol=PARITY_ATOL, rtol=0)
  back = RewardModel.from_pretrained(tmp_path)
  assert_same_params(rm, back)
  assert back.reward_stats == rm.reward_stats and back.step_separator == rm.step_separator
  # The run's data.max_length travels with the export: the server's default limit per item.
  trained = run_files.RunFiles.read(str(run_dir)).run_config.data.max_length
  assert rm.training_max_length == back.training_max_length == trained
  assert json.loads((tmp_path / "config.json").read_text())["jaxrm"]["training_max_length"] == trained
  for model in (rm, back):  # the server's default limit per item
    server = make_server(model, port=0)
    assert server.config.max_length == trained
    server.shutdown()  # never started: its port let go
  np.testing.assert_array_equal(back.score(CHATS, normalize=True), rm.score(CHATS, normalize=True))


def test_a_name_that_is_neither_a_path_nor_on_the_hub_says_which_and_why(monkeypatch, tmp_path):
  """A mistyped local folder of the form ``a/b`` reads as a hub name: the message says there is no
  such folder, and why the hub gave nothing (the real client, told it is offline)."""
  import huggingface_hub

  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
  monkeypatch.chdir(tmp_path)
  with pytest.raises(CheckpointError) as e:
    loading.locate("modles/my-rm")
  assert str(e.value).startswith(
    f"modles/my-rm: no such file or folder ({tmp_path / 'modles' / 'my-rm'}), and as a hub model name "
    "it could not be fetched: the hub is unreachable from here ("
  )
  assert str(e.value).endswith("), and the model is not in the local hub cache")
  assert "\n" not in str(e.value)


@pytest.mark.parametrize(
  "error,why",
  [
    ("GatedRepoError", "the repository is gated; log in with an account that has access (hf auth login)"),
    (
      "RepositoryNotFoundError",
      "the hub has no such repository (or it is private; log in with hf auth login)",
    ),
  ],
)
def test_a_hub_refusal_is_named(monkeypatch, tmp_path, error, why):
  import huggingface_hub
  from huggingface_hub import errors

  def refuse(*args, **kwargs):
    import httpx

    response = httpx.Response(401, request=httpx.Request("GET", "https://huggingface.co/api/models/org/x"))
    raise getattr(errors, error)("401 Client Error.\nlong details", response=response)

  # The hub is asked whether the model exists before anything downloads: it answers the refusal.
  monkeypatch.setattr(huggingface_hub.HfApi, "model_info", refuse)
  monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
  monkeypatch.chdir(tmp_path)
  with pytest.raises(CheckpointError, match=rf"could not be fetched: {re.escape(why)}$"):
    loading.locate("org/private-rm")
