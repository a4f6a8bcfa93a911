r"""GPU recipe: a Skywork-Reward-V2-style Bradley-Terry reward model, Llama-3.1-8B at 16,384 tokens.

Skywork-Reward-V2-Llama-3.1-8B (arXiv 2507.01352) is Llama-3.1-8B-Instruct trained as a
Bradley-Terry reward model on pairs of up to 16,384 tokens with a constant learning rate after
warm-up. A pair at that length is two rows of 16,384 tokens; on one host of 8 GPUs it trains with
each row's tokens split over 2 devices (``mesh.context=2``) and the weights over 4 (``mesh.fsdp=4``),
remat full: compiled for eight H100 80 GB cards, 32.0 GiB per device at its peak (``mesh.fsdp=8``
without context parallelism: 32.7 GiB). Check a change before asking for GPUs, then train; this
needs the Hugging Face hub (the model is gated: accept its licence and log in) and 8 GPUs:

  python -m jaxrm.plan --config=configs/skywork_v2_llama31_8b.py --gpu=h100-80gb --topology=1x8
  python -m jaxrm.train --config=configs/skywork_v2_llama31_8b.py

The report's 26 million curated pairs are not public; this recipe trains on Skywork's public
preference collection (Skywork-Reward-Preference-80K-v0.2, TRL's conversational format). Point
``data.train_data_path`` at your own pairs to train on them instead.
"""

from jaxrm.config import base_config


def get_config(arg=None):
  c = base_config()
  c.output_dir = "runs/skywork-v2-llama3.1-8b"
  c.model.name_or_path = "meta-llama/Llama-3.1-8B-Instruct"
  c.model.dtype = "bfloat16"
  c.model.remat = "full"
  c.mesh.data = 1
  c.mesh.fsdp = 4
  c.mesh.context = 2
  c.data.dataset_name = "PreferenceDataset"
  c.data.train_data_path = "Skywork/Skywork-Reward-Preference-80K-v0.2"
  c.data.val_data_paths = {}  # the collection has a train split only: hold out your own pairs
  c.data.max_length = 16384
  c.data.bucket_multiple = 1024  # a multiple of 2 x mesh.context, as zigzag balancing needs
  c.train.global_batch_size = 256  # pairs per update; check the report's to reproduce it
  c.train.micro_batch_size = 1
  c.train.max_epochs = 1
  c.train.max_steps = 1_000_000
  c.train.learning_rate = 3e-6
  c.train.lr_scheduler = "constant_with_warmup"  # the report: constant after warm-up
  c.train.warmup_steps = 50
  c.train.weight_decay = 0.0
  c.train.max_grad_norm = 1.0
  c.checkpointing.save_period = 100
  c.checkpointing.keep_top_k = 2
  if arg:
    raise ValueError(f"unknown variant {arg!r} of configs/skywork_v2_llama31_8b.py; it has none")
  return c
