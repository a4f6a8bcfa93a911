r"""Reward-model training throughput: jaxrm unpacked, packed and shared-prompt packed, and TRL.

CPU, SmolLM2-135M shape (random weights), against TRL's RewardTrainer on the same rows::

  python scripts/bench.py --model=smollm2-135m --vs-trl

One H200: Qwen2.5-1.5B shape, sequences up to 2048 tokens, bf16 compute, ``--attention=auto``
(the Pallas flash kernel on a GPU)::

  python scripts/bench.py --gpu
  python scripts/bench.py --gpu --dry_run  # settings, data and batch shapes only; runs anywhere

LoRA against full training, each mode in lockstep with the same mode training rank-16 adapters on
every linear layer over a frozen base (step time and peak memory of both, in the same run)::

  python scripts/bench.py --model=smollm2-135m --vs-lora --modes=unpacked,shared_prompt

Ranked groups against TRL's expanded pairs: K completions per prompt (``--ranked=4,7``), jaxrm
``reward.type=ranking`` with shared-prompt packing, ``ranking_loss=all_pairs`` (and
``plackett_luce`` beside it, its own loss), in lockstep with TRL on each group's K(K-1)/2 pairs::

  python scripts/bench.py --model=smollm2-135m --ranked=4,7 --batch_size=1 --steps=10

CPU step experiments: each mode in lockstep against itself changed by a variant, in its own
process (``serial_dots=on``: each projection's two backward products in turn; ``xla=<preset>``:
XLA:CPU thread and scheduling flags; ``malloc=<preset>``: glibc's allocator, ``system`` for its
defaults where jaxrm's workers otherwise start with huge-page temporaries as the commands do
(:mod:`jaxrm.run.host_memory`); ``layers``, ``scan``, ``remat``: the model's; ``head=lm``: a
verifier, ``reward.type=verifier`` reading its log-odds from the LM head's two answer rows at the
scored position, on the same rows; joined by ``+``)::

  python scripts/bench.py --modes=unpacked --batch_size=2 --steps=10 \
      --vs-variant=serial_dots=on,xla=eigen_single,scan=off+remat=full

TRL is needed only for ``--vs-trl`` and ``--ranked``, not by jaxrm: ``pip install --no-deps
trl==1.16.0`` into the environment. Memory per device, and one step of a planned setting on a GPU, are
``scripts/memory_plan.py``'s; the model shapes and generated rows are ``scripts/bench_common.py``'s.

Every run has its own process (so peak memory is its own) and the same procedurally generated
rows: multi-turn chats with long-tailed turn and completion lengths, two completions each, cut to
``--max_length`` from the left as the tokenizer does. Batch i holds rows [i*B, (i+1)*B) for every
mode and for TRL. jaxrm trains with the trainer's own optimizer, loss and step
(``update.build_update``, with the settings of ``TRAIN``, which TRL gets too), on batches from the
trainer's collators: ``unpacked`` (length buckets of 64), ``packed`` and ``shared_prompt`` (rows
as long as the batch's longest group, in multiples of 64, as ``data.packing`` builds them).

With ``--vs-trl`` each jaxrm mode runs in lockstep with a TRL run: the two processes take turns,
one training step each (ABBA order), so both meet the same machine load; on a shared machine,
load that changes between two runs otherwise decides the ratio. Each side compiles (jaxrm: one
program per distinct batch shape) and loads before the first step; only steps are timed, after
``--warmup`` untimed ones, from the start of the step to its updated parameters (batches are
collated before the clock starts, as both trainers' data loaders do).

A lockstep pair also reports its per-step ratio: batch i is the same on both sides, so step i's
ratio is the partner's seconds over the run's; the median, quartiles and range over the timed
steps show the spread that one total ratio hides. Each worker also times a plain 2048^3 float32
matmul under ``jax.jit`` in its own process (TRL's also under torch), the yardstick its model
FLOP/s are quoted against, and records its thread settings.

With ``--ranked``, ``--batch_size`` counts prompts: one step is ``--batch_size`` groups of K
completions for jaxrm (one packed row each, the prompt once) and their K(K-1)/2 pairs each for TRL
(one TRL step, prompt + better and prompt + worse per pair). The all-pairs Bradley-Terry loss is the
mean over those same pairs, as TRL's is over its batch, so the two take the same step from the
same weights: both sides start from one set of weights (written once as safetensors by a short
process, read by both), and after the first (untimed) step the benchmark stops unless the two
first-step losses agree (``LOSS_RTOL``). A pair counts as one of the loss's pairs on either side;
Plackett-Luce, a listwise loss, is credited with the same K(K-1)/2 per group.

Reported per run: pairs/s (pairs of the loss: a group of K counts K(K-1)/2) and pairs per
CPU-second (process CPU time, all threads); tokens/s of the sequences as a trainer without packing
sees them (prompt counted once per completion; a group of K as its K(K-1)/2 pairs, 2 sequences
each), of the real tokens fed to the model, and of all positions fed (padding included); packing
efficiency = real / fed positions; peak memory (host RSS on CPU, device peak bytes on GPU); the
process's minor page faults per step (median); compile seconds; model TFLOP/s; and MFU on GPU,
against ``--peak_tflops``.

Model FLOPs of a step = 6 N x real tokens + 12 L d x attended keys, where N = non-embedding
parameters (the embedding is a lookup; the reward head is counted), L = layers, d = query heads x
head dim, and attended keys = the sum over real tokens of the keys each attends to under its
causal (or shared-prompt tree) mask, i.e. position + 1. 6 N is the forward and backward matmuls;
12 L d per (query, key) pair the attention scores and weighted sums, forward and backward.
Padding and masked-out keys are not counted, so every mode and TRL are credited with the work a
model needs, not the work a layout wastes; a shared prompt is counted once, as it is computed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from bench_common import (
  IM_END,
  IM_START,
  NEWLINE,
  PAD,
  SHAPES,
  TOP_KERNELS,
  commit,
  kernel_table,
  make_groups,
  make_pairs,
  one_device_mesh,
  read_trace,
)

from jaxrm.data.tokenize import PreferenceExample
from jaxrm.models.config import REMAT_POLICIES, ModelConfig
from jaxrm.run import host_memory

JAXRM_MODES = ("unpacked", "packed", "shared_prompt")
BUCKET = 64  # sequence and row lengths are multiples of this
GPU_PRESET = dict(
  model="qwen2.5-1.5b",
  max_length=2048,
  batch_size=8,
  dtype="bfloat16",
  attention="auto",
  remat="dots",
  modes="shared_prompt,packed,unpacked",
)
# What both sides train with (train.* keys; TRL's RewardConfig gets the same values): a constant
# 1e-5 after clipping at 1, no weight decay, AdamW's default betas and eps.
TRAIN = dict(learning_rate=1e-5, lr_scheduler="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0)
RANKING_LOSSES = ("all_pairs", "plackett_luce")  # jaxrm's runs of each --ranked K, beside TRL's
# First-step losses of jaxrm all_pairs and TRL from the same weights on the same pairs: the same
# float32 model computed in another order (a packed row under a tree mask against one padded row
# per sequence, XLA's einsum attention against torch's sdpa); 1e-5 leaves room for that rounding
# through 30 layers (measured on the SmolLM2-135M shape: 3.4e-7 at K=4, 2.6e-8 at K=7), while a
# pair left out or counted twice, or the weights not the same, moves it by far more.
LOSS_RTOL = 1e-5


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", choices=sorted(SHAPES), default="smollm2-135m")
  p.add_argument(
    "--modes",
    default=",".join(JAXRM_MODES),
    help=f"jaxrm modes, comma-separated, from {', '.join(JAXRM_MODES)}",
  )
  p.add_argument("--vs-trl", action="store_true", help="run TRL's RewardTrainer in lockstep with each mode")
  p.add_argument(
    "--vs-lora",
    action="store_true",
    help="run each mode in lockstep with the same mode training LoRA adapters "
    "(--lora_rank on every linear layer, over a frozen base)",
  )
  p.add_argument("--lora_rank", type=int, default=16, help="rank of the adapters of --vs-lora and --lora")
  p.add_argument(
    "--lora",
    action="store_true",
    help="train LoRA adapters only (--lora_rank on every linear layer, over a frozen base in "
    "--dtype), without a partner: a shape whose full training does not fit",
  )
  p.add_argument(
    "--profile",
    default="",
    help="a folder: trace the timed steps with jax.profiler there, keep in the result the "
    f"{TOP_KERNELS} longest GPU kernels with their share of the steps' wall time, and delete "
    "the trace (profiled steps run slower: time them in another run)",
  )
  p.add_argument(
    "--ranked",
    default="",
    help="comma-separated completions per prompt, e.g. 4,7: instead of --modes, for each K "
    "jaxrm reward.type=ranking with shared-prompt packing (ranking_loss=all_pairs, and "
    "plackett_luce beside it) in lockstep with TRL on the K(K-1)/2 expanded pairs of the "
    "same groups, from the same weights; --batch_size then counts prompts",
  )
  p.add_argument("--gpu", action="store_true", help=f"H200 preset: {GPU_PRESET}")
  p.add_argument(
    "--dry_run",
    action="store_true",
    help="print the settings, the data and each mode's batch shapes, then stop",
  )
  p.add_argument("--batch_size", type=int, default=4, help="pairs per step")
  p.add_argument("--steps", type=int, default=3, help="timed steps per run")
  p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
  p.add_argument("--max_length", type=int, default=512, help="longest sequence, in tokens")
  p.add_argument(
    "--row_length",
    type=int,
    default=0,
    help="packed modes: every row this long (as data.packed_row_length; fewer distinct "
    "shapes to compile); 0: as long as each batch's longest group, in multiples "
    "of 64",
  )
  p.add_argument(
    "--fit_multiple",
    type=int,
    default=0,
    help="packed modes: each batch's row length (a multiple of this, at most --row_length) and "
    "row count fitted to it, the fewest token slots that hold it (PackSpec.fit_multiple); 0: "
    "rows as --row_length says",
  )
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument(
    "--attention",
    default="auto",
    help="ModelConfig.attention_impl, passed as given (auto: a fused kernel on GPU, the "
    "reference path elsewhere)",
  )
  p.add_argument(
    "--remat",
    default="elementwise",
    choices=REMAT_POLICIES,
    help="jaxrm rematerialization (model.remat); TRL checkpoints gradients only with 'full' (it "
    "has nothing like 'elementwise' or 'dots', which keep the products' outputs)",
  )
  p.add_argument("--peak_tflops", type=float, default=989.0, help="accelerator peak (H200 bf16 dense)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", default=None, help="write every result here")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one run, in this process
  p.add_argument("--channel", default=None, help=argparse.SUPPRESS)
  p.add_argument("--weights_dir", default=None, help=argparse.SUPPRESS)  # --ranked: both sides' start
  p.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's own)")
  p.add_argument(
    "--vs-variant",
    dest="vs_variant",
    default="",
    help="CPU step experiments: each mode in lockstep against itself changed by each of "
    "these variants (comma-separated; each key=value, joined by '+'): "
    + "; ".join(f"{k}: {v}" for k, v in VARIANT_KEYS.items()),
  )
  args = p.parse_args(argv)
  if args.gpu:
    for k, v in GPU_PRESET.items():
      if p.get_default(k) == getattr(args, k):
        setattr(args, k, v)
  args.modes = [m for m in args.modes.split(",") if m]
  if args.vs_trl and args.vs_lora:
    p.error("--vs-trl and --vs-lora: choose one partner per run")
  if args.lora and (args.vs_trl or args.vs_lora or args.ranked):
    p.error("--lora trains adapters alone: leave out --vs-trl, --vs-lora and --ranked")
  try:
    args.ranked = [int(k) for k in args.ranked.split(",") if k]
  except ValueError:
    p.error(f"--ranked={args.ranked}: give completions per prompt as integers, e.g. --ranked=4,7")
  if any(k < 2 for k in args.ranked):
    p.error(f"--ranked={','.join(map(str, args.ranked))}: a ranked group needs at least 2 completions")
  args.vs_variant = [v for v in args.vs_variant.split(",") if v]
  for v in args.vs_variant:
    try:
      parse_variant(v)
    except ValueError as e:
      p.error(f"--vs-variant: {e}")
  if args.weights_dir and any(parse_variant(v).get("head") for v in args.vs_variant):
    p.error("--vs-variant=head=lm trains random weights; leave out --weights_dir")
  if args.vs_variant and (args.vs_trl or args.vs_lora or args.ranked):
    p.error("--vs-variant compares jaxrm with itself: leave out --vs-trl, --vs-lora and --ranked")
  if args.ranked and (args.vs_trl or args.vs_lora):
    p.error("--ranked runs in lockstep with TRL already; leave out --vs-trl and --vs-lora")
  if args.ranked and args.warmup < 1:
    p.error("--ranked checks the losses on the first step, which is not timed: give --warmup of 1 or more")
  unknown = sorted(set(args.modes) - set(JAXRM_MODES))
  if unknown:
    p.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(JAXRM_MODES)}")
  return args


def model_config(args) -> ModelConfig:
  cfg = SHAPES[args.model].replace(
    dtype=args.dtype, param_dtype="float32", remat=args.remat, attention_impl=args.attention, pad_token_id=PAD
  )
  return cfg.replace(num_layers=args.layers) if args.layers else cfg


# ------------------------------------------------------------------------------- variants

# --vs-variant's keys: what each changes in the run it is compared with.
XLA_PRESETS = {  # XLA:CPU's thread and scheduling options, set in the variant's own process
  "eigen_single": "--xla_cpu_multi_thread_eigen=false",  # each matrix product on one thread
  "sched_concurrency": "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED",
  "sched_memory": "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
  # Dots handed to a matrix library instead of XLA:CPU's own (Eigen) kernels.
  "ynn_dot": "--xla_cpu_experimental_ynn_fusion_type=dot",
  "xnn_dot": "--xla_cpu_experimental_xnn_fusion_type=dot",
  "onednn_dot": "--xla_cpu_experimental_onednn_fusion_type=dot",
}
# The C library's allocator. jaxrm's workers start as the commands restart, with glibc's huge-page
# tunable where it changes something (jaxrm.run.host_memory); a preset sets the variant's environment
# instead (a GLIBC_TUNABLES of its own, empty for glibc's defaults).
MALLOC_PRESETS = {
  "system": {"GLIBC_TUNABLES": ""},  # glibc as it starts: every large block mapped per use
  # Every thread allocates from the main heap, which grows by brk and is never trimmed: a block
  # freed after one step is there for the next.
  "one_heap": {
    "GLIBC_TUNABLES": "",
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
  },
  # The same heap in 2 MiB pages: nothing faulted in again, and the pages of the default.
  "one_heap_huge": {
    "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
  },
}
VARIANT_KEYS = {
  "layers": "decoder layers",
  "scan": "on/off (model.scan_layers)",
  "remat": "none/elementwise/dots/full (model.remat)",
  "serial_dots": "on: each projection's weight gradient waits for its data gradient "
  "(an optimization barrier), and what follows waits for both",
  "xla": "XLA_FLAGS preset: " + ", ".join(f"{k} ({v})" for k, v in XLA_PRESETS.items()),
  "malloc": "glibc allocator preset: " + ", ".join(MALLOC_PRESETS),
  "attention_loops": "rows of at least this many tokens take the CPU attention's block loops "
  "(decoder.LOOP_MIN_TOKENS; the dense mask below)",
  "head": "lm: a verifier (reward.type=verifier: the LM head's log-odds of two answers) on the same rows",
}
# head=lm's answers (yes, no): two ids of the vocabulary; random weights make any two alike.
VERIFIER_TOKENS = (1, 2)


def parse_variant(spec: str) -> dict[str, str]:
  """``"layers=8+scan=off"`` -> ``{"layers": "8", "scan": "off"}``, each key and value checked."""
  out = {}
  for item in spec.split("+"):
    key, sep, value = item.partition("=")
    if not sep or key not in VARIANT_KEYS:
      raise ValueError(f"{item!r} is not key=value with key one of {', '.join(VARIANT_KEYS)}")
    allowed = {
      "scan": ("on", "off"),
      "serial_dots": ("on", "off"),
      "remat": REMAT_POLICIES,
      "xla": tuple(XLA_PRESETS),
      "malloc": tuple(MALLOC_PRESETS),
      "head": ("lm",),
    }.get(key)
    counted = {"layers": "a number of layers", "attention_loops": "a number of tokens"}
    if (allowed and value not in allowed) or (key in counted and not value.isdigit()):
      raise ValueError(f"{item!r}: {key} takes {'/'.join(allowed) if allowed else counted[key]}")
    out[key] = value
  return out


def variant_env(worker: str) -> dict[str, str]:
  """The environment of ``worker``'s process: its variant's XLA flags, if any."""
  variant = parse_variant(worker.split(VARIANT_SEP)[1]) if VARIANT_SEP in worker else {}
  env = dict(os.environ)
  if "xla" in variant:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + XLA_PRESETS[variant["xla"]]).strip()
  if "malloc" in variant:
    env.update(MALLOC_PRESETS[variant["malloc"]])
  elif worker.partition("@")[0] != "trl":  # a jaxrm worker: as the commands restart
    env.update(host_memory.huge_pages_env())
  return env


def apply_variant(cfg: ModelConfig, variant: dict[str, str]) -> ModelConfig:
  """``cfg`` changed as ``variant`` says (its model keys; ``serial_dots`` patches the projections)."""
  if "layers" in variant:
    cfg = cfg.replace(num_layers=int(variant["layers"]))
  if "scan" in variant:
    cfg = cfg.replace(scan_layers=variant["scan"] == "on")
  if "remat" in variant:
    cfg = cfg.replace(remat=variant["remat"])
  if variant.get("head") == "lm":
    cfg = cfg.replace(head="lm", verifier_tokens=VERIFIER_TOKENS)
  if "attention_loops" in variant:
    from jaxrm.models import decoder

    decoder.LOOP_MIN_TOKENS = int(variant["attention_loops"])  # read when the step is traced
  if variant.get("serial_dots") == "on":
    from jaxrm.models import layers

    layers.linear = serial_linear  # read when the step is traced
  return cfg


def serial_linear(x_nd, w_df, b_f=None):
  """``layers.linear`` whose backward pass computes the data gradient, then the weight gradient,
  then lets what follows run: the two products of one projection never share the cores."""
  import jax

  @jax.custom_vjp
  def matmul(x, w):
    return x @ w

  def fwd(x, w):
    return x @ w, (x, w)

  def bwd(res, dy):
    x, w = res
    dx = dy @ w.T
    dx, dy = jax.lax.optimization_barrier((dx, dy))
    dw = x.T @ dy
    dx, dw = jax.lax.optimization_barrier((dx, dw))
    return dx, dw

  matmul.defvjp(fwd, bwd)
  y = matmul(x_nd, w_df.astype(x_nd.dtype))
  return y if b_f is None else y + b_f.astype(y.dtype)


# ------------------------------------------------------------------------------------- data


def bench_pairs(args) -> list[PreferenceExample]:
  """Every row the benchmark trains on, warm-up batches first."""
  return make_pairs(
    args.batch_size * (args.warmup + args.steps), args.max_length, SHAPES[args.model].vocab_size, args.seed
  )


def bench_groups(args, k: int) -> list[PreferenceExample]:
  """``--ranked``'s groups of ``k`` completions, best first, warm-up batches first."""
  return make_groups(
    args.batch_size * (args.warmup + args.steps), k, args.max_length, SHAPES[args.model].vocab_size, args.seed
  )


def expanded_pairs(groups) -> list[PreferenceExample]:
  """Every group's K(K-1)/2 pairs (better, worse), each with the prompt: what a pairwise trainer
  is fed for a ranking."""
  out = []
  for g in groups:
    order = sorted(range(len(g.ranks)), key=lambda i: g.ranks[i])
    for a, i in enumerate(order):
      for j in order[a + 1 :]:
        out.append(PreferenceExample((g.input_ids[i], g.input_ids[j]), (0, 1), 0.0, g.source, {}))
  return out


def num_pairs(groups) -> int:
  """Pairs of an all-pairs loss: K(K-1)/2 for a group of K."""
  return sum(len(g.input_ids) * (len(g.input_ids) - 1) // 2 for g in groups)


def data_summary(examples) -> dict:
  lengths = np.array([len(s) for e in examples for s in e.input_ids])
  return {
    "sequences": len(lengths),
    "mean_length": float(lengths.mean()),
    "median_length": float(np.median(lengths)),
    "p90_length": float(np.percentile(lengths, 90)),
    "max_length": int(lengths.max()),
  }


def batches_of(examples, args):
  b = args.batch_size
  return [examples[i * b : (i + 1) * b] for i in range(args.warmup + args.steps)]


# ------------------------------------------------------------------------------------ FLOPs


def dense_params(cfg: ModelConfig, num_params: int) -> int:
  """N: parameters that cost 6 FLOPs per token (all but the embedding, which is a lookup)."""
  return num_params - cfg.vocab_size * cfg.hidden_size


def per_token(cfg: ModelConfig) -> int:
  """FLOPs per real token per parameter: 6 (forward 2, the inputs' gradients 2, the weights'
  gradients 2), or 4 under LoRA, whose frozen weights get no gradient (the adapters' own FLOPs,
  under 1% of them at rank 16, are left out)."""
  return 4 if cfg.lora.enabled else 6


def step_flops(cfg: ModelConfig, n_dense: int, tokens: int, keys: int) -> float:
  """6 N (LoRA: 4 N) per real token, plus 12 L d per attended (query, key) pair."""
  return per_token(cfg) * n_dense * tokens + 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * keys


def flop_formula(cfg: ModelConfig, n_dense: int) -> str:
  """:func:`step_flops` in words, with this model's numbers."""
  per_key = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim
  k = per_token(cfg)
  lora = " (LoRA: the frozen weights get no gradient)" if cfg.lora.enabled else ""
  return (
    f"FLOPs per step = {k} * N * real_tokens + 12 * L * H * Dh * attended_keys{lora}, with N = "
    f"{n_dense:,} non-embedding parameters ({k}N = {k * n_dense / 1e9:.2f} GFLOP per token) and "
    f"12 * {cfg.num_layers} * {cfg.num_heads} * {cfg.head_dim} = {per_key / 1e6:.2f} MFLOP per "
    f"attended (query, key) pair; attended_keys = sum over real tokens of position + 1"
  )


def attended_keys(batch) -> int:
  """Sum over real tokens of the keys each attends to: its position + 1 (unpacked rows are
  right-padded, so a row's positions count its real tokens)."""
  from jaxrm.data.batches import PreferenceBatch

  mask = batch.attention_mask  # [B, T]
  positions = np.cumsum(mask, -1) - 1 if isinstance(batch, PreferenceBatch) else batch.positions
  return int(((positions + 1) * mask).sum())


# ------------------------------------------------------------------------------------ jaxrm


def collator(mode: str, args, k: int = 2):
  """The trainer's ``groups -> batch`` for ``mode`` (``data.packing`` none, packed, shared_prompt)
  and groups of ``k`` completions."""
  from jaxrm.data import packing, pipeline

  if mode == "unpacked":
    return pipeline.Collator(
      batch_size=args.batch_size,
      pad_id=PAD,
      num_completions=k,
      buckets=pipeline.length_buckets(args.max_length, BUCKET),
    )
  # As data.packed_row_length: 0 = rows as long as the batch's longest group, in multiples of 64
  # (a group of k sequences of at most max_length tokens holds fewer than k * max_length).
  spec = packing.PackSpec(
    args.row_length or k * args.max_length,
    length_multiple=0 if args.row_length else BUCKET,
    shared_prompt=mode == "shared_prompt",
    pad_id=PAD,
    fit_multiple=args.fit_multiple,
  )
  return packing.PackedCollator(args.batch_size, spec, num_completions=k)


def _peak_memory_gib() -> float:
  import jax

  stats = jax.local_devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return stats["peak_bytes_in_use"] / 2**30
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _jaxrm_update(cfg: ModelConfig, seed: int, num_steps: int, reward=None, weights_dir: str | None = None):
  """The trainer's update of a model of ``cfg`` trained with ``reward`` (default Bradley-Terry;
  ``update.build_update``: its step compiles once per batch shape) and the model's parameter count.
  The weights are random, or ``weights_dir``'s (an HF checkpoint). With ``cfg.lora`` on, only the
  adapters and the head train, as in the trainer."""
  import jax
  from flax import nnx

  from jaxrm.config import RewardSpec, TrainSpec
  from jaxrm.models.decoder import Decoder
  from jaxrm.run import update
  from jaxrm.scoring import loading

  if weights_dir:
    overrides = {
      k: getattr(cfg, k) for k in ("dtype", "param_dtype", "remat", "attention_impl", "pad_token_id")
    }
    model = loading.load(
      loading.locate(weights_dir), overrides, head="sequence", mesh=one_device_mesh()
    ).model
  else:
    model = nnx.jit(lambda: Decoder(cfg, rngs=nnx.Rngs(seed)))()
  num_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
  built = update.build_update(
    model,
    reward or RewardSpec(),
    TrainSpec(**TRAIN, seed=seed),
    total_steps=num_steps,
    mesh=one_device_mesh(),
  )
  return built, num_params


LORA_SUFFIX = "+lora"  # a worker "<mode>+lora" trains adapters (--vs-lora)
VARIANT_SEP = "~"  # a worker "<mode>~<variant>" runs --vs-variant's variant


def compile_only_update(args, target: str):
  """The bench's update for ``args`` built over abstract weights on one compile-only GPU of
  ``target`` (``jaxrm.planning.gpu_targets``), with its collator, mesh and model config: what
  ``gpu_check.py --compile_only`` and ``step_time_calibration.py`` compile for each batch shape."""
  import dataclasses

  from jaxrm import sharding
  from jaxrm.config import RewardSpec, TrainSpec
  from jaxrm.hf.loader import placed_abstract_model
  from jaxrm.planning import gpu_targets
  from jaxrm.run import update

  cfg = model_config(args)
  if args.lora:
    cfg = dataclasses.replace(cfg, lora=lora_config(args))
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), devices=gpu_targets.devices(target, "1x1"))
  built = update.build_update(
    placed_abstract_model(cfg, mesh),
    RewardSpec(),
    TrainSpec(**TRAIN, seed=args.seed),
    total_steps=args.warmup + args.steps,
    mesh=mesh,
  )
  return built, collator(args.modes[0], args), mesh, cfg


def lora_config(args):
  """The adapters of ``--vs-lora`` and ``--lora``: rank ``--lora_rank`` on every linear layer,
  OpenRLHF's alpha; ``--lora`` keeps the frozen base in ``--dtype`` (bfloat16: 2 bytes a weight)."""
  from jaxrm.models.lora import LoraConfig

  base = args.dtype if args.lora and args.dtype != "float32" else None
  return LoraConfig(rank=args.lora_rank, alpha=16.0, targets="all-linear", base_dtype=base)


def ranked_worker(worker: str) -> tuple[str, int] | None:
  """``"<loss>@<K>"`` (a jaxrm run of ``--ranked``) or ``"trl@<K>"`` -> (loss or "trl", K)."""
  name, at, k = worker.partition("@")
  return (name, int(k)) if at else None


def run_jaxrm(worker: str, args, channel: _Channel) -> dict:
  """Compiles every batch shape, says "ready", then runs one step per "step" from the parent.

  ``worker`` is a mode (``+lora`` for adapters), or ``<ranking loss>@<K>`` for ``--ranked``, whose
  steps also report their loss (after the clock stops) for the first-step check.
  """
  import dataclasses

  import jax

  from jaxrm.config import RewardSpec
  from jaxrm.run.metrics import finalize_metrics

  cfg = model_config(args)
  ranked = ranked_worker(worker)
  if ranked:
    loss, k = ranked
    mode, lora_on, name = "shared_prompt", False, f"jaxrm K={k} {loss}"
    built, num_params = _jaxrm_update(
      cfg,
      args.seed,
      args.warmup + args.steps,
      RewardSpec(type="ranking", ranking_loss=loss),
      args.weights_dir,
    )
    examples = bench_groups(args, k)
  else:
    k = 2
    worker, _, variant = worker.partition(VARIANT_SEP)
    mode, lora_on = worker.removesuffix(LORA_SUFFIX), worker.endswith(LORA_SUFFIX)
    name = (
      f"jaxrm {mode}" + (f" LoRA r{args.lora_rank}" if lora_on else "") + (f" {variant}" if variant else "")
    )
    cfg = apply_variant(cfg, parse_variant(variant)) if variant else cfg
    if lora_on:
      cfg = dataclasses.replace(cfg, lora=lora_config(args))
    reward = RewardSpec(type="verifier") if cfg.head == "lm" else None
    built, num_params = _jaxrm_update(cfg, args.seed, args.warmup + args.steps, reward)
    examples = bench_pairs(args)
  train_step, state = built.train_step, built.state
  collate = collator(mode, args, k)
  groups = batches_of(examples, args)
  batches = [collate(g) for g in groups]
  start = time.perf_counter()
  for batch in batches:
    train_step.compile(state, batch)
  compile_s = time.perf_counter() - start
  matmul_s = jax_matmul_tflops()

  channel.send("ready")
  totals = _new_totals()
  n_dense = dense_params(cfg, num_params)
  losses = []
  for i, batch in enumerate(batches):
    channel.wait_for("step")
    if args.profile and i == args.warmup:
      jax.profiler.start_trace(args.profile, create_perfetto_trace=True)
    clock = _Clock()
    state, (metrics, _) = train_step(state, batch)
    jax.block_until_ready(state)
    clock.stop()
    if i >= args.warmup:
      real = int(batch.attention_mask.sum())
      _count(
        totals,
        clock,
        groups[i],
        real=real,
        fed=batch.attention_mask.size,
        flops=step_flops(cfg, n_dense, real, attended_keys(batch)),
      )
    if ranked:
      losses.append(finalize_metrics(metrics)["loss"])
    channel.send(f"done {losses[-1]!r}" if ranked else "done")
  channel.wait_for("finish")
  trained = sum(x.size for x in jax.tree.leaves(state["params"]))
  extra = {"losses": losses, "completions": k} if ranked else {}
  if args.profile:
    jax.profiler.stop_trace()
    extra["profile"] = kernel_table(read_trace(args.profile), totals["seconds"])
    shutil.rmtree(args.profile, ignore_errors=True)
  return _result(
    name,
    args,
    totals,
    num_params,
    compile_s=compile_s,
    trained_params_m=trained / 1e6,
    **extra,
    matmul_tflops=matmul_s,
    threads=_threads(),
    compiled_shapes=len({tuple(x.shape for x in jax.tree.leaves(b)) for b in batches}),
    flop_formula=flop_formula(cfg, n_dense),
    attention=cfg.attention_impl,
    backend=jax.default_backend(),
    versions=f"jax {jax.__version__}",
  )


# -------------------------------------------------------------------------------------- TRL


def random_hf_model(args):
  """A random float32 transformers sequence-classification model of the benchmark's shape."""
  import torch
  import transformers

  from jaxrm.models.config import to_hf_config

  hf = to_hf_config(model_config(args))
  config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
  torch.manual_seed(args.seed)
  return transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)


def write_start_weights(args, out_dir: str) -> None:
  """:func:`random_hf_model`, saved (safetensors) for both sides of a ``--ranked`` comparison to
  start from."""
  random_hf_model(args).save_pretrained(out_dir, safe_serialization=True)


def run_trl(args, channel: _Channel, k: int | None = None) -> dict:
  """TRL's RewardTrainer on the same model shape, rows and batches, one step per "step".

  With ``k`` (``--ranked``): the groups' expanded pairs, every group's K(K-1)/2 in the step of its
  group, from ``--weights_dir``; each step then reports its loss.
  """
  import datasets
  import tokenizers
  import torch
  import transformers
  import trl

  cfg = model_config(args)
  if k:
    steps_groups = [expanded_pairs(g) for g in batches_of(bench_groups(args, k), args)]
    examples = [e for g in steps_groups for e in g]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
      args.weights_dir, dtype=torch.float32
    )
  else:
    examples = bench_pairs(args)
    steps_groups = batches_of(examples, args)
    model = random_hf_model(args)
  num_params = sum(p.numel() for p in model.parameters())
  # The rows are token ids already; the tokenizer only names the pad and end tokens.
  vocab = {"<pad>": PAD, "<|im_start|>": IM_START, "<|im_end|>": IM_END, "<unk>": NEWLINE}
  tok = transformers.PreTrainedTokenizerFast(
    tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>")),
    pad_token="<pad>",
    eos_token="<|im_end|>",
  )
  data = datasets.Dataset.from_dict(
    {
      "chosen_ids": [e.input_ids[0].tolist() for e in examples],
      "rejected_ids": [e.input_ids[1].tolist() for e in examples],
    }
  )
  on_gpu = torch.cuda.is_available()
  matmul_tflops = jax_matmul_tflops()  # the same yardstick as jaxrm's, measured in this process
  lockstep = _TrlLockstep(channel, args.warmup + args.steps, report_loss=bool(k))
  with tempfile.TemporaryDirectory() as out:
    config = trl.RewardConfig(
      output_dir=out,
      per_device_train_batch_size=len(steps_groups[0]),
      max_steps=args.warmup + args.steps,
      learning_rate=TRAIN["learning_rate"],
      lr_scheduler_type=TRAIN["lr_scheduler"],
      warmup_steps=TRAIN["warmup_steps"],
      weight_decay=TRAIN["weight_decay"],
      max_grad_norm=TRAIN["max_grad_norm"],
      max_length=args.max_length,
      train_sampling_strategy="sequential",
      logging_strategy="no",
      save_strategy="no",
      report_to="none",
      disable_tqdm=True,
      dataloader_num_workers=0,
      use_cpu=not on_gpu,
      bf16=on_gpu and args.dtype == "bfloat16",
      gradient_checkpointing=args.remat == "full",
      seed=args.seed,
    )
    trainer = lockstep.trainer(trl.RewardTrainer)(
      model=model, args=config, train_dataset=data, processing_class=tok, callbacks=[lockstep.callback()]
    )
    trainer.train()
  totals = _new_totals()
  n_dense = dense_params(cfg, num_params)
  timed = zip(steps_groups[args.warmup :], lockstep.clocks[args.warmup :])
  for groups, clock in timed:
    lengths = [len(s) for e in groups for s in e.input_ids]
    # DataCollatorForPreference pads every sequence to the batch's longest.
    _count(
      totals,
      clock,
      groups,
      real=sum(lengths),
      fed=len(lengths) * max(lengths),
      flops=step_flops(cfg, n_dense, sum(lengths), sum(n * (n + 1) // 2 for n in lengths)),
    )
  memory = (
    torch.cuda.max_memory_allocated() / 2**30
    if on_gpu
    else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
  )
  threads = dict(
    _threads(), torch_threads=torch.get_num_threads(), torch_interop_threads=torch.get_num_interop_threads()
  )
  extra = {"losses": lockstep.losses(), "completions": k} if k else {}
  name = f"TRL RewardTrainer K={k} as pairs" if k else "TRL RewardTrainer"
  return _result(
    name,
    args,
    totals,
    num_params,
    memory_gib=memory,
    threads=threads,
    **extra,
    matmul_tflops=matmul_tflops,
    torch_matmul_tflops=torch_matmul_tflops(torch, on_gpu),
    attention=model.config._attn_implementation,
    backend="cuda" if on_gpu else "cpu",
    versions=f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}",
  )


class _TrlLockstep:
  """Says "ready" once the trainer is set up, holds each step until the parent says "step",
  times it to its optimizer update, and after the last one holds the trainer's wrap-up until the
  parent says "finish" (so it cannot overlap the other run's last step)."""

  def __init__(self, channel: _Channel, num_steps: int, report_loss: bool = False):
    self.channel = channel
    self.num_steps = num_steps
    self.report_loss = report_loss
    self.clocks: list[_Clock] = []
    self.step_losses = []  # each step's loss tensor, read after its clock stops

  def losses(self) -> list[float]:
    return [float(x) for x in self.step_losses]

  def trainer(self, base):
    """``base`` (TRL's RewardTrainer) keeping each step's loss, as the step computed it."""
    outer = self

    class Recording(base):
      def compute_loss(self, *args, **kwargs):
        out = super().compute_loss(*args, **kwargs)
        outer.step_losses.append((out[0] if isinstance(out, tuple) else out).detach())
        return out

    return Recording

  def callback(self):
    import transformers

    outer = self

    class Lockstep(transformers.TrainerCallback):
      def on_train_begin(self, *args, **kwargs):
        outer.channel.send("ready")

      def on_step_begin(self, *args, **kwargs):
        outer.channel.wait_for("step")
        outer.clocks.append(_Clock())

      def on_step_end(self, *args, **kwargs):
        outer.clocks[-1].stop()
        outer.channel.send(f"done {float(outer.step_losses[-1])!r}" if outer.report_loss else "done")
        if len(outer.clocks) == outer.num_steps:
          outer.channel.wait_for("finish")

    return Lockstep()


# ---------------------------------------------------------------------------------- reports

MATMUL_N = 2048  # the yardstick: a plain N x N x N float32 matmul


def _best_tflops(run, n: int = MATMUL_N, reps: int = 5) -> float:
  """TFLOP/s of the fastest of ``reps`` calls of ``run`` (an N^3 matmul, waited for)."""
  run()
  best = min(_timed(run) for _ in range(reps))
  return 2 * n**3 / best / 1e12


def _timed(run) -> float:
  start = time.perf_counter()
  run()
  return time.perf_counter() - start


def jax_matmul_tflops() -> float:
  """A plain float32 2048^3 matmul under ``jax.jit`` on the default device, in TFLOP/s."""
  import jax
  import jax.numpy as jnp

  a = jax.random.normal(jax.random.key(0), (MATMUL_N, MATMUL_N), jnp.float32)
  f = jax.jit(jnp.matmul)
  return _best_tflops(lambda: f(a, a).block_until_ready())


def torch_matmul_tflops(torch, on_gpu: bool) -> float:
  """The same matmul in torch (MKL/oneDNN on CPU), in TFLOP/s."""
  a = torch.randn(MATMUL_N, MATMUL_N, device="cuda" if on_gpu else "cpu")
  sync = torch.cuda.synchronize if on_gpu else (lambda: None)
  return _best_tflops(lambda: (a @ a, sync()))


def _threads() -> dict:
  """What sets this process's threads: CPUs it may run on and the environment that sizes pools."""
  keys = ("XLA_FLAGS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "GLIBC_TUNABLES", "MALLOC_ARENA_MAX")
  env = {k: os.environ[k] for k in keys if k in os.environ}
  return {"cpus": len(os.sched_getaffinity(0)), **env}


class _Clock:
  """Wall and process CPU seconds (every thread of the process) and the process's minor page
  faults from creation to ``stop()``."""

  def __init__(self):
    self.start = (time.perf_counter(), time.process_time(), _minor_faults())
    self.seconds = self.cpu_seconds = self.faults = None

  def stop(self) -> None:
    self.seconds = time.perf_counter() - self.start[0]
    self.cpu_seconds = time.process_time() - self.start[1]
    self.faults = _minor_faults() - self.start[2]


def _minor_faults() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _new_totals() -> dict:
  return dict(
    pairs=0, real=0, fed=0, seq=0, flops=0.0, seconds=0.0, cpu_seconds=0.0, step_seconds=[], step_faults=[]
  )


def _count(totals, clock: _Clock, groups, *, real: int, fed: int, flops: float) -> None:
  """Adds one timed step: its time, pairs, real and fed tokens, sequence tokens and FLOPs.

  A group of K completions counts K(K-1)/2 pairs and the sequences of those pairs (each completion
  with its prompt in K-1 of them): what a pairwise trainer would be fed for it.
  """
  totals["seconds"] += clock.seconds
  totals["step_seconds"].append(round(clock.seconds, 3))
  totals["cpu_seconds"] += clock.cpu_seconds
  totals["step_faults"].append(clock.faults)
  totals["pairs"] += num_pairs(groups)
  totals["real"] += real
  totals["fed"] += fed
  totals["seq"] += sum((len(e.input_ids) - 1) * sum(len(s) for s in e.input_ids) for e in groups)
  totals["flops"] += flops


def _rates(totals: dict, peak_tflops: float, on_gpu: bool) -> dict:
  sec = totals["seconds"]
  out = {
    "pairs_per_s": totals["pairs"] / sec,
    "pairs_per_cpu_s": totals["pairs"] / totals["cpu_seconds"],
    "seq_tokens_per_s": totals["seq"] / sec,
    "real_tokens_per_s": totals["real"] / sec,
    "fed_tokens_per_s": totals["fed"] / sec,
    "packing_efficiency": totals["real"] / totals["fed"],
    "model_tflops": totals["flops"] / sec / 1e12,
    "faults_per_step": float(np.median(totals["step_faults"])),
  }
  if on_gpu:
    out["mfu"] = out["model_tflops"] / peak_tflops
  return out


def _result(name, args, totals, num_params, memory_gib=None, **extra) -> dict:
  on_gpu = extra.get("backend") in ("gpu", "cuda")
  return {
    "name": name,
    "model": args.model,
    "params_m": num_params / 1e6,
    "batch_size": args.batch_size,
    "steps": args.steps,
    "totals": totals,
    "peak_memory_gib": _peak_memory_gib() if memory_gib is None else memory_gib,
    "peak_tflops": args.peak_tflops,
    "on_gpu": on_gpu,
    **extra,
    **_rates(totals, args.peak_tflops, on_gpu),
  }


COLUMNS = (  # key, header, format
  ("pairs_per_s", "pairs/s", "{:.4f}"),
  ("pairs_per_cpu_s", "pairs/CPU-s", "{:.4f}"),
  ("seq_tokens_per_s", "seq tok/s", "{:.0f}"),
  ("real_tokens_per_s", "real tok/s", "{:.0f}"),
  ("fed_tokens_per_s", "fed tok/s", "{:.0f}"),
  ("packing_efficiency", "efficiency", "{:.1%}"),
  ("peak_memory_gib", "peak GiB", "{:.2f}"),
  ("model_tflops", "TFLOP/s", "{:.3f}"),
  ("mfu", "MFU", "{:.1%}"),
  ("compile_s", "compile s", "{:.1f}"),
  ("faults_per_step", "faults/step", "{:.0f}"),
)


def paired_ratios(run: dict, partner: dict) -> dict:
  """``run``'s speed over ``partner``'s, step by step: both took the same batch i in turn, so the
  ratio of step i is partner's seconds over run's. Median, quartiles and range over the steps."""
  ratios = np.asarray(partner["totals"]["step_seconds"]) / np.asarray(run["totals"]["step_seconds"])
  q = np.percentile(ratios, [0, 25, 50, 75, 100])
  return {
    "steps": len(ratios),
    "median": float(q[2]),
    "quartiles": [float(q[1]), float(q[3])],
    "range": [float(q[0]), float(q[4])],
    "per_step": [round(float(r), 3) for r in ratios],
  }


def print_table(results: list[dict]) -> None:
  """One row per run, then each jaxrm run's speed as a multiple of its lockstep partner's."""
  print(f"{'run':<28}" + "".join(f"{h:>12}" for _, h, _ in COLUMNS))
  for r in results:
    print(f"{r['name']:<28}" + "".join(f"{fmt.format(r[k]) if k in r else '-':>12}" for k, _, fmt in COLUMNS))
  for r in results:
    if "vs" in r:
      other, ratio = r["vs"], r["vs_ratio"]
      print(
        f"{r['name']} vs {other['name']}: {r['pairs_per_s'] / other['pairs_per_s']:.2f}x the pairs/s "
        f"({r['pairs_per_cpu_s'] / other['pairs_per_cpu_s']:.2f}x per CPU-second); per step, paired: "
        f"median {ratio['median']:.2f}x, quartiles {ratio['quartiles'][0]:.2f}-{ratio['quartiles'][1]:.2f}, "
        f"range {ratio['range'][0]:.2f}-{ratio['range'][1]:.2f} over {ratio['steps']} steps; peak "
        f"memory {r['peak_memory_gib']:.2f} vs {other['peak_memory_gib']:.2f} GiB"
      )
  for r in results:
    if "matmul_tflops" in r:
      print(
        f"{r['name']}: {r['model_tflops']:.3f} model TFLOP/s = {r['model_tflops'] / r['matmul_tflops']:.0%} of "
        f"a plain {MATMUL_N}^3 float32 jax.jit matmul in the same process ({r['matmul_tflops']:.3f})"
        + (f"; torch's matmul there: {r['torch_matmul_tflops']:.3f}" if "torch_matmul_tflops" in r else "")
        + f"; threads {json.dumps(r.get('threads', {}))}"
      )


def dry_run(args) -> None:
  """Model size and FLOPs per token, and each mode's batch shapes, without compiling anything."""
  import jax
  from flax import nnx

  from jaxrm.models.decoder import Decoder

  cfg = model_config(args)
  cfg = cfg.replace(lora=lora_config(args)) if args.lora else cfg
  abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
  num_params = sum(x.size for x in jax.tree.leaves(nnx.state(abstract)))
  n_dense = dense_params(cfg, num_params)
  print(f"{num_params / 1e6:.1f}M parameters; {flop_formula(cfg, n_dense)}")
  from jaxrm.models.decoder import attention_summary

  print(attention_summary(cfg, "gpu" if args.gpu else None))
  groups = batches_of(bench_pairs(args), args)
  for mode in args.modes:
    collate = collator(mode, args)
    shapes = set()
    for i, g in enumerate(groups):
      batch = collate(g)
      shapes.add(tuple(x.shape for x in jax.tree.leaves(batch)))
      mask = batch.attention_mask
      real = int(mask.sum())
      print(
        f"{mode} batch {i}{' (warm-up)' if i < args.warmup else ''}: input_ids "
        f"{list(mask.shape)}, efficiency {real / mask.size:.1%}, "
        f"{step_flops(cfg, n_dense, real, attended_keys(batch)) / 1e12:.2f} TFLOP"
      )
    print(f"{mode}: {len(shapes)} distinct batch shapes, so {len(shapes)} compiles")


def main(argv=None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  if args.worker == "init":
    write_start_weights(args, args.weights_dir)
    return
  if args.worker:
    channel = _Channel.from_spec(args.channel)
    ranked = ranked_worker(args.worker)
    if args.worker == "trl" or (ranked and ranked[0] == "trl"):
      result = run_trl(args, channel, ranked and ranked[1])
    else:
      result = run_jaxrm(args.worker, args, channel)
    channel.send(json.dumps(result))
    return
  if args.ranked:
    run_ranked(args, argv)
    return
  examples = bench_pairs(args)
  print(
    f"model {args.model}, {args.batch_size} pairs/step, {args.steps} timed steps after "
    f"{args.warmup}, max_length {args.max_length}, {args.dtype}, attention {args.attention}, "
    f"remat {args.remat}",
    flush=True,
  )
  print("data:", json.dumps(data_summary(examples)), flush=True)
  if args.dry_run:
    dry_run(args)
    return
  results, failed = [], []
  for mode in args.modes:
    if args.vs_variant:
      session = run_lockstep(
        [mode] + [mode + VARIANT_SEP + v for v in args.vs_variant], argv, args.warmup + args.steps
      )
      for run in session[1:]:
        run["vs"], run["vs_ratio"] = session[0], paired_ratios(run, session[0])
      results += session
      failed += [] if session else [mode]
      continue
    partner = "trl" if args.vs_trl else mode + LORA_SUFFIX if args.vs_lora else None
    first = mode + LORA_SUFFIX if args.lora else mode
    session = run_lockstep([first] + ([partner] if partner else []), argv, args.warmup + args.steps)
    if not session:
      failed.append(mode)
    elif partner:
      # LoRA is the run compared with full training; TRL the partner jaxrm is compared with.
      run, other = session if args.vs_trl else session[::-1]
      run["vs"], run["vs_ratio"] = other, paired_ratios(run, other)
    results += session
    for r in session:
      print(f"{r['name']}: {r['pairs_per_s']:.4f} pairs/s", flush=True)
  print_table(results)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(
        {"args": vars(args), "commit": commit(), "data": data_summary(examples), "results": results},
        f,
        indent=1,
      )
  if failed:
    sys.exit(f"failed: {', '.join(failed)} (their output is above)")


def run_ranked(args, argv: list[str]) -> None:
  """``--ranked``: for each K, jaxrm all_pairs, TRL on the expanded pairs and jaxrm plackett_luce
  in one lockstep session from the same start weights; stops unless the first-step losses agree."""
  print(
    f"model {args.model}, {args.batch_size} prompts/step, K = {', '.join(map(str, args.ranked))}, "
    f"{args.steps} timed steps after {args.warmup}, max_length {args.max_length}, {args.dtype}, "
    f"attention {args.attention}, remat {args.remat}",
    flush=True,
  )
  results, failed = [], []
  for k in args.ranked:
    groups = bench_groups(args, k)
    print(f"K={k} data:", json.dumps(data_summary(groups)), flush=True)
    if args.dry_run:
      continue
    with tempfile.TemporaryDirectory() as weights:
      run_argv = [*argv, f"--weights_dir={weights}"]
      init = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *run_argv, "--worker", "init"],
        capture_output=True,
        text=True,
        check=False,
      )
      if init.returncode:
        sys.exit(f"writing the start weights failed:\n{init.stderr[-3000:]}")
      first, listwise = RANKING_LOSSES
      runs = [f"{first}@{k}", f"trl@{k}", f"{listwise}@{k}"]
      session = run_lockstep(runs, run_argv, args.warmup + args.steps, first_step=check_first_losses)
    if not session:
      failed.append(f"K={k}")
      continue
    jaxrm_all, trl_run, jaxrm_pl = session
    for run in (jaxrm_all, jaxrm_pl):
      run["vs"], run["vs_ratio"] = trl_run, paired_ratios(run, trl_run)
    jaxrm_all["first_loss_vs_trl"] = loss_agreement(jaxrm_all["losses"][0], trl_run["losses"][0])
    results += session
    for r in session:
      print(f"{r['name']}: {r['pairs_per_s']:.4f} pairs/s", flush=True)
  if results:
    print_table(results)
    for r in results:
      if "first_loss_vs_trl" in r:
        a = r["first_loss_vs_trl"]
        print(
          f"{r['name']} first-step loss {a['jaxrm']:.9f}, TRL's on the expanded pairs {a['trl']:.9f}: "
          f"relative difference {a['relative']:.2e} (limit {LOSS_RTOL:g}); the same step from the same "
          f"weights on the same pairs"
        )
      elif "losses" in r and r["name"].startswith("jaxrm"):
        print(
          f"{r['name']}: its own loss (listwise), first step {r['losses'][0]:.9f}; not comparable to TRL's"
        )
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "commit": commit(), "results": results}, f, indent=1)
  if failed:
    sys.exit(f"failed: {', '.join(failed)} (their output is above)")


def loss_agreement(jaxrm_loss: float, trl_loss: float) -> dict:
  """The two first-step losses and their relative difference."""
  return {"jaxrm": jaxrm_loss, "trl": trl_loss, "relative": abs(jaxrm_loss - trl_loss) / abs(trl_loss)}


def check_first_losses(said: dict[str, str]) -> None:
  """After the first step: jaxrm all_pairs and TRL's expanded pairs must have the same loss.

  Raises:
    RuntimeError: they differ by more than ``LOSS_RTOL``; nothing is timed.
  """
  losses = {ranked_worker(run)[0]: float(payload) for run, payload in said.items()}
  agreement = loss_agreement(losses["all_pairs"], losses["trl"])
  if not agreement["relative"] <= LOSS_RTOL:
    raise RuntimeError(
      f"first-step losses disagree: jaxrm all_pairs {agreement['jaxrm']!r}, TRL "
      f"{agreement['trl']!r} (relative {agreement['relative']:.2e} > {LOSS_RTOL:g}); "
      "not timing a comparison of two different computations"
    )


# --------------------------------------------------------------------------------- lockstep


class _Channel:
  """Line messages between the parent and a worker, over a pair of pipes."""

  def __init__(self, read_fd: int, write_fd: int):
    self.inp = os.fdopen(read_fd, "r")
    self.out = os.fdopen(write_fd, "w", buffering=1)

  @classmethod
  def from_spec(cls, spec: str) -> _Channel:
    return cls(*map(int, spec.split(",")))

  def send(self, message: str) -> None:
    self.out.write(message + "\n")

  def receive(self) -> str:
    return self.inp.readline().strip()

  def wait_for(self, message: str) -> None:
    if self.receive() != message:
      raise RuntimeError("the benchmark's parent process went away")

  def close(self) -> None:
    self.inp.close()
    self.out.close()


def run_lockstep(runs: list[str], argv: list[str], num_steps: int, first_step=None) -> list[dict]:
  """Runs each of ``runs`` in its own process, one step each in turn (ABBA), so that both sides
  of a comparison meet the same machine load; returns their results (none if one failed).

  A worker says "ready" once set up (and compiled), "done" (optionally followed by a word about
  the step) after each step it is told to take ("step"), and sends its result as one JSON line
  once told to "finish". ``first_step``, given each run's word about its first step, may stop the
  session there by raising RuntimeError.
  """
  workers = [_start_worker(run, argv) for run in runs]
  try:
    for run, _, channel, _ in workers:
      _expect(channel, "ready", run)
    for i in range(num_steps):
      said = {}
      for run, _, channel, _ in workers if i % 2 == 0 else workers[::-1]:
        channel.send("step")
        said[run] = _expect(channel, "done", run)
      if i == 0 and first_step:
        first_step(said)
    for _, _, channel, _ in workers:
      channel.send("finish")
    return [_result_of(channel, run) for run, _, channel, _ in workers]
  except RuntimeError as e:
    print(e, file=sys.stderr)
    for run, proc, _, log in workers:
      proc.kill()
      proc.wait()
      log.seek(0)
      print(f"--- {run}:\n{log.read()[-3000:]}", file=sys.stderr)
    return []
  finally:
    for _, proc, channel, log in workers:
      channel.close()  # a worker still waiting for its turn sees the end and stops
      proc.wait()
      log.close()


def _start_worker(run: str, argv: list[str]):
  """``run``'s process, talking over two pipes, its output in a temporary file."""
  child_reads, parent_writes = os.pipe()
  parent_reads, child_writes = os.pipe()
  log = tempfile.TemporaryFile("w+")
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    *argv,
    "--worker",
    run,
    "--channel",
    f"{child_reads},{child_writes}",
  ]
  proc = subprocess.Popen(
    cmd, pass_fds=(child_reads, child_writes), stdout=log, stderr=log, env=variant_env(run)
  )
  os.close(child_reads)
  os.close(child_writes)
  return run, proc, _Channel(parent_reads, parent_writes), log


def _expect(channel: _Channel, message: str, run: str) -> str:
  """Reads ``message`` from ``run``; returns what followed it on the line ("" if nothing)."""
  got = channel.receive()
  word, _, rest = got.partition(" ")
  if word != message:
    raise RuntimeError(f"{run} failed (said {got!r} instead of {message!r})")
  return rest


def _result_of(channel: _Channel, run: str) -> dict:
  line = channel.receive()
  try:
    return json.loads(line)
  except json.JSONDecodeError:
    raise RuntimeError(f"{run} failed after its last step (said {line[:200]!r})") from None


if __name__ == "__main__":
  main()
