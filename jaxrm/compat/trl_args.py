r"""The flags of TRL's reward script (``trl reward``, ``trl/scripts/reward.py``), run as they are.

  python -m jaxrm.train --trl_args --model_name_or_path Qwen/Qwen2-0.5B-Instruct \
      --dataset_name trl-lib/ultrafeedback_binarized --output_dir Qwen2-0.5B-Reward \
      --per_device_train_batch_size 8 --num_train_epochs 1 --learning_rate 1.0e-5 \
      --eval_strategy steps --eval_steps 50 --max_length 2048

The script reads four dataclasses: ``ScriptArguments``, ``RewardConfig`` (over transformers'
``TrainingArguments``), ``ModelConfig`` and ``DatasetMixtureConfig``. Their flags are declared
here with TRL's own defaults rather than parsed by TRL's ``TrlParser``: building a
``TrainingArguments`` needs PyTorch and accelerate, which a jaxrm install does not have, and
declaring each flag is also where jaxrm says what it does with it. Flags are written as
``HfArgumentParser`` takes them: ``--name value``, ``--name=value``, a bare ``--flag`` for True,
``--no_flag`` for False, dashes or underscores. A ``TrainingArguments`` flag that is not declared
here is ignored at its default value and refused at any other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Sequence
from typing import Any

from jaxrm import compat
from jaxrm.compat import Translation, refuse
from jaxrm.errors import ConfigError

_TRUE, _FALSE = ("true", "yes", "1", "t", "y"), ("false", "no", "0", "f", "n")
_LIST = "list"  # a flag taking one or more values (nargs="+")

# flag -> (type, TRL's default). RewardConfig's own defaults where it overrides TrainingArguments'
# (learning_rate 1e-4, logging_steps 10, gradient_checkpointing True, bf16 True unless fp16).
FLAGS: dict[str, tuple[Any, Any]] = {
  # ScriptArguments
  "dataset_name": (str, None),
  "dataset_config": (str, None),
  "dataset_train_split": (str, "train"),
  "dataset_test_split": (str, "test"),
  "dataset_streaming": (bool, False),
  "ignore_bias_buffers": (bool, False),
  # DatasetMixtureConfig
  "datasets": (_LIST, []),
  "streaming": (bool, False),
  "test_split_size": (float, None),
  # ModelConfig
  "model_name_or_path": (str, None),
  "model_revision": (str, "main"),
  "dtype": (str, "float32"),
  "attn_implementation": (str, None),
  "use_peft": (bool, False),
  "lora_r": (int, 16),
  "lora_alpha": (int, 32),
  "lora_dropout": (float, 0.05),
  "lora_target_modules": (_LIST, None),
  "lora_target_parameters": (_LIST, None),
  "lora_modules_to_save": (_LIST, None),
  "lora_task_type": (str, "CAUSAL_LM"),
  "use_rslora": (bool, False),
  "use_dora": (bool, False),
  "load_in_8bit": (bool, False),
  "load_in_4bit": (bool, False),
  "bnb_4bit_quant_type": (str, "nf4"),
  "use_bnb_nested_quant": (bool, False),
  "bnb_4bit_quant_storage": (str, None),
  "trust_remote_code": (bool, False),
  # RewardConfig's own
  "model_init_kwargs": (str, None),
  "chat_template_path": (str, None),
  "disable_dropout": (bool, True),
  "dataset_num_proc": (int, None),
  "eos_token": (str, None),
  "pad_token": (str, None),
  "max_length": (int, 1024),
  "pad_to_multiple_of": (str, "auto"),
  "center_rewards_coefficient": (float, None),
  "activation_offloading": (bool, False),
  # TrainingArguments that jaxrm reads
  "output_dir": (str, "trainer_output"),
  "overwrite_output_dir": (bool, False),  # transformers < 5
  "per_device_train_batch_size": (int, 8),
  "per_device_eval_batch_size": (int, 8),
  "gradient_accumulation_steps": (int, 1),
  "num_train_epochs": (float, 3.0),
  "max_steps": (int, -1),
  "learning_rate": (float, 1e-4),
  "lr_scheduler_type": (str, "linear"),
  "lr_scheduler_kwargs": (str, None),
  "warmup_steps": (float, 0.0),
  "warmup_ratio": (float, None),
  "weight_decay": (float, 0.0),
  "adam_beta1": (float, 0.9),
  "adam_beta2": (float, 0.999),
  "adam_epsilon": (float, 1e-8),
  "max_grad_norm": (float, 1.0),
  "optim": (str, "adamw_torch_fused"),
  "seed": (int, 42),
  "data_seed": (int, None),
  "eval_strategy": (str, "no"),
  "eval_steps": (float, None),
  "save_strategy": (str, "steps"),
  "save_steps": (float, 500.0),
  "save_total_limit": (int, None),
  "metric_for_best_model": (str, None),
  "greater_is_better": (bool, None),
  "load_best_model_at_end": (bool, False),
  "logging_steps": (float, 10.0),
  "bf16": (bool, None),
  "fp16": (bool, False),
  "gradient_checkpointing": (bool, True),
  "report_to": (_LIST, ["none"]),
  "run_name": (str, None),
  "push_to_hub": (bool, False),
  "dataloader_num_workers": (int, 0),
}

# Flags of TrainingArguments that change nothing jaxrm computes, whatever their value.
_HARMLESS = {
  "logging_dir": "TensorBoard files go to <output_dir>/tensorboard",
  "logging_strategy": "jaxrm logs every train.log_period steps",
  "logging_first_step": "logging only",
  "resume_from_checkpoint": "jaxrm resumes from output_dir's latest checkpoint by itself",
  "do_train": "always trains",
  "do_eval": "eval_strategy decides",
  "disable_tqdm": "display only",
  "tf32": "a GPU matmul mode",
  "torch_compile": "jaxrm compiles with XLA",
  "ddp_find_unused_parameters": "PyTorch DDP only",
  "ddp_backend": "PyTorch DDP only",
  "deepspeed": "memory placement only; jaxrm shards with its mesh",
  "fsdp": "memory placement only; jaxrm shards with its mesh",
  "fsdp_config": "see fsdp",
  "dataloader_pin_memory": "PyTorch loader only",
  "dataloader_persistent_workers": "PyTorch loader only",
  "dataloader_prefetch_factor": "PyTorch loader only",
  "remove_unused_columns": "jaxrm reads its own columns",
  "save_only_model": "jaxrm saves model and optimizer together",
  "gradient_checkpointing_kwargs": "see gradient_checkpointing",
  "local_rank": "jaxrm finds its processes itself",
  "hub_model_id": "no upload",
  "hub_strategy": "no upload",
  "hub_token": "no upload",
  "hub_private_repo": "no upload",
  "include_num_input_tokens_seen": "logging only",
  "log_level": "logging only",
  "save_safetensors": "jaxrm saves Orbax checkpoints; python -m jaxrm.export writes safetensors",
}


def parse(argv: Sequence[str]) -> dict[str, Any]:
  """The flags in ``argv`` as ``{name: value}`` (only those given; names with underscores).

  Raises:
    ConfigError: a token that is not a flag, a value of the wrong type, an unknown flag.
  """
  given, i = {}, 0
  argv = list(argv)
  while i < len(argv):
    token = argv[i]
    if not token.startswith("--") or token == "--":
      raise ConfigError(f"--trl_args: {token!r} is not a flag; TRL's flags are --name value")
    name, sep, inline = token[2:].partition("=")
    name = name.replace("-", "_")
    values = [inline] if sep else []
    i += 1
    while not sep and i < len(argv) and not argv[i].startswith("--"):
      values.append(argv[i])
      i += 1
    if name == "config":
      raise ConfigError("--trl_args --config: TRL's YAML recipes are not read; give their keys as flags")
    name, value = _typed(name, values)
    given[name] = value
  return given


def _typed(name: str, values: list[str]) -> tuple[str, Any]:
  """``(flag name, value)`` of one flag and the strings after it."""
  kind = _kind(name)
  if kind is None and name.startswith("no_") and _kind(name[3:]) is bool:
    if values:
      raise ConfigError(f"--{name} takes no value")
    return name[3:], False
  if kind is None:
    raise ConfigError(
      f"--{name}: not a flag of TRL's reward script (ScriptArguments, RewardConfig, "
      "ModelConfig, TrainingArguments)"
    )
  if kind is _LIST:
    if not values:
      raise ConfigError(f"--{name} needs one or more values")
    return name, [v for value in values for v in value.split(",") if v] if len(values) == 1 else values
  if kind is bool and not values:
    return name, True
  if len(values) != 1:
    raise ConfigError(f"--{name} takes one value; got {len(values)}: {' '.join(values) or '(none)'}")
  return name, _value(name, kind, values[0])


def is_flag(token: str) -> bool:
  """Whether ``token`` (``--name``, ``--name=value``, ``--no_name``) is a flag of TRL's reward
  script that this module declares (transformers' other ``TrainingArguments`` are not asked: that
  needs transformers imported)."""
  name = token[2:].partition("=")[0].replace("-", "_") if token.startswith("--") else ""
  declared = {**FLAGS, **dict.fromkeys(_HARMLESS, (str, None))}
  return name in declared or (name.startswith("no_") and declared.get(name[3:], (None,))[0] is bool)


def _kind(name: str):
  if name in FLAGS:
    return FLAGS[name][0]
  if name in _HARMLESS:  # some are flags of older transformers only
    return str
  field = _training_arguments().get(name)
  return None if field is None else str


def _value(name: str, kind, text: str) -> Any:
  if text.lower() in ("none", "null") and kind is not bool:
    return None
  if kind is bool:
    if text.lower() not in _TRUE + _FALSE:
      raise ConfigError(f"--{name}={text!r}: give true or false")
    return text.lower() in _TRUE
  try:
    return kind(text)
  except ValueError:
    raise ConfigError(f"--{name}={text!r}: expected {kind.__name__}") from None


def _training_arguments() -> dict[str, dataclasses.Field]:
  """transformers' ``TrainingArguments`` fields (reading them needs no PyTorch)."""
  from transformers import TrainingArguments

  return {f.name: f for f in dataclasses.fields(TrainingArguments)}


# ------------------------------------------------------------------ mapping


def translate(
  given: dict[str, Any], *, device_count: int, bf16_supported: bool = True, platform: str = "gpu"
) -> Translation:
  """Maps parsed flags (:func:`parse`) onto jaxrm's keys; ``device_count`` is TRL's world size.

  ``bf16_supported``: whether the run's devices (``platform``) compute in bfloat16
  (:func:`computes_bf16`): TRL's ``--bf16`` is on there unless given, and off elsewhere.

  Raises:
    ConfigError: a flag jaxrm cannot honour whose value would change the result, named.
  """
  if device_count < 1:
    raise ValueError(f"device_count={device_count}")
  args = {name: default for name, (_, default) in FLAGS.items()}
  args.update(given)
  bf16_default = args["bf16"] is None
  if bf16_default:
    args["bf16"] = not args["fp16"] and bf16_supported  # RewardConfig's rule, where bfloat16 runs
  tr = Translation("TRL")
  for name in given:
    if name not in FLAGS:
      _other_flag(name, given[name], tr)
  _model(args, tr)
  if bf16_default and not args["fp16"] and not bf16_supported:
    _say_bf16_is_off(tr, platform)
  _lora(args, tr)
  _evaluation(args, tr, device_count)
  _data(args, tr)
  _schedule(args, tr, device_count)
  _saving(args, tr)
  _logging(args, tr)
  _unsupported(args, tr)
  _quantized_without_peft(args)
  named = {token for key, _ in tr.fates for token in key.replace("/", " ").split()}
  for name in sorted(set(given) - {n.removeprefix("--") for n in named}):
    tr.ignore(f"--{name}", _QUIET.get(name, "at a value that changes nothing"))
  return tr


# Given flags that the mapping above read without naming them: why they change nothing.
_QUIET = {
  "ignore_bias_buffers": "PyTorch DDP only",
  "disable_dropout": "jaxrm's decoders have no dropout",
  "per_device_eval_batch_size": "no validation (--eval_strategy no)",
  "dataset_test_split": "no validation (--eval_strategy no)",
  "eval_steps": "no validation (--eval_strategy no)",
  "save_steps": "no checkpoints (--save_strategy no)",
  "save_total_limit": "no checkpoints (--save_strategy no)",
  "num_train_epochs": "--max_steps decides, as in transformers",
  "max_steps": "-1: the epochs decide",
  "greater_is_better": "no --metric_for_best_model",
  "bnb_4bit_quant_type": "no --load_in_4bit",
  "use_bnb_nested_quant": "no --load_in_4bit",
  "bnb_4bit_quant_storage": "storage of the 4-bit weights only",
  "model_revision": "main",
  "trust_remote_code": "false",
  "fp16": "false",
  "load_in_8bit": "false",
  "load_in_4bit": "false",
  "push_to_hub": "false",
}


def _say_bf16_is_off(tr: Translation, platform: str) -> None:
  at = next(i for i, (key, _) in enumerate(tr.fates) if key == "--bf16 / --dtype")
  key, fate = tr.fates[at]
  tr.fates[at] = (
    key,
    f"{fate} (--bf16 not given: TRL turns it on only where the hardware computes in bfloat16, "
    f"and these devices ({platform}) do not; --bf16 to use it anyway)",
  )


def computes_bf16(devices) -> bool:
  """Whether ``devices`` (JAX devices) compute in bfloat16, as TRL asks of the hardware before
  turning ``--bf16`` on by default: a TPU, or an NVIDIA GPU from Ampere on (compute capability 8),
  not a CPU."""
  device = devices[0]
  if device.platform == "tpu":
    return True
  if device.platform != "gpu":
    return False
  capability = getattr(device, "compute_capability", None)  # "8.0"; absent on ROCm
  try:
    return capability is None or float(capability) >= 8.0
  except ValueError:
    return True


def _quantized_without_peft(args: dict) -> None:
  for name in ("load_in_8bit", "load_in_4bit"):
    if args[name] and not args["use_peft"]:
      raise refuse(f"--{name}", True, "jaxrm quantizes only a LoRA run's frozen base: add --use_peft")


def _other_flag(name: str, value: Any, tr: Translation) -> None:
  if name in _HARMLESS:
    tr.ignore(f"--{name}", _HARMLESS[name])
    return
  field = _training_arguments().get(name)
  if field is None:
    raise refuse(f"--{name}", value, "not a flag of this transformers' TrainingArguments; remove it")
  default = field.default
  if value == default or str(value) == str(default) or _same_number(value, default):
    tr.ignore(f"--{name}", "at its default")
    return
  raise refuse(f"--{name}", value, "a TrainingArguments flag jaxrm does not honour; remove it")


def _same_number(text: Any, default: Any) -> bool:
  try:
    return not isinstance(default, bool) and float(text) == float(default)
  except (TypeError, ValueError):
    return False


def _model(args: dict, tr: Translation) -> None:
  if not args["model_name_or_path"]:
    raise ConfigError("--model_name_or_path is required (an HF model directory, .gguf file or hub name)")
  tr.set("--model_name_or_path", model__name_or_path=args["model_name_or_path"])
  tr.set("--output_dir", output_dir=args["output_dir"])
  if args["overwrite_output_dir"]:
    # transformers' "overwrite the content of the output directory": a run with other settings
    # starts afresh there (one with the same settings still resumes).
    tr.set("--overwrite_output_dir", changed_settings="start_fresh_remove_old")
  if args["fp16"]:
    raise refuse("--fp16", True, "jaxrm has no float16 loss scaling; use --bf16")
  param_dtype = {"float32": "float32", "bfloat16": "bfloat16"}.get(args["dtype"])
  if param_dtype is None:
    raise refuse("--dtype", args["dtype"], "jaxrm keeps the weights in float32 or bfloat16")
  # bf16 is mixed precision: the weights stay in --dtype, the compute in bfloat16.
  tr.set(
    "--bf16 / --dtype", model__dtype="bfloat16" if args["bf16"] else "float32", model__param_dtype=param_dtype
  )
  tr.set("--gradient_checkpointing", model__remat="full" if args["gradient_checkpointing"] else "elementwise")
  tr.set(
    "--seed --data_seed",
    train__seed=args["seed"],
    model__seed=args["seed"],
    data__shuffle_seed=args["seed"] if args["data_seed"] is None else args["data_seed"],
  )
  if args["model_revision"] != "main":
    raise refuse(
      "--model_revision",
      args["model_revision"],
      "jaxrm reads a hub model's main revision; download the revision and give its directory",
    )
  if args["trust_remote_code"]:
    raise refuse("--trust_remote_code", True, "jaxrm never runs a model's own code")
  if args["attn_implementation"] is not None:
    tr.ignore("--attn_implementation", "jaxrm picks its attention kernel (model.attention); the same result")
  tr.ignore("--disable_dropout", "jaxrm's decoders have no dropout (LoRA's is --lora_dropout)")


def _lora(args: dict, tr: Translation) -> None:
  if not args["use_peft"]:
    for name in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_task_type"):
      if FLAGS[name][1] != args[name]:
        tr.ignore(f"--{name}", "--use_peft is not given")
    return
  for name in ("use_rslora", "use_dora"):
    if args[name]:
      raise refuse(f"--{name}", True, "jaxrm's adapters are plain LoRA; remove it")
  for name in ("lora_target_parameters", "lora_modules_to_save"):
    if args[name]:
      raise refuse(
        f"--{name}",
        args[name],
        "jaxrm adapts modules by name (--lora_target_modules) and trains the reward head in full; remove it",
      )
  # peft's default targets for every decoder family jaxrm has (jaxrm/models/families).
  targets = ",".join(args["lora_target_modules"] or ["q_proj", "v_proj"])
  lora = {
    "rank": args["lora_r"],
    "alpha": float(args["lora_alpha"]),
    "dropout": args["lora_dropout"],
    "target_modules": targets,
    "base_dtype": _base_dtype(args),
  }
  tr.set(
    "--use_peft --lora_r --lora_alpha --lora_dropout --lora_target_modules --load_in_4bit --load_in_8bit "
    "--bnb_4bit_quant_type --use_bnb_nested_quant",
    model__lora=lora,
  )
  tr.ignore("--lora_task_type", f"{args['lora_task_type']}: the reward head trains in full, as with SEQ_CLS")


def _base_dtype(args: dict) -> str:
  if args["load_in_8bit"]:
    return "int8"
  if not args["load_in_4bit"]:
    return ""
  if args["bnb_4bit_quant_type"] != "nf4":
    raise refuse("--bnb_4bit_quant_type", args["bnb_4bit_quant_type"], "jaxrm's 4-bit base is nf4")
  if args["use_bnb_nested_quant"]:
    raise refuse("--use_bnb_nested_quant", True, "jaxrm does not quantize the nf4 scales; remove it")
  return "nf4"


def _data(args: dict, tr: Translation) -> None:
  if args["datasets"]:
    raise refuse("--datasets", args["datasets"], "jaxrm reads one dataset: give --dataset_name")
  name = args["dataset_name"]
  if not name:
    raise ConfigError(
      "--dataset_name is required (a hub dataset, a save_to_disk directory, a directory of "
      "<split>.jsonl files, or a file)"
    )
  if args["dataset_config"] is not None:
    raise refuse(
      "--dataset_config",
      args["dataset_config"],
      "jaxrm reads a hub dataset's default "
      "configuration; save the one you want with save_to_disk and give its directory",
    )
  train = _split_path(name, args["dataset_train_split"], "--dataset_train_split", "train")
  tr.set(
    "--dataset_name --dataset_train_split",
    data__dataset_name="PreferenceDataset",
    data__train_data_path=train,
  )
  if args["eval_strategy"] != "no":
    val = _split_path(name, args["dataset_test_split"], "--dataset_test_split", "validation")
    tr.set("--dataset_test_split", data__val_data_paths={"default": val})
  if args["max_length"] is None:
    raise refuse("--max_length", None, "jaxrm needs a length to bucket and compile for; give one")
  # TRL drops a pair whose chosen or rejected sequence is longer than max_length.
  tr.set("--max_length", data__max_length=args["max_length"], data__truncation="drop")
  if args["dataset_num_proc"] is not None:
    tr.set("--dataset_num_proc", data__num_proc=args["dataset_num_proc"])
  tr.set("--dataloader_num_workers", data__num_workers=args["dataloader_num_workers"])
  tr.set(
    "--center_rewards_coefficient",
    reward__center_rewards_coefficient=args["center_rewards_coefficient"] or 0.0,
  )
  for flag in ("dataset_streaming", "streaming"):
    if args[flag]:
      tr.ignore(f"--{flag}", "jaxrm reads rows as they are asked for; the same rows")


def _split_path(name: str, split: str, flag: str, jaxrm_split: str) -> str:
  """Where ``split`` of ``--dataset_name`` is, as jaxrm reads it.

  A directory of ``<split>.jsonl`` (``.json``, ``.parquet``, ``.csv``) files holds its splits by
  file name, as ``datasets.load_dataset`` reads it; a saved or hub dataset is read at the split
  jaxrm reads (``train``, ``validation``); a single file is ``load_dataset``'s ``train`` split.
  """
  from jaxrm.data.sources import FILE_SUFFIXES

  path = os.path.expanduser(name)
  if os.path.isdir(path):
    for suffix in FILE_SUFFIXES:
      if os.path.isfile(os.path.join(path, split + suffix)):
        return os.path.join(path, split + suffix)
    there = _splits_in(path, FILE_SUFFIXES)
    if there and split not in there:
      raise refuse(flag, split, f"{name} has no {split!r} split; its splits are {', '.join(there)}")
  if os.path.isfile(path):
    if split != "train":
      raise refuse(
        flag,
        split,
        f"{name} is one file, which datasets reads as a 'train' split only; give a "
        f"directory holding train.jsonl and {split}.jsonl",
      )
    return name
  if split != jaxrm_split:
    raise refuse(
      flag,
      split,
      f"jaxrm reads the {jaxrm_split!r} split of a saved or hub dataset; use "
      f"{flag} {jaxrm_split}, or a directory of <split>.jsonl files",
    )
  return name


def _splits_in(path: str, suffixes: Sequence[str]) -> list[str]:
  """The splits of a directory: those a saved ``DatasetDict`` lists (``dataset_dict.json``), else
  its ``<split>.<suffix>`` files' names."""
  saved = os.path.join(path, "dataset_dict.json")
  if os.path.isfile(saved):
    with contextlib.suppress(OSError, ValueError, TypeError):
      with open(saved) as f:
        return sorted(map(str, json.load(f)["splits"]))
  return sorted(
    {f[: -len(x)] for f in os.listdir(path) for x in suffixes if f.endswith(x) and len(f) > len(x)}
  )


def _schedule(args: dict, tr: Translation, device_count: int) -> None:
  per_device, accum = args["per_device_train_batch_size"], args["gradient_accumulation_steps"]
  tr.set(
    "--per_device_train_batch_size x devices x --gradient_accumulation_steps",
    train__global_batch_size=per_device * device_count * accum,
    train__micro_batch_size=per_device,
  )
  epochs, max_steps = args["num_train_epochs"], args["max_steps"]
  if max_steps > 0:  # transformers: max_steps overrides num_train_epochs
    tr.set("--max_steps", train__max_steps=max_steps, train__max_epochs=compat.UNTIL_EPOCHS)
  else:
    if epochs != int(epochs) or epochs < 1:
      raise refuse("--num_train_epochs", epochs, "jaxrm trains whole epochs; give an integer, or --max_steps")
    tr.set("--num_train_epochs", train__max_epochs=int(epochs), train__max_steps=compat.UNTIL_EPOCHS)
  tr.set("--learning_rate", train__learning_rate=args["learning_rate"])
  _scheduler(args, tr)
  tr.set("--warmup_steps / --warmup_ratio", train__warmup_steps=_steps(args, "warmup"))
  tr.set("--weight_decay", train__weight_decay=args["weight_decay"])
  tr.set(
    "--adam_beta1 --adam_beta2 --adam_epsilon",
    train__adam_beta1=args["adam_beta1"],
    train__adam_beta2=args["adam_beta2"],
    train__adam_epsilon=args["adam_epsilon"],
  )
  tr.set("--max_grad_norm", train__max_grad_norm=args["max_grad_norm"])
  if not args["optim"].startswith("adamw_"):
    raise refuse("--optim", args["optim"], "jaxrm trains with AdamW; use adamw_torch")
  tr.ignore("--optim", f"{args['optim']}: AdamW")


def _scheduler(args: dict, tr: Translation) -> None:
  kwargs = _dict_flag("--lr_scheduler_kwargs", args["lr_scheduler_kwargs"])
  min_lr_rate = kwargs.pop("min_lr_rate", None)
  if kwargs:
    raise refuse("--lr_scheduler_kwargs", kwargs, "jaxrm reads only min_lr_rate (cosine_with_min_lr)")
  keys = {"train__lr_scheduler": args["lr_scheduler_type"]}
  if min_lr_rate is not None:
    keys["train__min_lr_ratio"] = float(min_lr_rate)
  tr.set("--lr_scheduler_type --lr_scheduler_kwargs", **keys)


def _dict_flag(flag: str, value: str | None) -> dict:
  if not value:
    return {}
  import json

  try:
    parsed = json.loads(value)
  except json.JSONDecodeError:
    raise refuse(flag, value, "give a JSON object, e.g. '{\"min_lr_rate\": 0.1}'") from None
  if not isinstance(parsed, dict):
    raise refuse(flag, value, "give a JSON object")
  return parsed


def _steps(args: dict, what: str) -> int:
  """A step count that TrainingArguments lets be a fraction (< 1) of the run's steps."""
  flag = {
    "warmup": "--warmup_steps",
    "eval": "--eval_steps",
    "save": "--save_steps",
    "logging": "--logging_steps",
  }[what]
  value = args[flag[2:]]
  if what == "warmup" and args["warmup_ratio"] is not None:
    flag, value = "--warmup_ratio", args["warmup_ratio"]
    if value >= 1:
      raise refuse(flag, value, "a fraction of the run's steps, below 1")
  if value >= 1 or value == 0:
    if value != int(value):
      raise refuse(flag, value, "give a whole number of steps (or a fraction below 1)")
    return int(value)
  if args["max_steps"] <= 0:
    raise refuse(
      flag,
      value,
      "a fraction of the run's steps, which jaxrm knows only once the data is read; "
      "give a number of steps, or --max_steps",
    )
  return math.ceil(value * args["max_steps"])  # transformers rounds up


def _evaluation(args: dict, tr: Translation, device_count: int) -> None:
  strategy = args["eval_strategy"]
  if strategy == "no":
    tr.set(
      "--eval_strategy",
      data__val_data_paths={},
      eval__val_period=0,
      eval__val_at_end=False,
      checkpointing__metric_name="",
    )
    return
  if strategy != "steps":
    raise refuse(
      "--eval_strategy", strategy, "jaxrm validates every N steps: use --eval_strategy steps --eval_steps N"
    )
  if args["eval_steps"] is None:
    args["eval_steps"] = args["logging_steps"]  # transformers' rule
  # transformers evaluates every eval_steps steps, not after the last one.
  tr.set("--eval_strategy --eval_steps", eval__val_period=_steps(args, "eval"), eval__val_at_end=False)
  tr.set(
    "--per_device_eval_batch_size x devices",
    eval__batch_size=args["per_device_eval_batch_size"] * device_count,
  )


def _saving(args: dict, tr: Translation) -> None:
  strategy = args["save_strategy"]
  if strategy == "no":
    tr.set("--save_strategy", checkpointing__enabled=False)
    return
  if strategy != "steps":
    raise refuse(
      "--save_strategy", strategy, "jaxrm saves every N steps: use --save_strategy steps --save_steps N"
    )
  keep = args["save_total_limit"]
  tr.set("--save_strategy --save_steps", checkpointing__save_period=_steps(args, "save"))
  tr.set("--save_total_limit", checkpointing__keep_top_k=keep if keep else compat.UNTIL_EPOCHS)
  metric = args["metric_for_best_model"]
  if metric is None and args["load_best_model_at_end"]:
    metric = "loss"  # transformers' default metric for the best model
  if metric is None:
    if args["eval_strategy"] != "no":
      tr.set(
        "--metric_for_best_model", checkpointing__metric_name=""
      )  # the latest are kept, as transformers does
    return
  name = metric.removeprefix("eval_")
  if name not in ("loss", "accuracy"):
    raise refuse("--metric_for_best_model", metric, "jaxrm ranks checkpoints by validation loss or accuracy")
  higher = args["greater_is_better"] if args["greater_is_better"] is not None else name != "loss"
  tr.set(
    "--metric_for_best_model --greater_is_better",
    checkpointing__metric_name=f"validation-default_{name}",
    checkpointing__higher_is_better=higher,
  )
  if args["load_best_model_at_end"]:
    tr.ignore(
      "--load_best_model_at_end", "the best checkpoint is kept; export it with python -m jaxrm.export"
    )


def _logging(args: dict, tr: Translation) -> None:
  tr.set("--logging_steps", train__log_period=_steps(args, "logging"))
  report_to = [r for r in args["report_to"] if r != "none"]
  if "all" in report_to:
    report_to = ["tensorboard", "wandb", "mlflow"]
  unknown = sorted(set(report_to) - {"tensorboard", "wandb", "mlflow"})
  if unknown:
    tr.ignore(f"--report_to {' '.join(unknown)}", "jaxrm logs to tensorboard, wandb and mlflow only")
  run_name = args["run_name"] or ""
  tr.set(
    "--report_to --run_name",
    logger__tensorboard="tensorboard" in report_to,
    logger__wandb_enabled="wandb" in report_to,
    logger__mlflow_enabled="mlflow" in report_to,
    logger__wandb={"project": os.environ.get("WANDB_PROJECT", "huggingface"), "name": run_name},
    logger__mlflow={
      "experiment_name": os.environ.get("MLFLOW_EXPERIMENT_NAME", "Default"),
      "run_name": run_name,
      "tracking_uri": os.environ.get("MLFLOW_TRACKING_URI", ""),
    },
  )


def _unsupported(args: dict, tr: Translation) -> None:
  """RewardConfig's flags that would change the run when set, and that jaxrm has no key for."""
  if args["chat_template_path"] is not None:
    tr.set("--chat_template_path", model__chat_template=_chat_template(args["chat_template_path"]))
    tr.fates[-1] = ("--chat_template_path", f"model.chat_template (read from {args['chat_template_path']})")
  why = {
    "model_init_kwargs": "jaxrm loads the model with its own settings",
    "eos_token": "jaxrm uses the tokenizer's own eos token",
    "pad_token": "jaxrm uses the tokenizer's own pad token",
    "test_split_size": "jaxrm does not split a dataset; give a test split",
  }
  for name, reason in why.items():
    if args[name] is not None:
      raise refuse(f"--{name}", args[name], f"{reason}; remove it")
  if args["push_to_hub"]:
    raise refuse(
      "--push_to_hub", True, "jaxrm does not upload; export with python -m jaxrm.export and upload that"
    )
  tr.ignore("--pad_to_multiple_of", "padding only (jaxrm pads to data.bucket_multiple)")
  if args["activation_offloading"]:
    tr.ignore("--activation_offloading", "memory placement only")


def _chat_template(path: str) -> str:
  """The template ``--chat_template_path`` names, as TRL reads it: a Jinja file, or a tokenizer
  directory's ``chat_template.jinja`` or ``tokenizer_config.json`` template."""
  import json

  if os.path.isdir(path):
    jinja, config = os.path.join(path, "chat_template.jinja"), os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(jinja):
      path = jinja
    elif os.path.isfile(config):
      with open(config) as f:
        template = json.load(f).get("chat_template")
      if isinstance(template, str) and template:
        return template
      raise refuse("--chat_template_path", path, "its tokenizer_config.json has no chat_template")
    else:
      raise refuse(
        "--chat_template_path",
        path,
        "the directory has neither chat_template.jinja nor "
        "tokenizer_config.json (a hub name cannot be read offline: pass a local file or directory)",
      )
  if not os.path.isfile(path):
    raise refuse(
      "--chat_template_path",
      path,
      "no such file or directory (a Jinja template file, or a tokenizer directory holding one)",
    )
  with open(path) as f:
    return f.read()
