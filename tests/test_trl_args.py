"""``python -m jaxrm.train --trl_args ...``: the flags of TRL's reward script, read as TRL reads them."""

import dataclasses
import json
import os
import sys

import jax
import pytest
import tiny_run

from jaxrm import compat
from jaxrm.compat import trl_args
from jaxrm.data import demo
from jaxrm.errors import ConfigError

# TRL's documented reward-script commands (docs: "trl reward"; trl/scripts/reward.py), the model
# and the dataset left to each test.
DOCUMENTED = [
  "--output_dir",
  "Qwen2-0.5B-Reward",
  "--per_device_train_batch_size",
  "8",
  "--num_train_epochs",
  "1",
  "--learning_rate",
  "1.0e-5",
  "--eval_strategy",
  "steps",
  "--eval_steps",
  "50",
  "--max_length",
  "2048",
]
DOCUMENTED_LORA = ["--use_peft", "--lora_r", "32", "--lora_alpha", "16"]
MODEL_AND_DATA = ["--model_name_or_path", "/models/qwen", "--dataset_name", "trl-lib/ultrafeedback_binarized"]


def translate(*flags, device_count=1, **hardware):
  return trl_args.translate(trl_args.parse(list(flags)), device_count=device_count, **hardware)


def test_flags_match_trl_dataclasses():
  trl = pytest.importorskip("trl")
  fields = {}
  for cls in (trl.ScriptArguments, trl.RewardConfig, trl.ModelConfig, trl.DatasetMixtureConfig):
    fields.update({f.name: f for f in dataclasses.fields(cls)})
  # Defaults TRL sets after construction, or in a form a command line cannot give.
  derived = {
    "bf16": None,
    "report_to": ["none"],
    "model_init_kwargs": None,
    "lr_scheduler_kwargs": None,
    "output_dir": "trainer_output",
  }  # transformers: None is "trainer_output"
  # transformers 5 folded warmup_ratio into warmup_steps < 1 and dropped overwrite_output_dir; older
  # TRL commands still give them.
  older = {"warmup_ratio", "overwrite_output_dir"}
  for name, (_, default) in trl_args.FLAGS.items():
    if name in older:
      continue
    assert name in fields, f"--{name} is no flag of TRL's reward script"
    field = fields[name]
    theirs = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    assert default == derived.get(name, theirs), name


def test_documented_command(tmp_path):
  data = write_splits(tmp_path / "data")
  tr = translate(
    "--model_name_or_path", "/models/qwen", "--dataset_name", data, *DOCUMENTED, *DOCUMENTED_LORA
  )
  reported = {token for key, _ in tr.fates for token in key.replace("/", " ").split()}
  assert {
    f for f in DOCUMENTED + DOCUMENTED_LORA if f.startswith("--")
  } <= reported  # each flag's fate is printed
  run = translate("--model_name_or_path", "/models/qwen", "--dataset_name", data, *DOCUMENTED).run_config()
  assert (run.model.name_or_path, run.output_dir) == ("/models/qwen", "Qwen2-0.5B-Reward")
  assert (run.train.global_batch_size, run.train.micro_batch_size) == (8, 8)
  assert (run.train.max_epochs, run.train.max_steps) == (1, compat.UNTIL_EPOCHS)
  assert (run.train.learning_rate, run.train.lr_scheduler, run.train.warmup_steps) == (1e-5, "linear", 0)
  assert (run.train.weight_decay, run.train.adam_beta2, run.train.adam_epsilon) == (0.0, 0.999, 1e-8)
  assert (run.eval.val_period, run.eval.val_at_end, run.eval.batch_size) == (50, False, 8)
  assert run.data.train_data_path == os.path.join(data, "train.jsonl")
  assert run.data.val_data_paths == {"default": os.path.join(data, "test.jsonl")}  # --dataset_test_split test
  assert (run.data.max_length, run.data.truncation) == (2048, "drop")  # TRL filters longer pairs out
  # RewardConfig's defaults: bf16 mixed precision, gradient checkpointing, logging every 10 steps
  assert (run.model.dtype, run.model.param_dtype, run.model.remat) == ("bfloat16", "float32", "full")
  assert (run.train.log_period, run.train.seed, run.checkpointing.save_period) == (10, 42, 500)
  assert run.model.lora.rank == 0
  assert (run.logger.wandb_enabled, run.logger.mlflow_enabled, run.logger.tensorboard) == (
    False,
    False,
    False,
  )


@pytest.mark.parametrize("per_device,accum,devices", [(8, 1, 1), (4, 2, 1), (2, 4, 8), (3, 5, 2)])
def test_global_batch_is_trls_arithmetic(per_device, accum, devices):
  run = translate(
    *MODEL_AND_DATA,
    "--per_device_train_batch_size",
    str(per_device),
    "--gradient_accumulation_steps",
    str(accum),
    "--per_device_eval_batch_size",
    "4",
    "--eval_strategy",
    "steps",
    "--dataset_test_split",
    "validation",
    device_count=devices,
  ).run_config()
  # TRL: per_device_train_batch_size x world size x gradient_accumulation_steps
  assert run.train.global_batch_size == per_device * devices * accum
  assert run.train.micro_batch_size == per_device
  assert run.eval.batch_size == 4 * devices


def test_lora_flags():
  lora = translate(*MODEL_AND_DATA, *DOCUMENTED_LORA).run_config().model.lora
  assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (32, 16.0, 0.05, "q_proj,v_proj")
  lora = (
    translate(
      *MODEL_AND_DATA,
      "--use_peft",
      "--lora_target_modules",
      "q_proj",
      "k_proj",
      "--load_in_4bit",
      "--lora_dropout=0.0",
    )
    .run_config()
    .model.lora
  )
  assert (lora.target_modules, lora.base_dtype, lora.dropout) == ("q_proj,k_proj", "nf4", 0.0)


def test_flag_spellings():
  given = trl_args.parse(
    [
      "--per-device-train-batch-size=4",
      "--no_gradient_checkpointing",
      "--bf16",
      "false",
      "--report_to",
      "wandb",
      "mlflow",
      "--use_peft",
      "--eval_steps",
      "0.25",
    ]
  )
  assert given == {
    "per_device_train_batch_size": 4,
    "gradient_checkpointing": False,
    "bf16": False,
    "report_to": ["wandb", "mlflow"],
    "use_peft": True,
    "eval_steps": 0.25,
  }


def test_report_to_and_fractions():
  run = translate(
    *MODEL_AND_DATA,
    "--report_to",
    "wandb",
    "mlflow",
    "--run_name",
    "rm1",
    "--max_steps",
    "200",
    "--warmup_ratio",
    "0.1",
    "--eval_strategy",
    "steps",
    "--eval_steps",
    "0.25",
    "--dataset_test_split",
    "validation",
    "--save_steps",
    "50",
    "--save_total_limit",
    "2",
    "--metric_for_best_model",
    "eval_accuracy",
  ).run_config()
  assert (run.checkpointing.save_period, run.checkpointing.keep_top_k) == (50, 2)
  assert (run.checkpointing.metric_name, run.checkpointing.higher_is_better) == (
    "validation-default_accuracy",
    True,
  )
  assert (run.logger.wandb_enabled, run.logger.mlflow_enabled, run.logger.tensorboard) == (True, True, False)
  assert (run.logger.wandb.name, run.logger.mlflow.run_name) == ("rm1", "rm1")
  assert (run.train.max_steps, run.train.warmup_steps, run.eval.val_period) == (200, 20, 50)


@pytest.mark.parametrize(
  "flags,message",
  [
    (["--fp16"], "--fp16=True: jaxrm has no float16 loss scaling; use --bf16"),
    (["--use_peft", "--use_dora"], "--use_dora=True: jaxrm's adapters are plain LoRA"),
    (["--eval_strategy", "epoch"], "--eval_strategy='epoch': jaxrm validates every N steps"),
    (["--trust_remote_code"], "--trust_remote_code=True: jaxrm never runs a model's own code"),
    (
      ["--label_smoothing_factor", "0.1"],
      "--label_smoothing_factor='0.1': a TrainingArguments flag jaxrm does not honour; remove it",
    ),
    (
      ["--warmup_ratio", "0.1"],
      "--warmup_ratio=0.1: a fraction of the run's steps, which jaxrm knows only once",
    ),
    (
      ["--eval_strategy", "steps"],
      "--dataset_test_split='test': jaxrm reads the 'validation' split of a saved or hub dataset",
    ),
    (["--num_train_epochs", "1.5"], "--num_train_epochs=1.5: jaxrm trains whole epochs"),
    (["--max_lenght", "512"], "--max_lenght: not a flag of TRL's reward script"),
  ],
)
def test_refused_flags_are_named(flags, message):
  with pytest.raises(ConfigError) as e:
    translate(*MODEL_AND_DATA, *flags)
  assert str(e.value).startswith(message), str(e.value)


def test_chat_template_path_sets_the_template(tmp_path):
  template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
  (tmp_path / "t.jinja").write_text(template)
  assert (
    translate(*MODEL_AND_DATA, "--chat_template_path", str(tmp_path / "t.jinja"))
    .run_config()
    .model.chat_template
    == template
  )
  tokenizer_dir = tmp_path / "tok"
  tokenizer_dir.mkdir()
  (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
  assert (
    translate(*MODEL_AND_DATA, "--chat_template_path", str(tokenizer_dir)).run_config().model.chat_template
    == template
  )
  with pytest.raises(ConfigError, match=r"^--chat_template_path='Qwen/x': no such file or directory"):
    translate(*MODEL_AND_DATA, "--chat_template_path", "Qwen/x")


def test_ignored_flags_are_reported():
  fates = dict(
    translate(
      *MODEL_AND_DATA,
      "--label_smoothing_factor",
      "0",
      "--logging_dir",
      "logs",
      "--attn_implementation",
      "flash_attention_2",
      "--ignore_bias_buffers",
    ).fates
  )
  assert fates["--label_smoothing_factor"] == "ignored: at its default"
  assert fates["--logging_dir"].startswith("ignored: TensorBoard files go to")
  assert fates["--attn_implementation"].startswith("ignored: jaxrm picks its attention kernel")
  assert fates["--ignore_bias_buffers"] == "ignored: PyTorch DDP only"


def write_splits(directory, n_train=16, n_test=8):
  """A directory of train.jsonl and test.jsonl in TRL's conversational preference layout (implicit
  prompt), as ``datasets.load_dataset(directory)`` reads it."""
  os.makedirs(directory, exist_ok=True)
  for split, n, demo_split in (("train", n_train, "train"), ("test", n_test, "validation")):
    with open(os.path.join(directory, f"{split}.jsonl"), "w") as f:
      for row in demo.demo_arithmetic(demo_split, num_rows=n):
        ranked = sorted(row["completions"], key=lambda c: c["rank"])
        chosen, rejected = (row["context"] + c["completion"] for c in ranked[:2])
        f.write(json.dumps({"chosen": chosen, "rejected": rejected}) + "\n")
  return str(directory)


def test_a_directory_of_split_files(tmp_path):
  data = write_splits(tmp_path / "data")
  run = translate(
    "--model_name_or_path", "/m", "--dataset_name", data, "--eval_strategy", "steps"
  ).run_config()
  assert run.data.train_data_path == os.path.join(data, "train.jsonl")
  assert run.data.val_data_paths == {"default": os.path.join(data, "test.jsonl")}


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_documented_command_runs_on_the_tiny_model(model_dir, tmp_path, lora):
  data = write_splits(tmp_path / "data")
  out = str(tmp_path / "Qwen2-0.5B-Reward")
  flags = [a if a != "Qwen2-0.5B-Reward" else out for a in DOCUMENTED] + (DOCUMENTED_LORA if lora else [])
  # 16 pairs, batches of 8: 2 steps; an evaluation every 2 steps (the documented 50 would be never)
  flags = [a if a != "50" else "2" for a in flags]
  result = tiny_run.run(
    [
      sys.executable,
      "-m",
      "jaxrm.train",
      "--trl_args",
      "--model_name_or_path",
      model_dir,
      "--dataset_name",
      data,
      *flags,
    ],
    timeout=600,
    HOME=str(tmp_path),
  )
  assert result.returncode == 0, tiny_run.describe(result)
  assert (
    "(--bf16 not given: TRL turns it on only where the hardware computes in bfloat16, and these devices (cpu) do not"
    in (result.stdout)
  )  # a CPU run stays in float32, as TRL's would
  assert (
    "--per_device_train_batch_size x devices x --gradient_accumulation_steps  -> "
    "train.global_batch_size=8, train.micro_batch_size=8" in result.stdout
  )
  rows = tiny_run.read_metrics(out)
  assert [r["step"] for r in rows if "validation-default_loss" in r] == [2]
  saved = json.loads(open(os.path.join(out, "config.json")).read())
  assert saved["train"]["learning_rate"] == 1e-5 and saved["data"]["max_length"] == 2048
  if lora:
    assert (saved["model"]["lora"]["rank"], saved["model"]["lora"]["alpha"]) == (32, 16.0)
    assert "LoRA rank 32 (alpha 16, dropout 0.05) on q_proj, v_proj" in result.stdout
    import numpy as np
    from flax import nnx

    from jaxrm import RewardModel

    rm = RewardModel.from_pretrained(out)
    lora_b = [
      np.asarray(v)
      for path, v in nnx.to_flat_state(nnx.state(rm.model))
      if "lora_b" in "/".join(map(str, path))
    ]
    assert lora_b and any(np.abs(b).max() > 0 for b in lora_b)  # B starts at 0: the adapters trained


def test_bf16_is_on_by_default_only_where_the_hardware_computes_in_it():
  """TRL turns --bf16 on unless told, where the hardware supports bfloat16; a CPU run stays in
  float32 and the start line says why."""
  on_gpu = translate(*MODEL_AND_DATA)
  assert on_gpu.run_config().model.dtype == "bfloat16"
  on_cpu = translate(*MODEL_AND_DATA, bf16_supported=False, platform="cpu")
  assert (on_cpu.run_config().model.dtype, on_cpu.run_config().model.param_dtype) == ("float32", "float32")
  assert dict(on_cpu.fates)["--bf16 / --dtype"] == (
    "model.dtype='float32', model.param_dtype='float32' (--bf16 not given: TRL turns it on only "
    "where the hardware computes in bfloat16, and these devices (cpu) do not; --bf16 to use it anyway)"
  )
  assert "(cpu) do not; --bf16 to use it anyway)" in on_cpu.table()
  asked = translate(*MODEL_AND_DATA, "--bf16", bf16_supported=False, platform="cpu")
  assert asked.run_config().model.dtype == "bfloat16"
  assert not trl_args.computes_bf16(jax.devices("cpu"))


def test_trl_flags_without_trl_args_say_where_they_go():
  result = tiny_run.run([sys.executable, "-m", "jaxrm.train", "--model_name_or_path", "Qwen/Qwen2-0.5B"])
  assert result.returncode == 2, tiny_run.describe(result)
  assert result.stderr.strip() == (
    "error: --model_name_or_path is a flag of TRL's reward script: give TRL's flags after --trl_args, "
    "e.g. python -m jaxrm.train --trl_args --model_name_or_path ... (jaxrm's own keys are "
    "--config.<section>.<key>, with --config=configs/rm.py)"
  )


@pytest.mark.parametrize("flag", ["--dataset_test_split", "--dataset_train_split"])
def test_a_missing_split_is_named_with_the_splits_there_are(tmp_path, flag):
  data = write_splits(tmp_path / "data")
  with pytest.raises(ConfigError) as e:
    translate("--model_name_or_path", "/m", "--dataset_name", data, "--eval_strategy", "steps", flag, "eval")
  assert str(e.value) == f"{flag}='eval': {data} has no 'eval' split; its splits are test, train"


def test_overwrite_output_dir_starts_afresh_where_settings_changed():
  assert translate(*MODEL_AND_DATA).run_config().changed_settings == "refuse"
  config = translate(*MODEL_AND_DATA, "--overwrite_output_dir").run_config()
  assert config.changed_settings == "start_fresh_remove_old"
  assert (
    translate(*MODEL_AND_DATA, "--overwrite_output_dir", "false").run_config().changed_settings == "refuse"
  )
