r"""Evaluates a reward model on preference, stepwise or rated data, or on a public benchmark.

  python -m jaxrm.evaluate --model=runs/rm --data=demo_arithmetic
  python -m jaxrm.evaluate --model=model.gguf --data=rewardbench.jsonl --subset_field=subset \
      --output=eval/
  python -m jaxrm.evaluate --model=runs/prm --data=steps.jsonl --dataset_name=StepwiseDataset
  python -m jaxrm.evaluate --model=runs/helpsteer2 --data=rated.jsonl --dataset_name=RatedDataset
  python -m jaxrm.evaluate --model=runs/rm --benchmark=rewardbench --max_length=2048 --output=eval/
  python -m jaxrm.evaluate --model=runs/prm --benchmark=processbench --data=ProcessBench/ --output=eval/

``--benchmark`` (rewardbench, rewardbench2, rmbench, processbench) scores by that benchmark's
official rules (see :mod:`jaxrm.benchmarks`) and reports its official figures under their official
names, with a length-bias report for the preference benchmarks; ``--data`` is then a file or
``save_to_disk`` directory in the benchmark's public schema, or a hub name (default: the
benchmark's own dataset), and ``--output`` gets ``eval.json`` and ``length_bias.png``.

``--data`` is a file or directory in the format ``--dataset_name`` names (PreferenceDataset by
default), or the name of a dataset itself (``demo_arithmetic``, ``HelpSteer3``...), read from its
usual place.

Preference data (sequence-head models): accuracy (the best completion scored above the worst),
overall and per subset (a RewardBench-style column, ``--subset_field``), the loss, the reward
statistics and the length bias (reward against completion length in tokens, and
``length_bias.png``). Stepwise data (token-head models): step accuracy, recall of each class, F1
of the error class, the share of solutions whose first error is found exactly, and the baseline
that calls every step correct. Rated data (regression models, one output per attribute, read for
the model's attributes): the mean squared error, and per attribute the MSE, the mean absolute error
and Pearson's and Spearman's correlation of prediction and rating, with the pairwise accuracy over
same-prompt responses ranked by ``--combine`` (default: the first attribute), as validation reports
them. With ``--output`` it writes ``eval.json`` and ``rewards.png``, a histogram of chosen vs
rejected rewards (of the probability that a step is correct, for stepwise models; for regression
models, predictions plotted against ratings).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import types
from typing import Any, Sequence

import jax
import numpy as np

from jaxrm import benchmarks, cli, losses
from jaxrm.batches import IGNORE_INDEX, PreferenceBatch, RegressionBatch, StepwiseBatch
from jaxrm.benchmarks import length_bias
from jaxrm.benchmarks.scoring import Scorer, model_scorer
from jaxrm.data import pipeline
from jaxrm.data.drops import DropReport
from jaxrm.errors import EvaluationError
from jaxrm.models.heads import correct_probability
from jaxrm.data.records import PreferenceRecord, RatedRecord, StepwiseRecord
from jaxrm.data.tokenize import (PreferenceExample, RatedExample, StepwiseExample, TokenizeOptions, pad_id,
                                 tokenize_all)

NO_SUBSET = "(none)"  # the subset of rows that have no subset column
REPORT_FILE = "eval.json"
HISTOGRAM_FILE = "rewards.png"


def evaluate(rm, data: Sequence[Any], *, options: TokenizeOptions | None = None, batch_size: int = 8,
             bucket_multiple: int = 64, drops: DropReport | None = None,
             combine: str | None = None) -> dict[str, Any]:
  """Scores every example of ``data`` and returns its metrics.

  Args:
    rm: a :class:`jaxrm.RewardModel` (sequence head for preferences, token head for steps, a
      regression model's head, one output per name of ``rm.attributes``, for rated rows).
    data: preference, stepwise or rated records (tokenized here with ``options``), or tokenized
      examples. Rated rows hold their ratings in the order of ``rm.attributes``.
    options: how records are tokenized (default ``TokenizeOptions()``).
    batch_size: examples (groups of completions) per forward pass.
    bucket_multiple: sequence lengths are padded to a multiple of this, so that few shapes compile.
    drops: where rows dropped by tokenization are counted (and already-dropped rows, if given).
    combine: rated rows: what ``pairwise_accuracy`` ranks same-prompt responses by, as
      ``reward.combine`` takes it (an attribute, or ``"name=weight,..."``; default: the first).

  Returns:
    ``{"kind": "preference" | "stepwise" | "regression", "num_examples", "metrics", "subsets",
    "dropped", "scores"}``. ``metrics`` uses the names of the training loss's validation metrics;
    ``subsets`` maps each subset to ``{"num_examples", **metrics}`` (empty when no row has one);
    ``scores`` holds float32 arrays: ``chosen``/``rejected`` rewards [N] of each example's best and
    worst completion, for stepwise models ``correct``/``error``, the probability that a step is
    correct, for the steps labelled each way, and for regression models ``predictions`` and
    ``ratings`` [N, A] with ``rated`` (bool [N, A]: where a row rates an attribute). Preference
    results also have ``length_bias`` (see :mod:`jaxrm.benchmarks.length_bias`; lengths in tokens
    after the prompt), whose comparisons are ``scores["length"]``; regression results have
    ``attributes`` and ``combine``.
  """
  drops = drops if drops is not None else DropReport()
  examples = _examples(rm, data, options or TokenizeOptions(), drops)
  kind = _kind(examples[0])
  _check_head(rm, kind)
  if kind == "regression" and examples[0].labels.shape[0] != len(rm.attributes):
    raise EvaluationError(f"the rated rows hold {examples[0].labels.shape[0]} ratings each and the model has "
                          f"{len(rm.attributes)} outputs ({', '.join(rm.attributes)}); read the rows for the "
                          "model's attributes")
  if combine is not None and kind != "regression":
    raise EvaluationError(f"combine={combine!r} ranks the attributes of rated rows; this data is {kind} data")
  pad = pad_id(rm.tokenizer, rm.config.pad_token_id)
  max_len = max(len(ids) for e in examples for ids in _sequences(e))
  buckets = pipeline.length_buckets(-(-max_len // bucket_multiple) * bucket_multiple, bucket_multiple)
  batches = pipeline.make_eval_batches(examples, batch_size=batch_size, buckets=buckets, pad_id=pad)
  extra = {}
  if kind == "stepwise":
    metrics_fn, scores, arrays = _stepwise_arrays(rm, batches, len(examples))
  elif kind == "regression":
    spec = _regression_spec(rm.attributes, combine)
    extra = {"attributes": list(spec.attribute_names), "combine": spec.combine or spec.attribute_names[0]}
    metrics_fn, scores, arrays = _regression_arrays(rm, batches, len(examples), spec)
  else:
    metrics_fn, scores, arrays = _preference_arrays(rm, batches, len(examples))
  result = {
      "kind": kind,
      **extra,
      "num_examples": len(examples),
      "metrics": metrics_fn(*arrays, np.ones(len(examples), np.float32)),
      "subsets": _per_subset(examples, lambda mask: metrics_fn(*arrays, mask)),
      "dropped": drops.as_dict(),
      "scores": scores,
  }
  if kind == "preference":
    scores["length"] = _length_comparisons(examples, arrays[0])
    result["length_bias"] = length_bias.report(scores["length"], unit="tokens")
  return result


def _per_subset(examples, metrics_of) -> dict[str, dict[str, float]]:
  """``metrics_of(example_mask [N])`` for each subset; {} when no example has a subset."""
  if all(e.meta.get("subset") is None for e in examples):
    return {}
  subsets = np.array([str(e.meta.get("subset", NO_SUBSET)) for e in examples])
  return {name: {"num_examples": int(np.sum(subsets == name)),
                 **metrics_of((subsets == name).astype(np.float32))}
          for name in sorted(set(subsets))}


def _examples(rm, data: Sequence[Any], options: TokenizeOptions, drops: DropReport) -> list:
  if not data:
    raise EvaluationError("there is nothing to evaluate: the data has no rows")
  if all(isinstance(x, (PreferenceExample, StepwiseExample, RatedExample)) for x in data):
    examples = list(data)
  elif all(isinstance(x, (PreferenceRecord, StepwiseRecord, RatedRecord)) for x in data):
    if rm.tokenizer is None:
      raise EvaluationError("the model has no tokenizer to tokenize records with; pass tokenizer= to "
                            "RewardModel.from_pretrained, or pass tokenized examples")
    examples = tokenize_all(data, rm.tokenizer, options, drops)
  else:
    raise EvaluationError("data must be all records (PreferenceRecord / StepwiseRecord / RatedRecord) or all "
                          f"tokenized examples; got {sorted({type(x).__name__ for x in data})}")
  if not examples:
    raise EvaluationError(f"every row was dropped\n{drops.summary('data')}")
  if len({_kind(e) for e in examples}) > 1:
    kinds = " and ".join(sorted({_kind(e) for e in examples}))
    raise EvaluationError(f"data mixes {kinds} rows; evaluate them separately")
  return examples


def _kind(example) -> str:
  if isinstance(example, StepwiseExample):
    return "stepwise"
  return "regression" if isinstance(example, RatedExample) else "preference"


def _check_head(rm, kind: str) -> None:
  config, stepwise = rm.config, kind == "stepwise"
  if kind == "regression":
    _regression_attributes(rm, "rated data")
    return
  if stepwise and config.head != "token":
    raise EvaluationError(
        "stepwise data needs a token-head (process reward) model, and this model has a sequence head; "
        "evaluate it on preference data, or evaluate a model trained with reward.type=stepwise")
  if stepwise and config.num_labels != 2:
    raise EvaluationError(f"a process reward model has 2 labels (step in error, step correct); this "
                          f"token head has {config.num_labels}")
  if not stepwise and config.head != "sequence":
    raise EvaluationError(
        "preference data needs a sequence-head model, and this is a token-head (process reward) model; "
        "give stepwise data (--dataset_name=StepwiseDataset or demo_arithmetic_steps)")
  if not stepwise and config.num_labels != 1:
    raise EvaluationError(f"a reward model has one output; this sequence head has {config.num_labels}"
                          + ("" if rm.attributes is None else
                             f" ({', '.join(rm.attributes)}): evaluate it on rated data "
                             "(--dataset_name=RatedDataset, HelpSteer2 or demo_attributes)"))


def _sequences(example) -> Sequence[np.ndarray]:
  return example.input_ids if isinstance(example, PreferenceExample) else (example.input_ids,)


# --------------------------------------------------------------------------------------- preferences


def _preference_arrays(rm, batches: list[PreferenceBatch], n: int):
  """Rewards [N, K] (best completion first), ranks [N, K] (-1 absent) and margins [N]."""
  k = batches[0].ranks.shape[1]
  rewards = np.concatenate(
      [rm.score_tokens(b.input_ids, b.attention_mask).reshape(-1, k) for b in batches])[:n]
  ranks = np.concatenate([b.ranks for b in batches])[:n]
  margin = np.concatenate([b.margin for b in batches])[:n]
  worst = np.max(ranks, axis=1)  # completions are in preference order: the worst is the last real one
  scores = {"chosen": rewards[:, 0], "rejected": rewards[np.arange(n), worst]}
  return _preference_metrics, scores, (rewards, ranks, margin)


def _length_comparisons(examples: list[PreferenceExample], rewards: np.ndarray) -> length_bias.Comparisons:
  """The best vs the worst completion of each example; lengths in tokens after the shared prompt."""
  pairs, responses = [], []
  for e, r in zip(examples, rewards):
    shared = _shared_prefix(e.input_ids)
    lengths = [len(ids) - shared for ids in e.input_ids]  # best first, the worst last
    pairs.append((r[0], lengths[0], r[len(lengths) - 1], lengths[-1]))
    responses += [(r[j], n, j == 0) for j, n in enumerate(lengths)]
  return length_bias.comparisons(pairs, responses)


def _shared_prefix(sequences: Sequence[np.ndarray]) -> int:
  n = min(len(x) for x in sequences)
  same = np.all([x[:n] == sequences[0][:n] for x in sequences], axis=0)
  return int(np.argmin(same)) if not same.all() else n


# Jitted: one compile per evaluation instead of one per operation, whatever the number of subsets.
_bradley_terry_sums = jax.jit(lambda *args: losses.bradley_terry_loss(*args)[1])
_stepwise_sums = jax.jit(lambda *args: losses.stepwise_loss(*args)[1])


def _preference_metrics(rewards, ranks, margin, mask) -> dict[str, float]:
  """The Bradley-Terry validation metrics, with the std of chosen/rejected rewards and margins."""
  metrics = losses.finalize_metrics(_bradley_terry_sums(rewards, ranks, mask, margin))
  rows = mask > 0
  chosen = rewards[rows, 0]
  rejected = rewards[rows, np.max(ranks[rows], axis=1)]
  for name, values in (("chosen_reward", chosen), ("rejected_reward", rejected),
                       ("margin", chosen - rejected)):
    metrics[f"{name}_std"] = float(np.std(values)) if len(values) else math.nan
  return metrics


# ------------------------------------------------------------------------------------------ stepwise


def _stepwise_arrays(rm, batches: list[StepwiseBatch], n: int):
  """Logits [N, S, 2] and labels [N, S] of each example's labelled steps, in order; -100 pads."""
  step_logits, step_labels = [], []
  for b in batches:
    logits = rm.score_tokens(b.input_ids, b.attention_mask)  # [B, T, 2]
    for row_logits, row_labels in zip(logits, b.labels):
      where = row_labels != IGNORE_INDEX
      step_logits.append(row_logits[where])
      step_labels.append(row_labels[where])
  step_logits, step_labels = step_logits[:n], step_labels[:n]
  num_steps = max(len(x) for x in step_labels)
  logits = np.zeros((n, num_steps, 2), np.float32)
  labels = np.full((n, num_steps), IGNORE_INDEX, np.int32)
  for i, (x, y) in enumerate(zip(step_logits, step_labels)):
    logits[i, :len(y)], labels[i, :len(y)] = x, y
  all_logits, all_labels = np.concatenate(step_logits), np.concatenate(step_labels)
  p_correct = correct_probability(all_logits)
  scores = {"correct": p_correct[all_labels == 1], "error": p_correct[all_labels == 0]}
  return _stepwise_metrics, scores, (logits, labels)


def _stepwise_metrics(logits, labels, mask) -> dict[str, float]:
  return losses.finalize_metrics(_stepwise_sums(logits, labels, mask))


# ---------------------------------------------------------------------------------------- regression


def _regression_attributes(rm, data: str) -> tuple[str, ...]:
  """The attributes of a regression model, which rated rows (``data``) are read and scored for."""
  if rm.attributes is None:
    raise EvaluationError(
        f"{data} needs a regression model (one output per attribute, trained with reward.type=regression); "
        f"this model has a {rm.config.head} head with {rm.config.num_labels} output(s) and records no "
        "attribute names")
  return rm.attributes


def _regression_spec(attributes: Sequence[str], combine: str | None) -> losses.RewardSpec:
  try:
    losses.combination_weights(combine or attributes[0], attributes)
  except ValueError as e:
    raise EvaluationError(str(e)) from None
  return losses.RewardSpec(type="regression", attributes=",".join(attributes), combine=combine or "")


def _regression_arrays(rm, batches: list[RegressionBatch], n: int, spec: losses.RewardSpec):
  """Predictions, ratings and rating masks [N, A], and prompt groups [N]."""
  a = len(spec.attribute_names)
  predictions = np.concatenate([rm.score_tokens(b.input_ids, b.attention_mask).reshape(-1, a)
                                for b in batches])[:n]
  labels, label_mask, group = (np.concatenate([getattr(b, f) for b in batches])[:n]
                               for f in ("labels", "label_mask", "group"))
  scores = {"predictions": predictions, "ratings": labels, "rated": label_mask > 0}
  return functools.partial(_regression_metrics, spec), scores, (predictions, labels, label_mask, group)


def _regression_metrics(spec: losses.RewardSpec, predictions, labels, label_mask, group, mask) -> dict[str, float]:
  """Validation's regression metrics: the loss's MSE, MAE and Pearson sums, Spearman and pairwise
  accuracy from the whole set."""
  batch = types.SimpleNamespace(labels=labels, label_mask=label_mask, example_mask=mask, group=group)
  return losses.finalize_metrics(_regression_sums(spec, predictions, batch))


def _regression_sums(spec: losses.RewardSpec, predictions, batch) -> losses.Metrics:
  return losses.batch_loss(spec, samples=True)(predictions, batch)[1]


# ------------------------------------------------------------------------------------------- output


def format_report(result: dict[str, Any]) -> str:
  """The overall and per-subset metrics as the CLI prints them."""
  m = result["metrics"]
  if result["kind"] == "preference":
    lines = [
        f"accuracy           {m['accuracy']:.4f}  (best completion scored above the worst; "
        f"ties {m['tie_rate']:.4f})",
        f"pairwise accuracy  {m['pairwise_accuracy']:.4f}  (every ordered pair of completions)",
        f"loss               {m['loss']:.4f}",
        f"chosen reward      {m['chosen_reward']:.4f} ± {m['chosen_reward_std']:.4f}",
        f"rejected reward    {m['rejected_reward']:.4f} ± {m['rejected_reward_std']:.4f}",
        f"margin             {m['margin']:.4f} ± {m['margin_std']:.4f}",
        f"all rewards        {m['reward_mean']:.4f} ± {m['reward_std']:.4f}",
    ]
    columns = ("accuracy", "margin", "chosen_reward", "rejected_reward")
  elif result["kind"] == "regression":
    attributes = result["attributes"]
    width = max(len("attribute"), *(len(a) for a in attributes))
    lines = [
        f"mse                {m['mse']:.4f}  (every rating)",
        f"pairwise accuracy  {m['pairwise_accuracy']:.4f}  (same-prompt responses whose ratings differ, "
        f"ranked by {result['combine']})",
        f"loss               {m['loss']:.4f}",
        "",
        f"{'attribute':<{width}}  {'mse':>8}  {'mae':>8}  {'pearson':>8}  {'spearman':>8}",
    ]
    lines += [f"{a:<{width}}" + "".join(f"  {m[f'{k}_{a}']:>8.4f}" for k in ("mse", "mae", "pearson", "spearman"))
              for a in attributes]
    columns = ("mse", "pairwise_accuracy", f"pearson_{attributes[0]}", f"spearman_{attributes[0]}")
  else:
    lines = [
        f"step accuracy      {m['step_accuracy']:.4f}  (baseline calling every step correct: "
        f"{m['positive_rate']:.4f})",
        f"recall             correct {m['recall_correct']:.4f}, error {m['recall_error']:.4f}",
        f"F1 (error class)   {m['f1_error']:.4f}  (baseline: 0)",
        f"first error found  {m['first_error_found']:.4f}  (of solutions with an error)",
        f"loss               {m['loss']:.4f}",
    ]
    columns = ("step_accuracy", "f1_error", "first_error_found", "positive_rate")
  lines.insert(0, f"{result['num_examples']} examples")
  if result["subsets"]:
    width = max(len("subset"), *(len(s) for s in result["subsets"]))
    lines.append("")
    lines.append(f"{'subset':<{width}}  {'n':>6}" + "".join(f"  {c:>17}" for c in columns))
    for name, sm in result["subsets"].items():
      lines.append(f"{name:<{width}}  {sm['num_examples']:>6}" + "".join(f"  {sm[c]:>17.4f}" for c in columns))
  if "length_bias" in result:
    lines += ["", length_bias.format_report(result["length_bias"])]
  return "\n".join(lines)


def plot_scores(result: dict[str, Any], ax) -> None:
  """Draws the histogram of chosen vs rejected rewards (step probabilities for PRMs; for
  regression models, each attribute's predictions against its ratings) on ``ax``."""
  if result["kind"] == "regression":
    scores = result["scores"]
    for a, name in enumerate(result["attributes"]):
      rated = scores["rated"][:, a]
      ax.scatter(scores["ratings"][rated, a], scores["predictions"][rated, a], s=8, alpha=0.5,
                 label=f"{name} (n={int(rated.sum())})")
    ax.set_xlabel("rating")
    ax.set_ylabel("prediction")
    ax.set_title("Predictions against ratings, per attribute")
    ax.legend()
    return
  if result["kind"] == "preference":
    series = (("chosen", result["scores"]["chosen"]), ("rejected", result["scores"]["rejected"]))
    ax.set_xlabel("reward")
    ax.set_title("Rewards of the best (chosen) and worst (rejected) completions")
  else:
    series = (("steps labelled correct", result["scores"]["correct"]),
              ("steps labelled in error", result["scores"]["error"]))
    ax.set_xlabel("P(step correct)")
    ax.set_title("Predicted probability that a step is correct")
  values = np.concatenate([v for _, v in series])
  bins = np.histogram_bin_edges(values, bins=min(40, max(10, len(values) // 10)))
  for label, v in series:
    ax.hist(v, bins=bins, alpha=0.6, label=f"{label} (n={len(v)})")
  ax.set_ylabel("count")
  ax.legend()


def write_outputs(result: dict[str, Any], output_dir: str, info: dict[str, Any]) -> list[str]:
  """Writes ``eval.json`` (``info`` merged in; no per-row scores), ``rewards.png`` and, for
  preferences, ``length_bias.png``; returns their paths."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  os.makedirs(output_dir, exist_ok=True)
  report = {**info, **{k: v for k, v in result.items() if k != "scores"}}
  with open(os.path.join(output_dir, REPORT_FILE), "w") as f:
    json.dump(_json_safe(report), f, indent=2)
  fig = Figure(figsize=(7, 4))
  FigureCanvasAgg(fig)
  plot_scores(result, fig.add_subplot())
  fig.tight_layout()
  fig.savefig(os.path.join(output_dir, HISTOGRAM_FILE), dpi=100)
  files = [os.path.join(output_dir, f) for f in (REPORT_FILE, HISTOGRAM_FILE)]
  if "length" in result["scores"]:
    files.append(os.path.join(output_dir, length_bias.PLOT_FILE))
    length_bias.plot(result["scores"]["length"], files[-1], "Reward against completion length", unit="tokens")
  return files


def _json_safe(value):
  """NaN (a metric with nothing counted) becomes null, which JSON can hold."""
  if isinstance(value, dict):
    return {k: _json_safe(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_json_safe(v) for v in value]
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


# ---------------------------------------------------------------------------------------------- CLI


def _define_flags() -> None:
  from absl import flags
  flags.DEFINE_string("model", None, "HF checkpoint dir, .gguf file, embedded:NAME, or a jaxrm run dir.",
                      required=True)
  flags.DEFINE_string("data", None, "A data file/directory, or a dataset name (demo_arithmetic...); with "
                      "--benchmark, a file/directory in its schema or a hub name (default: its hub dataset).")
  flags.DEFINE_enum("benchmark", None, list(benchmarks.BENCHMARKS), "Score by this benchmark's official "
                    "rules instead of plain accuracy.")
  flags.DEFINE_float("threshold", 0.5, "processbench: a step is wrong when P(correct) is below this.")
  flags.DEFINE_string("dataset_name", None, "Format of --data: PreferenceDataset (default), StepwiseDataset, "
                      "RatedDataset, or a public/demo dataset name.")
  flags.DEFINE_string("combine", None, "Rated data: what pairwise_accuracy ranks same-prompt responses by, "
                      "an attribute or name=weight,... (default: the model's first attribute).")
  flags.DEFINE_string("split", "validation", "Split of a dataset read by name, or of a saved DatasetDict "
                      "(with --benchmark, default: the benchmark's; processbench: comma-separated).")
  flags.DEFINE_string("subset_field", None, "Column holding each row's subset (default: the dataset's, "
                      "'subset' for user files).")
  flags.DEFINE_integer("max_rows", 0, "Evaluate only the first N rows (0: all).")
  flags.DEFINE_integer("max_length", 1024, "Longest sequence in tokens; longer rows are dropped or cut.")
  flags.DEFINE_enum("truncation", "drop", ["drop", "left"], "Over-length rows: drop them, or cut the "
                    "oldest context.")
  flags.DEFINE_string("step_separator", "\n", "Text after each step of a stepwise row.")
  flags.DEFINE_integer("batch_size", 8, "Examples per forward pass.")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
  flags.DEFINE_string("attention", "auto", "Attention implementation: auto (a fused kernel on GPU, the "
                      "reference path elsewhere) | reference | pallas | cudnn.")
  flags.DEFINE_string("output", None, "Directory for eval.json and rewards.png (length_bias.png with "
                      "--benchmark; default: print only).")


def _dataset(data: str, dataset_name: str | None) -> tuple[str, str | None]:
  """(dataset name, path or None) of ``--data`` and ``--dataset_name``."""
  from jaxrm.data import registry
  if data in registry.DATASET_NAMES:
    if dataset_name not in (None, data):
      raise EvaluationError(f"--data={data} names a dataset, which --dataset_name={dataset_name} contradicts; "
                            "give one of them")
    return data, None
  return dataset_name or "PreferenceDataset", data


def _load_records(dataset_name: str, path: str | None, split: str, subset_field: str | None,
                  max_rows: int, drops: DropReport, attributes: Sequence[str] | None = None):
  from jaxrm.data import registry
  options = {} if subset_field is None else {"subset_field": subset_field}
  if attributes is not None:
    options["attributes"] = tuple(attributes)
  records = registry.load_records(dataset_name, path, split=split, drops=drops, **options)
  return records[:max_rows] if max_rows else records


def main() -> None:
  """Evaluates ``--model`` on ``--data`` and prints (and with ``--output`` writes) the report."""
  from absl import flags

  from jaxrm.reward_model import RewardModel

  cli.setup_logging(logging.WARNING)  # the report is the output: only warnings go with it
  f = flags.FLAGS
  if f.benchmark:
    _benchmark_main(f)
    return
  if not f.data:
    raise EvaluationError("--data is required (a data file or directory, or a dataset name), unless "
                          "--benchmark names a benchmark")
  from jaxrm.data import registry

  drops = DropReport()
  dataset_name, path = _dataset(f.data, f.dataset_name)
  rated = registry.kind(dataset_name) == "rated"
  if rated:  # read for the model's attributes: the model comes first
    rm = RewardModel.from_pretrained(f.model, dtype=f.dtype, attention_impl=f.attention)
    records = _load_records(dataset_name, path, f.split, f.subset_field, f.max_rows, drops,
                            _regression_attributes(rm, f"{dataset_name} (rated rows)"))
  else:  # bad rows fail before the model loads
    records = _load_records(dataset_name, path, f.split, f.subset_field, f.max_rows, drops)
    rm = RewardModel.from_pretrained(f.model, dtype=f.dtype, attention_impl=f.attention)
  options = TokenizeOptions(max_length=f.max_length, truncation=f.truncation, step_separator=f.step_separator)
  result = evaluate(rm, records, options=options, batch_size=f.batch_size, drops=drops, combine=f.combine)
  print(f"jaxrm evaluate: model {f.model}, data {f.data}")
  print(format_report(result))
  print(f"\n{drops.summary('dropped rows')}")
  if f.output:
    print(f"wrote {', '.join(write_outputs(result, f.output, {'model': f.model, 'data': f.data}))}")


def _benchmark_main(f) -> None:
  from jaxrm.reward_model import RewardModel

  split = f.split if f["split"].present else None
  loaded = benchmarks.load(f.benchmark, f.data, split=split, max_rows=f.max_rows)  # bad rows fail fast
  rm = RewardModel.from_pretrained(f.model, dtype=f.dtype, attention_impl=f.attention)
  report = run_benchmark(f.benchmark, rm, loaded, threshold=f.threshold, batch_size=f.batch_size,
                         max_length=f.max_length, output_dir=f.output, info={"model": f.model})
  print(f"jaxrm evaluate: model {f.model}")
  print(benchmarks.format_report(report))
  print(f"\n{report['drop_report'].summary('dropped rows')}")
  if f.output:
    print(f"wrote {', '.join(report['files'])}")


# ----------------------------------------------------------------------------------------- benchmarks


def run_benchmark(name: str, model, data: str | dict | None = None, *, split: str | None = None,
                  max_rows: int = 0, threshold: float = 0.5, batch_size: int = 32, max_length: int = 2048,
                  output_dir: str | None = None, info: dict[str, Any] | None = None) -> dict[str, Any]:
  """Runs a public benchmark by its official rules (see :mod:`jaxrm.benchmarks`).

  Args:
    name: rewardbench, rewardbench2, rmbench or processbench.
    model: a :class:`jaxrm.RewardModel` (a sequence head for the preference benchmarks, a token
      head for processbench), or a :class:`~jaxrm.benchmarks.scoring.Scorer` of reward / step
      functions.
    data: a file or ``save_to_disk`` directory in the benchmark's schema, or a hub name (default
      the benchmark's hub dataset); or rows already read by :func:`jaxrm.benchmarks.load`.
    split: the split (processbench: comma-separated splits); default the benchmark's.
    max_rows: score only the first N rows of each split (0: all).
    threshold: processbench: a step is wrong when P(correct) is below this.
    batch_size, max_length: rows per forward pass; longest row in tokens (longer ones lose their
      oldest tokens, as the official harnesses truncate on the left; too-long solutions are dropped).
    output_dir: where to write ``eval.json`` and ``length_bias.png``; the paths go in ``"files"``.
    info: more keys for ``eval.json`` (the CLI gives the model).

  Returns:
    The report of :func:`jaxrm.benchmarks.score`, and ``"files"``: what was written.
  """
  scorer = model if isinstance(model, Scorer) else model_scorer(model, batch_size=batch_size,
                                                                max_length=max_length)
  loaded = data if isinstance(data, dict) else benchmarks.load(name, data, split=split, max_rows=max_rows)
  report = benchmarks.score(loaded, scorer, threshold=threshold)
  report["files"] = write_benchmark_outputs(report, output_dir, info or {}) if output_dir else []
  return report


def write_benchmark_outputs(report: dict[str, Any], output_dir: str, info: dict[str, Any]) -> list[str]:
  """Writes ``eval.json`` (no per-row data) and, for preference benchmarks, ``length_bias.png``."""
  os.makedirs(output_dir, exist_ok=True)
  files = [os.path.join(output_dir, REPORT_FILE)]
  with open(files[0], "w") as f:
    json.dump(_json_safe({**info, **{k: v for k, v in report.items() if k not in benchmarks.ROW_KEYS}}),
              f, indent=2)
  if "comparisons" in report:
    files.append(os.path.join(output_dir, length_bias.PLOT_FILE))
    length_bias.plot(report["comparisons"], files[-1], f"{report['benchmark']}: reward against response length")
  return files


if __name__ == "__main__":
  cli.run(main, define_flags=_define_flags)
