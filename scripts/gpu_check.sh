#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py) on a machine with one NVIDIA GPU and no package index, in
# under 8 minutes: GPU tests, the Qwen2.5-1.5B benchmark, the largest planned shape that trains
# one step, then as much of the sweep as the budget leaves (the 1.5B shape over remat x pairs per
# step x attention route, its fastest setting profiled and beside TRL, the 8B settings); one JSON
# file with everything, each measured peak beside its compile-time plan.
#
#   bash scripts/gpu_check.sh --sweep_only --out=sweep.json  # the sweep alone, in its own 8 minutes
#
#   bash scripts/gpu_wheels.sh                        # first, where PyPI is reachable: .wheels/
#   bash scripts/gpu_check.sh --compile_only --out=gpu_check.json  # then anywhere: compiled for
#                                                     # the H200 (--gpu=...), no GPU needed
#   bash scripts/gpu_check.sh --out=gpu_check.json    # on the GPU machine, .wheels/ and that file
#                                                     # beside it (its compile step is reused)
#   bash scripts/gpu_check.sh --dry_run               # anywhere: sizes every step, compiles nothing
#
# On the GPU machine it first installs the carried wheels (.wheels/: what jaxrm needs that the
# machine lacks) and jaxrm itself (--no-deps, editable). A dry run or a compile-only run installs
# nothing and uses .venv's Python where there is one (its GPU compiler: make gpu-compiler). Other
# arguments go to scripts/gpu_check.py.
set -uo pipefail
cd "$(dirname "$0")/.."

here_only=0  # runs here, without a GPU: nothing to install
for arg in "$@"; do [[ $arg == --dry_run || $arg == --compile_only ]] && here_only=1; done
if [[ -n ${PYTHON:-} ]]; then
  python=$PYTHON
elif (( here_only )) && [[ -x .venv/bin/python ]]; then
  python=.venv/bin/python
else
  python=python3
fi

if (( ! here_only )); then
  pip=("$python" -m pip install -q --no-index --no-deps --no-cache-dir)
  if compgen -G ".wheels/*.whl" >/dev/null; then
    "${pip[@]}" --find-links .wheels .wheels/*.whl || { echo "installing .wheels/ failed" >&2; exit 1; }
  else
    echo "no .wheels/ here (bash scripts/gpu_wheels.sh makes it): relying on installed packages" >&2
  fi
  # No index, so no isolated build environment either: build with the setuptools installed.
  if ! "${pip[@]}" --no-build-isolation -e .; then
    echo "pip install -e . failed: importing jaxrm from $PWD instead" >&2
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
fi

# JAX takes 75% of the GPU's memory by default; the largest shapes need nearly all of it
# (the CUDA context keeps its own few hundred MiB outside it).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.99}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec "$python" scripts/gpu_check.py "$@"
