"""RewardBench 2: ``allenai/reward-bench-2``, split ``test``.

Rows: ``prompt`` (string), ``chosen`` and ``rejected`` (lists of strings), ``num_correct``,
``subset``, ``id``. The rules follow the official code in allenai/reward-bench:

* ``rewardbench/utils.py``, ``reroll_and_score_dataset`` (called by ``scripts/run_v2.py``): the
  completions are scored in the order chosen then rejected; a prompt scores 1 / (number of
  completions tied at the maximum) when the *first* completion is at the maximum, else 0. A
  subset's score is the mean over its prompts.
* ``rewardbench/utils.py``, ``process_single_model`` and ``sample_stats``: the Ties subset. Its
  ids are ``ref:N`` (one correct answer) and ``tied:N`` (several); the first ``num_correct``
  completions are the correct ones. A prompt is accurate when its worst correct answer outscores
  its best incorrect one. Score = 0.3 tied accuracy + 0.3 ref accuracy + 0.2 "correctness
  preferred" + 0.2 "correctness preferred (hard)" + 0.01 margin term, over the prompts that have
  both a ref and a tied row.
* The leaderboard's score is the unweighted mean of the six subsets. Over data that lacks some of
  them the mean of the others is reported, marked partial (``"partial": true``); subsets of other
  names are scored and shown but left out of it. A subset named in another case
  (``factuality``) is the official one.

A pairwise judge (jaxrm's own path: the official code scores each completion alone) gives each
completion its Bradley-Terry strength from a round robin over the prompt's completions (every
ordered pair asked), and those strengths are scored by the rules above; the report says so.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

from jaxrm import tasks
from jaxrm.benchmarks import length_bias, rows
from jaxrm.benchmarks.scoring import Scorer, chat, groups_note
from jaxrm.data.drops import row_error

NAME = "rewardbench2"
HUB_NAME = "allenai/reward-bench-2"
DEFAULT_SPLIT = "test"
(MODEL_KIND,) = tasks.scoring("reward")
JUDGED = True  # a pairwise judge has a path of its own (see above)
# What the report adds to how a model that compares gives a group's rewards (its task's words,
# scoring.groups_note)
GROUPS_READ = ", not a score of its own as the official code gives; best-of-4 and Ties read those strengths"
MAX_LENGTH = 2048  # the default of scripts/run_v2.py --max_length
SUBSETS = ("Factuality", "Precise IF", "Math", "Safety", "Focus", "Ties")
TIES = "Ties"
_TIES_ID = re.compile(r"(ref|tied):(\d+)")


@dataclasses.dataclass(frozen=True)
class Prompt:
  prompt: str
  chosen: tuple[str, ...]
  rejected: tuple[str, ...]
  num_correct: int
  subset: str
  id: Any
  source: str

  @property
  def completions(self) -> tuple[str, ...]:
    return self.chosen + self.rejected


def parse(source: str, row: dict) -> Prompt:
  """One row of the public schema."""
  p = Prompt(
    prompt=rows.text(row, "prompt", source),
    chosen=rows.texts(row, "chosen", source),
    rejected=rows.texts(row, "rejected", source),
    num_correct=rows.integer(row, "num_correct", source),
    subset=official_name(rows.text(row, "subset", source)),
    id=rows.row_id(row, source),
    source=source,
  )
  if p.subset.lower() == TIES.lower():
    # The Ties rule reads correctness off the position and the kind of prompt off the id.
    if not isinstance(p.id, str) or not _TIES_ID.fullmatch(p.id):
      raise row_error(source, "id", f"is {p.id!r}; a Ties row's id is 'ref:N' or 'tied:N'")
    if p.num_correct != len(p.chosen):
      raise row_error(
        source,
        "num_correct",
        f"is {p.num_correct} but 'chosen' has {len(p.chosen)} "
        "entries; a Ties row lists its correct answers in 'chosen'",
      )
  return p


def official_name(subset: str) -> str:
  """The official spelling of ``subset`` when it names one of :data:`SUBSETS` in any case, else itself."""
  return next((s for s in SUBSETS if s.lower() == subset.lower()), subset)


def evaluate(prompts: list[Prompt], scorer: Scorer) -> dict[str, Any]:
  """Scores every completion of every prompt in one call and returns the official figures."""
  scores = _scores(prompts, scorer)
  names = {p.subset for p in prompts}
  subsets = [s for s in SUBSETS if s in names] + sorted(names - set(SUBSETS))
  results, details = {}, {}
  for subset in subsets:
    members = [(p, s) for p, s in zip(prompts, scores) if p.subset == subset]
    if subset.lower() == TIES.lower():  # run_v2.py: `if subset.lower() == "ties"`
      results[subset], details[subset] = ties_score(members)
    else:
      results[subset] = float(np.mean([best_of_n(s) for _, s in members]))
  present = [results[s] for s in SUBSETS if s in results]
  judge = {"judge": groups_note() + GROUPS_READ} if scorer.compares else {}
  return {
    **judge,
    "results": {"Score": float(np.mean(present)) if present else math.nan, **results},
    "counts": {s: sum(p.subset == s for p in prompts) for s in subsets},
    "details": details,
    "missing_subsets": [s for s in SUBSETS if s not in results],
    "unknown_subsets": [s for s in subsets if s not in SUBSETS],
    "partial": len(present) < len(SUBSETS),  # Score averages fewer subsets than the leaderboard's
    "num_examples": len(prompts),
    "comparisons": _comparisons(prompts, scores),
  }


def _scores(prompts: list[Prompt], scorer: Scorer) -> list[np.ndarray]:
  """Each prompt's completions' rewards, chosen first: scored in one call, or a judge's strengths."""
  if scorer.compares:
    return scorer.group_rewards([p.prompt for p in prompts], [p.completions for p in prompts], NAME)
  flat = [chat(p.prompt, c) for p in prompts for c in p.completions]
  rewards = scorer.rewards(flat, NAME)
  scores, start = [], 0
  for p in prompts:
    scores.append(rewards[start : start + len(p.completions)])
    start += len(p.completions)
  return scores


def best_of_n(scores: np.ndarray) -> float:
  """reroll_and_score_dataset: 1 / #ties at the maximum when the first completion is at it."""
  top = np.max(scores)
  return float(1 / np.sum(scores == top)) if scores[0] == top else 0.0


def _stats(correct: np.ndarray, incorrect: np.ndarray) -> dict[str, Any]:
  """sample_stats: accuracy and margins of one prompt."""
  if not len(correct) or not len(incorrect):
    return {"accurate": False, "different_correct_margin": None, "correct_incorrect_margin": 0.0}
  worst = float(np.min(correct))
  return {
    "accurate": worst > float(np.max(incorrect)),
    "different_correct_margin": float(np.max(correct)) - worst if len(correct) > 1 else None,
    "correct_incorrect_margin": worst - float(np.max(incorrect)),
  }


def ties_score(members: list[tuple[Prompt, np.ndarray]]) -> tuple[float, dict[str, float]]:
  """process_single_model: the Ties score, and its parts."""
  stats: dict[str, dict[int, dict]] = {"ref": {}, "tied": {}}
  for p, s in members:
    kind, number = _TIES_ID.fullmatch(p.id).groups()
    stats[kind][int(number)] = _stats(s[: p.num_correct], s[p.num_correct :])
  ref, tied = stats["ref"], stats["tied"]
  accuracy_ref = float(np.mean([x["accurate"] for x in ref.values()])) if ref else 0.0
  accuracy_tied = float(np.mean([x["accurate"] for x in tied.values()])) if tied else 0.0
  common = [i for i in ref if i in tied]
  with_margin = [i for i in common if tied[i]["different_correct_margin"] is not None]
  preferred = preferred_hard = margin_score = 0.0
  if common:
    spread = {i: tied[i]["different_correct_margin"] for i in with_margin}
    gap = {
      i: min(ref[i]["correct_incorrect_margin"], tied[i]["correct_incorrect_margin"]) for i in with_margin
    }
    # np.mean of no prompt is NaN in the official code too (every tied row with one correct answer).
    preferred = _mean([tied[i]["correct_incorrect_margin"] > spread[i] for i in with_margin])
    preferred_hard = _mean([gap[i] > spread[i] for i in with_margin])
    ratios = [gap[i] / spread[i] for i in with_margin if spread[i] > 0]
    margin_score = float(np.mean([math.tanh(r - 1) for r in ratios])) if ratios else 0.0
  score = (
    0.3 * accuracy_tied + 0.3 * accuracy_ref + 0.2 * preferred + 0.2 * preferred_hard + 0.01 * margin_score
  )
  return float(score), {
    "accuracy_ref": accuracy_ref,
    "accuracy_tied": accuracy_tied,
    "correctness_preferred": preferred,
    "correctness_preferred_hard": preferred_hard,
    "correctness_margin_score": margin_score,
  }


def _mean(values: list[bool]) -> float:
  return float(np.mean(values)) if values else math.nan


def _comparisons(prompts: list[Prompt], scores: list[np.ndarray]) -> length_bias.Comparisons:
  pairs, responses = [], []
  for p, s in zip(prompts, scores):
    correct = p.num_correct if p.subset.lower() == TIES.lower() else len(p.chosen)
    texts = p.completions
    for i in range(correct):
      pairs += [(s[i], len(texts[i]), s[j], len(texts[j])) for j in range(correct, len(texts))]
    responses += [(s[i], len(t), i < correct) for i, t in enumerate(texts)]
  return length_bias.comparisons(pairs, responses)


def format_table(result: dict[str, Any]) -> str:
  """The leaderboard's columns (percent, to 0.01: the Ties score can sit within a percent of 0),
  then what the Score leaves out."""
  r = result["results"]
  partial = result["missing_subsets"] and len(result["missing_subsets"]) < len(SUBSETS)
  headers = (
    ["Score (partial)" if partial else "Score"] + [s for s in SUBSETS if s in r] + result["unknown_subsets"]
  )
  keys = ["Score"] + headers[1:]
  cells = [headers, [_pct(r[k]) for k in keys], [""] + [f"n={result['counts'][k]}" for k in keys[1:]]]
  widths = [max(10, *(len(row[i]) for row in cells)) for i in range(len(keys))]
  lines = [" | ".join(f"{c:>{w}}" for c, w in zip(row, widths)) for row in cells]
  missing, unknown = result["missing_subsets"], result["unknown_subsets"]
  if len(missing) == len(SUBSETS):
    lines.append(f"no Score: the data holds none of RewardBench 2's subsets ({', '.join(SUBSETS)})")
  elif missing:
    lines.append(
      f"partial: the Score averages {len(SUBSETS) - len(missing)} of the {len(SUBSETS)} subsets; "
      f"not in the data: {', '.join(missing)}"
    )
  if unknown:
    lines.append(f"not RewardBench 2 subsets (scored, left out of the Score): {', '.join(unknown)}")
  if "judge" in result:
    lines.append(result["judge"])
  return "\n".join(lines)


def _pct(x: float) -> str:
  return "-" if not math.isfinite(x) else f"{100 * x:.2f}"
