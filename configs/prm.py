r"""Process (stepwise) reward model: the embedded SmolLM2-135M-Instruct on demo_arithmetic_steps.

python -m jaxrm.train --config=configs/prm.py
python -m jaxrm.train --config=configs/prm.py:smoke
"""

from jaxrm.config import base_config


def get_config(arg=None):
  c = base_config()
  c.output_dir = "runs/prm"
  c.reward.type = "stepwise"
  c.data.dataset_name = "demo_arithmetic_steps"
  c.data.max_length = 128
  c.data.bucket_multiple = 16
  c.data.max_val_rows = 200
  c.train.global_batch_size = 8
  c.train.micro_batch_size = 8
  c.train.max_steps = 60
  c.train.learning_rate = 5e-5
  c.train.warmup_steps = 5
  c.eval.val_period = 30
  c.checkpointing.save_period = 30
  c.checkpointing.keep_top_k = 1
  if arg == "smoke":
    c.output_dir = "runs/prm-smoke"
    c.train.max_steps = 6
    c.train.warmup_steps = 1
    c.eval.val_period = 3
    c.data.max_val_rows = 32
    c.checkpointing.save_period = 3
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of configs/prm.py; known: smoke")
  return c
