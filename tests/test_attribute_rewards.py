"""A regression model's attributes as one TRL reward function each, sharing one forward pass per
batch; and TRL's own GRPOTrainer weighing them beside an async remote reward."""

import collections
import inspect
import types

import numpy as np
import pytest
from helpers import approx, grpo_trainer, serving

from jaxrm import RewardModel
from jaxrm.scoring import reward_funcs
from jaxrm.server import ServerConfig

ATTRIBUTES = ("helpfulness", "verbosity")
PROMPTS = ["Q: 1 + 1?", "Q: 1 + 1?", "Q: 2 + 3?", "Q: 2 + 3?"]
COMPLETIONS = [" A: 2", " A: 11", " A: 5", " A: 23"]


@pytest.fixture(scope="module")
def regression_rm(cache_root, tmp_path_factory):
  """A tiny random 2-layer Llama regression model (one output per attribute) with SmolLM2's
  tokenizer, saved as transformers saves one and loaded back."""
  import hf_tiny
  import tiny_run
  import torch
  import transformers

  tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_run.tokenizer_dir(cache_root))
  names = dict(enumerate(ATTRIBUTES))
  config = hf_tiny.tiny_config(
    "llama",
    num_labels=len(ATTRIBUTES),
    problem_type="regression",
    id2label=names,
    label2id={v: k for k, v in names.items()},
    vocab_size=len(tokenizer),
    num_hidden_layers=2,
    pad_token_id=tokenizer.pad_token_id,
    bos_token_id=tokenizer.bos_token_id,
    eos_token_id=tokenizer.eos_token_id,
  )
  torch.manual_seed(0)
  model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
  out = tmp_path_factory.mktemp("regression") / "hf"
  model.save_pretrained(out)
  tokenizer.save_pretrained(out)
  rm = RewardModel.from_pretrained(out)
  assert rm.attributes == ATTRIBUTES
  return rm


class Counting:
  """``rm``, counting its calls to ``score`` (one per forward pass over a batch)."""

  def __init__(self, rm):
    self.rm, self.calls = rm, 0
    self.config, self.attributes = rm.config, rm.attributes

  def score(self, *args, **kwargs):
    self.calls += 1
    return self.rm.score(*args, **kwargs)


def trl_kwargs(completions):
  """The keyword arguments GRPOTrainer passes a reward function besides prompts and completions."""
  return dict(completion_ids=[[7] * len(str(c)) for c in completions], trainer_state=None, log_metric=print)


def test_one_reward_func_per_attribute_each_a_column_of_score(regression_rm):
  counting = Counting(regression_rm)
  funcs = reward_funcs.as_reward_funcs(counting, name="rm")
  assert [f.__name__ for f in funcs] == ["rm_helpfulness", "rm_verbosity"]
  rewards = [f(prompts=PROMPTS, completions=COMPLETIONS, **trl_kwargs(COMPLETIONS)) for f in funcs]
  assert all(isinstance(r, list) and all(type(x) is float for x in r) for r in rewards)
  np.testing.assert_array_equal(
    np.column_stack(rewards), regression_rm.score(prompts=PROMPTS, completions=COMPLETIONS)
  )
  assert counting.calls == 1  # one forward pass served both attributes
  # The batch is known by its contents, not by the list objects TRL happens to pass.
  assert funcs[1](prompts=list(PROMPTS), completions=list(COMPLETIONS)) == rewards[1]
  assert counting.calls == 1
  chat = (
    [[{"role": "user", "content": "Capital of France?"}]] * 2,
    [[{"role": "assistant", "content": "Paris."}], [{"role": "assistant", "content": "Lyon."}]],
  )
  got = [f(prompts=chat[0], completions=chat[1]) for f in funcs]
  np.testing.assert_array_equal(
    np.column_stack(got), regression_rm.score(prompts=chat[0], completions=chat[1])
  )
  assert counting.calls == 2


def test_as_reward_funcs_takes_a_regression_model_only(tiny_rm):
  with pytest.raises(
    ValueError,
    match=r"^as_reward_funcs gives one reward function per attribute of a regression model; this "
    r"model has a sequence head with 1 output, one reward per row: use as_reward_func$",
  ):
    reward_funcs.as_reward_funcs(tiny_rm)
  prm = types.SimpleNamespace(config=tiny_rm.config.replace(head="token", num_labels=2), attributes=None)
  with pytest.raises(ValueError, match=r"this model has a token head with 2 labels, one reward per row"):
    reward_funcs.as_reward_funcs(prm)
  unnamed = types.SimpleNamespace(config=tiny_rm.config.replace(num_labels=3), attributes=None)
  with pytest.raises(
    ValueError,
    match=r"^as_reward_funcs needs a regression model \(one output per attribute, trained with "
    r"reward.type=regression\); this model has a sequence head with 3 outputs",
  ):
    reward_funcs.as_reward_funcs(unnamed)


# ------------------------------------------------------------------ TRL's own GRPOTrainer


def recorded(reward_func, calls):
  """``reward_func`` under its own name, sync or async as it is, appending (prompts, completions,
  rewards) of each call to ``calls[name]``."""
  name = reward_func.__name__
  if inspect.iscoroutinefunction(reward_func):

    async def wrapper(prompts, completions, **kwargs):
      rewards = await reward_func(prompts=prompts, completions=completions, **kwargs)
      calls[name].append((list(prompts), list(completions), rewards))
      return rewards

  else:

    def wrapper(prompts, completions, **kwargs):
      rewards = reward_func(prompts=prompts, completions=completions, **kwargs)
      calls[name].append((list(prompts), list(completions), rewards))
      return rewards

  wrapper.__name__ = name
  return wrapper


@pytest.mark.slow
def test_grpo_trainer_weighs_attribute_rewards_beside_an_async_remote_reward(
  regression_rm, tiny_rm, cache_root, tmp_path
):
  """One GRPO step of TRL's GRPOTrainer, tiny random policy: the attributes' reward functions,
  weighted and normalized each before they are summed, and an async function scored by a live
  jaxrm server, which TRL awaits."""
  counting = Counting(regression_rm)
  calls = collections.defaultdict(list)
  with serving(tiny_rm, ServerConfig(max_length=64, batch_size=4)) as server:
    remote = reward_funcs.remote_reward_func(server.url, name="remote_rm", asynchronous=True)
    funcs = [recorded(f, calls) for f in [*reward_funcs.as_reward_funcs(counting, name="rm"), remote]]
    trainer = grpo_trainer(
      cache_root,
      tmp_path,
      funcs,
      ["Q: 1 + 1?", "Q: 2 + 3?"] * 2,
      reward_weights=[1.0, 0.5, 2.0],
      multi_objective_aggregation="normalize_then_sum",
    )
    trainer.train()

  batches = calls["rm_helpfulness"]
  assert batches, "GRPOTrainer never called the reward functions"
  assert len(calls["rm_verbosity"]) == len(calls["remote_rm"]) == len(batches)
  assert counting.calls == len(batches)  # one forward pass per batch for both attributes
  for (prompts, completions, helpfulness), (*same, verbosity) in zip(batches, calls["rm_verbosity"]):
    assert same == [prompts, completions]
    np.testing.assert_array_equal(
      np.column_stack([helpfulness, verbosity]),
      regression_rm.score(prompts=prompts, completions=completions),
    )
  for prompts, completions, rewards in calls["remote_rm"]:
    # The server batches and pads rows its own way: equal up to the roundings of other shapes.
    assert rewards == approx(tiny_rm.score(prompts=prompts, completions=completions))
  logged = [h for h in trainer.state.log_history if "reward" in h]
  assert logged, f"TRL logged no rewards: {trainer.state.log_history}"
  for name in ("rm_helpfulness", "rm_verbosity", "remote_rm"):
    assert f"rewards/{name}/mean" in logged[-1], logged[-1]
    # The reward's health, through TRL's log_metric: an attribute's reward_mean is its mean.
    assert logged[-1][f"reward_health/{name}/reward_mean"] == pytest.approx(
      logged[-1][f"rewards/{name}/mean"]
    )
