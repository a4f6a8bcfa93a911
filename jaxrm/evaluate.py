r"""Evaluates a reward model on preference, stepwise or rated data, or on a public benchmark.

  python -m jaxrm.evaluate --model=runs/rm --data=demo_arithmetic
  python -m jaxrm.evaluate --model=model.gguf --data=rewardbench.jsonl --subset_field=subset \
      --output=eval/
  python -m jaxrm.evaluate --model=runs/prm --data=steps.jsonl
  python -m jaxrm.evaluate --model=runs/helpsteer2 --data=rated.jsonl
  python -m jaxrm.evaluate --model=runs/rm --benchmark=rewardbench --output=eval/
  python -m jaxrm.evaluate --model=runs/prm --benchmark=processbench --data=ProcessBench/ --output=eval/
  python -m jaxrm.evaluate --model=runs/judge --data=pairs.jsonl
  python -m jaxrm.evaluate --model=runs/judge --benchmark=judgebench --data=judgebench_gpt.jsonl

This module is the command line only; the library is :mod:`jaxrm.evaluation` (in Python:
:func:`jaxrm.evaluation.evaluate`).

``--benchmark`` (rewardbench, rewardbench2, rmbench, processbench, judgebench) scores by that
benchmark's official rules (see :mod:`jaxrm.benchmarks`) and reports its official figures under
their official names, with a length-bias report for the preference benchmarks. A pairwise judge
(``reward.type=pairwise``) is asked each pair of rewardbench and rmbench in both orders (their mean
log-odds decides), ranks each rewardbench2 prompt's completions by the Bradley-Terry strengths of
a round robin (the report says this is a judge's path), and runs judgebench (local ``.jsonl``
files in JudgeBench's format, or its hub dataset) by JudgeBench's own rule for the two orders;
its reports add its accuracy in each order, consistency and position bias, and its texts default
to the model's context. ``--data`` is then a file or
``save_to_disk`` directory in the benchmark's public schema, or a hub name (default: the
benchmark's own dataset), ``--max_length`` defaults to the official harness's (2048 tokens for
rewardbench, rewardbench2 and rmbench; the model's context for processbench, whose harness cuts
no solution), and ``--output`` gets ``eval.json`` and ``length_bias.png``.

``--data`` is a file or directory in the format ``--dataset_name`` names (by default the format of
the model's task, which a run and an export record: RatedDataset for a regression model,
StepwiseDataset for a process reward model, PreferenceDataset for the others), or the name of a
dataset itself (``demo_arithmetic``, ``HelpSteer3``...), read from its usual place. Rows are
rendered as the model's training rendered its own (the chat template, or plain text).

Preference data judged by a pairwise judge: each pair in both orders, the accuracy in each order
and in both, the consistency (both orders agree), the position bias (the mean P(A) over both
orders; 0.5: none), the loss and the log-odds, as validation reports them; ``rewards.png`` is the
histogram of each order's log-odds. Preference data (sequence-head models): accuracy (the best completion scored above the worst),
overall and per subset (a RewardBench-style column, ``--subset_field``), the loss, the reward
statistics and the length bias (reward against completion length in tokens, and
``length_bias.png``). Stepwise data (token-head models): step accuracy, recall of each class, F1
of the error class, the share of solutions whose first error is found exactly, and the baseline
that calls every step correct. Rated data (regression models, one output per attribute, read for
the model's attributes): the mean squared error, and per attribute the MSE, the mean absolute error
and Pearson's and Spearman's correlation of prediction and rating, with the pairwise accuracy over
same-prompt responses ranked by ``--combine`` (default: the first attribute), as validation reports
them. With ``--output`` it writes ``eval.json``, ``rewards.png``, a histogram of chosen vs
rejected rewards (of the probability that a step is correct, for stepwise models; for regression
models, predictions plotted against ratings), and for preference data ``length_bias.png``.
``--max_length`` defaults to the model's training length (the run's ``data.max_length``, which a
run and an export of it record), as ``serve`` does. A training run is scored at its best
checkpoint (``--step`` for another); the step and why it was taken are printed first. It says how
many examples it scores, and how fast.
"""

from __future__ import annotations

import logging

from jaxrm.run import host_memory

if __name__ == "__main__":  # first: glibc reads its tunables only when a process starts
  host_memory.restart_with_huge_pages()

from jaxrm import benchmarks, cli
from jaxrm.data.tokenize import TokenizeOptions
from jaxrm.server.config import DEFAULT_MAX_LENGTH, default_max_length


def _define_flags() -> None:
  from absl import flags

  flags.DEFINE_string(
    "model", None, "HF checkpoint dir, .gguf file, embedded:NAME, or a jaxrm run dir.", required=True
  )
  flags.DEFINE_string(
    "data",
    None,
    "A data file/directory, or a dataset name (demo_arithmetic...); with "
    "--benchmark, a file/directory in its schema or a hub name (default: its hub dataset).",
  )
  flags.DEFINE_enum(
    "benchmark",
    None,
    list(benchmarks.BENCHMARKS),
    "Score by this benchmark's official rules instead of plain accuracy.",
  )
  flags.DEFINE_float("threshold", 0.5, "processbench: a step is wrong when P(correct) is below this.")
  flags.DEFINE_string(
    "dataset_name",
    None,
    "Format of --data: PreferenceDataset, StepwiseDataset, RatedDataset "
    "(default: the model's task's), or a public/demo dataset name.",
  )
  flags.DEFINE_string(
    "combine",
    None,
    "Rated data: what pairwise_accuracy ranks same-prompt responses by, "
    "an attribute or name=weight,... (default: the model's first attribute).",
  )
  flags.DEFINE_string(
    "split",
    "validation",
    "Split of a dataset read by name, or of a saved DatasetDict "
    "(with --benchmark, default: the benchmark's; processbench: comma-separated).",
  )
  flags.DEFINE_string(
    "subset_field",
    None,
    "Column holding each row's subset (default: the dataset's, 'subset' for user files).",
  )
  flags.DEFINE_integer("max_rows", 0, "Evaluate only the first N rows (0: all).")
  flags.DEFINE_integer(
    "max_length",
    None,
    "Longest sequence in tokens; longer rows are dropped or cut "
    "(default: the training run's data.max_length, which a run and an export of it record; "
    f"else {DEFAULT_MAX_LENGTH}, or the model's context if shorter; with --benchmark, its "
    "official harness's: 2048, the model's context for processbench).",
  )
  flags.DEFINE_enum(
    "truncation", "drop", ["drop", "left"], "Over-length rows: drop them, or cut the oldest context."
  )
  flags.DEFINE_string("step_separator", "\n", "Text after each step of a stepwise row.")
  flags.DEFINE_integer("batch_size", 8, "Examples per forward pass.")
  cli.define_compute_flags()
  flags.DEFINE_string(
    "output",
    None,
    "Directory for eval.json, rewards.png (not with --benchmark) and, for "
    "preference data, length_bias.png (default: print only).",
  )
  cli.define_step_flag()
  cli.define_verifier_flags()


def main() -> None:
  """Evaluates ``--model`` on ``--data`` and prints (and with ``--output`` writes) the report."""
  from absl import flags

  from jaxrm import evaluation
  from jaxrm.data.drops import DropReport
  from jaxrm.errors import EvaluationError

  cli.setup_logging(logging.WARNING)  # the report is the output: only warnings go with it...
  logging.getLogger("jaxrm.evaluation").setLevel(logging.INFO)  # ...and how far scoring has got
  f = flags.FLAGS
  if f.benchmark:
    _benchmark_main(f)
    return
  if not f.data:
    raise EvaluationError(
      "--data is required (a data file or directory, or a dataset name), unless --benchmark names a benchmark"
    )
  drops = DropReport()
  rm, records = evaluation.read_data(
    f.data,
    lambda: _model(f),
    dataset_name=f.dataset_name or _format_of_model(f),
    split=f.split,
    subset_field=f.subset_field,
    max_rows=f.max_rows,
    drops=drops,
  )
  max_length = f.max_length or default_max_length(rm.config.max_position_embeddings, rm.training_max_length)
  options = TokenizeOptions(max_length=max_length, truncation=f.truncation, step_separator=f.step_separator)
  result = evaluation.evaluate(
    rm, records, options=options, batch_size=f.batch_size, drops=drops, combine=f.combine
  )
  print(f"jaxrm evaluate: model {f.model}, data {f.data}, max_length {options.max_length}")
  print(evaluation.format_report(result))
  timing = result["timing"]
  print(
    f"\nscored {result['num_examples']} examples in {timing['seconds']:.1f} s "
    f"({timing['examples_per_second']:.1f} examples/s, compiles included)"
  )
  print(drops.summary("dropped rows"))
  if f.output:
    print(
      f"wrote {', '.join(evaluation.write_outputs(result, f.output, {'model': f.model, 'data': f.data}))}"
    )


def _model(f):
  from jaxrm.scoring.reward_model import RewardModel

  return RewardModel.from_pretrained(
    cli.located_model(f.model, f.step),
    dtype=f.dtype,
    attention_impl=f.attention,
    **cli.asker_requests(f),
  )


def _format_of_model(f) -> str:
  """What ``--data`` is read as when no ``--dataset_name`` says: the format of the data the
  model's task trains on, as its files record it (read without its weights). A model that cannot
  be read gives the default format: its error comes when it loads, after the data's."""
  from jaxrm import evaluation
  from jaxrm.scoring import loading
  from jaxrm.scoring.reward_model import RewardModel

  try:
    source = loading.locate(f.model, f.step)
    task = RewardModel.from_pretrained(source, load_weights=False, **cli.asker_requests(f)).task
  except Exception:  # noqa: BLE001 -- said when the model loads
    task = None
  return evaluation.dataset_source(f.data, None, task)[0]


def _benchmark_main(f) -> None:
  from jaxrm import evaluation

  split = f.split if f["split"].present else None
  loaded = benchmarks.load(f.benchmark, f.data, split=split, max_rows=f.max_rows)  # bad rows fail fast
  report = evaluation.run_benchmark(
    f.benchmark,
    _model(f),
    loaded,
    threshold=f.threshold,
    batch_size=f.batch_size,
    max_length=f.max_length,
    output_dir=f.output,
    info={"model": f.model},
  )
  print(f"jaxrm evaluate: model {f.model}")
  print(benchmarks.format_report(report))
  print(f"\n{report['drop_report'].summary('dropped rows')}")
  if f.output:
    print(f"wrote {', '.join(report['files'])}")


if __name__ == "__main__":
  cli.run(main, define_flags=_define_flags)
