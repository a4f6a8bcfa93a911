#!/bin/bash
# Multi-node reward-model training under Slurm: one task per node, each task driving all of its
# node's GPUs. jax.distributed.initialize() reads the coordinator, process count and process id
# from Slurm's environment, so the command is the same on every node.
#
#   sbatch scripts/slurm_train.sh                                  # the GPU recipe
#   sbatch scripts/slurm_train.sh configs/rm.py --config.train.max_steps=500
#
# The mesh covers every GPU of every node: with the config's mesh.fsdp=-1 the parameters and
# optimizer state are sharded over all of them. Resubmitting the same job continues from the
# latest checkpoint in the output directory, which must be on a filesystem every node sees.
#
#SBATCH --job-name=jaxrm-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail

CONFIG=${1:-configs/qwen25_1p5b_helpsteer3.py}
shift || true
OUTPUT_DIR=${OUTPUT_DIR:-runs/$(basename "$CONFIG" .py)}

cd "${SLURM_SUBMIT_DIR:-.}"
source .venv/bin/activate  # installed with: pip install -e '.[cuda12]'

# Let XLA take most of each GPU's memory up front; the rest is left for NCCL's buffers.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
export TOKENIZERS_PARALLELISM=false

srun --kill-on-bad-exit=1 python -m jaxrm.train \
  --config="$CONFIG" \
  --config.output_dir="$OUTPUT_DIR" \
  "$@"
