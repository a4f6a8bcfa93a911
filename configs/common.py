"""The full set of config keys with their defaults; every config file starts from these.

Keys follow NeMo RL's names where it has one (data.dataset_name, data.train_data_path,
data.val_data_paths, checkpointing.metric_name...). Overriding a key that does not exist, or with
a value of the wrong type, fails when the command line is parsed.
"""

import ml_collections

EMBEDDED_MODEL = "embedded:SmolLM2-135M-Instruct"


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.output_dir = "runs/rm"

  c.model = ml_collections.ConfigDict()
  c.model.name_or_path = EMBEDDED_MODEL  # HF dir, .gguf file, hub name, or a jaxrm run/checkpoint dir
  c.model.dtype = "float32"  # compute dtype: float32 | bfloat16
  c.model.param_dtype = "float32"  # master weights (and optimizer state)
  c.model.remat = "none"  # none | full | dots
  c.model.seed = 0  # seed of a new reward head

  c.reward = ml_collections.ConfigDict()
  c.reward.type = "bradley_terry"  # bradley_terry | ranking | stepwise
  c.reward.ranking_loss = "plackett_luce"  # plackett_luce | all_pairs (reward.type=ranking)
  c.reward.center_rewards_coefficient = 0.0

  c.data = ml_collections.ConfigDict()
  c.data.dataset_name = "demo_arithmetic"
  c.data.train_data_path = ""  # empty: the dataset's default (demo sets: made on the spot)
  c.data.val_data_paths = ml_collections.ConfigDict({"default": "validation"})
  c.data.max_length = 256
  c.data.truncation = "drop"  # drop | left
  c.data.step_separator = "\n"
  c.data.train_on_last_step_only = False
  c.data.bucket_multiple = 64
  # none | packed (several sequences per row) | shared_prompt (packed, a group's prompt written once)
  c.data.packing = "none"
  # Tokens per packed row; 0: each batch's rows as long as its longest group (at most
  # max_length x completions per group), rounded up to bucket_multiple.
  c.data.packed_row_length = 0
  c.data.num_workers = 0
  c.data.shuffle_seed = 0
  c.data.max_train_rows = 0  # 0: all
  c.data.max_val_rows = 0  # per validation set; 0: all

  c.train = ml_collections.ConfigDict()
  c.train.global_batch_size = 16  # groups (pairs, ranked lists or stepwise rows) per update
  c.train.micro_batch_size = 16  # groups per device per forward pass (gradient accumulation)
  c.train.max_steps = 100
  c.train.max_epochs = 1
  c.train.learning_rate = 1e-5
  c.train.lr_decay = "cosine"  # cosine | linear | constant
  c.train.min_lr_ratio = 0.0
  c.train.warmup_steps = 10
  c.train.weight_decay = 0.0
  c.train.max_grad_norm = 1.0
  c.train.seed = 0
  c.train.log_period = 5

  c.eval = ml_collections.ConfigDict()
  c.eval.val_period = 50
  c.eval.val_at_start = False
  c.eval.val_at_end = True
  c.eval.val_batches = 0  # 0: the whole validation set
  c.eval.batch_size = 32  # groups per validation batch

  c.checkpointing = ml_collections.ConfigDict()
  c.checkpointing.enabled = True
  c.checkpointing.checkpoint_dir = ""  # empty: <output_dir>/checkpoints
  c.checkpointing.metric_name = "validation-default_loss"
  c.checkpointing.higher_is_better = False
  c.checkpointing.keep_top_k = 2
  c.checkpointing.save_period = 50

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 1

  c.logger = ml_collections.ConfigDict()
  c.logger.tensorboard = True
  c.logger.log_dir = ""  # empty: <output_dir>/tensorboard
  c.logger.progress_bar = True
  return c
