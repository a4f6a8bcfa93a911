"""``python -m jaxrm.train --nemo_config=rm.yaml``: NeMo RL's RM recipe read as NeMo RL reads it.

tests/data/nemo_rm.yaml holds every key of NeMo RL's shipped examples/configs/rm.yaml.
"""

import json
import os
import sys

import pytest
import tiny_run
from omegaconf import OmegaConf

from jaxrm import compat
from jaxrm.compat import nemo
from jaxrm.data import demo
from jaxrm.errors import ConfigError, DataError

YAML = os.path.join(tiny_run.ROOT, "tests", "data", "nemo_rm.yaml")


def leaves(tree, prefix=""):
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      yield from leaves(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}"


def translate(*overrides, path=YAML, device_count=1):
  return nemo.translate(nemo.load(path, list(overrides)), device_count=device_count)


def test_every_key_is_mapped_or_reported():
  config = nemo.load(YAML)
  tr = nemo.translate(config, device_count=1)
  reported = [key for key, _ in tr.fates]
  for leaf in leaves(config):
    assert any(leaf == k or leaf.startswith(k + ".") for k in reported), (
      f"{leaf} is neither mapped nor reported"
    )
  fates = dict(tr.fates)
  assert fates["policy.megatron_cfg"].startswith("ignored: enabled is false")
  assert fates["policy.optimizer.kwargs.foreach"].startswith("ignored:")
  run = tr.run_config()
  assert (run.train.max_steps, run.train.max_epochs) == (
    compat.UNTIL_EPOCHS,
    1,
  )  # max_num_steps -1: epochs decide
  assert run.eval.val_batches == 0  # val_batches -1: all
  assert (run.model.dtype, run.model.param_dtype, run.model.remat) == ("bfloat16", "float32", "elementwise")
  assert (run.mesh.tensor, run.data.packing) == (1, "none")
  assert (run.train.learning_rate, run.train.weight_decay) == (2e-6, 0.1)
  assert (run.train.adam_beta1, run.train.adam_beta2, run.train.adam_epsilon) == (0.9, 0.98, 1e-5)
  assert (run.train.lr_scheduler, run.train.warmup_steps) == ("constant", 0)  # NeMo RL's RM has no scheduler
  assert (run.train.global_batch_size, run.train.micro_batch_size, run.data.max_length) == (128, 1, 8192)
  assert (run.output_dir, run.checkpointing.save_period, run.checkpointing.keep_top_k) == (
    "results/rm",
    16,
    3,
  )
  assert (run.logger.wandb_enabled, run.logger.wandb.project, run.logger.wandb.name) == (
    True,
    "rm-dev",
    "rm-dev-HelpSteer3",
  )
  assert (run.logger.monitor_gpus, run.logger.mlflow.experiment_name) == (True, "rm-dev")


def test_interpolations_and_overrides_resolve_as_omegaconf_does():
  overrides = [
    "policy.model_name=/models/tiny",
    "rm.val_period=4",
    "policy.dtensor_cfg.tensor_parallel_size=2",
    "data.dataset_name=PreferenceDataset",
    "+data.val_data_paths.held_out=/data/v.jsonl",
    "checkpointing.metric_name=val:validation-held_out_loss",
  ]
  ours = nemo.load(YAML, overrides)
  theirs = OmegaConf.to_container(
    OmegaConf.merge(OmegaConf.load(YAML), OmegaConf.from_dotlist([o.lstrip("+") for o in overrides])),
    resolve=True,
  )
  assert ours == theirs
  assert ours["policy"]["tokenizer"]["name"] == "/models/tiny"
  assert ours["checkpointing"]["save_period"] == 4
  assert ours["policy"]["make_sequence_length_divisible_by"] == 2
  assert ours["logger"]["wandb"]["name"] == "rm-dev-PreferenceDataset"
  run = translate(*overrides, "cluster.gpus_per_node=2", device_count=2).run_config()
  assert (run.model.name_or_path, run.mesh.tensor, run.eval.val_period) == ("/models/tiny", 2, 4)
  assert run.data.val_data_paths == {"held_out": "/data/v.jsonl"}


def test_defaults_file_underneath(tmp_path):
  recipe = tmp_path / "recipe.yaml"
  recipe.write_text(f"defaults: {YAML}\nrm:\n  val_period: 8\npolicy:\n  model_name: /models/x\n")
  config = nemo.load(str(recipe))
  assert config["checkpointing"]["save_period"] == 8  # ${rm.val_period} resolved after the merge
  assert config["policy"]["tokenizer"]["name"] == "/models/x"
  assert config["policy"]["precision"] == "bfloat16"


@pytest.mark.parametrize(
  "override,message",
  [
    (
      "policy.megatron_cfg.enabled=true",
      "policy.megatron_cfg.enabled=True: jaxrm has no Megatron backend; set it to false",
    ),
    (
      "policy.reward_model_cfg.reward_model_type=gaussian",
      "policy.reward_model_cfg.reward_model_type='gaussian': "
      "jaxrm has reward model types bradley_terry, ranking, ",
    ),
    (
      "policy.dtensor_cfg.context_parallel_size=0",
      "policy.dtensor_cfg.context_parallel_size=0: use a positive integer",
    ),
    ("policy.precision=float16", "policy.precision='float16': jaxrm trains in bfloat16 or float32"),
    ("data.shuffle=false", "data.shuffle=False: jaxrm always shuffles"),
    (
      "+policy.optimizer.kwargs.nesterov=true",
      "policy.optimizer.kwargs.nesterov: not a key of NeMo RL's RM config that jaxrm knows",
    ),
    (
      "cluster.gpus_per_node=8",
      "cluster.gpus_per_node=8 x cluster.num_nodes=1 = 8 devices, but jaxrm finds 1",
    ),
  ],
)
def test_unsupported_settings_are_refused_by_key(override, message):
  with pytest.raises(ConfigError) as e:
    translate(override)
  assert str(e.value).startswith(message), str(e.value)


def test_chat_template_goes_to_the_tokenizer():
  template = nemo.load(YAML)["policy"]["tokenizer"]["chat_template"]
  assert template.startswith("{{- bos_token }}")  # the shipped recipe's Llama-3 template
  run = translate().run_config()
  assert run.model.chat_template == template
  assert dict(translate().fates)["policy.tokenizer.chat_template"].startswith(
    'model.chat_template="{{- bos_token }}'
  )
  assert translate("policy.tokenizer.chat_template=default").run_config().model.chat_template == ""
  with pytest.raises(
    ConfigError, match=r"^policy\.tokenizer\.chat_template=3: a chat template is a Jinja string"
  ):
    translate("policy.tokenizer.chat_template=3")


def test_bad_overrides_are_named():
  with pytest.raises(
    ConfigError,
    match=r"'policy\.modelname=x': the YAML has no key 'policy\.modelname'; .*"
    r"\+policy\.modelname=\.\.\.",
  ):
    nemo.load(YAML, ["policy.modelname=x"])
  with pytest.raises(ConfigError, match=r"'policy\.model_name': a NeMo RL override is section\.key=value"):
    nemo.load(YAML, ["policy.model_name"])


def test_binary_preference_dataset_rows_as_nemo_converts_them(tmp_path):
  rows = tmp_path / "pairs.jsonl"
  rows.write_text(json.dumps({"question": "2+2?", "good": "4", "bad": "5"}) + "\n")
  with pytest.raises(
    DataError,
    match=r"pairs.jsonl:1: field 'prompt': is missing; BinaryPreferenceDataset reads the columns "
    r"prompt, chosen, rejected .*; have \['bad', 'good', 'question'\]",
  ):
    translate(
      "data.dataset_name=BinaryPreferenceDataset",
      f"+data.train_data_path={rows}",
      f"checkpointing.checkpoint_dir={tmp_path / 'bad'}",
    )
  tr = translate(
    "data.dataset_name=BinaryPreferenceDataset",
    f"+data.train_data_path={rows}",
    f"+data.val_data_path={rows}",
    f"checkpointing.checkpoint_dir={tmp_path / 'run'}",
    "+data.prompt_key=question",
    "+data.chosen_key=good",
    "+data.rejected_key=bad",
  )
  run = tr.run_config()
  assert run.data.dataset_name == "PreferenceDataset"
  assert list(run.data.val_data_paths) == ["default"]
  with open(run.data.val_data_paths["default"]) as f:
    assert json.loads(f.read()) == {  # NeMo RL's to_preference_data_format
      "context": [{"role": "user", "content": "2+2?"}],
      "completions": [
        {"rank": 0, "completion": [{"role": "assistant", "content": "4"}]},
        {"rank": 1, "completion": [{"role": "assistant", "content": "5"}]},
      ],
    }


def test_cli_errors_are_one_line():
  procs = {
    "refused": tiny_run.run(
      [
        sys.executable,
        "-m",
        "jaxrm.train",
        f"--nemo_config={YAML}",
        "policy.model_name=/m",
        "policy.megatron_cfg.enabled=true",
      ]
    ),
    "two_recipes": tiny_run.run(
      [sys.executable, "-m", "jaxrm.train", f"--nemo_config={YAML}", "--config=configs/rm.py"]
    ),
    "not_a_number": tiny_run.run(
      [sys.executable, "-m", "jaxrm.train", f"--nemo_config={YAML}", "policy.optimizer.kwargs.lr=fast"]
    ),
  }
  for name, code, start in (
    ("refused", 2, "error: policy.megatron_cfg.enabled=True"),
    (
      "not_a_number",
      2,
      "error: policy.optimizer.kwargs.lr='fast' (in the override 'policy.optimizer.kwargs.lr=fast'): "
      "expected a number, got a string",
    ),
    (
      "two_recipes",
      2,
      "error: give one of --config=configs/rm.py, --nemo_config=rm.yaml or "
      "--trl_args ...; got --config and --nemo_config",
    ),
  ):
    result = procs[name]
    assert result.returncode == code, tiny_run.describe(result)
    assert "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")][0].startswith(start), (
      result.stderr
    )


def write_rows(path, split, n):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in demo.demo_arithmetic(split, num_rows=n))
  return str(path)


@pytest.mark.slow
def test_shipped_recipe_runs_on_the_tiny_model(model_dir, tmp_path):
  train = write_rows(tmp_path / "train.jsonl", "train", 16)
  val = write_rows(tmp_path / "val.jsonl", "validation", 8)
  out = tmp_path / "run"
  result = tiny_run.run(
    [
      sys.executable,
      "-m",
      "jaxrm.train",
      f"--nemo_config={YAML}",
      f"policy.model_name={model_dir}",
      "data.dataset_name=PreferenceDataset",
      f"+data.train_data_path={train}",
      f"+data.val_data_paths.default={val}",
      f"checkpointing.checkpoint_dir={out}",
      # the tiny run's size: 2 steps of 8 pairs, validated and saved at step 2
      "policy.train_global_batch_size=8",
      "policy.train_micro_batch_size=8",
      "policy.max_total_sequence_length=128",
      "rm.max_num_steps=2",
      "rm.val_period=2",
      "rm.val_global_batch_size=8",
      "logger.wandb_enabled=false",
      f"logger.log_dir={tmp_path / 'logs'}",
    ],
    timeout=600,
    HOME=str(tmp_path),
  )  # the tokenized-data cache goes under HOME: not the user's
  assert result.returncode == 0, tiny_run.describe(result)
  assert (
    "policy.optimizer.kwargs.betas" in result.stdout
    and "train.adam_beta1=0.9, train.adam_beta2=0.98" in result.stdout
  )
  rows = tiny_run.read_metrics(str(out))
  assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]  # NeMo RL logs every step
  assert [r["step"] for r in rows if "validation-default_loss" in r] == [2]
  saved = json.loads((out / "config.json").read_text())
  assert saved["train"]["adam_beta2"] == 0.98 and saved["model"]["dtype"] == "bfloat16"
  # The recipe's chat template laid the chats out, and is saved with the run's tokenizer.
  template = nemo.load(YAML)["policy"]["tokenizer"]["chat_template"]
  from jaxrm import RewardModel

  assert RewardModel.from_pretrained(str(out), load_weights=False).tokenizer.chat_template == template


def test_context_parallelism_with_packing_runs_where_nemo_rl_refuses_it():
  # NeMo RL raises for reward models on context_parallel_size > 1 and on sequence packing;
  # jaxrm splits each (packed) row's tokens over mesh.context.
  run = translate(
    "policy.dtensor_cfg.context_parallel_size=2",
    "policy.sequence_packing.enabled=true",
    "cluster.gpus_per_node=2",
    device_count=2,
  ).run_config()
  assert (run.mesh.context, run.mesh.fsdp, run.data.packing) == (2, -1, "packed")  # fsdp: the rest


def test_defaults_read_yaml_files_only_and_errors_never_show_their_content(tmp_path):
  """NeMo RL's inheritance: paths relative to the file naming them (or absolute); only YAML files,
  each a mapping, and an error names the file without printing what it holds."""
  secret = "s3cr3t-token"
  (tmp_path / "notes.txt").write_text(f"token: {secret}\n")
  (tmp_path / "broken.yaml").write_text(f"rm:\n  seed: [{secret}\n")
  (tmp_path / "list.yaml").write_text(f"- {secret}\n")
  for parent, message in (
    ("notes.txt", f"defaults names '{tmp_path / 'notes.txt'}', which is not a YAML file"),
    ("/etc/passwd", "defaults names '/etc/passwd', which is not a YAML file"),
    ("broken.yaml", f"{tmp_path / 'broken.yaml'}: not valid YAML at line 3, column 1"),
    ("list.yaml", f"{tmp_path / 'list.yaml'}: not a mapping of sections"),
    ("missing.yaml", f"defaults names '{tmp_path / 'missing.yaml'}', which does not exist"),
    ("[{a: b}]", "defaults is a YAML file's path, or a list of them"),
  ):
    (tmp_path / "child.yaml").write_text(f"defaults: {parent}\n")
    with pytest.raises(ConfigError) as e:
      nemo.load(str(tmp_path / "child.yaml"))
    assert message in str(e.value) and secret not in str(e.value) and "root:" not in str(e.value)
  with pytest.raises(ConfigError, match="is not a YAML file"):
    nemo.load(str(tmp_path / "notes.txt"))

  # a parent in another folder names its own parent relative to itself; _override_ replaces a section
  (tmp_path / "base").mkdir()
  (tmp_path / "base" / "mid.yaml").write_text("defaults: ../root.yaml\nrm: {seed: 2}\n")
  (tmp_path / "root.yaml").write_text(f"defaults: {YAML}\nrm: {{val_period: 3}}\n")
  (tmp_path / "child.yaml").write_text(
    "defaults: [base/mid.yaml]\ncluster: {_override_: true, num_nodes: 1}\n"
  )
  config = nemo.load(str(tmp_path / "child.yaml"))
  assert (config["rm"]["seed"], config["rm"]["val_period"], config["rm"]["max_num_epochs"]) == (2, 3, 1)
  assert config["cluster"] == {"num_nodes": 1}


def test_a_numeric_key_holding_no_number_is_named_with_where_it_was_set(tmp_path):
  (tmp_path / "child.yaml").write_text(f"defaults: {YAML}\npolicy: {{optimizer: {{kwargs: {{lr: fast}}}}}}\n")
  for path, overrides, message in (
    (
      tmp_path / "child.yaml",
      [],
      f"policy.optimizer.kwargs.lr='fast' (in {tmp_path / 'child.yaml'}): expected a number",
    ),
    (
      YAML,
      ["rm.seed=abc"],
      "rm.seed='abc' (in the override 'rm.seed=abc'): expected an integer, got a string",
    ),
    (
      YAML,
      ["rm.val_period=1.5"],
      "rm.val_period=1.5 (in the override 'rm.val_period=1.5'): expected an integer",
    ),
    (YAML, ["policy.max_grad_norm=true"], "policy.max_grad_norm=True (in the override"),
    (
      YAML,
      ["policy.optimizer.kwargs.betas=[0.9,x]"],
      "policy.optimizer.kwargs.betas[1]='x' (in the override",
    ),
    (YAML, ["cluster.num_nodes=two"], "cluster.num_nodes='two'"),
  ):
    with pytest.raises(ConfigError) as e:
      nemo.load(str(path), overrides)
    assert str(e.value).startswith(message), str(e.value)
  assert (
    nemo.load(YAML, ["policy.max_grad_norm=null", "checkpointing.keep_top_k=null"])["policy"]["max_grad_norm"]
    is None
  )
