"""A causal LM as a pairwise judge (``RewardModel.from_pretrained(..., judge=True)``, a run of
``reward.type=pairwise``, an export of one): its log-odds are transformers' ``log_softmax[A] -
log_softmax[B]`` after ``rm.judge_text``; ``compare`` reads both orders antisymmetrically; group
rewards are the Bradley-Terry strengths of its comparisons; the export is a causal LM that jaxrm
reads back as a judge; its reward function groups a batch by prompt; bad input is refused by name."""

import asyncio
import dataclasses
import json

import hf_tiny
import numpy as np
import pytest
import tiny_run
import torch
import transformers
from helpers import PARITY_ATOL, REBATCHED, SERVER_CONFIG, approx, assistant, serving, user

from jaxrm import RewardModel, cli
from jaxrm.errors import CheckpointError, ConfigError
from jaxrm.export import export
from jaxrm.integrations import verl
from jaxrm.run.run_files import RunFiles
from jaxrm.scoring import reward_funcs
from jaxrm.scoring.kinds import ModelKindError
from jaxrm.tasks import pairwise
from jaxrm.tasks.pairwise import Judge

QUESTION = "Which answer is right, A or B? Answer A or B."
PROMPTS = [
  [{"role": "system", "content": "Be brief."}, user("What is 2 + 2?")],
  "Name a colour.",
  [user("Hi"), assistant("Hello!"), user("What is 3 * 3?")],
]
RESPONSES_A = ["4", "Blue, or green.", [assistant("9")]]
RESPONSES_B = ["5", "Seven.", "It is 6."]


def transformers_log_odds(model, tokenizer, texts, answers=("A", "B")):
  """``log_softmax(logits)[A] - [B]`` of the next token after each text (tokenized without added
  special tokens: the chat template wrote them)."""
  a, b = (tokenizer.encode(x, add_special_tokens=False)[0] for x in answers)
  out = []
  for text in texts:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
      log_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)
    out.append(float(log_probs[a] - log_probs[b]))
  return np.asarray(out)


@pytest.fixture(scope="module")
def judge(causal_dir):
  return RewardModel.from_pretrained(causal_dir, judge={"question": QUESTION})


# ------------------------------------------------------------------ its log-odds


def test_log_odds_are_transformers_on_the_judge_text(judge, causal_dir, smollm2_tokenizer):
  assert (judge.kind, judge.config.head, judge.judge) == ("pairwise", "lm", Judge(QUESTION))
  assert judge.verifier is judge.judge
  assert judge.config.verifier_tokens == tuple(
    smollm2_tokenizer.encode(a, add_special_tokens=False)[0] for a in ("A", "B")
  )
  texts = [judge.judge_text(p, a, b) for p, a, b in zip(PROMPTS, RESPONSES_A, RESPONSES_B)]
  # One user turn holding the conversation, both responses and the question, then the assistant's
  # turn opened.
  assert texts[1].endswith(
    "[Conversation]\nUser: Name a colour.\n\n[Response A]\nBlue, or green.\n\n[Response B]\nSeven.\n\n"
    f"{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
  )
  torch_model = transformers.AutoModelForCausalLM.from_pretrained(causal_dir, dtype=torch.float32).eval()
  expected = transformers_log_odds(torch_model, smollm2_tokenizer, texts)
  got = judge.compare(PROMPTS, RESPONSES_A, RESPONSES_B, orders="ab")
  np.testing.assert_allclose(got, expected, atol=PARITY_ATOL, rtol=0)
  assert np.ptp(expected) > 100 * PARITY_ATOL  # a random model still tells these apart


def test_another_family_untied(smollm2_tokenizer, tmp_path):
  """Qwen3 (its q/k norms), the LM head apart from the embeddings."""
  tok = smollm2_tokenizer
  torch_model = hf_tiny.build(
    "qwen3",
    head="causal",
    vocab_size=len(tok),
    pad_token_id=tok.pad_token_id,
    bos_token_id=tok.bos_token_id,
    eos_token_id=tok.eos_token_id,
    tie_word_embeddings=False,
  ).eval()
  torch_model.save_pretrained(tmp_path)
  tok.save_pretrained(tmp_path)
  rm = RewardModel.from_pretrained(tmp_path, judge=True)
  assert rm.judge == Judge() and not rm.config.tie_word_embeddings
  texts = [rm.judge_text(p, a, b) for p, a, b in zip(PROMPTS[:2], RESPONSES_A, RESPONSES_B)]
  expected = transformers_log_odds(torch_model, tok, texts)
  np.testing.assert_allclose(
    rm.compare(PROMPTS[:2], RESPONSES_A[:2], RESPONSES_B[:2], orders="ab"), expected, atol=PARITY_ATOL, rtol=0
  )


def test_both_orders_are_antisymmetric_exactly(judge):
  ab = judge.compare(PROMPTS, RESPONSES_A, RESPONSES_B)
  ba = judge.compare(PROMPTS, RESPONSES_B, RESPONSES_A)
  assert ab.dtype == np.float32 and np.array_equal(ab, -ba)
  one_order = judge.compare(PROMPTS * 2, RESPONSES_A + RESPONSES_B, RESPONSES_B + RESPONSES_A, orders="ab")
  np.testing.assert_allclose(ab, (one_order[:3] - one_order[3:]) / 2, **REBATCHED)
  assert np.abs(one_order[:3] + one_order[3:]).max() > 1e-4  # the position moves the random judge


# ------------------------------------------------------------------ group rewards


def test_group_rewards_are_the_bradley_terry_strengths_of_compare(judge):
  prompt, responses = PROMPTS[0], ["4", "5", "four", "It is 4."]
  n = len(responses)
  d = np.full((n, n), np.nan, np.float32)
  pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
  d[tuple(zip(*pairs))] = judge.compare(
    [prompt] * len(pairs), [responses[i] for i, _ in pairs], [responses[j] for _, j in pairs]
  )
  d = (d - d.T) / 2  # the two items of a pair score alike up to float rounding (other batches)
  (scores,) = judge.score_groups([prompt], [responses])
  np.testing.assert_allclose(scores.log_odds, d, **REBATCHED)
  np.testing.assert_allclose(scores.rewards, pairwise.bradley_terry(d), atol=1e-5)
  assert scores.rewards.dtype == np.float32 and abs(float(scores.rewards.sum())) < 1e-5  # centred
  rates = judge.score_group(prompt, responses, aggregate="win_rate")
  np.testing.assert_allclose(rates, np.nanmean(1 / (1 + np.exp(-d)), axis=1), atol=1e-6)
  # Against a reference, each response's one comparison is its strength above the reference.
  against = judge.score_group(prompt, responses, strategy="reference", reference="4 it is")
  np.testing.assert_allclose(against, judge.compare([prompt] * n, responses, ["4 it is"] * n), atol=1e-5)
  # Circular: each with the next, both orders; the pairs met are those of the circle.
  (circle,) = judge.score_groups([prompt], [responses], strategy="circular")
  met = ~np.isnan(circle.log_odds)
  assert met.sum() == 2 * n and all(met[i, (i + 1) % n] for i in range(n))
  json.dumps(circle.to_json())  # null where not compared


def test_reward_function_groups_the_batch_by_prompt(judge):
  """GRPO batches hold each prompt's completions anywhere in the batch; a prompt alone gets 0."""
  p, q = PROMPTS[0], PROMPTS[2]
  prompts = [p, q, p, "Lone prompt.", q, p]
  completions = ["4", "9", "5", "x", "It is 9.", "four"]
  f = judge.as_reward_func(name="judge")
  rewards = f(prompts=prompts, completions=completions, trainer_state=None)
  want_p = judge.score_group(p, ["4", "5", "four"])
  want_q = judge.score_group(q, ["9", "It is 9."])
  np.testing.assert_allclose(
    rewards, [want_p[0], want_q[0], want_p[1], 0.0, want_q[1], want_p[2]], **REBATCHED
  )
  assert rewards[3] == 0.0 and f.__name__ == "judge"
  rates = judge.as_reward_func(aggregate="win_rate")(prompts=prompts, completions=completions)
  assert rates[3] == 0.5


@pytest.mark.slow
def test_trl_grpo_trainer_takes_the_group_rewards(judge, cache_root, tmp_path):
  """Two steps of TRL's GRPOTrainer: each batch's rewards are its groups' rewards by prompt."""
  from helpers import grpo_trainer

  f = judge.as_reward_func(name="judge", strategy="circular")
  calls = []

  def recorded(prompts, completions, **kwargs):
    rewards = f(prompts=prompts, completions=completions, **kwargs)
    calls.append((list(prompts), list(completions), rewards))
    return rewards

  recorded.__name__ = f.__name__
  trainer = grpo_trainer(cache_root, tmp_path, [recorded], ["Q: 12 * 3 + 4?", "Q: 7 - 9?"] * 2, max_steps=2)
  trainer.train()
  assert len(calls) == 2
  for prompts, completions, rewards in calls:
    for prompt in set(prompts):
      rows = [i for i, x in enumerate(prompts) if x == prompt]
      want = judge.score_group(prompt, [completions[i] for i in rows], strategy="circular")
      np.testing.assert_allclose([rewards[i] for i in rows], want, **REBATCHED)
  assert [h for h in trainer.state.log_history if "rewards/judge/mean" in h]


def test_a_judge_server_gives_the_remote_and_verl_rewards(judge):
  """remote_reward_func(strategy=...) sends each prompt's group to /compare; verl's compute_score
  compares the solution with its reference answer there (strategy reference)."""
  prompts = ["What is 2 + 2?", "Name a colour.", "What is 2 + 2?", "What is 2 + 2?"]
  completions = ["4", "Blue.", "5", "Four."]
  config = dataclasses.replace(SERVER_CONFIG, max_batch=8, max_length=128, buckets=(128,))
  with serving(judge, config) as server:
    remote = reward_funcs.remote_reward_func(server.url, strategy="round_robin")
    got = remote(prompts=prompts, completions=completions)
    scored = asyncio.run(
      verl.compute_score("gsm8k", "5", 4, {"question": "What is 2 + 2?"}, url=server.url, judge=True)
    )
  local = judge.as_reward_func()(prompts=prompts, completions=completions)
  assert got == approx(local) and got[1] == 0.0
  want = judge.score_group([user("What is 2 + 2?")], ["5"], strategy="reference", reference="4")
  assert [scored["score"]] == approx(want)


# ------------------------------------------------------------------ saved and read back


def test_export_is_a_causal_lm_read_back_as_the_judge(judge, smollm2_tokenizer, tmp_path):
  judge.save_pretrained(tmp_path / "first")
  # jaxrm.export reads the first export back as the judge it is, not told, and exports it again.
  back = export(str(tmp_path / "first"), str(tmp_path / "export"))
  out = tmp_path / "export"
  with open(out / "config.json") as f:
    config = json.load(f)
  assert config["architectures"] == ["LlamaForCausalLM"]
  assert config["jaxrm"]["task"] == {"name": "pairwise", "verifier": judge.judge.to_json()}
  with open(out / "jaxrm_verifier.json") as f:
    assert json.load(f) == {
      "task": "pairwise",
      "question": QUESTION,
      "answers": ["A", "B"],
      "template": pairwise.TEMPLATE,
    }
  torch_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  texts = [judge.judge_text(p, a, b) for p, a, b in zip(PROMPTS, RESPONSES_A, RESPONSES_B)]
  got = judge.compare(PROMPTS, RESPONSES_A, RESPONSES_B, orders="ab")
  np.testing.assert_allclose(
    got, transformers_log_odds(torch_model, smollm2_tokenizer, texts), atol=PARITY_ATOL, rtol=0
  )
  assert back.kind == "pairwise" and back.judge == judge.judge
  np.testing.assert_array_equal(back.compare(PROMPTS, RESPONSES_A, RESPONSES_B, orders="ab"), got)
  # judge=True keeps what it recorded; verifier=True makes it a verifier with its defaults.
  assert RewardModel.from_pretrained(out, judge=True, load_weights=False).judge == judge.judge
  as_verifier = RewardModel.from_pretrained(out, verifier=True, load_weights=False)
  assert as_verifier.kind == "verifier" and as_verifier.judge is None


def test_a_pairwise_run_records_its_judge(judge, causal_dir, tmp_path):
  """A run of reward.type=pairwise records the judge in model_config.json's task; the run loads
  back as that judge without being told, and is no verifier."""
  out = tmp_path / "run"
  out.mkdir()
  config = tiny_run.config(causal_dir, str(out), reward__type="pairwise", reward__judge_question=QUESTION)
  run_config = cli.run_config(config)
  RunFiles(str(out), judge.config, run_config).write(judge.tokenizer)
  with open(out / "model_config.json") as f:
    assert json.load(f)["task"] == {"name": "pairwise", "verifier": Judge(QUESTION).to_json()}
  rm = RewardModel.from_pretrained(out, load_weights=False)
  assert rm.kind == "pairwise" and rm.judge == Judge(QUESTION)
  with pytest.raises(
    CheckpointError, match=r"trained as a pairwise model; it cannot be loaded as a verifier model"
  ):
    RewardModel.from_pretrained(out, verifier=True, load_weights=False)


# ------------------------------------------------------------------ refused


def test_bad_requests_are_refused_by_name(judge, causal_dir, model_dir):
  with pytest.raises(
    ConfigError, match=r"the judge's answer 'A or' is 2 tokens for this tokenizer \('A', 'Ġor'\)"
  ):
    RewardModel.from_pretrained(causal_dir, judge={"answers": ["A or", "B"]}, load_weights=False)
  with pytest.raises(ConfigError, match=r"judge= with head='sequence': a judge's head is the LM head"):
    RewardModel.from_pretrained(causal_dir, judge=True, head="sequence")
  with pytest.raises(ConfigError, match=r"verifier= and judge= both given"):
    RewardModel.from_pretrained(causal_dir, judge=True, verifier=True)
  with pytest.raises(CheckpointError, match=r"missing tensor 'lm_head.weight'.*load a causal LM"):
    RewardModel.from_pretrained(model_dir, judge=True)
  with pytest.raises(
    ValueError,
    match=r"^a group of 1 response: strategy='round_robin' compares responses with each other, so it needs at least 2$",
  ):
    judge.score_group("Q", ["only one"])
  with pytest.raises(
    ValueError, match=r"^strategy must be one of round_robin, circular, reference; got 'swiss'$"
  ):
    judge.score_group("Q", ["a", "b"], strategy="swiss")
  with pytest.raises(ValueError, match=r"strategy must be one of .*; got 'swiss'"):
    judge.as_reward_func(strategy="swiss")
  with pytest.raises(ValueError, match=r"normalize=: a pairwise judge's rewards are its comparisons"):
    judge.as_reward_func(normalize=True)
  # A judge gives no reward of one response.
  with pytest.raises(
    ModelKindError,
    match=r"this model has an LM head \(a pairwise judge: .*\); a pairwise judge compares responses: rm.compare or rm.score_group",
  ):
    judge.score(["What is 2 + 2? 4"])
  with pytest.raises(
    ModelKindError, match=r"a reward function needs .*; this model has an LM head \(a pairwise judge"
  ):
    judge.as_multi_agent_reward_func(lambda item, c: c)


def test_other_models_are_no_judges(tiny_rm):
  with pytest.raises(
    ModelKindError,
    match=r"^compare\(\) needs a pairwise judge .*; this model has a sequence head with 1 output; train one with reward.type=pairwise",
  ):
    tiny_rm.compare(["Q"], ["a"], ["b"])
  with pytest.raises(ValueError, match=r"strategy= and aggregate= are for a pairwise judge"):
    tiny_rm.as_reward_func(strategy="circular")


@pytest.mark.parametrize(
  "verb, args",
  [
    ("judge_text", ("Q", "a", "b")),
    ("score_group", ("Q", ["a", "b"])),
    ("score_groups", (["Q"], [["a", "b"]])),
  ],
)
def test_each_judge_verb_refuses_another_model_by_its_name(tiny_rm, verb, args):
  """The judge's verbs are its task's (Task.verbs): a model of another task finds them and is
  refused, each verb naming itself; its ``judge`` is None."""
  with pytest.raises(
    ModelKindError,
    match=rf"^{verb}\(\) needs a pairwise judge .*; this model has a sequence head with 1 output; train one with reward.type=pairwise",
  ):
    getattr(tiny_rm, verb)(*args)
  assert tiny_rm.judge is None and "compare" not in dir(tiny_rm)
