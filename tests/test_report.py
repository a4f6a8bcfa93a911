"""The console reports: validation tables and the end-of-run summary, from hand-made metrics."""

import math

from jaxrm import report

PREFERENCE = {
    "validation-default_loss": 0.6931, "validation-default_accuracy": 0.5, "validation-default_margin": 0.00012,
    "validation-default_tie_rate": 0.0,
    # A set name with "_" in it: "train_sample", not "train" with metric "sample_loss".
    "validation-train_sample_loss": 0.5123, "validation-train_sample_accuracy": 0.75,
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
      "  tie_rate     0.0000             -")


def test_validation_table_shows_whatever_metrics_a_set_has():
  stepwise = {"validation-prm_loss": 0.4, "validation-prm_step_accuracy": 0.8, "validation-prm_f1_error": math.nan,
              "validation-prm_recall_error": 0.0}
  # Per-attribute metrics of a regression set: names the report has never heard of.
  rated = {"validation-rated_loss": 1.5, "validation-rated_mse_helpfulness": 0.25,
           "validation-rated_spearman_helpfulness": 0.61, "validation-rated_mse_coherence": 0.5}
  text = report.validation_table({**stepwise, **rated}, ["prm", "rated", "absent"], step=3)
  lines = text.splitlines()
  assert lines[0] == "validation at step 3"
  assert lines[1].split() == ["prm", "rated"]  # a set with no metrics has no column
  assert [line.split()[0] for line in lines[2:]] == [
      "loss", "step_accuracy", "f1_error", "recall_error", "mse_coherence", "mse_helpfulness",
      "spearman_helpfulness"]
  assert lines[4].split() == ["f1_error", "nan", "-"] and lines[8].split() == ["spearman_helpfulness", "-", "0.6100"]
  assert report.validation_table({"train/loss": 1.0}, ["default"], step=1) == "validation at step 1: no metrics"


def test_run_summary_names_the_best_checkpoint_and_the_commands():
  text = report.run_summary(
      output_dir="runs/rm", steps=200, wall_seconds=3725.4, train_tokens=12_000_000, train_seconds=3000.0,
      final_metrics=PREFERENCE, sets=["default", "train_sample"], final_step=200,
      best=(150, "validation-default_loss", 0.6012), higher_is_better=False, dataset_name="PreferenceDataset",
      val_path="data/val set.jsonl", max_length=2048, truncation="left", lora=True)
  lines = text.splitlines()
  assert lines[0] == "run finished: 200 steps in 1h02m05s, 4.0k tokens/s in train steps"
  assert lines[1] == "best checkpoint: step 150, validation-default_loss = 0.6012 (lower is better)"
  assert lines[2] == "final validation at step 200 (2.0 s)"
  assert lines[-5:] == [
      "use it:",
      "  from jaxrm import RewardModel; rm = RewardModel.from_pretrained('runs/rm')  # the best checkpoint",
      "  python -m jaxrm.evaluate --model=runs/rm --data='data/val set.jsonl' --max_length=2048 --truncation=left",
      "  python -m jaxrm.export --checkpoint=runs/rm --out=runs/rm-hf",
      "  python -m jaxrm.export --checkpoint=runs/rm --out=runs/rm-adapters --adapters_only"]


def test_evaluate_command_for_a_dataset_read_by_name():
  [_, evaluate, _] = report.usage_commands("runs/prm", dataset_name="demo_arithmetic_steps", val_path="validation",
                                           max_length=256)
  assert evaluate == ("python -m jaxrm.evaluate --model=runs/prm --data=demo_arithmetic_steps --split=validation "
                      "--max_length=256")
  [_, evaluate, _] = report.usage_commands("runs/prm", dataset_name="StepwiseDataset", val_path="steps.jsonl",
                                           max_length=512)
  assert evaluate == ("python -m jaxrm.evaluate --model=runs/prm --data=steps.jsonl --dataset_name=StepwiseDataset "
                      "--max_length=512")


def test_summary_without_ranking_or_validation():
  text = report.run_summary(output_dir="runs/x", steps=4, wall_seconds=42, train_tokens=0, train_seconds=0.0,
                            final_metrics={}, sets=["default"], final_step=None, best=None, higher_is_better=False,
                            dataset_name="HelpSteer3", val_path="", max_length=1024)
  assert text.splitlines()[:2] == ["run finished: 4 steps in 42s", "use it:"]
  assert "--data=HelpSteer3 --max_length=1024" in text


def test_a_run_stopped_early_is_not_called_finished():
  text = report.run_summary(output_dir="runs/x", steps=2, wall_seconds=42, train_tokens=0, train_seconds=0.0,
                            final_metrics={}, sets=["default"], final_step=None, best=None, higher_is_better=False,
                            dataset_name="HelpSteer3", val_path="", max_length=1024, finished=False)
  assert text.splitlines()[0] == "run stopped early (run again to continue): 2 steps in 42s"
  assert "finished" not in text
