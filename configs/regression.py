r"""Multi-attribute regression reward model (HelpSteer2 / Nemotron style): the embedded
SmolLM2-135M-Instruct on demo_attributes, offline.

A linear head on the last token predicts helpfulness, correctness and verbosity (0..4); validation
reports each attribute's MSE, MAE, Pearson and Spearman correlation, and the pairwise accuracy of
helpfulness on pairs of answers to the same question.

  python -m jaxrm.train --config=configs/regression.py
  python -m jaxrm.train --config=configs/regression.py:smoke      # 6 steps, 32 validation rows
  python -m jaxrm.train --config=configs/regression.py:helpsteer2 # nvidia/HelpSteer2 from the hub
  python -m jaxrm.train --config=configs/regression.py \
      --config.data.dataset_name=RatedDataset \
      --config.data.train_data_path=train.jsonl --config.data.val_data_paths.default=val.jsonl \
      --config.reward.attributes=helpfulness,correctness --config.reward.attribute_range=0,4
"""

from jaxrm.config import base_config


def get_config(arg=None):
  c = base_config()
  c.output_dir = "runs/regression"
  c.reward.type = "regression"
  c.reward.attributes = "helpfulness,correctness,verbosity"
  c.reward.attribute_range = "0,4"
  c.reward.combine = "helpfulness"
  c.data.dataset_name = "demo_attributes"
  c.data.max_length = 128
  c.data.bucket_multiple = 16
  c.train.global_batch_size = 8
  c.train.micro_batch_size = 8
  c.train.max_steps = 120
  c.train.learning_rate = 5e-5
  c.train.warmup_steps = 5
  c.train.weight_decay = 0.01
  c.eval.val_period = 60
  c.checkpointing.save_period = 60
  c.checkpointing.keep_top_k = 1
  if arg == "smoke":
    c.output_dir = "runs/regression-smoke"
    c.train.max_steps = 6
    c.train.warmup_steps = 1
    c.eval.val_period = 3
    c.data.max_val_rows = 32
    c.checkpointing.save_period = 3
  elif arg == "helpsteer2":
    # The five HelpSteer2 attributes; the pairwise metric combines them as Nemotron-4-340B-Reward's
    # model card does for RewardBench.
    c.output_dir = "runs/regression-helpsteer2"
    c.data.dataset_name = "HelpSteer2"
    c.data.max_length = 2048
    c.data.bucket_multiple = 256
    c.data.val_data_paths = {"default": ""}
    c.reward.attributes = "helpfulness,correctness,coherence,complexity,verbosity"
    c.reward.attribute_range = ""
    c.reward.combine = "helpfulness=0.3,correctness=0.74,coherence=0.46,complexity=0.47,verbosity=-0.33"
    c.train.global_batch_size = 128
    c.train.micro_batch_size = 8
    c.train.max_steps = 160  # about one epoch of HelpSteer2's 20k training rows
    c.train.learning_rate = 1e-5
    c.eval.val_period = 40
    c.checkpointing.save_period = 40
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of configs/regression.py; known: smoke, helpsteer2")
  return c
