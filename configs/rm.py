r"""Bradley-Terry reward model: the embedded SmolLM2-135M-Instruct on demo_arithmetic.

  python -m jaxrm.train --config=configs/rm.py
  python -m jaxrm.train --config=configs/rm.py:smoke           # about a minute on CPU
  python -m jaxrm.train --config=configs/rm.py:lora            # LoRA rank 16 on all-linear
  python -m jaxrm.train --config=configs/rm.py --config.data.train_data_path=train.jsonl \
      --config.data.val_data_paths.default=val.jsonl --config.data.max_length=2048 \
      --config.train.max_steps=500

Own data needs only data.train_data_path (.jsonl, .json, .parquet, .csv, a save_to_disk directory
or a hub name): it is read as PreferenceDataset rows, and validated on the sets that
data.val_data_paths names, a dict of name -> path (none by default; checkpoints are then kept by
recency). --config.data.val_data_paths.default=val.jsonl sets the first, and
--config.data.val_data_paths.<name>=<path> adds more (validation-<name>_loss...). The demo's rows
are short (data.max_length=128); real conversations need a longer one, or most are dropped
(counted in the run's drop report). A run shorter
than train.warmup_steps=5 needs --config.train.warmup_steps=1 (or a constant schedule).
"""

from jaxrm.config import base_config


def get_config(arg=None):
  c = base_config()
  c.output_dir = "runs/rm"
  c.data.max_length = 128
  c.data.bucket_multiple = 16
  c.data.packing = "shared_prompt"  # the prompt once per pair: ~1.8x the pairs per second here
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
    c.output_dir = "runs/rm-smoke"
    c.train.max_steps = 6
    c.train.warmup_steps = 1
    c.eval.val_period = 3
    c.data.max_val_rows = 32
    c.checkpointing.save_period = 3
  elif arg == "lora":
    # Adapters over a frozen base; they start at B = 0 and want a larger learning rate.
    c.output_dir = "runs/rm-lora"
    c.model.lora.rank = 16
    c.model.lora.alpha = 32.0
    c.model.lora.target_modules = "all-linear"
    c.train.learning_rate = 2e-4
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of configs/rm.py; known: smoke, lora")
  return c
