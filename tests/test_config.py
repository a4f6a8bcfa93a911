"""The run config: ConfigDict (files, command line) and dataclasses (the library) hold the same keys."""

import json
import os

import pytest

from jaxrm.config import (
  CheckpointSpec,
  DataSpec,
  EvalSpec,
  LoraSpec,
  ModelSpec,
  RewardSpec,
  RunConfig,
  TrainSpec,
  base_config,
  from_config_dict,
  normalize_metric_name,
)
from jaxrm.errors import ConfigError
from jaxrm.models.lora import LoraConfig
from jaxrm.tasks import pairwise


def test_base_config_is_the_dataclass_defaults():
  c = base_config()
  assert from_config_dict(c) == RunConfig()
  # NeMo RL's key names, in their sections.
  assert c.model.name_or_path == "embedded:SmolLM2-135M-Instruct"
  assert c.data.val_data_paths.to_dict() == {"default": "validation"}
  assert c.checkpointing.metric_name == "validation-default_loss"
  assert sorted(c.keys()) == [
    "changed_settings",
    "checkpointing",
    "data",
    "eval",
    "logger",
    "mesh",
    "model",
    "output_dir",
    "reward",
    "train",
  ]
  assert isinstance(c.train.learning_rate, float) and isinstance(c.train.max_steps, int)


def test_overrides_reach_the_dataclasses_and_round_trip_through_json():
  c = base_config()
  c.train.max_steps = 7
  c.train.warmup_steps = 2
  c.data.val_data_paths = {"a": "x.jsonl", "b": "y.jsonl"}
  c.checkpointing.metric_name = "val:validation-b_accuracy"
  run = from_config_dict(c)
  assert run.train.max_steps == 7 and run.data.val_data_paths == {"a": "x.jsonl", "b": "y.jsonl"}
  assert run.checkpointing.metric == "validation-b_accuracy"
  assert RunConfig.from_dict(json.loads(json.dumps(run.to_dict()))) == run


def test_a_notebook_sets_only_what_it_changes():
  run = RunConfig(output_dir="/tmp/x", train=TrainSpec(max_steps=3, warmup_steps=1))
  assert run.train.max_steps == 3 and run.train.learning_rate == TrainSpec().learning_rate
  assert run.data.tokenize_options.max_length == DataSpec().max_length


@pytest.mark.parametrize(
  "make, message",
  [
    (
      lambda: ModelSpec(attention="flash"),
      "model.attention must be one of auto, reference, pallas, cudnn; got 'flash'",
    ),
    (
      lambda: ModelSpec(remat="elementwize"),
      "model.remat must be one of none, elementwise, dots, full; got 'elementwize'",
    ),
    (lambda: DataSpec(packing="pack"), "data.packing must be one of none, packed, shared_prompt; got 'pack'"),
    (lambda: DataSpec(packed_row_length=-1), "data.packed_row_length=-1: use a number of tokens per row"),
    (
      lambda: RunConfig(checkpointing=CheckpointSpec(metric_name="validation-other_loss")),
      "checkpointing.metric_name='validation-other_loss' names no validation set; use "
      "'validation-<set>_<metric>' with <set> one of default",
    ),
    (
      lambda: RunConfig.from_dict({"trian": {}}),
      "the config has no key 'trian'; it has output_dir, changed_settings, model",
    ),
    (
      lambda: RunConfig.from_dict({"train": {"max_stepz": 1}}),
      "config.train has no key 'max_stepz'; it has adam_beta1, adam_beta2, adam_epsilon, global_batch_size",
    ),
    (  # no former names are read: train.lr_decay is train.lr_scheduler
      lambda: RunConfig.from_dict({"train": {"lr_decay": "cosine"}}),
      "config.train has no key 'lr_decay'; it has adam_beta1, adam_beta2, adam_epsilon, global_batch_size",
    ),
    (
      lambda: RunConfig.from_dict({"model": {"lora": {"rnak": 8}}}),
      "config.model.lora has no key 'rnak'; it has alpha, base_dtype, dropout, rank, target_modules",
    ),
    (lambda: RunConfig.from_dict({"model": {"lora": 8}}), "config.model.lora is a section (rank, alpha"),
    (lambda: LoraSpec(rank=-1), "model.lora.rank=-1: LoRA rank=-1; use 0"),
    (lambda: LoraSpec(rank=8, alpha=0.0), "model.lora.alpha=0.0: LoRA alpha=0.0; use a positive number"),
    (
      lambda: LoraSpec(rank=8, target_modules="q_proj,qkv_proj"),
      "model.lora.target_modules='q_proj,qkv_proj': LoRA targets ['qkv_proj'] are not projections",
    ),
    (
      lambda: LoraSpec(rank=8, target_modules=""),
      "model.lora.target_modules='': LoRA rank=8 adapts no projection",
    ),
    (
      lambda: LoraSpec(rank=8, dropout=1.0),
      "model.lora.dropout=1.0: LoRA dropout=1.0; use a probability in [0, 1)",
    ),
    (
      lambda: LoraSpec(rank=8, base_dtype="fp8"),
      "model.lora.base_dtype='fp8': LoRA base_dtype='fp8'; use one of",
    ),
    (lambda: LoraSpec(base_dtype="nf4"), "model.lora.base_dtype='nf4': LoRA base_dtype='nf4' freezes"),
    (lambda: TrainSpec(lr_scheduler="polynomial"), "train.lr_scheduler='polynomial' is not one of cosine, "),
    (
      lambda: TrainSpec(lr_scheduler="cosine_with_min_lr"),
      "train.lr_scheduler='cosine_with_min_lr' needs train.min_lr_ratio > 0",
    ),
    (lambda: TrainSpec(adam_beta2=1.0), "train.adam_beta2=1.0: use a number in [0, 1)"),
    (lambda: TrainSpec(max_steps=2.5), "train.max_steps=2.5: expected int, got float"),
    (lambda: TrainSpec(max_steps=True), "train.max_steps=True: expected int, got bool"),
    (lambda: TrainSpec(max_steps=0), "train.max_steps=0: use a positive number of optimizer updates"),
    (
      lambda: TrainSpec(max_epochs=-1),
      "train.max_epochs=-1: use a number of epochs, or 0 for train.max_steps alone",
    ),
    (lambda: DataSpec(max_length="512"), "data.max_length='512': expected int, got str"),
    (lambda: RunConfig(eval=EvalSpec(val_at_start="yes")), "eval.val_at_start='yes': expected bool, got str"),
    (
      lambda: RunConfig(train={"max_steps": 3}),
      "train: a TrainSpec section, not dict {'max_steps': 3}; give TrainSpec(...), or build the whole "
      "config with RunConfig.from_dict(...)",
    ),
    (lambda: RunConfig(model=ModelSpec(lora={"rank": 4})), "model.lora: a LoraSpec section, not dict"),
    (
      lambda: TrainSpec(learning_rate=float("nan")),
      "train.learning_rate=nan: use a positive finite number, e.g. 1e-5 (TRL's --learning_rate",
    ),
    (lambda: TrainSpec(learning_rate=0.0), "train.learning_rate=0.0: use a positive finite number"),
    (lambda: TrainSpec(learning_rate=-1e-5), "train.learning_rate=-1e-05: use a positive finite number"),
    (lambda: TrainSpec(learning_rate=float("inf")), "train.learning_rate=inf: use a positive finite number"),
    (lambda: TrainSpec(weight_decay=-0.1), "train.weight_decay=-0.1: use a non-negative finite number"),
    (
      lambda: TrainSpec(max_grad_norm=float("nan")),
      "train.max_grad_norm=nan: use a non-negative finite number",
    ),
    (lambda: TrainSpec(adam_epsilon=float("inf")), "train.adam_epsilon=inf: use a small positive number"),
    (
      lambda: RunConfig(output_dir=""),
      "output_dir='': name the folder the run writes into (output_dir='runs/rm'; on the command line "
      "--config.output_dir=runs/rm)",
    ),
    (lambda: RunConfig.from_dict({"output_dir": "  "}), "output_dir='  ': name the folder the run writes"),
    (lambda: TrainSpec(adam_epsilon=0.0), "train.adam_epsilon=0.0: use a small positive number"),
    (
      lambda: TrainSpec(min_lr_ratio=2.0),
      "train.min_lr_ratio=2.0: use a fraction of learning_rate in [0, 1]",
    ),
  ],
)
def test_bad_values_name_their_key(make, message):
  with pytest.raises(ConfigError) as e:
    make()
  assert str(e.value).startswith(message)


def test_lora_is_a_nested_section_set_from_the_command_line():
  c = base_config()
  assert c.model.lora.to_dict() == {
    "rank": 0,
    "alpha": 16.0,
    "dropout": 0.0,
    "target_modules": "all-linear",
    "base_dtype": "",
  }
  assert not from_config_dict(c).model.lora.lora_config.enabled
  # What --config.model.lora.rank=8 --config.model.lora.target_modules=q_proj,v_proj sets.
  c.model.lora.rank = 8
  c.model.lora.target_modules = "q_proj, v_proj"
  c.model.lora.base_dtype = "int8"
  run = from_config_dict(c)
  assert run.model.lora.lora_config == LoraConfig(rank=8, targets=("q_proj", "v_proj"), base_dtype="int8")
  assert RunConfig.from_dict(json.loads(json.dumps(run.to_dict()))) == run
  # A notebook may name the targets as a list; the spec keeps the string form of the config.
  assert LoraSpec(rank=4, target_modules=["v_proj", "q_proj"]).target_modules == "v_proj,q_proj"
  assert ModelSpec(lora=LoraSpec(rank=4)).lora.lora_config.targets == LoraConfig().targets


def test_section_checks_become_config_errors():
  c = base_config()
  c.reward.type = "pairs"
  with pytest.raises(ConfigError, match=r"^reward.type must be one of bradley_terry, ranking, stepwise"):
    from_config_dict(c)


def regression_on(dataset_name, **reward):
  c = base_config()
  c.data.dataset_name, c.reward.type = dataset_name, "regression"
  for key, value in reward.items():
    c.reward[key] = value
  return c


def test_helpsteer2_regression_defaults_to_its_five_attributes():
  run = from_config_dict(regression_on("HelpSteer2"))
  names = ("helpfulness", "correctness", "coherence", "complexity", "verbosity")
  assert run.reward.attribute_names == names
  # config.json holds the attributes the run trained on, so reading it back needs no default.
  assert run.to_dict()["reward"]["attributes"] == ",".join(names)
  assert RunConfig.from_dict(json.loads(json.dumps(run.to_dict()))) == run
  chosen = from_config_dict(regression_on("HelpSteer2", attributes="verbosity, helpfulness"))
  assert chosen.reward.attribute_names == ("verbosity", "helpfulness")


def test_generic_rated_data_still_needs_its_attributes():
  with pytest.raises(ConfigError) as e:
    from_config_dict(regression_on("RatedDataset"))
  assert str(e.value) == (
    "reward.attributes is empty: reward.type='regression' needs the rated attributes, "
    "e.g. reward.attributes='helpfulness,correctness,coherence,complexity,verbosity'"
  )


def test_reward_keys_are_parsed_once_and_stay_out_of_the_dict():
  spec = RewardSpec(
    "regression", attributes="a, b", attribute_weights="1,3", attribute_range="0,4", combine="b"
  )
  fields = {
    "type": "regression",
    "ranking_loss": "plackett_luce",
    "center_rewards_coefficient": 0.0,
    "preference_strength_scaling": False,
    "attributes": "a, b",
    "attribute_weights": "1,3",
    "attribute_range": "0,4",
    "combine": "b",
    "verifier_question": "Is the last response correct and helpful? Answer Yes or No.",
    "verifier_answers": "Yes,No",
    "verifier_loss": "bradley_terry",
    "judge_question": pairwise.DEFAULT_QUESTION,
    "judge_answers": "A,B",
  }
  assert (spec.attribute_names, spec.weights, spec.value_range, spec.combination) == (
    ("a", "b"),
    (1.0, 3.0),
    (0.0, 4.0),
    (0.0, 1.0),
  )
  assert spec.attribute_names is spec.attribute_names  # kept, not parsed again
  assert RunConfig(reward=spec).to_dict()["reward"] == fields
  assert spec == RewardSpec(**fields) and hash(spec) == hash(RewardSpec(**fields))
  assert repr(spec) == repr(RewardSpec(**fields))


def test_metric_name_prefixes():
  assert normalize_metric_name("val:validation-default_loss") == "validation-default_loss"
  assert normalize_metric_name("validation/validation-default_loss") == "validation-default_loss"
  assert normalize_metric_name("") is None


def test_scheduler_and_adam_keys_under_trl_names(caplog):
  c = base_config()
  assert (c.train.lr_scheduler, c.train.adam_beta1, c.train.adam_beta2, c.train.adam_epsilon) == (
    "cosine",
    0.9,
    0.999,
    1e-8,
  )  # transformers' and PyTorch's defaults
  # NeMo RL's RM recipe, from the command line.
  c.train.adam_beta2, c.train.adam_epsilon, c.train.lr_scheduler = 0.98, 1e-5, "inverse-square-root"
  run = from_config_dict(c)
  assert (run.train.adam_beta2, run.train.adam_epsilon, run.train.lr_scheduler) == (
    0.98,
    1e-5,
    "inverse_sqrt",
  )
  assert RunConfig.from_dict(json.loads(json.dumps(run.to_dict()))) == run
  with caplog.at_level("WARNING", logger="jaxrm.config"):
    assert TrainSpec(lr_scheduler="constant", warmup_steps=5).lr_scheduler == "constant"
  assert "train.warmup_steps=5 is ignored" in caplog.text


def test_data_cache_keys():
  c = base_config()
  assert (c.data.cache, c.data.cache_dir, c.data.num_proc) == (True, "", 1)
  spec = from_config_dict(c).data
  assert spec.cache_directory.endswith(os.path.join(".cache", "jaxrm", "tokenized"))
  assert spec.tokenizer_processes == 1
  assert DataSpec(cache=False).cache_directory is None
  assert DataSpec(cache_dir="~/tok").cache_directory == os.path.expanduser("~/tok")
  assert DataSpec(num_proc=0).tokenizer_processes == (os.cpu_count() or 1)
  with pytest.raises(
    ConfigError, match=r"^data.num_proc=-2: use a number of processes, or 0 for one per CPU"
  ):
    DataSpec(num_proc=-2)


def test_own_files_need_only_their_path():
  run = RunConfig(data=DataSpec(train_data_path="train.jsonl"))
  # The demo's dataset and validation split are the demo's: the file is read as its kind's format,
  # with no validation set, and checkpoints are kept by recency.
  assert (run.data.dataset_name, run.data.val_data_paths) == ("PreferenceDataset", {})
  assert run.checkpointing.metric is None
  steps = DataSpec(dataset_name="demo_arithmetic_steps", train_data_path="steps.jsonl")
  assert steps.dataset_name == "StepwiseDataset"
  assert DataSpec(train_data_path="validation").dataset_name == "demo_arithmetic"  # the demo's split
  # A set added beside the demo's default: ranked by its own loss (also from NeMo RL's "val:" spelling).
  two = RunConfig(
    data=DataSpec(train_data_path="t.jsonl", val_data_paths={"default": "validation", "b": "v.jsonl"}),
    checkpointing=CheckpointSpec(metric_name="val:validation-default_loss"),
  )
  assert two.data.val_data_paths == {"b": "v.jsonl"} and two.checkpointing.metric == "validation-b_loss"
  # A public dataset keeps its sets: "validation" is its validation split.
  assert DataSpec(dataset_name="HelpSteer3").val_data_paths == {"default": "validation"}


def test_a_file_format_leaves_out_sets_it_cannot_read(caplog):
  spec = DataSpec(
    dataset_name="PreferenceDataset",
    train_data_path="t.jsonl",
    val_data_paths={"held_out": "test", "off": "", "v": "v.jsonl"},
  )
  assert spec.val_data_paths == {"v": "v.jsonl"}
  assert (
    "data.val_data_paths.held_out='test' is left out: PreferenceDataset reads only the files it is given; "
    "set it to a file to validate on"
  ) in caplog.text


def test_a_run_shorter_than_its_warmup_names_the_keys():
  with pytest.raises(ConfigError) as e:
    TrainSpec(max_steps=3, warmup_steps=5)
  assert str(e.value) == (
    "train.max_steps=3 ends the run within train.warmup_steps=5, leaving train.lr_scheduler='cosine' no steps "
    "to decay: lower train.warmup_steps (e.g. --config.train.warmup_steps=1), or use "
    "--config.train.lr_scheduler=constant_with_warmup"
  )
  assert TrainSpec(max_steps=3, warmup_steps=5, lr_scheduler="constant_with_warmup").max_steps == 3


def test_each_task_owns_its_reward_keys():
  """A task's own keys (Task.settings; an LM-head task's asker's) are reward keys with their
  defaults, and one set for a reward.type of another task is refused, naming the task's type."""
  from jaxrm import tasks

  owned = {key: task for task in tasks.TASKS.values() for key in task.settings}
  assert {"verifier_question", "verifier_answers", "judge_question", "judge_answers"} <= set(owned)
  assert base_config().reward.judge_answers == "A,B"
  for key, task in owned.items():
    default = task.settings[key][0]
    assert getattr(RewardSpec(task.reward_types[0]), key) == default
    with pytest.raises(
      ValueError, match=rf"^reward.{key} applies to reward.type='{task.reward_types[0]}', not 'ranking'$"
    ):
      RewardSpec("ranking", **{key: default + "?"})
