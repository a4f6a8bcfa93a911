"""The run config: ConfigDict (files, command line) and dataclasses (the library) hold the same keys."""

import json

import pytest

from jaxrm.config import (CheckpointSpec, DataSpec, LoraSpec, ModelSpec, RunConfig, TrainSpec, base_config,
                          from_config_dict, normalize_metric_name)
from jaxrm.models.lora import LoraConfig
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
    (lambda: RunConfig.from_dict({"model": {"lora": {"rnak": 8}}}),
     "config.model.lora has no key 'rnak'; it has alpha, base_dtype, dropout, rank, target_modules"),
    (lambda: RunConfig.from_dict({"model": {"lora": 8}}), "config.model.lora is a section (rank, alpha"),
    (lambda: LoraSpec(rank=-1), "model.lora.rank=-1: LoRA rank=-1; use 0"),
    (lambda: LoraSpec(rank=8, alpha=0.0), "model.lora.alpha=0.0: LoRA alpha=0.0; use a positive number"),
    (lambda: LoraSpec(rank=8, target_modules="q_proj,qkv_proj"),
     "model.lora.target_modules='q_proj,qkv_proj': LoRA targets ['qkv_proj'] are not projections"),
    (lambda: LoraSpec(rank=8, target_modules=""), "model.lora.target_modules='': LoRA rank=8 adapts no projection"),
    (lambda: LoraSpec(rank=8, dropout=0.1), "model.lora.dropout=0.1: LoRA dropout is not supported yet; use 0.0"),
    (lambda: LoraSpec(rank=8, base_dtype="fp8"), "model.lora.base_dtype='fp8': LoRA base_dtype='fp8'; use one of"),
    (lambda: LoraSpec(base_dtype="nf4"), "model.lora.base_dtype='nf4': LoRA base_dtype='nf4' freezes"),
])
def test_bad_values_name_their_key(make, message):
  with pytest.raises(ConfigError) as e:
    make()
  assert str(e.value).startswith(message)


def test_lora_is_a_nested_section_set_from_the_command_line():
  c = base_config()
  assert c.model.lora.to_dict() == {"rank": 0, "alpha": 16.0, "dropout": 0.0, "target_modules": "all-linear",
                                    "base_dtype": ""}
  assert not from_config_dict(c).model.lora.lora_config().enabled
  # What --config.model.lora.rank=8 --config.model.lora.target_modules=q_proj,v_proj sets.
  c.model.lora.rank = 8
  c.model.lora.target_modules = "q_proj, v_proj"
  c.model.lora.base_dtype = "int8"
  run = from_config_dict(c)
  assert run.model.lora.lora_config() == LoraConfig(rank=8, targets=("q_proj", "v_proj"), base_dtype="int8")
  assert RunConfig.from_dict(json.loads(json.dumps(run.to_dict()))) == run
  # A notebook may name the targets as a list; the spec keeps the string form of the config.
  assert LoraSpec(rank=4, target_modules=["v_proj", "q_proj"]).target_modules == "v_proj,q_proj"
  assert ModelSpec(lora=LoraSpec(rank=4)).lora.lora_config().targets == LoraConfig().targets


def test_section_checks_become_config_errors():
  c = base_config()
  c.reward.type = "pairwise"
  with pytest.raises(ConfigError, match=r"^reward.type must be one of bradley_terry, ranking, stepwise"):
    from_config_dict(c)


def test_metric_name_prefixes():
  assert normalize_metric_name("val:validation-default_loss") == "validation-default_loss"
  assert normalize_metric_name("validation/validation-default_loss") == "validation-default_loss"
  assert normalize_metric_name("") is None
