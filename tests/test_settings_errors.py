"""Numbers that make no sense are refused at load, in the spelling the user wrote them: a TRL flag
names the flag first, a jaxrm key names the key; on the command line, one line and exit 2."""

import pytest
import tiny_run

from jaxrm.compat import trl_args
from jaxrm.errors import ConfigError

MODEL_AND_DATA = ["--model_name_or_path", "/models/qwen", "--dataset_name", "trl-lib/ultrafeedback_binarized"]


@pytest.mark.parametrize(
  "flag, value, jaxrm_key, rule",
  [
    ("--learning_rate", "nan", "train.learning_rate=nan", "use a positive finite number"),
    ("--learning_rate", "inf", "train.learning_rate=inf", "use a positive finite number"),
    ("--learning_rate", "-1", "train.learning_rate=-1.0", "use a positive finite number"),
    ("--learning_rate", "0", "train.learning_rate=0.0", "use a positive finite number"),
    ("--max_grad_norm", "inf", "train.max_grad_norm=inf", "use a non-negative finite number"),
    ("--weight_decay", "-0.1", "train.weight_decay=-0.1", "use a non-negative finite number"),
  ],
)
def test_a_trl_flag_is_named_as_written(flag, value, jaxrm_key, rule):
  tr = trl_args.translate(trl_args.parse([*MODEL_AND_DATA, flag, value]), device_count=1)
  with pytest.raises(ConfigError) as e:
    tr.run_config()
  assert str(e.value).startswith(f"{flag} (TRL), which sets {jaxrm_key}: {rule}"), e.value


def test_cli_refuses_a_nan_learning_rate_with_exit_2(tmp_path):
  result = tiny_run.run(
    [
      *tiny_run.cli("", str(tmp_path / "run"))[:3],
      "--trl_args",
      *MODEL_AND_DATA,
      "--output_dir",
      str(tmp_path / "run"),
      "--learning_rate",
      "nan",
    ]
  )
  assert result.returncode == 2, tiny_run.describe(result)
  assert "Traceback" not in result.stderr
  assert (
    result.stderr.strip()
    .splitlines()[-1]
    .startswith("error: --learning_rate (TRL), which sets train.learning_rate=nan")
  ), result.stderr


@pytest.mark.parametrize(
  "flag, message",
  [
    ("--config.train.learning_rate=-1", "train.learning_rate=-1.0: use a positive finite number"),
    ("--config.train.seed=abc", "--config.train.seed"),
  ],
)
def test_cli_refuses_a_bad_jaxrm_key_with_exit_2(model_dir, tmp_path, flag, message):
  result = tiny_run.run(tiny_run.cli(model_dir, str(tmp_path / "run"), flag))
  assert result.returncode == 2, tiny_run.describe(result)
  assert "Traceback" not in result.stderr
  assert message in result.stderr, result.stderr


def test_the_start_says_which_of_max_steps_and_max_epochs_ends_the_run():
  from types import SimpleNamespace

  from jaxrm import compat
  from jaxrm.config import RunConfig, TrainSpec
  from jaxrm.run import trainer

  stream = SimpleNamespace(steps_per_epoch=8, num_examples=64, global_batch_size=8)
  run = lambda **train: trainer.planned_steps(RunConfig(train=TrainSpec(warmup_steps=1, **train)), stream)
  assert run(max_steps=10, max_epochs=2) == (10, "train.max_steps")
  assert run(max_steps=100, max_epochs=2) == (
    16,
    "train.max_epochs=2 of 8 steps each (64 train examples, train.global_batch_size=8), before train.max_steps=100",
  )
  # TRL's and NeMo's "until the epochs run out" has no max_steps to name.
  assert run(max_steps=compat.UNTIL_EPOCHS, max_epochs=1)[1].endswith("train.global_batch_size=8)")
