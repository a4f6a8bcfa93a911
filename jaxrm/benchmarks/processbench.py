"""ProcessBench: ``Qwen/ProcessBench``, splits gsm8k, math, olympiadbench, omnimath.

Rows: ``problem`` (string), ``steps`` (list of strings), ``label`` (the index of the first wrong
step, -1 when every step is right), ``id``.

The scores are those of the evaluation that QwenLM/ProcessBench's main branch ships for process
reward models, ``code/run_eval_prm_rlhflow.py``:

* the prediction is the first step judged wrong, -1 if none; a sample is right when the
  prediction equals its label;
* per split: the accuracy on erroneous samples (label != -1) and on correct ones (label == -1),
  in percent, and their harmonic mean (F1); then the average F1 over the splits, which the paper
  reports.

That script asks a generative PRM, over chat turns, whether its next token after each step is
"+"; a token-classification head has no such token. The layout here is instead the one of the
token-classification (TRL-trained PRM) evaluation ``code/run_eval_prm_trl.py``, which is not on
main: it lives on a branch of QwenLM/ProcessBench, and huggingface/ProcessBench ships another
version of it.

* the solution is ``problem + separator``, then each step followed by the separator, and each
  step is judged at its last token. (The model side lays it out with
  :meth:`jaxrm.RewardModel.encode_steps`, as stepwise training does: that script also adds the
  tokenizer's special tokens before every step, which for tokenizers with a BOS token puts a BOS
  inside the solution; and it tokenizes step and separator together.)
* neither script cuts or drops a solution for its length, so :data:`MAX_LENGTH` is None: the
  model's context. Only a solution the model cannot hold is dropped (and counted).

A step is judged wrong when its P(correct) is below ``threshold`` (default 0.5). The TRL script
takes the argmax of the two logits instead, which at P = 0.5 exactly calls the step wrong (argmax
picks the first class); with a threshold that step is right.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrm import tasks
from jaxrm.benchmarks import rows
from jaxrm.benchmarks.scoring import Scorer
from jaxrm.data.drops import DropReport, row_error
from jaxrm.errors import EvaluationError

NAME = "processbench"
HUB_NAME = "Qwen/ProcessBench"
SPLITS = ("gsm8k", "math", "olympiadbench", "omnimath")
DEFAULT_SPLIT = ",".join(SPLITS)
(MODEL_KIND,) = tasks.scoring("steps")
JUDGED = False  # no pairwise judge's path: it scores steps
MAX_LENGTH = None  # the model's context: the official code cuts and drops nothing for its length
DROP_TOO_LONG = "problem + steps longer than max_length (ProcessBench solutions are never cut)"


@dataclasses.dataclass(frozen=True)
class Sample:
  problem: str
  steps: tuple[str, ...]
  label: int  # first wrong step, -1 for none
  id: Any
  source: str


def parse(source: str, row: dict) -> Sample:
  """One row of the public schema."""
  s = Sample(
    problem=rows.text(row, "problem", source),
    steps=rows.texts(row, "steps", source),
    label=rows.integer(row, "label", source),
    id=rows.row_id(row, source),
    source=source,
  )
  if not -1 <= s.label < len(s.steps):
    raise row_error(
      source,
      "label",
      f"is {s.label}; it is the index of the first wrong step (0 to "
      f"{len(s.steps) - 1} for these {len(s.steps)} steps) or -1 when none is wrong",
    )
  return s


def first_error(p_correct: np.ndarray, threshold: float) -> int:
  """The first step whose P(correct) is below ``threshold``, or -1."""
  wrong = np.flatnonzero(p_correct < threshold)
  return int(wrong[0]) if len(wrong) else -1


def evaluate(
  splits: dict[str, list[Sample]], scorer: Scorer, *, threshold: float = 0.5, drops: DropReport | None = None
) -> dict[str, Any]:
  """Scores every solution of every split in one call and returns the official figures."""
  drops = drops if drops is not None else DropReport()
  samples = [s for split in splits.values() for s in split]
  probabilities = scorer.step_probabilities([s.problem for s in samples], [s.steps for s in samples], NAME)
  in_order = iter(probabilities)  # the order of `samples`: split by split
  results, counts, predictions = {}, {}, {}
  for name, split in splits.items():
    kept = []
    for s in split:
      p = next(in_order)
      if p is None:
        drops.drop(DROP_TOO_LONG, s.source)
      elif len(p) != len(s.steps):
        raise EvaluationError(
          f"{s.source}: the step function gave {len(p)} probabilities for {len(s.steps)} steps"
        )
      else:
        kept.append((s, first_error(p, threshold)))
    results[name] = split_scores([s.label for s, _ in kept], [pred for _, pred in kept])
    counts[name] = {
      "error": sum(s.label != -1 for s, _ in kept),
      "correct": sum(s.label == -1 for s, _ in kept),
    }
    predictions[name] = [{"id": s.id, "label": s.label, "prediction": pred} for s, pred in kept]
  results["average_f1"] = float(np.mean([results[n]["f1"] for n in splits]))
  return {
    "results": results,
    "counts": counts,
    "threshold": threshold,
    "num_examples": sum(len(v) for v in splits.values()),
    "predictions": predictions,
  }


def split_scores(labels: Sequence[int], predictions: Sequence[int]) -> dict[str, float]:
  """Error acc, correct acc (percent) and their harmonic mean, as the official scripts compute them."""
  match = np.asarray(predictions) == np.asarray(labels)
  erroneous = np.asarray(labels) != -1
  error_acc = float(match[erroneous].mean() * 100) if erroneous.any() else math.nan
  correct_acc = float(match[~erroneous].mean() * 100) if (~erroneous).any() else math.nan
  total = error_acc + correct_acc
  f1 = 2 * error_acc * correct_acc / total if total > 0 else math.nan
  return {"error_acc": error_acc, "correct_acc": correct_acc, "f1": f1}


def format_table(result: dict[str, Any]) -> str:
  """The paper's columns: per split error / correct / F1 (percent), then the average F1."""
  r = result["results"]
  names = [n for n in r if n != "average_f1"]
  lines = [f"{'':>12}" + "".join(f"{n:>15}" for n in names) + f"{'Avg. F1':>10}"]
  for key, label in (("error_acc", "error"), ("correct_acc", "correct"), ("f1", "F1")):
    tail = f"{_num(r['average_f1'], 'undefined'):>10}" if key == "f1" else ""
    lines.append(
      f"{label:>12}" + "".join(f"{_num(r[n][key], _undefined(r[n], key)):>15}" for n in names) + tail
    )
  lines.append(
    f"{'samples':>12}"
    + "".join(
      f"{str(result['counts'][n]['error']) + ' / ' + str(result['counts'][n]['correct']):>15}" for n in names
    )
  )
  lines.append(f"a step is wrong when P(correct) < {result['threshold']}")
  return "\n".join(lines)


def _num(x: float, undefined: str) -> str:
  return undefined if not math.isfinite(x) else f"{x:.1f}"


def _undefined(split: dict[str, float], key: str) -> str:
  """What a split's NaN figure means: it has no erroneous or no correct samples (F1 needs both
  accuracies), or both accuracies are 0 (F1 is 0 / 0)."""
  if key != "correct_acc" and not math.isfinite(split["error_acc"]):
    return "no errors"
  if key != "error_acc" and not math.isfinite(split["correct_acc"]):
    return "none correct"
  return "0 / 0"
