"""The console reports: validation tables and the end-of-run summary, from hand-made metrics."""

import math

from jaxrm.run import report

PREFERENCE = {
  "validation-default_loss": 0.6931,
  "validation-default_accuracy": 0.5,
  "validation-default_margin": 0.00012,
  "validation-default_tie_rate": 0.0,
  # A set name with "_" in it: "train_sample", not "train" with metric "sample_loss".
  "validation-train_sample_loss": 0.5123,
  "validation-train_sample_accuracy": 0.75,
  "validation-train_sample_margin": 1.25,
  "timing/validation/total_validation_time": 2.04,
  "train/loss": 9.0,  # not a validation metric
}


def test_validation_table_has_a_column_per_set_and_a_row_per_metric():
  text = report.validation_table(PREFERENCE, ["default", "train_sample"], step=200)
  assert text == (
    "validation at step 200 (2.0 s)\n"
    "              default  train_sample\n"
    "  loss         0.6931        0.5123\n"
    "  accuracy     0.5000        0.7500\n"
    "  margin    1.200e-04        1.2500\n"
    "  tie_rate     0.0000             -"
  )


def test_validation_table_shows_whatever_metrics_a_set_has():
  stepwise = {
    "validation-prm_loss": 0.4,
    "validation-prm_step_accuracy": 0.8,
    "validation-prm_f1_error": math.nan,
    "validation-prm_recall_error": 0.0,
  }
  # Per-attribute metrics of a regression set: names the report has never heard of.
  rated = {
    "validation-rated_loss": 1.5,
    "validation-rated_mse_helpfulness": 0.25,
    "validation-rated_spearman_helpfulness": 0.61,
    "validation-rated_mse_coherence": 0.5,
  }
  text = report.validation_table({**stepwise, **rated}, ["prm", "rated", "absent"], step=3)
  lines = text.splitlines()
  assert lines[0] == "validation at step 3"
  assert lines[1].split() == ["prm", "rated"]  # a set with no metrics has no column
  assert [line.split()[0] for line in lines[2:]] == [
    "loss",
    "step_accuracy",
    "f1_error",
    "recall_error",
    "mse_coherence",
    "mse_helpfulness",
    "spearman_helpfulness",
  ]
  assert lines[4].split() == ["f1_error", "nan", "-"] and lines[8].split() == [
    "spearman_helpfulness",
    "-",
    "0.6100",
  ]
  assert (
    report.validation_table({"train/loss": 1.0}, ["default"], step=1) == "validation at step 1: no metrics"
  )


def test_run_summary_names_the_best_checkpoint_and_the_commands():
  text = report.run_summary(
    output_dir="runs/rm",
    steps=200,
    wall_seconds=3725.4,
    train_tokens=12_000_000,
    train_seconds=3000.0,
    final_metrics=PREFERENCE,
    sets=["default", "train_sample"],
    final_step=200,
    best=(150, "validation-default_loss", 0.6012),
    higher_is_better=False,
    dataset_name="PreferenceDataset",
    val_path="data/val set.jsonl",
    truncation="left",
    lora=True,
  )
  lines = text.splitlines()
  assert lines[0] == "run finished: 200 steps in 1h02m05s, 4.0k tokens/s in train steps"
  assert lines[1] == "best checkpoint: step 150, validation-default_loss = 0.6012 (lower is better)"
  assert lines[2] == "final validation at step 200 (2.0 s)"

  assert lines[-5:] == [
    "use it:",
    "  from jaxrm import RewardModel; rm = RewardModel.from_pretrained('runs/rm')  # the best checkpoint",
    "  python -m jaxrm.evaluate --model=runs/rm --data='data/val set.jsonl' --truncation=left",
    "  python -m jaxrm.export --model=runs/rm --out=runs/rm-hf",
    "  python -m jaxrm.export --model=runs/rm --out=runs/rm-adapters --adapters_only",
  ]


# A run's summary, each test changing what it is about.
SUMMARY = dict(
  output_dir="runs/x",
  steps=4,
  wall_seconds=42,
  train_tokens=0,
  train_seconds=0.0,
  final_metrics={},
  sets=["default"],
  final_step=None,
  best=None,
  higher_is_better=False,
  dataset_name="HelpSteer3",
  val_path="",
)


def summary(**changed) -> str:
  return report.run_summary(**{**SUMMARY, **changed})


def test_run_summary_points_at_a_final_table_the_run_printed():
  shown = summary(
    final_metrics=PREFERENCE, sets=["default", "train_sample"], final_step=200, final_shown=True
  ).splitlines()
  assert shown[1:3] == ["final validation: the table at step 200 above", "use it:"]


def test_evaluate_command_for_a_dataset_read_by_name():
  [_, evaluate, _] = report.usage_commands(
    "runs/prm", dataset_name="demo_arithmetic_steps", val_path="validation"
  )
  assert (
    evaluate == "python -m jaxrm.evaluate --model=runs/prm --data=demo_arithmetic_steps --split=validation"
  )
  [_, evaluate, _] = report.usage_commands("runs/prm", dataset_name="StepwiseDataset", val_path="steps.jsonl")
  assert (
    evaluate == "python -m jaxrm.evaluate --model=runs/prm --data=steps.jsonl --dataset_name=StepwiseDataset"
  )


def test_summary_without_ranking_or_validation():
  text = summary()
  assert text.splitlines()[:2] == ["run finished: 4 steps in 42s", "use it:"]
  assert "  python -m jaxrm.evaluate --model=runs/x --data=HelpSteer3\n" in text


def test_a_run_stopped_early_is_not_called_finished():
  text = summary(steps=2, finished=False)
  assert text.splitlines()[0] == "run stopped early (run again to continue): 2 steps in 42s"
  assert "finished" not in text


def test_a_resumed_run_and_a_finished_one_say_so():
  assert summary(steps=2, start_step=6, wall_seconds=9).splitlines()[0] == (
    "run finished: 2 steps in 9s, resumed from step 6"
  )
  assert summary(steps=0, start_step=8).splitlines()[0] == (
    "run already finished at step 8: nothing left to train (raise train.max_steps to train on)"
  )
  by_epochs = summary(steps=0, start_step=8, ends_by="train.max_epochs=1 of 8 steps each")
  assert by_epochs.splitlines()[0] == (
    "run already finished at step 8: nothing left to train (raise train.max_epochs to train on)"
  )


def test_start_summary_names_a_resume_and_a_finished_run():
  from jaxrm.data.drops import DropReport
  from jaxrm.models.config import ModelConfig

  model = ModelConfig(
    family="llama",
    vocab_size=8,
    hidden_size=8,
    intermediate_size=8,
    num_layers=1,
    num_heads=1,
    num_kv_heads=1,
    head_dim=8,
  )
  common = dict(
    model_name="m",
    model=model,
    reward_type="bradley_terry",
    num_params=10,
    trained_params=10,
    attention="reference",
    mesh_shape={"data": 1},
    devices=1,
    backend="cpu",
    processes=1,
    train_examples=16,
    steps_per_epoch=2,
    validation_sizes={},
    drops={"train": DropReport()},
    global_batch_size=8,
    grad_accum=1,
    tokens_per_step=100.0,
    pack=None,
    micro_batched=False,
    shared_tokens_per_step=None,
    group_by_length=False,
    output_dir="runs/x",
  )
  steps = lambda text: next(line for line in text.splitlines() if line.startswith("steps: ")).split(
    ", batch"
  )[0]
  by_steps = dict(common, ends_by="train.max_steps")
  assert steps(report.run_start(start_step=0, total_steps=8, **by_steps)) == "steps: 0 -> 8 (train.max_steps)"
  assert steps(report.run_start(start_step=6, total_steps=8, **by_steps)) == (
    "steps: resumed from step 6 -> 8 (train.max_steps)"
  )
  assert steps(report.run_start(start_step=8, total_steps=8, **by_steps)) == (
    "steps: already finished at step 8 (raise train.max_steps to train on)"
  )
  by_epochs = dict(common, ends_by="train.max_epochs=4 of 2 steps each, before train.max_steps=100")
  assert steps(report.run_start(start_step=0, total_steps=8, **by_epochs)) == (
    "steps: 0 -> 8 (train.max_epochs=4 of 2 steps each, before train.max_steps=100)"
  )
  assert steps(report.run_start(start_step=8, total_steps=8, **by_epochs)) == (
    "steps: already finished at step 8 (raise train.max_epochs to train on)"
  )
  # No validation set (own files without data.val_data_paths) is said in words.
  assert "data: 16 train examples (2 steps/epoch), no validation\n" in report.run_start(
    start_step=0, total_steps=8, **by_steps
  )


def test_progress_line_for_a_log_that_is_not_a_terminal():
  assert report.progress_line(10, 120, 0.69314, 0.5, 0.4213) == (
    "step 10/120: loss 0.6931, accuracy 0.500, 0.42 s/step"
  )


def test_a_run_on_own_files_without_validation_names_a_file_to_evaluate_on():
  [_, evaluate, export] = report.usage_commands(
    "runs/own", dataset_name="PreferenceDataset", val_path="", files_only=True
  )
  assert evaluate == "python -m jaxrm.evaluate --model=runs/own --data=HELD_OUT.jsonl"
  assert export == "python -m jaxrm.export --model=runs/own --out=runs/own-hf"


def test_progress_line_leaves_out_an_accuracy_the_task_has_none_of():
  # A regression step has no accuracy; the trainer's NaN is not printed as "accuracy nan".
  for accuracy in (None, math.nan):
    assert report.progress_line(3, 30, 0.25, accuracy, 0.1) == "step 3/30: loss 0.2500, 0.10 s/step"
