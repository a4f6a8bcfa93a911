"""Evaluating a pairwise judge: on preference pairs, each judged in both orders (accuracy in each
order and in both, consistency, position bias), equal to a hand computation from
``pairwise.compare``'s single orders."""

import json

import numpy as np
import pytest
from helpers import REBATCHED, assistant, user
from tiny_judge import tiny_judge

from jaxrm.evaluation import evaluate, format_report
from jaxrm.tasks import pairwise

PAIRS = [
  {"prompt": [user("What is 2 + 2?")], "chosen": [assistant("4")], "rejected": [assistant("5")]},
  {"prompt": [user("Capital of France?")], "chosen": [assistant("Paris")], "rejected": [assistant("Rome")]},
  {"prompt": [user("Say hi.")], "chosen": [assistant("Hi!")], "rejected": [assistant("No.")]},
  {"prompt": [user("3 * 3?")], "chosen": [assistant("9")], "rejected": [assistant("6, I think")]},
]


@pytest.fixture(scope="module")
def judge(smollm2_tokenizer, tmp_path_factory):
  return tiny_judge(smollm2_tokenizer, tmp_path_factory.mktemp("judge"))


def _sigmoid(x):
  return 1 / (1 + np.exp(-np.asarray(x, np.float64)))


def test_a_judges_pairs_are_scored_in_both_orders(judge, tmp_path):
  path = tmp_path / "pairs.jsonl"
  path.write_text("".join(json.dumps(row) + "\n" for row in PAIRS))
  result = evaluate(judge, str(path), max_length=128)
  prompts = [r["prompt"] for r in PAIRS]
  chosen, rejected = [r["chosen"] for r in PAIRS], [r["rejected"] for r in PAIRS]
  ab = pairwise.compare(judge, prompts, chosen, rejected, orders="ab")  # the better shown as A
  ba = pairwise.compare(judge, prompts, rejected, chosen, orders="ab")  # ... as B
  assert result["kind"] == "pairwise" and result["num_examples"] == len(PAIRS)
  np.testing.assert_allclose(result["scores"]["better_as_a"], ab, **REBATCHED)
  np.testing.assert_allclose(result["scores"]["better_as_b"], ba, **REBATCHED)
  m = result["metrics"]
  first, second = ab > 0, ba < 0
  assert m["accuracy_first"] == pytest.approx(first.mean())
  assert m["accuracy_second"] == pytest.approx(second.mean())
  assert m["accuracy"] == pytest.approx((first.mean() + second.mean()) / 2)
  assert m["consistency"] == pytest.approx((first == second).mean())
  assert m["position_bias"] == pytest.approx(((_sigmoid(ab) + _sigmoid(ba)) / 2).mean(), rel=1e-6)
  loss = -(np.log(_sigmoid(ab)) + np.log(_sigmoid(-ba))) / 2
  assert m["loss"] == pytest.approx(loss.mean(), rel=1e-5)
  report = format_report(result)
  assert "position bias" in report and "consistency" in report
