r"""A tiny random Llama reward model with SmolLM2's tokenizer, and a config that trains it in seconds.

This file is also a config file for the CLI (the argument is the model directory)::

  python -m jaxrm.train --config=tests/tiny_run.py:/path/to/tiny_model --config.output_dir=/tmp/run

and a script that trains on 8 fake CPU devices and reports how parameters are sharded::

  python tests/tiny_run.py sharded /path/to/tiny_model /tmp/run

The model (2 layers, hidden 64, SmolLM2's 49152-token vocabulary), the converted tokenizer and
JAX's compiled programs are kept in pytest's cache directory. The learning rate is constant after
warmup, so runs of different lengths share one compiled train step.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_TORCH = os.path.join(ROOT, "tests", "no_torch")  # its sitecustomize hides torch from a subprocess
TOKENIZER_CACHE = "smollm2_135m_instruct_tokenizer"
MODEL_CACHE = "jaxrm_tiny_llama_smollm2_vocab_v1"

# What every tiny run trains: 4 steps of 8 pairs; checkpoints and validation every 2 steps.
TINY = {
  "data.max_length": 96,
  "data.bucket_multiple": 96,  # one length bucket: one compiled train step
  "data.max_train_rows": 64,
  "data.max_val_rows": 8,
  "train.global_batch_size": 8,
  "train.micro_batch_size": 8,
  "train.max_steps": 4,
  "train.max_epochs": 100,
  "train.learning_rate": 1e-3,
  "train.lr_scheduler": "constant_with_warmup",
  "train.warmup_steps": 2,
  "train.weight_decay": 0.01,
  "train.log_period": 1,
  "eval.val_period": 2,
  "eval.batch_size": 8,
  "checkpointing.save_period": 2,
  "checkpointing.keep_top_k": 1,
  "logger.progress_bar": False,
  # Tests never write into the home directory's cache; a test of the cache sets its own.
  "data.cache": False,
}


def set_keys(config, overrides: dict):
  """Sets dotted keys (``"train.max_steps"``) of a ConfigDict; returns it."""
  for key, value in overrides.items():
    *parents, leaf = key.split(".")
    node = config
    for p in parents:
      node = node[p]
    node[leaf] = value
  return config


def get_config(arg=None):
  """The tiny run; ``arg`` is the model directory."""
  from jaxrm.config import base_config

  c = base_config()
  c.model.name_or_path = arg or ""
  c.data.val_data_paths = {"default": "validation", "train_sample": "train"}
  c.checkpointing.metric_name = "val:validation-default_loss"
  return set_keys(c, TINY)


def config(model_dir: str, output_dir: str, **overrides):
  """The tiny run's ConfigDict writing into ``output_dir``; overrides use ``__`` for dots.

  A ConfigDict, as the command line gives it: :func:`train` reads it into a ``RunConfig`` as
  the CLI does, so config errors surface as they would there.
  """
  c = get_config(model_dir)
  c.output_dir = output_dir
  return set_keys(c, {k.replace("__", "."): v for k, v in overrides.items()})


def train(config_dict, **kwargs):
  """Trains as ``python -m jaxrm.train`` does with this config: the ConfigDict read into a
  ``RunConfig`` at the edge, then ``trainer.train_and_evaluate``."""
  from jaxrm import cli
  from jaxrm.run import trainer

  return trainer.train_and_evaluate(cli.run_config(config_dict), **kwargs)


def cli(model_dir: str, output_dir: str, *flags: str) -> list[str]:
  """The command line of the tiny run."""
  return [
    sys.executable,
    "-m",
    "jaxrm.train",
    f"--config={os.path.abspath(__file__)}:{model_dir}",
    f"--config.output_dir={output_dir}",
    *flags,
  ]


def _xla_knows(flag: str) -> bool:
  """Whether the installed jaxlib has an XLA flag (XLA aborts on an unknown one in XLA_FLAGS): its
  name in the library that parses the flags, found without starting JAX (~0.1 s)."""
  import importlib.util
  import mmap

  spec = importlib.util.find_spec("jaxlib")
  path = spec and spec.origin and os.path.join(os.path.dirname(spec.origin), "libjax_common.so")
  if not path or not os.path.isfile(path):
    return False
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
    return m.find(b"\0" + flag.encode() + b"\0") >= 0


# XLA flags of every test process and subprocess. The suite compiles ~2000 small programs that
# each run for milliseconds, so compiling is most of its time:
# - LLVM's optimisation of their machine code took half of the suite's compile time (measured on
#   three training test files: backend compile 64 s -> 36 s, wall 127 s -> 93 s);
# - XLA:CPU's newer fusion emitters (MLIR) cost three times the older ones' compile time (measured
#   on test_packed_training.py and test_shared_scoring.py, one process, cold cache: backend compile
#   70 s -> 23 s, wall 129 s -> 79 s).
# Both leave XLA's HLO passes and buffer assignment (the memory figures tests read) as they are;
# the machine code's float operations may be ordered or fused otherwise, so float32 results may
# move by roundings (measured: the context-parallel gradients' largest float32 error against
# float64, 7.6e-6 of the largest gradient at XLA's defaults, 6.6e-6 at these flags; the bound
# each test checks is derived for float32, not for one setting: tests/test_context_parallel.py).
# The trainer, the benchmarks and the plan command compile at XLA's defaults.
_OLDER_EMITTERS = ["--xla_cpu_use_fusion_emitters=false"] if _xla_knows("xla_cpu_use_fusion_emitters") else []
TEST_XLA_FLAGS = " ".join(
  ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"] + _OLDER_EMITTERS
)
# XLA flags of a process that trains the real SmolLM2-135M (30 layers) rather than compiling many
# small programs: its few programs run for seconds, and unoptimised machine code costs more there
# than LLVM's optimisation saves (measured on notebooks/quickstart.ipynb, one process, cold cache:
# 89 CPU-s at TEST_XLA_FLAGS, 70 at XLA's defaults, 65 with the older fusion emitters alone).
REAL_MODEL_XLA_FLAGS = " ".join(_OLDER_EMITTERS)


def subprocess_env(xla_flags: str = TEST_XLA_FLAGS, *, torch: bool = False, **extra) -> dict[str, str]:
  """Environment of a subprocess: the repository importable, one CPU device (unless ``extra``'s
  XLA_FLAGS say more), ``xla_flags``, the shared compile cache; torch hidden (as where users run
  jaxrm: ``tests/no_torch``) unless ``torch``."""
  env = dict(os.environ)
  path = ROOT if torch else os.pathsep.join([NO_TORCH, ROOT])
  env.update(PYTHONPATH=path, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false")
  env["XLA_FLAGS"] = " ".join([xla_flags] + ([extra.pop("XLA_FLAGS")] if "XLA_FLAGS" in extra else []))
  if _compile_cache:
    env.update(
      JAX_COMPILATION_CACHE_DIR=_compile_cache,
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
  env.update(extra)
  return env


def run(args: list[str], timeout: float = 300, **env) -> subprocess.CompletedProcess:
  """Runs a command in the repository root (:func:`subprocess_env`); output captured as text."""
  return subprocess.run(
    args, cwd=ROOT, env=subprocess_env(**env), capture_output=True, text=True, timeout=timeout
  )


def describe(result: subprocess.CompletedProcess) -> str:
  """A failed subprocess's exit code and the tail of its output, for assertion messages."""
  return f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-5000:]}"


def read_metrics(output_dir: str) -> list[dict]:
  with open(os.path.join(output_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def train_losses(output_dir: str) -> dict[int, float]:
  """step -> train/loss, from metrics.jsonl."""
  return {r["step"]: r["train/loss"] for r in read_metrics(output_dir) if "train/loss" in r}


RESUMED_KEYS = ("train/loss", "train/accuracy", "train/grad_norm", "train/learning_rate")


def assert_resumed_equals_uninterrupted(
  resumed: str, uninterrupted: str, steps, keys=RESUMED_KEYS, atol=1e-6, *, logged_again=False
):
  """A run stopped and run again (in ``resumed``) logged what the run never stopped logged: the same
  training ``steps``, once each, and every one of ``keys`` within ``atol`` (0: equal to the bit).
  ``logged_again``: a run killed after logging a step but before saving it logs the step again when
  run again; the last row of each step counts."""
  import numpy as np

  got, want = ([r for r in read_metrics(out) if "train/loss" in r] for out in (resumed, uninterrupted))
  if logged_again:
    got = sorted({r["step"]: r for r in got}.values(), key=lambda r: r["step"])
  assert [r["step"] for r in got] == [r["step"] for r in want] == list(steps)
  for key in keys:
    if atol:
      np.testing.assert_allclose(
        [r[key] for r in got], [r[key] for r in want], rtol=0, atol=atol, err_msg=key
      )
    else:
      assert [r[key] for r in got] == [r[key] for r in want], key


# ------------------------------------------------------------------ shared state of a test session

_compile_cache: str | None = None
_baseline: dict[str, str] = {}


def cache_root(request, tmp_path_factory) -> str:
  """pytest's cache directory (``.pytest_cache/d``), or a session temp dir without the cache plugin."""
  cache = getattr(request.config, "cache", None)
  return os.path.dirname(str(cache.mkdir("jaxrm"))) if cache else str(tmp_path_factory.getbasetemp())


def enable_compile_cache(root: str) -> None:
  """Keeps JAX's compiled programs under ``root`` for this process and the subprocesses it starts."""
  global _compile_cache
  if _compile_cache:
    return
  import jax

  _compile_cache = os.path.join(root, "jax_compilation_cache")
  jax.config.update("jax_compilation_cache_dir", _compile_cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def baseline_run(model_dir: str, root: str) -> str:
  """The tiny run, uninterrupted on one device, trained once per session; its output directory."""
  if model_dir not in _baseline:
    # One per pytest-xdist worker: two workers training into one directory would resume each other.
    output_dir = os.path.join(root, "baseline" + os.environ.get("PYTEST_XDIST_WORKER", ""))
    train(config(model_dir, output_dir))
    _baseline[model_dir] = output_dir
  return _baseline[model_dir]


# ------------------------------------------------------------------ the model


def tokenizer_dir(cache_root: str) -> str:
  """SmolLM2's tokenizer converted from the embedded GGUF (seconds), saved under ``cache_root``."""
  saved = os.path.join(cache_root, TOKENIZER_CACHE)
  if not os.path.exists(os.path.join(saved, "tokenizer.json")):
    import transformers

    from jaxrm.hf import gguf

    path = gguf.embedded_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    _save_atomically(saved, tok.save_pretrained)
  return saved


def tiny_model_dir(cache_root: str, head: str = "sequence") -> str:
  """A random 2-layer Llama with SmolLM2's tokenizer, saved under ``cache_root``.

  ``head``: "sequence" (LlamaForSequenceClassification, one label), "token"
  (LlamaForTokenClassification, two labels: a process reward model) or "causal" (LlamaForCausalLM
  with tied embeddings, as SmolLM2's: a verifier's).
  """
  saved = os.path.join(cache_root, MODEL_CACHE + ("" if head == "sequence" else f"_{head}"))
  if os.path.exists(os.path.join(saved, "config.json")):
    return saved
  import hf_tiny
  import transformers

  tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir(cache_root))
  model = hf_tiny.build(
    "llama",
    head=head,
    vocab_size=len(tok),
    num_hidden_layers=2,
    pad_token_id=tok.pad_token_id,
    bos_token_id=tok.bos_token_id,
    eos_token_id=tok.eos_token_id,
    tie_word_embeddings=head == "causal",
  )

  def save(d):
    model.save_pretrained(d)
    tok.save_pretrained(d)

  _save_atomically(saved, save)
  return saved


def _save_atomically(final: str, save) -> None:
  tmp = f"{final}.tmp{os.getpid()}"
  shutil.rmtree(tmp, ignore_errors=True)
  save(tmp)
  try:
    os.rename(tmp, final)
  except OSError:  # built meanwhile by another process
    shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------ the sharded script


def _sharded_main(model_dir: str, output_dir: str) -> None:
  """Trains the tiny run on a 2x2x2 mesh of 8 CPU devices; prints where a q kernel's shards live."""
  import jax

  jax.config.update("jax_num_cpu_devices", 8)
  import optax
  from flax import nnx

  from jaxrm import sharding
  from jaxrm.run import optim, steps
  from jaxrm.scoring.reward_model import RewardModel

  c = config(model_dir, output_dir, mesh__data=2, mesh__fsdp=2, mesh__tensor=2, train__micro_batch_size=2)
  train(c)
  mesh = sharding.make_mesh(sharding.MeshConfig(2, 2, 2))
  params = nnx.state(RewardModel.from_pretrained(model_dir, mesh=mesh).model)
  tx = optim.make_optimizer(optax.constant_schedule(1e-3))
  state, _ = steps.init_state(params, tx, seed=0, mesh=mesh)
  q = state["params"]["layers"]["q"].get_value()
  mu_q = optax.tree_utils.tree_get(state["opt_state"], "mu")["layers"]["q"].get_value()
  report = {
    "devices": jax.device_count(),
    "q_shape": list(q.shape),
    "q_spec": [list(a) if isinstance(a, tuple) else a for a in q.sharding.spec],
    "q_shard_shape": list(q.addressable_shards[0].data.shape),
    "mu_q_spec": [list(a) if isinstance(a, tuple) else a for a in mu_q.sharding.spec],
    "step_spec": list(state["step"].sharding.spec),
  }
  print("SHARDING " + json.dumps(report))


if __name__ == "__main__":
  if len(sys.argv) != 4 or sys.argv[1] != "sharded":
    sys.exit("usage: python tests/tiny_run.py sharded MODEL_DIR OUTPUT_DIR")
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  _sharded_main(sys.argv[2], sys.argv[3])


def train_two_processes(model_dir: str, out: str, *flags: str, timeout: float = 400) -> list[tuple[str, str]]:
  """``python -m jaxrm.train`` as two local processes joined through a coordinator (one host's
  data each); each one's (stdout, stderr), after checking that both exited cleanly."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  procs = [
    subprocess.Popen(
      cli(
        model_dir,
        out,
        *flags,
        f"--coordinator_address=localhost:{port}",
        "--num_processes=2",
        f"--process_id={i}",
      ),
      cwd=ROOT,
      env=subprocess_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  try:
    outputs = [p.communicate(timeout=timeout) for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, (stdout, stderr) in zip(procs, outputs):
    assert p.returncode == 0, f"exit {p.returncode}\n{stdout[-2000:]}\n{stderr[-5000:]}"
  return outputs


# Six epochs of the tiny run's 64 pairs, validated at the end on 64 held-out pairs and on the 64 it
# trained on ("train_sample"), and saved at the end (tests/test_precision.py,
# tests/test_context_parallel.py).
LEARN = {
  "train.max_steps": 48,
  "eval.val_period": 0,
  "eval.batch_size": 32,
  "data.max_val_rows": 64,
  "checkpointing.save_period": 0,
  "logger.tensorboard": False,
}
# The 64 pairs the tiny run trains on, ranked after 6 epochs (48 steps of 8): float32 gets 92% of
# them right, bfloat16 88%, from 50% (chance) at the start; their loss falls from ln 2 = 0.69 to
# 0.24 and 0.29. Chance ranks 48 of 64 right with probability 4e-5. (Held-out questions stay near
# chance, 62-67% of 64 pairs: a random 2-layer model does not learn arithmetic in 48 steps.)
LEARNED_ACCURACY = 0.75
LEARNED_LOSS = 0.45
