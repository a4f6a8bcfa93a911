"""A process reward model's step probabilities as RL rewards: steps, aggregations, reward functions."""

import asyncio
import math

import numpy as np
import pytest
from helpers import REBATCHED, grpo_trainer

from jaxrm.data.drops import DropReport
from jaxrm.data.records import StepwiseRecord
from jaxrm.data.tokenize import TokenizeOptions, tokenize_stepwise
from jaxrm.scoring import reward_funcs, step_rewards

# ------------------------------------------------------------------ step_rewards


def test_split_steps_cuts_where_training_put_the_separator():
  assert step_rewards.split_steps("Add 2.\nAdd 3.\nSo 5.\n", "\n") == ["Add 2.", "Add 3.", "So 5."]
  assert step_rewards.split_steps("Add 2.\nSo 5.", "\n") == ["Add 2.", "So 5."]  # no separator after the last
  assert step_rewards.split_steps("So 5.", "\n\n") == ["So 5."]  # no separator: one step
  assert step_rewards.split_steps("a\n\n\n b \n  \n", "\n") == ["a", " b "]  # empty steps dropped, text kept
  assert step_rewards.split_steps("one ки two ки", " ки") == ["one", " two"]
  assert step_rewards.split_steps("", "\n") == [] and step_rewards.split_steps("\n\n", "\n") == []


def test_split_steps_gives_the_tokens_of_a_training_row(smollm2_tokenizer):
  """A completion written as training lays a row out (each step followed by the separator)
  splits back into the steps of that row: the same token ids."""
  steps, sep = ("First, 12 * 3 = 36.", " Then 36 + 4 = 40.", " The answer is 40."), "\n\n"
  completion = "".join(s + sep for s in steps)

  def ids(steps):
    record = StepwiseRecord(
      prompt="What is 12 * 3 + 4?", steps=tuple(steps), labels=(True,) * len(steps), source="t"
    )
    return tokenize_stepwise(
      record, smollm2_tokenizer, TokenizeOptions(512, "drop", sep), DropReport()
    ).input_ids

  np.testing.assert_array_equal(ids(step_rewards.split_steps(completion, sep)), ids(steps))


def test_split_steps_errors():
  with pytest.raises(ValueError, match=r"the step separator must be a non-empty string, got ''"):
    step_rewards.split_steps("a", "")
  with pytest.raises(TypeError, match="must be a string, got list"):
    step_rewards.split_steps([{"role": "assistant", "content": "a"}], "\n")


def test_aggregate_each_way():
  p = [0.9, 0.25, 0.5, 0.8]
  assert step_rewards.aggregate(p) == 0.25  # min by default
  assert step_rewards.DEFAULT_AGGREGATION == "min"
  assert step_rewards.aggregate(p, "min") == 0.25
  assert step_rewards.aggregate(p, "last") == 0.8
  assert step_rewards.aggregate(p, "product") == pytest.approx(0.09, rel=1e-15)  # float64 products
  assert step_rewards.aggregate(p, "mean") == pytest.approx(0.6125, rel=1e-15)
  assert step_rewards.aggregate(np.float32([0.5]), "product") == 0.5
  assert all(type(step_rewards.aggregate(p, how)) is float for how in step_rewards.AGGREGATIONS)


def test_aggregate_errors():
  with pytest.raises(
    ValueError,
    match=r"aggregation='max' is not an aggregation of step probabilities; "
    r"choose one of min, last, product, mean \(default min\)",
  ):
    step_rewards.aggregate([0.5], "max")
  with pytest.raises(ValueError, match="a solution with no steps has no step probabilities to aggregate"):
    step_rewards.aggregate([], "mean")
  with pytest.raises(ValueError, match=r"step probabilities must lie in \[0, 1\]; got 1.5"):
    step_rewards.aggregate([0.5, 1.5])
  with pytest.raises(ValueError, match=r"must lie in \[0, 1\]; got nan"):
    step_rewards.aggregate([math.nan])


def test_check_aggregation_names_the_flag():
  assert step_rewards.check_aggregation("last") == "last"
  with pytest.raises(ValueError, match=r"^--step_aggregation='Min' is not an aggregation"):
    step_rewards.check_aggregation("Min", flag="--step_aggregation")
  with pytest.raises(ValueError, match=r"^step_aggregation=None is not"):
    step_rewards.check_aggregation(None)


def test_every_door_takes_the_same_aggregation_names(tiny_prm):
  """The reward functions (local, remote, async), verl's compute_score and the server all take
  step_aggregation as one of step_rewards.AGGREGATIONS, and refuse another with one message."""
  from jaxrm.integrations import verl
  from jaxrm.server import ServerConfig

  url = "http://127.0.0.1:1"  # nothing is sent: the name is checked at the door
  doors = {
    "as_reward_func": lambda how: reward_funcs.as_reward_func(tiny_prm, step_aggregation=how),
    "remote_reward_func": lambda how: reward_funcs.remote_reward_func(url, step_aggregation=how),
    "async remote_reward_func": lambda how: reward_funcs.remote_reward_func(
      url, step_aggregation=how, asynchronous=True
    ),
    "the server": lambda how: ServerConfig(step_aggregation=how),
  }
  for door, make in doors.items():
    for how in step_rewards.AGGREGATIONS:
      make(how)
    with pytest.raises(
      ValueError,
      match=r"^step_aggregation='max' is not an aggregation of step probabilities; choose one of "
      r"min, last, product, mean \(default min\)",
    ):
      make("max")
      pytest.fail(f"{door} took step_aggregation='max'")
  with pytest.raises(ValueError, match=r"^step_aggregation='max' is not an aggregation"):
    asyncio.run(verl.compute_score("src", "2", "2", {"question": "q"}, url=url, step_aggregation="max"))


# ------------------------------------------------------------------ reward functions of a process reward model

PROMPTS = ["Q: 12 * 3 + 4?", "Q: 12 * 3 + 4?", "Q: 7 - 9?"]
COMPLETIONS = [" 12 * 3 = 36.\n 36 + 4 = 40.\n So 40.\n", " 12 * 3 = 35.\n 35 + 4 = 39.", " -2"]


def reference(prm, prompts, completions, how):
  """Each reward from rm.score_steps of the completion's steps (cut at the separator, as trained),
  aggregated here by numpy, not by jaxrm.scoring.step_rewards."""
  reduce = {"min": np.min, "last": lambda p: p[-1], "product": np.prod, "mean": np.mean}[how]
  out = []
  for prompt, completion in zip(prompts, completions):
    steps = [s for s in completion.split(prm.step_separator) if s.strip()]
    out.append(float(reduce(np.float64(prm.score_steps(prompt, steps)))) if steps else None)
  return out


def assert_close(got, want):
  """None where ``want`` has None, else equal up to REBATCHED: scored together (shared prefix,
  batched) instead of one solution at a time, the float32 step probabilities agree up to the
  roundings of other shapes; the aggregates are float64."""
  assert [g is None for g in got] == [w is None for w in want], (got, want)
  assert [g for g in got if g is not None] == pytest.approx(
    [w for w in want if w is not None], rel=REBATCHED["rtol"], abs=REBATCHED["atol"]
  )


@pytest.mark.parametrize("how", step_rewards.AGGREGATIONS)
def test_reward_func_aggregates_score_steps(tiny_prm, how):
  f = reward_funcs.as_reward_func(tiny_prm, step_aggregation=how, name="prm")
  got = f(prompts=PROMPTS, completions=COMPLETIONS, completion_ids=[[1]] * 3, trainer_state=None)
  want = reference(tiny_prm, PROMPTS, COMPLETIONS, how)
  assert_close(got, want)
  assert all(type(r) is float for r in got) and len(set(got)) == 3


def test_reward_func_default_is_the_minimum_step(tiny_prm):
  got = tiny_prm.as_reward_func()(prompts=PROMPTS, completions=COMPLETIONS)
  assert_close(got, reference(tiny_prm, PROMPTS, COMPLETIONS, "min"))
  steps = tiny_prm.score_steps(PROMPTS[0], [" 12 * 3 = 36.", " 36 + 4 = 40.", " So 40."])
  assert len(steps) == 3
  assert_close(got[:1], [min(steps)])


def test_reward_func_conversational(tiny_prm):
  prompts = [[{"role": "user", "content": "What is 2 + 2?"}]] * 2
  solutions = ["2 + 2 = 4.\nThe answer is 4.", "2 + 2 = 5."]
  got = tiny_prm.as_reward_func()(
    prompts=prompts, completions=[[{"role": "assistant", "content": s}] for s in solutions]
  )
  assert_close(got, reference(tiny_prm, prompts, solutions, "min"))


def test_reward_func_no_steps_is_no_reward(tiny_prm):
  f = reward_funcs.as_reward_func(tiny_prm, step_aggregation="mean")
  got = f(prompts=PROMPTS, completions=["", "\n\n", COMPLETIONS[2]])
  assert got[:2] == [None, None]
  assert_close(got[2:], reference(tiny_prm, PROMPTS[2:], COMPLETIONS[2:], "mean"))


def test_multi_agent_reward_func_of_a_prm(tiny_prm):
  def pair(item, a, b):
    return item["prompt"], f"{a}\n{b}\n"

  def chat(item, a, b):
    return [{"role": "user", "content": item["prompt"]}, {"role": "assistant", "content": f"{a}\n{b}"}]

  items = [{"prompt": "Q: 12 * 3 + 4?"}]
  agents = [["12 * 3 = 36.", "12 * 3 = 35."], ["36 + 4 = 40.", "35 + 4 = 39."]]
  got = reward_funcs.as_multi_agent_reward_func(tiny_prm, pair, step_aggregation="product")(
    *agents, batch_items=items
  )
  texts = [f"{a}\n{b}\n" for a, b in zip(*agents)]
  assert_close(got, reference(tiny_prm, [items[0]["prompt"]] * 2, texts, "product"))
  got = reward_funcs.as_multi_agent_reward_func(tiny_prm, chat)(*agents, batch_items=items)
  chats = [[{"role": "user", "content": items[0]["prompt"]}]] * 2
  assert_close(got, reference(tiny_prm, chats, texts, "min"))
  with pytest.raises(ValueError, match=r"jaxrm_reward: joint response 1 has no steps to score"):
    tiny_prm.as_multi_agent_reward_func(lambda item, a: (item["prompt"], a))(["x", "\n"], batch_items=items)
  with pytest.raises(
    ValueError,
    match=r"return a \(prompt, solution\) pair or a conversation ending in the "
    r"assistant's solution; got Q: 12",
  ):
    tiny_prm.as_multi_agent_reward_func(lambda item, a: item["prompt"] + a)(["x"], batch_items=items)


def test_reward_func_errors(tiny_prm, tiny_rm):
  with pytest.raises(
    ValueError, match=r"^step_aggregation='max' is not an aggregation of step probabilities"
  ):
    reward_funcs.as_reward_func(tiny_prm, step_aggregation="max")
  with pytest.raises(
    ValueError,
    match=r"^normalize= is for a sequence-head model's rewards; .* "
    r"\(step_aggregation=, one of min, last, product, mean\): leave normalize out",
  ):
    reward_funcs.as_reward_func(tiny_prm, normalize=True)
  with pytest.raises(ValueError, match=r"^combine= is for a sequence-head model's rewards"):
    reward_funcs.as_multi_agent_reward_func(tiny_prm, lambda item, a: a, combine="x")
  with pytest.raises(
    ValueError,
    match=r"^step_aggregation='min' is for a process reward model \(a token head, "
    r"scored by its steps\); this model has a sequence head with 1 output: "
    r"leave step_aggregation out",
  ):
    reward_funcs.as_reward_func(tiny_rm, step_aggregation="min")
  f = tiny_prm.as_reward_func()
  with pytest.raises(
    ValueError,
    match=r"completions\[1\]: a process reward model scores the steps of one "
    r"solution: a string, or one assistant message",
  ):
    f(prompts=["p", "p"], completions=["a", [{"role": "user", "content": "b"}]])


# ------------------------------------------------------------------ TRL's own GRPOTrainer


@pytest.mark.slow
def test_trl_grpo_trainer_takes_a_prm_reward(tiny_prm, cache_root, tmp_path):
  """One GRPO step of TRL's GRPOTrainer with a tiny random policy: it calls the PRM's reward
  function as it calls any, and each reward is the aggregate of score_steps of that completion."""
  import tiny_run
  import transformers

  tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_run.tokenizer_dir(cache_root))
  newline = tokenizer.encode(tiny_prm.step_separator, add_special_tokens=False)
  assert len(newline) == 1
  prm = reward_funcs.as_reward_func(tiny_prm, step_aggregation="last", name="prm_last")
  calls = []

  def recorded(prompts, completions, **kwargs):
    rewards = prm(prompts=prompts, completions=completions, **kwargs)
    calls.append((list(prompts), list(completions), rewards))
    return rewards

  recorded.__name__ = prm.__name__
  trainer = grpo_trainer(
    cache_root,
    tmp_path,
    [recorded],
    ["Q: 12 * 3 + 4?", "Q: 7 - 9?"] * 2,
    # The random policy spreads its samples over SmolLM2's 49k tokens; a bias on the separator
    # makes completions of several steps, some empty ones among them.
    generation_kwargs={"sequence_bias": {tuple(newline): 10.0}},
  )
  trainer.train()

  assert calls, "GRPOTrainer never called the reward function"
  prompts, completions, rewards = (sum((c[k] for c in calls), []) for k in range(3))
  assert len(completions) >= 4 and all(isinstance(c, str) for c in completions)
  assert any(len(step_rewards.split_steps(c, "\n")) > 1 for c in completions)
  assert_close(rewards, reference(tiny_prm, prompts, completions, "last"))
  logged = [h for h in trainer.state.log_history if "rewards/prm_last/mean" in h]
  assert logged, f"TRL logged no prm_last rewards: {trainer.state.log_history}"
