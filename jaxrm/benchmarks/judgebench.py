"""JudgeBench: ``ScalerLab/JudgeBench``, splits ``gpt`` and ``claude`` (the two files of its
repository's ``data/``), read from local ``.jsonl`` files in its format or the hub.

Rows: ``question``, ``response_A``, ``response_B`` (strings), ``label`` (``"A>B"`` or ``"B>A"``:
which response is objectively right), ``source`` (the dataset the question comes from:
``mmlu-pro-<subject>``, ``livebench-reasoning``, ``livebench-math``, ``livecodebench``...),
``pair_id``. A pairwise judge only (``MODEL_KIND``): the question is the user's turn, the two
responses its A and B.

The rules follow ScalerLab/JudgeBench:

* ``run_judge.py``, ``judge_pairs``: by default (no ``--single_game``) each pair is judged twice,
  as given (A, B) and swapped (B, A). A jaxrm judge's decision in one order is ``A>B`` where its
  log-odds ``log p(A) - log p(B)`` is above 0, ``B>A`` below, none (as a tie) at exactly 0.
* ``utils/metrics.py``, ``compute_final_metrics`` with ``reverse_order``: the swapped order's
  decision is flipped back; each decision equal to the label counts +1, each equal to the flipped
  label -1; a pair is right when the sum is above 0. So a pair is right when both orders pick the
  right response, or one does and the other gives no decision; one right and one wrong is a tie,
  and not right. Accuracy is the share of right pairs (its ``100 * n_correct / n_pairs``).

Accuracy is also given per category, as the paper's table groups the sources (Knowledge: every
``mmlu-pro-*``; Reasoning, Math, Coding: ``livebench-reasoning``, ``livebench-math``,
``livecodebench``; another source is its own column), and per source; with the consistency
figures ``compute_final_metrics`` counts (both orders right, both wrong, the orders disagreeing).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxrm import tasks
from jaxrm.benchmarks import rows
from jaxrm.benchmarks.scoring import Scorer, both_orders_figures, both_orders_line
from jaxrm.data.drops import row_error

NAME = "judgebench"
HUB_NAME = "ScalerLab/JudgeBench"
DEFAULT_SPLIT = "gpt"
(MODEL_KIND,) = tasks.scoring("comparisons")
JUDGED = True
MAX_LENGTH = None  # a judge reads both responses at once: the model's context
LABELS = ("A>B", "B>A")
# The paper's categories, by the start of a row's source.
CATEGORIES = {
  "Knowledge": "mmlu-pro",
  "Reasoning": "livebench-reasoning",
  "Math": "livebench-math",
  "Coding": "livecodebench",
}


@dataclasses.dataclass(frozen=True)
class Pair:
  question: str
  response_a: str
  response_b: str
  label: str  # one of LABELS
  dataset: str  # the row's "source": where the question comes from
  id: Any
  source: str  # where the row is (file and line)

  @property
  def category(self) -> str:
    return next((c for c, start in CATEGORIES.items() if self.dataset.startswith(start)), self.dataset)


def parse(source: str, row: dict) -> Pair:
  """One row of JudgeBench's format."""
  label = rows.text(row, "label", source)
  if label not in LABELS:
    raise row_error(source, "label", f"is {label!r}; JudgeBench's labels are {' or '.join(LABELS)}")
  return Pair(
    question=rows.text(row, "question", source),
    response_a=rows.text(row, "response_A", source),
    response_b=rows.text(row, "response_B", source),
    label=label,
    dataset=rows.text(row, "source", source) if "source" in row else "",
    id=row.get("pair_id", source),
    source=source,
  )


def decision(log_odds: float) -> str | None:
  """A judge's verdict in one order: ``A>B``, ``B>A``, or None (no decision) at a log-odds of 0."""
  return "A>B" if log_odds > 0 else "B>A" if log_odds < 0 else None


def flip(verdict: str | None) -> str | None:
  """utils/metrics.py, ``flip_judgment``: A>B and B>A swapped, anything else as it is."""
  return {"A>B": "B>A", "B>A": "A>B"}.get(verdict, verdict)


def outcome(label: str, first: str | None, swapped: str | None) -> int:
  """compute_final_metrics with reverse_order: +1 (right), -1 (wrong) or 0 (a tie) of a pair whose
  judge said ``first`` as given and ``swapped`` with its responses swapped."""
  counter = 0
  for verdict in (first, flip(swapped)):
    counter += 1 if verdict == label else -1 if verdict == flip(label) else 0
  return int(np.sign(counter))


def evaluate(pairs: list[Pair], scorer: Scorer) -> dict[str, Any]:
  """Asks the judge every pair in both orders in one call and returns JudgeBench's figures."""
  s_ab, s_ba = scorer.both_orders(
    [p.question for p in pairs], [p.response_a for p in pairs], [p.response_b for p in pairs], NAME
  )
  first = [decision(x) for x in s_ab]
  second = [flip(decision(x)) for x in s_ba]  # as the given order reads it
  right = np.array([outcome(p.label, d1, decision(x)) > 0 for p, d1, x in zip(pairs, first, s_ba)])
  categories = np.array([p.category for p in pairs])
  datasets = np.array([p.dataset for p in pairs])
  named = [c for c in CATEGORIES if c in set(categories)] + sorted(set(categories) - set(CATEGORIES))
  results = {"Overall": float(right.mean())}
  results.update({c: float(right[categories == c].mean()) for c in named})
  labels = [p.label for p in pairs]
  # Which response is better, as the judge's log-odds read it in the given order (A first).
  better_first = np.array([p.label == "A>B" for p in pairs])
  s_better_as_a = np.where(better_first, s_ab, s_ba)
  s_better_as_b = np.where(better_first, s_ba, s_ab)
  return {
    "results": results,
    "counts": {c: int(np.sum(categories == c)) for c in named},
    "per_source": {d: float(right[datasets == d].mean()) for d in sorted(set(datasets))},
    "consistency": {
      "both_right": sum(a == label and b == label for a, b, label in zip(first, second, labels)),
      "both_wrong": sum(a != label and b != label for a, b, label in zip(first, second, labels)),
      "orders_disagree": sum(a != b for a, b in zip(first, second)),
    },
    "judge": both_orders_figures(s_better_as_a, s_better_as_b),
    "num_examples": len(pairs),
  }


def format_table(result: dict[str, Any]) -> str:
  """Overall and per-category accuracy (percent), then how the two orders agreed."""
  r, c = result["results"], result["consistency"]
  columns = list(r)
  width = max(9, *(len(x) for x in columns))
  n = result["num_examples"]
  lines = [
    " | ".join(f"{x:>{width}}" for x in columns),
    " | ".join(f"{100 * r[x]:>{width}.1f}" for x in columns),
    " | ".join(f"{'n=' + str(result['counts'].get(x, n)):>{width}}" for x in columns),
    "",
    f"both orders right on {c['both_right']} of {n} pairs, both wrong on {c['both_wrong']}; "
    f"the two orders disagree on {c['orders_disagree']} (a tie: not right)",
    both_orders_line(result["judge"], "JudgeBench's rule decides"),
  ]
  return "\n".join(lines)
