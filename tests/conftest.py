import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import tiny_run  # noqa: E402

# Read when JAX's backend starts, after this file: see tiny_run.TEST_XLA_FLAGS.
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), tiny_run.TEST_XLA_FLAGS]))


# The modules that take longest in a whole run (measured, longest first), started first so that
# the two workers of `make test` (pytest-xdist, --dist loadscope --no-loadscope-reorder: modules
# handed out in their collected order; xdist's default reorders them by their number of tests)
# end together instead of one waiting for the other's last long module. Only the order changes; a
# stale list costs seconds, not correctness.
SLOWEST_FIRST = (
  "test_bench.py",
  "test_gpu_compile.py",
  "test_gguf.py",
  "test_verifier.py",
  "test_train.py",
  "test_context_parallel.py",
  "test_notebook.py",
  "test_plan.py",
  "test_fault_injection.py",
  "test_first_use.py",
  "test_precision.py",
  "test_shared_scoring.py",
  "test_pairwise_judge.py",
  "test_pairwise_training.py",
  "test_packed_training.py",
  "test_serve.py",
  "test_sharding.py",
  "test_evaluate.py",
  "test_cache.py",
  "test_nemo_config.py",
  "test_lora_export.py",
  "test_export.py",
  "test_padding.py",
  "test_serve_limits.py",
  "test_serve_load.py",
  "test_lora_training.py",
  "test_scoring.py",
  "test_regression_training.py",
  "test_flash_attention.py",
  "test_micro_batches.py",
  "test_trl_args.py",
)


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a module keeps its order


def pytest_runtest_setup(item):
  """``@pytest.mark.gpu`` tests run only where JAX's default backend is a GPU."""
  if item.get_closest_marker("gpu") is not None:
    import jax

    if jax.default_backend() != "gpu":
      pytest.skip(f"needs a GPU; JAX's default backend is {jax.default_backend()}")


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
def causal_dir(cache_root):
  """A tiny random LlamaForCausalLM (tied embeddings) with SmolLM2's tokenizer: a verifier or a
  pairwise judge loads it."""
  return tiny_run.tiny_model_dir(cache_root, head="causal")


@pytest.fixture(scope="session")
def tiny_rm(model_dir):
  """The model of ``model_dir``, loaded once; tests read it and never change it."""
  from jaxrm import RewardModel

  return RewardModel.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def tiny_prm(cache_root):
  """The same tiny llama with a two-label token head (a process reward model), loaded once."""
  from jaxrm import RewardModel

  return RewardModel.from_pretrained(tiny_run.tiny_model_dir(cache_root, head="token"))


@pytest.fixture(scope="session")
def smollm2_tokenizer(cache_root):
  """SmolLM2's tokenizer: converted from the embedded GGUF once, then kept in ``cache_root``."""
  import transformers

  return transformers.AutoTokenizer.from_pretrained(tiny_run.tokenizer_dir(cache_root))


@pytest.fixture(scope="session")
def baseline(model_dir, tmp_path_factory):
  """4 uninterrupted steps; validation and checkpoints at steps 2 and 4."""
  return tiny_run.baseline_run(model_dir, str(tmp_path_factory.mktemp("runs")))
