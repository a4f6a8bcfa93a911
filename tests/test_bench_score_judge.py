"""scripts/bench_score.py --judge on a tiny causal LM: a group's judge texts, the tokens each
shared layout holds, and jaxrm's shared score_group against transformers' causal LM on the same
texts one by one."""

import os
import sys

import numpy as np
import pytest
import tiny_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_score  # noqa: E402


@pytest.fixture(scope="module")
def judge(cache_root):
  return bench_score.load_judge(tiny_run.tiny_model_dir(cache_root, head="causal"), "float32")


def test_a_groups_texts_are_counted_and_scored_as_transformers_scores_them(judge):
  args = bench_score.parse_args(
    ["--workload=grpo", "--judge", "--prompts=1", "--max_length=512", "--prompt_median=96"]
    + ["--completion_median=16", "--batch_size=4"]
  )
  drawn = bench_score.judge_groups(judge, args, 3, "round_robin")
  assert drawn.pairs == [[(0, 1), (1, 0), (0, 2), (2, 0), (1, 2), (2, 1)]]
  assert drawn.texts[0] == judge.judge_text(drawn.prompts[0], *drawn.groups[0][:2])

  tokens = bench_score.judge_tokens(judge, drawn, args)
  ids = drawn.ids
  conversation = len(os.path.commonprefix(ids))
  by_a = [[ids[k] for k, (i, _) in enumerate(drawn.pairs[0]) if i == a] for a in range(3)]
  assert tokens["one_by_one"] == sum(map(len, ids))
  assert tokens["conversation_shared"] == conversation + sum(len(r) - conversation for r in ids)
  assert tokens["conversation_and_a_shared"] == sum(
    len(os.path.commonprefix(rows)) + sum(len(r) - len(os.path.commonprefix(rows)) for r in rows)
    for rows in by_a
  )
  # The tiny model's attention costs as much as the rest of a layer at 240 tokens, so jaxrm's grouping
  # keeps rows short: each response A's two texts share a packed row, not all six one row.
  assert tokens["conversation_shared"] < tokens["fed"] == tokens["conversation_and_a_shared"]
  assert (tokens["packed_rows"], tokens["rows_alone"]) == (3, 0)

  hf = bench_score.load_transformers(judge, "float32")
  scorers = bench_score.judge_scorers(judge, hf, drawn, "round_robin", args)
  (_, (ours,)), shapes = bench_score.fed_shapes(judge, scorers["score_group shared"])
  _, (theirs,) = scorers["transformers"]()
  # The three packed rows of 280-300 tokens, in passes of no more token slots than the widest
  # unshared batch of these texts (4 rows of 256)
  assert shapes == [(2, 320), (1, 320)] and 2 * 320 + 320 >= tokens["fed"]
  compared = ~np.eye(3, dtype=bool)
  assert np.array_equal(np.isnan(ours), ~compared) and np.array_equal(ours, -ours.T, equal_nan=True)
  np.testing.assert_allclose(ours[compared], theirs[compared], atol=bench_score.AGREE_ATOL)
  assert np.abs(ours[compared]).max() > 10 * bench_score.AGREE_ATOL  # the bound says something
