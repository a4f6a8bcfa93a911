"""What the benchmark scripts share: the model shapes they train, the token ids of their generated
rows, the rows themselves, and a one-device mesh.

``scripts/bench.py`` (throughput, in lockstep with TRL or LoRA) and ``scripts/memory_plan.py``
(memory per device, and one step on a GPU) import it; neither imports the other. JAX is imported
only inside the functions that need it, so a parent process that only starts workers never
starts a backend.
"""

from __future__ import annotations

import os
import subprocess

import numpy as np

from jaxrm.data.tokenize import PreferenceExample
from jaxrm.models.config import ModelConfig, from_hf_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Public shapes: the values of each model's config.json on the Hugging Face hub (the repository
# named), as ``models.config.from_hf_config`` reads them. Only the architecture matters here.
HF_CONFIGS = {
  "smollm2-135m": {  # HuggingFaceTB/SmolLM2-135M-Instruct
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
  },
  "qwen2.5-1.5b": {  # Qwen/Qwen2.5-1.5B: head_dim 1536 / 12 = 128, q/k/v biases (qwen2)
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
  },
  "llama3.1-8b": {  # meta-llama/Llama-3.1-8B: head_dim 4096 / 32 = 128
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "rope_scaling": {
      "rope_type": "llama3",
      "factor": 8.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
  },
  "qwen3-8b": {  # Qwen/Qwen3-8B: explicit head_dim 128, q/k RMSNorm (qwen3)
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
  },
}
SHAPES = {
  "tiny": ModelConfig(
    family="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
  ),
  **{name: from_hf_config(hf) for name, hf in HF_CONFIGS.items()},
}

# Token ids of the generated chats: ChatML-like markers, then text.
PAD, IM_START, IM_END, NEWLINE, SYSTEM, USER, ASSISTANT = range(7)
FIRST_TEXT = 16


def _lognormal(rng, median: float, sigma: float, cap: int) -> int:
  return int(min(max(rng.lognormal(np.log(median), sigma), 1), cap))


def make_pairs(n: int, max_length: int, vocab: int, seed: int) -> list[PreferenceExample]:
  """``n`` two-completion chats: 1-8 turns, optional system prompt, long-tailed lengths."""
  return make_groups(n, 2, max_length, vocab, seed)


def make_groups(n: int, k: int, max_length: int, vocab: int, seed: int) -> list[PreferenceExample]:
  """``n`` chats of ``k`` ranked completions each (best first), as :func:`make_pairs` makes its
  pairs (``k=2`` gives the same rows)."""
  rng = np.random.default_rng(seed)
  text = lambda k: list(rng.integers(FIRST_TEXT, vocab, k))
  message = lambda role, k: [IM_START, role, NEWLINE] + text(k) + [IM_END, NEWLINE]
  out = []
  for i in range(n):
    context = message(SYSTEM, _lognormal(rng, 30, 0.5, 400)) if rng.random() < 0.5 else []
    for _ in range(min(int(rng.geometric(0.45)), 8) - 1):
      context += message(USER, _lognormal(rng, 50, 1.0, 2000))
      context += message(ASSISTANT, _lognormal(rng, 150, 0.9, 2000))
    context += message(USER, _lognormal(rng, 60, 1.0, 2000)) + [IM_START, ASSISTANT, NEWLINE]
    completions = [text(_lognormal(rng, 180, 0.9, max_length // 2 - 1)) + [IM_END] for _ in range(k)]
    # As truncation="left": the oldest context tokens go until the longest sequence fits.
    context = context[max(0, len(context) + max(map(len, completions)) - max_length) :]
    ids = tuple(np.asarray(context + c, np.int32) for c in completions)
    out.append(PreferenceExample(ids, tuple(range(k)), 0.0, f"group {i}" if k > 2 else f"pair {i}", {}))
  return out


def full_pairs(pairs: int, length: int, vocab: int, seed: int = 0):
  """``pairs`` preference pairs whose two completions both fill ``length`` tokens: the unpacked
  batch (``data.packing=none``) at its longest. input_ids [2 * pairs, length]."""
  from jaxrm.data.batches import PreferenceBatch

  rng = np.random.default_rng(seed)
  return PreferenceBatch(
    input_ids=rng.integers(FIRST_TEXT, vocab, (2 * pairs, length)).astype(np.int32),
    attention_mask=np.ones((2 * pairs, length), np.int32),
    ranks=np.tile(np.arange(2, dtype=np.int32), (pairs, 1)),
    margin=np.zeros(pairs, np.float32),
    example_mask=np.ones(pairs, np.float32),
  )


def one_device_mesh():
  """A 1x1x1 mesh on this machine's first device: where a single benchmark run trains."""
  import jax

  from jaxrm import sharding

  return sharding.make_mesh(sharding.MeshConfig(1, 1, 1), devices=jax.devices()[:1])


def commit() -> str:
  """The checkout the figures come from: ``git describe --always --dirty`` (``-dirty``: with
  uncommitted changes), or ``unknown`` outside a git checkout."""
  try:
    out = subprocess.run(
      ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True, timeout=20
    )
  except (OSError, subprocess.TimeoutExpired):
    return "unknown"
  return out.stdout.strip() or "unknown"


# ------------------------------------------------------------------ a profile, summarised

TOP_KERNELS = 15


def kernel_table(trace: dict, wall_s: float, top: int = TOP_KERNELS) -> dict:
  """The ``top`` longest GPU kernels of a ``jax.profiler`` trace (its Perfetto JSON: ``traceEvents``),
  each with its total time and share of ``wall_s``, the traced steps' wall time.

  Kernels are the complete events ("ph": "X", durations in microseconds) of the processes the
  trace names as GPU devices ("/device:GPU:..."); a kernel launched many times counts once, its
  launches summed. ``busy_share`` is the union of all kernels' intervals over the wall: what is
  left of it the GPU waited (on launches, the host, or a transfer).
  """
  events = trace.get("traceEvents", [])
  gpus = {
    e["pid"]
    for e in events
    if e.get("ph") == "M" and e.get("name") == "process_name" and "GPU" in str(e.get("args", {}).get("name"))
  }
  kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpus and e.get("dur")]
  if not kernels:
    return {"kernels": [], "note": "no GPU kernel events in the trace (is CUPTI installed?)"}
  totals: dict[str, list[float]] = {}
  for e in kernels:
    entry = totals.setdefault(e["name"], [0.0, 0])
    entry[0] += e["dur"] / 1e6
    entry[1] += 1
  ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
  rows = [
    {"kernel": name, "seconds": round(s, 6), "launches": n, "share": round(s / wall_s, 4)}
    for name, (s, n) in ranked[:top]
  ]
  return {
    "wall_s": round(wall_s, 4),
    "kernel_s": round(sum(s for s, _ in totals.values()), 6),
    "busy_share": round(_union_s(kernels) / wall_s, 4),
    "distinct_kernels": len(totals),
    "kernels": rows,
  }


def _union_s(events) -> float:
  """Seconds covered by at least one of ``events`` (overlapping streams counted once)."""
  covered, end = 0.0, float("-inf")
  for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
    if stop > end:
      covered += stop - max(start, end)
      end = stop
  return covered / 1e6


def read_trace(directory: str) -> dict:
  """The Perfetto JSON ``jax.profiler`` wrote under ``directory`` (``perfetto_trace.json.gz``)."""
  import glob
  import gzip
  import json

  found = sorted(glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"), recursive=True))
  if not found:
    return {}
  with gzip.open(found[-1], "rt") as f:
    return json.load(f)
