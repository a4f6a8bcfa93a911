r"""GPU recipe: Qwen2.5-1.5B Bradley-Terry reward model on HelpSteer3, NeMo RL's hyper-parameters.

Needs the Hugging Face hub (model and dataset are downloaded) and a GPU:

  python -m jaxrm.train --config=configs/qwen25_1p5b_helpsteer3.py
"""

from jaxrm.config import base_config


def get_config(arg=None):
  c = base_config()
  c.output_dir = "runs/qwen25-1.5b-helpsteer3"
  c.model.name_or_path = "Qwen/Qwen2.5-1.5B"
  c.model.dtype = "bfloat16"
  c.model.remat = "dots"
  c.data.dataset_name = "HelpSteer3"
  c.data.train_data_path = ""
  c.data.val_data_paths = {"helpsteer3": ""}
  c.data.max_length = 8192
  c.data.bucket_multiple = 512
  c.train.global_batch_size = 128
  c.train.micro_batch_size = 1
  c.train.max_epochs = 1
  c.train.max_steps = 1_000_000
  c.train.learning_rate = 2e-6
  c.train.warmup_steps = 0
  c.train.lr_scheduler = "constant"
  c.train.adam_beta2 = 0.98
  c.train.adam_epsilon = 1e-5
  c.train.weight_decay = 0.1
  c.train.max_grad_norm = 1.0
  c.eval.val_period = 16
  c.eval.val_at_start = True
  c.checkpointing.metric_name = "validation-helpsteer3_accuracy"
  c.checkpointing.higher_is_better = True
  c.checkpointing.save_period = 16
  c.checkpointing.keep_top_k = 3
  return c
