import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

import tiny_run  # noqa: E402


@pytest.fixture(scope="session")
def cache_root(request, tmp_path_factory):
  """Where tiny models and JAX's compiled programs are kept between runs of the suite."""
  root = tiny_run.cache_root(request, tmp_path_factory)
  tiny_run.enable_compile_cache(root)
  return root


@pytest.fixture(scope="session")
def model_dir(cache_root):
  """A tiny random llama sequence classifier over SmolLM2's vocabulary, with its tokenizer."""
  return tiny_run.tiny_model_dir(cache_root)


@pytest.fixture(scope="session")
def baseline(model_dir, tmp_path_factory):
  """4 uninterrupted steps; validation and checkpoints at steps 2 and 4."""
  return tiny_run.baseline_run(model_dir, str(tmp_path_factory.mktemp("runs")))
