"""The generative verifier (``reward.type=verifier``, ``RewardModel.from_pretrained(..., verifier=True)``):
its score is transformers' ``log_softmax(logits)[yes] - [no]`` after the question; it trains on
preference pairs, packed rows scoring as unpacked ones; its export is a causal LM that transformers
loads and jaxrm loads back as a verifier; bad answers, heads and uses are refused by name."""

import dataclasses
import json
import os
import sys

import hf_tiny
import numpy as np
import peft
import pytest
import tiny_run
import torch
import transformers
from helpers import PARITY_ATOL, REBATCHED, SERVER_CONFIG, approx, assistant, call, serving, user

from jaxrm import RewardModel
from jaxrm.config import RewardSpec
from jaxrm.data import packing, pipeline, registry
from jaxrm.data.drops import DropReport
from jaxrm.data.tokenize import TokenizeOptions, pad_id, tokenize_all
from jaxrm.errors import CheckpointError, ConfigError, EvaluationError
from jaxrm.evaluation import evaluate
from jaxrm.export import export
from jaxrm.hf.safetensors_io import SafetensorsFile
from jaxrm.scoring.kinds import ModelKindError
from jaxrm.tasks import asker, verifier

QUESTION = "Is the answer right? Answer Yes or No."
CONVERSATIONS = [
  [user("What is 2 + 2?"), assistant("4")],
  [user("What is 2 + 2?"), assistant("5")],
  [{"role": "system", "content": "Be brief."}, user("Name a colour."), assistant("Blue, or green.")],
]


def causal_lm(tokenizer, path, tie: bool):
  """A tiny random LlamaForCausalLM over SmolLM2's vocabulary, saved with its tokenizer in ``path``."""
  model = hf_tiny.build(
    "llama",
    head="causal",
    vocab_size=len(tokenizer),
    num_hidden_layers=2,
    pad_token_id=tokenizer.pad_token_id,
    bos_token_id=tokenizer.bos_token_id,
    eos_token_id=tokenizer.eos_token_id,
    tie_word_embeddings=tie,
  )
  model.save_pretrained(path)
  tokenizer.save_pretrained(path)
  return model


def transformers_log_odds(model, tokenizer, conversations, question, answers=("Yes", "No")):
  """``log_softmax(logits)[yes] - [no]`` at the last position of each conversation followed by
  ``question``, rendered by the chat template with the generation prompt."""
  yes, no = (tokenizer.encode(a, add_special_tokens=False)[0] for a in answers)
  out = []
  for conversation in conversations:
    text = tokenizer.apply_chat_template(
      conversation + [user(question)], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
      log_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)
    out.append(float(log_probs[yes] - log_probs[no]))
  return np.asarray(out)


# ------------------------------------------------------------------ zero-shot


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_zero_shot_scores_equal_transformers_log_odds(smollm2_tokenizer, tmp_path, tie):
  torch_model = causal_lm(smollm2_tokenizer, tmp_path, tie)
  rm = RewardModel.from_pretrained(tmp_path, verifier={"question": QUESTION, "answers": ["Yes", "No"]})
  assert (rm.kind, rm.config.head, rm.config.tie_word_embeddings) == ("verifier", "lm", tie)
  assert rm.verifier == verifier.Verifier(QUESTION, ("Yes", "No"))
  assert ("lm_head" in vars(rm.model)) != tie and "score" not in vars(rm.model)  # no reward head
  expected = transformers_log_odds(torch_model, smollm2_tokenizer, CONVERSATIONS, QUESTION)
  np.testing.assert_allclose(rm.score(CONVERSATIONS), expected, atol=PARITY_ATOL, rtol=0)
  # Prompt and completion given apart lay out the same rows; the two that share a prompt score
  # together (one packed row), or alone, alike.
  split = dict(prompts=[c[:-1] for c in CONVERSATIONS], completions=[c[-1:] for c in CONVERSATIONS])
  np.testing.assert_allclose(rm.score(**split), expected, atol=PARITY_ATOL, rtol=0)
  np.testing.assert_allclose(rm.score(**split, share_prefix=False), rm.score(**split), **REBATCHED)


def test_gemma2_final_soft_capping_acts_on_the_answers_logits(smollm2_tokenizer, tmp_path):
  """Gemma 2 caps the LM head's logits (c * tanh(z / c)) before the softmax: each of the two
  answers' logits is capped before their difference. A cap of 0.5 moves these by far more than the
  tolerance."""
  tok = smollm2_tokenizer
  torch_model = hf_tiny.build(
    "gemma2",
    head="causal",
    vocab_size=len(tok),
    pad_token_id=tok.pad_token_id,
    bos_token_id=tok.bos_token_id,
    eos_token_id=tok.eos_token_id,
    tie_word_embeddings=True,
    final_logit_softcapping=0.5,
  )
  torch_model.save_pretrained(tmp_path)
  tok.save_pretrained(tmp_path)
  rm = RewardModel.from_pretrained(tmp_path, verifier={"question": QUESTION})
  assert rm.config.final_logit_softcapping == 0.5
  expected = transformers_log_odds(torch_model, tok, CONVERSATIONS, QUESTION)
  np.testing.assert_allclose(rm.score(CONVERSATIONS), expected, atol=PARITY_ATOL, rtol=0)
  uncapped = RewardModel.from_pretrained(
    tmp_path, verifier={"question": QUESTION}, final_logit_softcapping=None
  )
  assert np.abs(uncapped.score(CONVERSATIONS) - expected).max() > 100 * PARITY_ATOL


def test_default_question_and_plain_text(smollm2_tokenizer, tmp_path):
  torch_model = causal_lm(smollm2_tokenizer, tmp_path, tie=True)
  rm = RewardModel.from_pretrained(tmp_path, verifier=True)
  assert rm.verifier.question == verifier.DEFAULT_QUESTION and rm.verifier.answers == ("Yes", "No")
  # Plain text is a user turn (the prompt) and an assistant turn (the completion).
  got = rm.score(prompts=["What is 2 + 2?"], completions=["4"])
  expected = transformers_log_odds(
    torch_model, smollm2_tokenizer, CONVERSATIONS[:1], verifier.DEFAULT_QUESTION
  )
  np.testing.assert_allclose(got, expected, atol=PARITY_ATOL, rtol=0)


def test_render_is_the_text_of_the_ids_scored(causal_dir, smollm2_tokenizer):
  """``Verifier.render``: the conversation and the question's turn, rendered with the generation
  prompt; tokenized, exactly the ids ``rm.encode`` lays out (what other frameworks are given)."""
  rm = RewardModel.from_pretrained(causal_dir, verifier={"question": QUESTION})
  for conversation in CONVERSATIONS:
    text = rm.verifier.render(smollm2_tokenizer, conversation)
    assert text == smollm2_tokenizer.apply_chat_template(
      conversation + [user(QUESTION)], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith(f"{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    assert smollm2_tokenizer(text, add_special_tokens=False)["input_ids"] == rm.encode(conversation)


def test_answers_must_be_one_token_each(smollm2_tokenizer, tmp_path):
  causal_lm(smollm2_tokenizer, tmp_path, tie=True)
  with pytest.raises(
    ConfigError, match=r"answer 'Yes indeed' is 2 tokens for this tokenizer \('Yes', 'Ġindeed'\)"
  ):
    RewardModel.from_pretrained(tmp_path, verifier={"answers": ["Yes indeed", "No"]})
  with pytest.raises(ConfigError, match="two different non-empty strings"):
    verifier.Verifier(answers=("Yes", "Yes"))
  with pytest.raises(ConfigError, match=r"reward.verifier_answers='Yes'.*two \(yes, then no\)"):
    RewardSpec("verifier", verifier_answers="Yes")


def test_a_classifier_without_lm_head_is_no_verifier(model_dir):
  with pytest.raises(CheckpointError, match=r"missing tensor 'lm_head.weight'.*load a causal LM"):
    RewardModel.from_pretrained(model_dir, verifier=True)


def test_wrong_uses_name_the_verifier(smollm2_tokenizer, tmp_path):
  causal_lm(smollm2_tokenizer, tmp_path, tie=True)
  rm = RewardModel.from_pretrained(tmp_path, verifier=True)
  with pytest.raises(
    ModelKindError,
    match=r"score_steps needs a token-head .*; this model has an LM head \(a verifier: the log-odds "
    r"of two answer tokens\); a verifier scores conversations",
  ):
    rm.score_steps("What is 2 + 2?", ["2 + 2 = 4\n"])
  # A verifier serves where a preference model does: one reward per row.
  assert rm.check_kind("preference", use="a reward function", one_reward=True) == "verifier"


# ------------------------------------------------------------------ scoring elsewhere


@pytest.fixture(scope="module")
def zero_shot(smollm2_tokenizer, tmp_path_factory):
  """A tiny random causal LM (tied embeddings) loaded as a verifier asking QUESTION."""
  path = tmp_path_factory.mktemp("zero_shot")
  causal_lm(smollm2_tokenizer, path, tie=True)
  return RewardModel.from_pretrained(path, verifier={"question": QUESTION})


def test_reward_function_scores_through_score(zero_shot):
  prompts, completions = [c[:-1] for c in CONVERSATIONS], [c[-1:] for c in CONVERSATIONS]
  rewards = zero_shot.as_reward_func()(prompts=prompts, completions=completions, trainer_state=None)
  np.testing.assert_allclose(rewards, zero_shot.score(CONVERSATIONS), **REBATCHED)


def test_server_classifies_by_the_answers(zero_shot):
  want = zero_shot.score(CONVERSATIONS[:2])
  config = dataclasses.replace(SERVER_CONFIG, max_length=128, buckets=(64, 128))
  with serving(zero_shot, config) as server:
    status, reply, _ = call(server.url, "/score", {"conversations": CONVERSATIONS[:2]})
    assert status == 200, reply
    assert reply["rewards"] == approx(want)
    status, reply, _ = call(server.url, "/classify", {"messages": CONVERSATIONS[0]})
    assert status == 200, reply
    (item,) = reply["data"]
    p_yes = 1 / (1 + np.exp(-want[0]))
    assert item["num_classes"] == 2 and item["probs"] == approx([p_yes, 1 - p_yes])
    assert item["label"] == ("Yes" if p_yes >= 0.5 else "No")
    status, reply, _ = call(server.url, "/classify", {"messages": CONVERSATIONS[0], "use_activation": False})
    assert status == 400 and "is a verifier" in reply["error"], reply


def test_evaluation_lays_records_out_with_the_question(zero_shot):
  result = evaluate(zero_shot, "demo_arithmetic", max_rows=4, max_length=128)
  assert result["kind"] == "preference" and result["num_examples"] == 4
  records = registry.load_records("demo_arithmetic", None, split="validation", drops=DropReport())[:4]
  chosen = zero_shot.score(
    prompts=[r.context for r in records], completions=[r.completions[r.ranks.index(0)] for r in records]
  )
  np.testing.assert_allclose(np.sort(result["scores"]["chosen"]), np.sort(chosen), **REBATCHED)


def test_evaluate_command_line_takes_a_causal_lm_as_verifier(causal_dir, tmp_path):
  args = [f"--model={causal_dir}", "--data=demo_arithmetic", "--max_rows=4", "--max_length=128"]
  proc = tiny_run.run([sys.executable, "-m", "jaxrm.evaluate", *args, "--verifier", f"--output={tmp_path}"])
  assert proc.returncode == 0, tiny_run.describe(proc)
  with open(tmp_path / "eval.json") as f:
    report = json.load(f)
  rm = RewardModel.from_pretrained(causal_dir, verifier=True)
  want = evaluate(rm, "demo_arithmetic", max_rows=4, max_length=128)
  assert report["metrics"] == pytest.approx(want["metrics"], rel=1e-5, abs=1e-6)
  # Without --verifier the causal LM is a base model with a new reward head; --verifier_question
  # alone is refused.
  proc = tiny_run.run([sys.executable, "-m", "jaxrm.evaluate", *args, "--verifier_question=Right?"])
  assert proc.returncode == 2 and "--verifier_question applies with --verifier" in proc.stderr, proc.stderr


# ------------------------------------------------------------------ training


@pytest.fixture(scope="module")
def verifier_run(causal_dir, tmp_path_factory):
  """The tiny run with reward.type=verifier; validation at the start and at steps 2 and 4."""
  out = str(tmp_path_factory.mktemp("verifier") / "run")
  tiny_run.train(tiny_run.config(causal_dir, out, reward__type="verifier", eval__val_at_start=True))
  return out


def test_verifier_run_trains(verifier_run):
  val = {r["step"]: r for r in tiny_run.read_metrics(verifier_run) if "validation-train_sample_loss" in r}
  assert list(val) == [0, 2, 4]
  # The Bradley-Terry loss of the log-odds falls on the pairs it trains on.
  assert val[4]["validation-train_sample_loss"] < val[0]["validation-train_sample_loss"] - 0.01
  rm = RewardModel.from_pretrained(verifier_run)
  assert rm.kind == "verifier" and rm.verifier == verifier.Verifier()


@pytest.mark.parametrize("shared", [False, True], ids=["packed", "shared_prompt"])
def test_packed_rows_score_as_unpacked(causal_dir, shared):
  """Each completion branch ends with the question and the generation prompt; its log-odds are
  read at its last token, as an unpacked row's."""
  rm = RewardModel.from_pretrained(causal_dir, verifier=True)
  records = registry.load_records("demo_arithmetic", None, split="train", drops=DropReport())[:6]
  options = TokenizeOptions(max_length=96, verifier_question=rm.verifier.question)
  examples = tokenize_all(records, rm.tokenizer, options, DropReport())
  # SmolLM2's chat template: the question's user turn, then the assistant's turn opened.
  asked = f"<|im_start|>user\n{rm.verifier.question}<|im_end|>\n<|im_start|>assistant\n"
  assert all(rm.tokenizer.decode(ids).endswith(asked) for e in examples for ids in e.input_ids)
  batch = dict(batch_size=6, buckets=(96,), pad_id=pad_id(rm.tokenizer), num_completions=2)
  (unpacked,) = pipeline.make_eval_batches(examples, **batch)
  pack = packing.PackSpec(row_length=192, length_multiple=16, shared_prompt=shared)
  (packed,) = pipeline.make_eval_batches(examples, **batch, pack=pack)
  assert packed.input_ids.shape[0] < unpacked.input_ids.shape[0]
  want = np.asarray(unpacked.outputs(rm.model))
  np.testing.assert_allclose(np.asarray(packed.outputs(rm.model)), want, **REBATCHED)
  assert np.ptp(want) > 0


def test_a_run_saved_before_the_verifier_keys_resumes(model_dir, tmp_path):
  """config.json of a run started by a jaxrm without reward.verifier_*: the keys at their defaults
  are no changed setting, so the rerun resumes; set otherwise, they are."""
  out = tmp_path / "run"
  tiny_run.train(tiny_run.config(model_dir, str(out), eval__val_at_end=False), stop_after_steps=2)
  with open(out / "config.json") as f:
    saved = json.load(f)
  for key in ("verifier_question", "verifier_answers", "verifier_loss"):
    del saved["reward"][key]
  with open(out / "config.json", "w") as f:
    json.dump(saved, f)
  tiny_run.train(tiny_run.config(model_dir, str(out), eval__val_at_end=False))
  assert [r["step"] for r in tiny_run.read_metrics(out) if "train/loss" in r] == [1, 2, 3, 4]
  with pytest.raises(ConfigError, match=r"reward.verifier_loss"):
    tiny_run.train(tiny_run.config(model_dir, str(out), reward__verifier_loss="all_pairs"))


# ------------------------------------------------------------------ export


def test_export_is_a_causal_lm_with_the_same_log_odds(verifier_run, smollm2_tokenizer, tmp_path):
  out = tmp_path / "export"
  rm = export(verifier_run, str(out))
  with open(out / "config.json") as f:
    config = json.load(f)
  assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
  with open(out / asker.FILE) as f:
    assert json.load(f) == {"question": verifier.DEFAULT_QUESTION, "answers": ["Yes", "No"]}
  assert "lm_head.weight" not in SafetensorsFile(str(out / "model.safetensors")).keys()  # tied
  torch_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  assert torch_model.lm_head.weight.data_ptr() == torch_model.model.embed_tokens.weight.data_ptr()
  scores = rm.score(CONVERSATIONS)
  expected = transformers_log_odds(torch_model, smollm2_tokenizer, CONVERSATIONS, verifier.DEFAULT_QUESTION)
  np.testing.assert_allclose(scores, expected, atol=PARITY_ATOL, rtol=0)
  # jaxrm reads its export back as the verifier it is, without being told.
  back = RewardModel.from_pretrained(out)
  assert back.kind == "verifier" and back.verifier == rm.verifier
  np.testing.assert_allclose(back.score(CONVERSATIONS), scores, atol=PARITY_ATOL, rtol=0)


def test_untied_export_writes_the_lm_head(smollm2_tokenizer, tmp_path):
  causal_lm(smollm2_tokenizer, tmp_path / "lm", tie=False)
  rm = RewardModel.from_pretrained(tmp_path / "lm", verifier={"question": QUESTION})
  rm.save_pretrained(tmp_path / "export")
  assert "lm_head.weight" in SafetensorsFile(str(tmp_path / "export" / "model.safetensors")).keys()
  torch_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
  expected = transformers_log_odds(torch_model.eval(), smollm2_tokenizer, CONVERSATIONS, QUESTION)
  np.testing.assert_allclose(rm.score(CONVERSATIONS), expected, atol=PARITY_ATOL, rtol=0)
  assert os.path.isfile(tmp_path / "export" / asker.FILE)
  assert RewardModel.from_pretrained(tmp_path / "export").verifier == rm.verifier
  # verifier=True keeps the question the export recorded; a dict asks another.
  assert RewardModel.from_pretrained(tmp_path / "export", verifier=True).verifier == rm.verifier
  other = RewardModel.from_pretrained(tmp_path / "export", verifier={"question": "Right?"})
  assert other.verifier.question == "Right?"
  with pytest.raises(ValueError, match="verifier=True with head='sequence'"):
    RewardModel.from_pretrained(tmp_path / "export", verifier=True, head="sequence")


def test_lora_verifier_trains_and_exports_merged(causal_dir, smollm2_tokenizer, tmp_path):
  """LoRA adapters over the frozen causal LM (its LM head frozen too); the export merges them, or
  writes the adapters alone for peft."""
  out = tmp_path / "lora"
  c = tiny_run.config(
    causal_dir,
    str(out),
    reward__type="verifier",
    model__lora__rank=4,
    train__max_steps=2,
    eval__val_at_end=False,
  )
  tiny_run.train(tiny_run.set_keys(c, {"checkpointing.save_period": 2, "train.learning_rate": 1e-2}))
  rm = export(str(out), str(tmp_path / "export"))
  assert rm.kind == "verifier" and rm.config.lora.rank == 4
  base = RewardModel.from_pretrained(causal_dir, verifier=True)
  assert np.abs(rm.score(CONVERSATIONS) - base.score(CONVERSATIONS)).max() > 1e-3  # the adapters moved it
  torch_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
  expected = transformers_log_odds(
    torch_model.eval(), smollm2_tokenizer, CONVERSATIONS, verifier.DEFAULT_QUESTION
  )
  np.testing.assert_allclose(rm.score(CONVERSATIONS), expected, atol=PARITY_ATOL, rtol=0)
  # Adapters only: a CAUSAL_LM peft directory (no head saved: the base's LM head is frozen) that
  # peft applies over the base causal LM, scoring as jaxrm does; the question and answers beside it.
  export(str(out), str(tmp_path / "adapters"), adapters_only=True, base_model=causal_dir)
  with open(tmp_path / "adapters" / "adapter_config.json") as f:
    adapter_config = json.load(f)
  assert adapter_config["task_type"] == "CAUSAL_LM" and adapter_config["modules_to_save"] is None
  with open(tmp_path / "adapters" / asker.FILE) as f:
    assert json.load(f) == rm.verifier.to_json()
  base_lm = transformers.AutoModelForCausalLM.from_pretrained(causal_dir, dtype=torch.float32)
  adapted = peft.PeftModel.from_pretrained(base_lm, tmp_path / "adapters").eval()
  expected = transformers_log_odds(adapted, smollm2_tokenizer, CONVERSATIONS, verifier.DEFAULT_QUESTION)
  np.testing.assert_allclose(rm.score(CONVERSATIONS), expected, atol=PARITY_ATOL, rtol=0)


# ------------------------------------------------------------------ labelled items


def labelled_file(path, split: str, rows: int, plain: bool = False) -> str:
  """TRL's unpaired rows (prompt, completion, label) from the demo's pairs: the better completion
  of each labelled true, the worse false; conversations, or with ``plain`` their texts."""
  records = registry.load_records("demo_arithmetic", None, split=split, drops=DropReport())[: rows // 2]
  with open(path, "w") as f:
    for r in records:
      for completion, rank in zip(r.completions, r.ranks):
        prompt = r.context[-1]["content"] if plain else r.context
        text = completion[0]["content"] if plain else completion
        f.write(json.dumps({"prompt": prompt, "completion": text, "label": rank == 0}) + "\n")
  return str(path)


def labelled_config(causal_dir, tmp_path, out, **overrides):
  train, val = (
    labelled_file(tmp_path / "train.jsonl", "train", 64),
    labelled_file(tmp_path / "val.jsonl", "validation", 16),
  )
  return tiny_run.config(
    causal_dir,
    str(out),
    reward__type="verifier",
    data__dataset_name="PreferenceDataset",
    data__train_data_path=train,
    data__val_data_paths={"default": val, "train_sample": train},
    eval__val_at_start=True,
    data__max_val_rows=0,
    **overrides,
  )


@pytest.fixture(scope="module")
def labelled_run(causal_dir, tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("labelled")
  out = tmp_path / "run"
  # 12 steps: 64 balanced items take a few epochs to move more than the log-odds' bias.
  tiny_run.train(
    labelled_config(
      causal_dir, tmp_path, out, train__max_steps=12, eval__val_period=6, train__learning_rate=1e-4
    )
  )
  return str(out), tmp_path


def test_labelled_items_train_with_cross_entropy_over_the_answers(labelled_run, causal_dir):
  out, tmp_path = labelled_run
  val = {r["step"]: r for r in tiny_run.read_metrics(out) if "validation-default_loss" in r}
  assert list(val) == [0, 6, 12]
  assert val[12]["validation-train_sample_loss"] < val[0]["validation-train_sample_loss"] - 0.01
  for key in ("accuracy", "positive_rate", "auroc", "ece"):
    assert 0 <= val[0][f"validation-default_{key}"] <= 1, key
  assert val[0]["validation-default_positive_rate"] == 0.5
  # Step 0 is the causal LM as it is: the loss is -log sigmoid(+-log-odds) of rm.score's log-odds.
  rm = RewardModel.from_pretrained(causal_dir, verifier=True)
  with open(tmp_path / "val.jsonl") as f:
    rows = [json.loads(line) for line in f]
  s = rm.score(prompts=[r["prompt"] for r in rows], completions=[r["completion"] for r in rows]).astype(
    np.float64
  )
  y = np.array([r["label"] for r in rows])
  loss = -np.mean(np.where(y, -np.logaddexp(0, -s), -np.logaddexp(0, s)))
  assert val[0]["validation-default_loss"] == pytest.approx(loss, abs=1e-5)
  assert val[0]["validation-default_accuracy"] == np.mean((s > 0) == y)
  auroc = np.mean([(a > b) + 0.5 * (a == b) for a in s[y] for b in s[~y]])
  assert val[0]["validation-default_auroc"] == pytest.approx(auroc, abs=1e-9)
  p = 1 / (1 + np.exp(-s))
  bins = np.minimum((p * 10).astype(int), 9)
  ece = sum(abs(y[bins == b].sum() - p[bins == b].sum()) for b in range(10)) / len(s)
  assert val[0]["validation-default_ece"] == pytest.approx(ece, abs=1e-5)


def test_plain_text_labelled_items_are_read(causal_dir, tmp_path):
  path = labelled_file(tmp_path / "plain.jsonl", "train", 4, plain=True)
  records = registry.load_records("PreferenceDataset", path, split="train", drops=DropReport())
  assert sorted(r.label for r in records) == [False, False, True, True]
  assert isinstance(records[0].context, str) and isinstance(records[0].completion, str)


def test_labelled_items_are_refused_where_they_cannot_train(causal_dir, model_dir, tmp_path):
  c = labelled_config(causal_dir, tmp_path, tmp_path / "bt")
  c.reward.type = "bradley_terry"
  c.model.name_or_path = model_dir
  with pytest.raises(
    ConfigError,
    match=r"holds labelled items \(prompt, completion, label; .*train.jsonl:1\), which train reward.type=verifier or pointwise only, not 'bradley_terry'",
  ):
    tiny_run.train(c)
  c = labelled_config(causal_dir, tmp_path, tmp_path / "mixed")
  lines = (tmp_path / "train.jsonl").read_text().splitlines(keepends=True)
  pair = json.dumps({"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"}) + "\n"
  (tmp_path / "train.jsonl").write_text("".join([lines[0], pair, *lines[1:]]))
  with pytest.raises(
    ConfigError,
    match=r"mixes labelled items \(.*train.jsonl:1\) with preference pairs \(.*train.jsonl:2\); give one kind "
    r"of row per file",
  ):
    tiny_run.train(c)


def test_evaluation_of_labelled_items(labelled_run, causal_dir):
  out, tmp_path = labelled_run
  rm = RewardModel.from_pretrained(causal_dir, verifier=True)
  result = evaluate(rm, str(tmp_path / "val.jsonl"), max_length=128)
  assert result["kind"] == "labelled" and result["num_examples"] == 16
  # The metrics the run's validation reported at step 0, of the same model.
  (step0,) = [r for r in tiny_run.read_metrics(out) if r["step"] == 0 and "validation-default_loss" in r]
  for key in ("loss", "accuracy", "positive_rate", "auroc", "ece", "reward_mean"):
    assert result["metrics"][key] == pytest.approx(step0[f"validation-default_{key}"], abs=1e-5), key
  # A preference model is not a verifier.
  with pytest.raises(EvaluationError, match=r"labelled items needs a verifier"):
    evaluate(
      RewardModel.from_pretrained(tiny_run.tiny_model_dir(os.path.dirname(causal_dir))),
      str(tmp_path / "val.jsonl"),
    )
