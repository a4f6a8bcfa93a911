"""The run config: ConfigDict (files, command line) and dataclasses (the library) hold the same keys."""

import json

import pytest

from jaxrm.config import (CheckpointSpec, DataSpec, ModelSpec, RunConfig, TrainSpec, base_config, from_config_dict,
                          normalize_metric_name)
from jaxrm.errors import ConfigError


def test_base_config_is_the_dataclass_defaults():
  c = base_config()
  assert from_config_dict(c) == RunConfig()
  # NeMo RL's key names, in their sections.
  assert c.model.name_or_path == "embedded:SmolLM2-135M-Instruct"
  assert c.data.val_data_paths.to_dict() == {"default": "validation"}
  assert c.checkpointing.metric_name == "validation-default_loss"
  assert sorted(c.keys()) == ["checkpointing", "data", "eval", "logger", "mesh", "model", "output_dir",
                              "reward", "train"]
  assert isinstance(c.train.learning_rate, float) and isinstance(c.train.max_steps, int)


def test_overrides_reach_the_dataclasses_and_round_trip_through_json():
  c = base_config()
  c.train.max_steps = 7
  c.data.val_data_paths = {"a": "x.jsonl", "b": "y.jsonl"}
  c.checkpointing.metric_name = "val:validation-b_accuracy"
  run = from_config_dict(c)
  assert run.train.max_steps == 7 and run.data.val_data_paths == {"a": "x.jsonl", "b": "y.jsonl"}
  assert run.checkpointing.metric == "validation-b_accuracy"
  assert RunConfig.from_dict(json.loads(json.dumps(run.to_dict()))) == run


def test_a_notebook_sets_only_what_it_changes():
  run = RunConfig(output_dir="/tmp/x", train=TrainSpec(max_steps=3))
  assert run.train.max_steps == 3 and run.train.learning_rate == TrainSpec().learning_rate
  assert run.data.tokenize_options.max_length == DataSpec().max_length


@pytest.mark.parametrize("make, message", [
    (lambda: ModelSpec(attention="flash"), "model.attention must be one of auto, reference, pallas, cudnn; got 'flash'"),
    (lambda: DataSpec(packing="pack"), "data.packing must be one of none, packed, shared_prompt; got 'pack'"),
    (lambda: DataSpec(packed_row_length=-1), "data.packed_row_length=-1: use a number of tokens per row"),
    (lambda: RunConfig(checkpointing=CheckpointSpec(metric_name="validation-other_loss")),
     "checkpointing.metric_name='validation-other_loss' names no validation set; use "
     "'validation-<set>_<metric>' with <set> one of default"),
    (lambda: RunConfig.from_dict({"trian": {}}), "the config has no key 'trian'; it has output_dir, model"),
    (lambda: RunConfig.from_dict({"train": {"max_stepz": 1}}),
     "config.train has no key 'max_stepz'; it has global_batch_size"),
])
def test_bad_values_name_their_key(make, message):
  with pytest.raises(ConfigError) as e:
    make()
  assert str(e.value).startswith(message)


def test_section_checks_become_config_errors():
  c = base_config()
  c.reward.type = "pairwise"
  with pytest.raises(ConfigError, match=r"^reward.type must be one of bradley_terry, ranking, stepwise"):
    from_config_dict(c)


def test_metric_name_prefixes():
  assert normalize_metric_name("val:validation-default_loss") == "validation-default_loss"
  assert normalize_metric_name("validation/validation-default_loss") == "validation-default_loss"
  assert normalize_metric_name("") is None
