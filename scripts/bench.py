r"""Reward-model training throughput: jaxrm unpacked, packed and shared-prompt packed, and TRL.

CPU, SmolLM2-135M shape (random weights), against TRL's RewardTrainer on the same rows::

  python scripts/bench.py --model=smollm2-135m --vs-trl

One H200: Qwen2.5-1.5B shape, sequences up to 2048 tokens, bf16 compute, cuDNN attention::

  python scripts/bench.py --gpu

Every mode runs in its own process (so peak memory is its own) on the same procedurally generated
rows: multi-turn chats with long-tailed turn and completion lengths, two completions each, cut to
``--max_length`` from the left as the tokenizer does. Batch i holds rows [i*B, (i+1)*B) for every
mode and for TRL; the first ``--warmup`` batches are not timed, and compilation (one program per
distinct batch shape) happens before the clock starts and is reported on its own.

Reported per mode: pairs/s; tokens/s of the sequences as a trainer without packing sees them
(prompt counted once per completion), of the real tokens fed to the model, and of all positions
fed (padding included); packing efficiency = real / fed positions; peak memory (host RSS on CPU,
device peak bytes on GPU); model TFLOP/s; and MFU on GPU, against ``--peak_tflops``.

FLOPs of a step = real tokens x (6 N + 12 L T d): N = non-embedding parameters (the embedding is
a lookup; the reward head is counted), L = layers, T = row length fed to the model, d = query
heads x head dim. 6 N is the forward and backward matmuls; 12 L T d the attention scores and
weighted sums, forward and backward. TRL's step is counted the same way with its padded length.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

from jaxrm.data.tokenize import PreferenceExample
from jaxrm.models.config import ModelConfig, RopeConfig

SHAPES = {
    "tiny": dict(family="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16),
    "smollm2-135m": dict(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                         rope=RopeConfig(theta=100000.0), max_position_embeddings=8192,
                         tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(family="qwen2", vocab_size=151936, hidden_size=1536,
                         intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2,
                         head_dim=128, rms_norm_eps=1e-6, rope=RopeConfig(theta=1000000.0),
                         max_position_embeddings=32768, tie_word_embeddings=True, qkv_bias=True),
}
JAXRM_MODES = ("unpacked", "packed", "shared")
BUCKET = 64  # sequence and row lengths are multiples of this
GPU_PRESET = dict(model="qwen2.5-1.5b", max_length=2048, row_length=4096, batch_size=8,
                  dtype="bfloat16", attention="cudnn", remat="dots", modes="shared,packed,unpacked")

# Token ids of the generated chats: ChatML-like markers, then text.
PAD, IM_START, IM_END, NEWLINE, SYSTEM, USER, ASSISTANT = range(7)
FIRST_TEXT = 16


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", choices=sorted(SHAPES), default="smollm2-135m")
  p.add_argument("--modes", default=",".join(JAXRM_MODES), help="jaxrm modes, comma-separated")
  p.add_argument("--vs-trl", action="store_true", help="also run TRL's RewardTrainer")
  p.add_argument("--gpu", action="store_true", help=f"H200 preset: {GPU_PRESET}")
  p.add_argument("--batch_size", type=int, default=4, help="pairs per step")
  p.add_argument("--steps", type=int, default=3, help="timed steps per mode")
  p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
  p.add_argument("--max_length", type=int, default=512, help="longest sequence, in tokens")
  p.add_argument("--row_length", type=int, default=None, help="packed row length (2 x max_length)")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--attention", default="xla", choices=("xla", "cudnn"))
  p.add_argument("--remat", default="none", choices=("none", "dots", "full"))
  p.add_argument("--peak_tflops", type=float, default=989.0, help="accelerator peak (H200 bf16 dense)")
  p.add_argument("--rounds", type=int, default=1, help="measure every run this many times")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", default=None, help="write every result here")
  p.add_argument("--only", default=None, help=argparse.SUPPRESS)  # one mode, in this process
  p.add_argument("--result", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.gpu:
    for k, v in GPU_PRESET.items():
      if p.get_default(k) == getattr(args, k):
        setattr(args, k, v)
  args.row_length = args.row_length or 2 * args.max_length
  return args


def model_config(args) -> ModelConfig:
  return ModelConfig(**SHAPES[args.model], dtype=args.dtype, param_dtype="float32",
                     remat=args.remat, attention_impl=args.attention, pad_token_id=PAD)


# ------------------------------------------------------------------------------------- data


def _lognormal(rng, median: float, sigma: float, cap: int) -> int:
  return int(min(max(rng.lognormal(np.log(median), sigma), 1), cap))


def make_pairs(n: int, max_length: int, vocab: int, seed: int) -> list[PreferenceExample]:
  """``n`` two-completion chats: 1-8 turns, optional system prompt, long-tailed lengths."""
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
    completions = [text(_lognormal(rng, 180, 0.9, max_length // 2 - 1)) + [IM_END] for _ in range(2)]
    # As truncation="left": the oldest context tokens go until the longest sequence fits.
    context = context[max(0, len(context) + max(map(len, completions)) - max_length):]
    ids = tuple(np.asarray(context + c, np.int32) for c in completions)
    out.append(PreferenceExample(ids, (0, 1), 0.0, f"pair {i}", {}))
  return out


def data_summary(examples) -> dict:
  lengths = np.array([len(s) for e in examples for s in e.input_ids])
  return {"sequences": len(lengths), "mean_length": float(lengths.mean()),
          "median_length": float(np.median(lengths)), "p90_length": float(np.percentile(lengths, 90)),
          "max_length": int(lengths.max())}


def batches_of(examples, args):
  b = args.batch_size
  return [examples[i * b:(i + 1) * b] for i in range(args.warmup + args.steps)]


def flops_per_token(cfg: ModelConfig, num_params: int, length: int) -> float:
  n = num_params - cfg.vocab_size * cfg.hidden_size
  return 6 * n + 12 * cfg.num_layers * length * cfg.num_heads * cfg.head_dim


# ------------------------------------------------------------------------------------ jaxrm


def _packed_loss_fn(model):
  """Bradley-Terry loss of a packed batch, rewards read per completion and put back as [G, K]."""
  from flax import nnx
  from jaxrm import losses
  from jaxrm.data import packing
  graphdef = nnx.graphdef(model)

  def loss_fn(params, batch):
    m = nnx.merge(graphdef, params)
    out = m(batch["input_ids"], batch["attention_mask"], batch["positions"], batch["segment_ids"],
            batch["branch_ids"], reward_positions=batch["reward_positions"])
    rewards = packing.group_rewards(out, batch["reward_index"])
    _, metrics = losses.bradley_terry_loss(rewards, batch["ranks"], batch["example_mask"],
                                           batch["margin"])
    return metrics["loss"].total, metrics

  return loss_fn


def _collator(mode, args):
  """``groups -> batch`` for ``mode``; lengths (and packed row counts) follow each batch."""
  from jaxrm.data import packing, pipeline
  if mode == "unpacked":
    return pipeline.Collator(batch_size=args.batch_size, pad_id=PAD, num_completions=2,
                             buckets=pipeline.length_buckets(args.max_length, BUCKET))
  spec = packing.PackSpec(args.row_length, length_multiple=BUCKET, shared_prompt=mode == "shared",
                          pad_id=PAD)
  return packing.PackedCollator(args.batch_size, spec, num_completions=2)


def _peak_memory_gib() -> float:
  import jax
  stats = jax.local_devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return stats["peak_bytes_in_use"] / 2**30
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _compile_all(train_step, state, batches, collate):
  """Compiled step per batch shape, and the seconds spent compiling."""
  start, compiled = time.perf_counter(), {}
  for groups in batches:
    batch = collate(groups)
    key = tuple((k, v.shape) for k, v in sorted(batch.items()))
    if key not in compiled:
      compiled[key] = train_step.lower(state, batch).compile()
  return compiled, time.perf_counter() - start


def run_jaxrm(mode: str, args) -> dict:
  import jax
  from flax import nnx
  from jaxrm import optim, steps
  from jaxrm.models.decoder import RewardModelModule

  cfg = model_config(args)
  batches = batches_of(make_pairs(args.batch_size * (args.warmup + args.steps), args.max_length,
                                  cfg.vocab_size, args.seed), args)
  model = nnx.jit(lambda: RewardModelModule(cfg, rngs=nnx.Rngs(args.seed)))()
  params = nnx.state(model)
  num_params = sum(x.size for x in jax.tree.leaves(params))
  sched = dict(learning_rate=1e-5, warmup_steps=0, total_steps=1, decay="constant")
  tx = optim.make_optimizer(**sched, max_grad_norm=1.0)
  loss_fn = steps.make_loss_fn(model, steps.RewardSpec()) if mode == "unpacked" else _packed_loss_fn(model)
  train_step = steps.make_train_step(loss_fn, tx, optim.make_schedule(**sched))
  state = {"params": params, "opt_state": jax.jit(tx.init)(params), "step": jax.numpy.zeros((), "int32")}
  collate = _collator(mode, args)
  attention = cfg.attention_impl
  try:
    compiled, compile_s = _compile_all(train_step, state, batches, collate)
  except Exception as e:  # cuDNN may refuse a shape or mask: measure the XLA path instead
    if cfg.attention_impl != "cudnn":
      raise
    attention = f"xla (cudnn failed: {str(e).splitlines()[0][:200]})"
    args.attention = "xla"
    return dict(run_jaxrm(mode, args), attention=attention)

  totals = _new_totals()
  for i, groups in enumerate(batches):
    if i == args.warmup:
      jax.block_until_ready(state)
      clock = _Clock()
    batch = collate(groups)
    key = tuple((k, v.shape) for k, v in sorted(batch.items()))
    state, _ = compiled[key](state, batch)
    if i >= args.warmup:
      _count(totals, cfg, num_params, groups, real=int(batch["attention_mask"].sum()),
             fed=batch["attention_mask"].size, length=batch["input_ids"].shape[1])
  jax.block_until_ready(state)
  totals["seconds"], totals["cpu_seconds"] = clock.elapsed()
  return _result(f"jaxrm {mode}", args, totals, num_params, compile_s=compile_s,
                 attention=attention, backend=jax.default_backend())


# -------------------------------------------------------------------------------------- TRL


def run_trl(args) -> dict:
  import datasets
  import tokenizers
  import torch
  import transformers
  from trl import RewardConfig, RewardTrainer
  from jaxrm.models.config import to_hf_config

  cfg = model_config(args)
  examples = make_pairs(args.batch_size * (args.warmup + args.steps), args.max_length,
                        cfg.vocab_size, args.seed)
  hf = to_hf_config(cfg)
  config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
  torch.manual_seed(args.seed)
  model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
  num_params = sum(p.numel() for p in model.parameters())
  # The rows are token ids already; the tokenizer only names the pad and end tokens.
  vocab = {"<pad>": PAD, "<|im_start|>": IM_START, "<|im_end|>": IM_END, "<unk>": NEWLINE}
  tok = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>")),
      pad_token="<pad>", eos_token="<|im_end|>")
  data = datasets.Dataset.from_dict({"chosen_ids": [e.input_ids[0].tolist() for e in examples],
                                     "rejected_ids": [e.input_ids[1].tolist() for e in examples]})
  on_gpu = torch.cuda.is_available()
  with tempfile.TemporaryDirectory() as out:
    config = RewardConfig(
        output_dir=out, per_device_train_batch_size=args.batch_size,
        max_steps=args.warmup + args.steps, learning_rate=1e-5, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, max_length=args.max_length,
        train_sampling_strategy="sequential", logging_strategy="no", save_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_num_workers=0, use_cpu=not on_gpu,
        bf16=on_gpu and args.dtype == "bfloat16", gradient_checkpointing=args.remat != "none",
        seed=args.seed)

    class StepTimer(transformers.TrainerCallback):
      def __init__(self):
        self.begins, self.ends = [], []

      def on_step_begin(self, *args, **kwargs):
        self.begins.append(_Clock())

      def on_step_end(self, *args, **kwargs):
        self.ends.append(self.begins[0].now())

    timer = StepTimer()
    trainer = RewardTrainer(model=model, args=config, train_dataset=data, processing_class=tok,
                            callbacks=[timer])
    trainer.train()
  totals = _new_totals()
  for groups in batches_of(examples, args)[args.warmup:]:
    lengths = [len(s) for e in groups for s in e.input_ids]
    # DataCollatorForPreference pads every sequence to the batch's longest.
    _count(totals, cfg, num_params, groups, real=sum(lengths), fed=len(lengths) * max(lengths),
           length=max(lengths))
  memory = (torch.cuda.max_memory_allocated() / 2**30 if on_gpu
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
  totals["seconds"], totals["cpu_seconds"] = timer.begins[args.warmup].elapsed(timer.ends[-1])
  return _result("TRL RewardTrainer", args, totals, num_params,
                 memory_gib=memory, backend="cuda" if on_gpu else "cpu",
                 versions=f"trl {__import__('trl').__version__}, torch {torch.__version__}")


# ---------------------------------------------------------------------------------- reports


class _Clock:
  """Wall and process CPU seconds (every thread of the process) since it was made."""

  def __init__(self):
    self.start = self.now()

  @staticmethod
  def now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()

  def elapsed(self, end: tuple[float, float] | None = None) -> tuple[float, float]:
    end = end or self.now()
    return end[0] - self.start[0], end[1] - self.start[1]


def _new_totals() -> dict:
  return dict(pairs=0, real=0, fed=0, seq=0, flops=0.0, seconds=0.0, cpu_seconds=0.0)


def _count(totals, cfg, num_params, groups, *, real, fed, length) -> None:
  """Adds one timed step: its pairs, real and fed tokens, sequence tokens and FLOPs."""
  totals["pairs"] += len(groups)
  totals["real"] += real
  totals["fed"] += fed
  totals["seq"] += sum(len(s) for e in groups for s in e.input_ids)
  totals["flops"] += real * flops_per_token(cfg, num_params, length)


def _rates(totals: dict, peak_tflops: float, on_gpu: bool) -> dict:
  sec = totals["seconds"]
  out = {
      "pairs_per_s": totals["pairs"] / sec, "pairs_per_cpu_s": totals["pairs"] / totals["cpu_seconds"],
      "seq_tokens_per_s": totals["seq"] / sec, "real_tokens_per_s": totals["real"] / sec,
      "fed_tokens_per_s": totals["fed"] / sec, "packing_efficiency": totals["real"] / totals["fed"],
      "model_tflops": totals["flops"] / sec / 1e12,
  }
  if on_gpu:
    out["mfu"] = out["model_tflops"] / peak_tflops
  return out


def _result(name, args, totals, num_params, memory_gib=None, **extra) -> dict:
  on_gpu = extra.get("backend") in ("gpu", "cuda")
  return {"name": name, "model": args.model, "params_m": num_params / 1e6,
          "batch_size": args.batch_size, "steps": args.steps, "totals": totals,
          "peak_memory_gib": _peak_memory_gib() if memory_gib is None else memory_gib,
          "peak_tflops": args.peak_tflops, "on_gpu": on_gpu, **extra,
          **_rates(totals, args.peak_tflops, on_gpu)}


def combine(rounds: list[dict]) -> dict:
  """One run's results over several rounds: totals summed, rates recomputed, memory the peak."""
  totals = {k: sum(r["totals"][k] for r in rounds) for k in rounds[0]["totals"]}
  first = rounds[0]
  return {**first, "rounds": len(rounds), "totals": totals,
          "peak_memory_gib": max(r["peak_memory_gib"] for r in rounds),
          **_rates(totals, first["peak_tflops"], first["on_gpu"])}


COLUMNS = (  # key, header, format
    ("pairs_per_s", "pairs/s", "{:.4f}"), ("pairs_per_cpu_s", "pairs/CPU-s", "{:.4f}"),
    ("seq_tokens_per_s", "seq tok/s", "{:.0f}"),
    ("real_tokens_per_s", "real tok/s", "{:.0f}"), ("fed_tokens_per_s", "fed tok/s", "{:.0f}"),
    ("packing_efficiency", "efficiency", "{:.1%}"), ("peak_memory_gib", "peak GiB", "{:.2f}"),
    ("model_tflops", "TFLOP/s", "{:.3f}"), ("mfu", "MFU", "{:.1%}"), ("compile_s", "compile s", "{:.1f}"),
)


def print_table(results: list[dict]) -> None:
  """One row per run, then each jaxrm run's pairs/s as a multiple of TRL's."""
  print(f"{'run':<20}" + "".join(f"{h:>12}" for _, h, _ in COLUMNS))
  for r in results:
    print(f"{r['name']:<20}" + "".join(f"{fmt.format(r[k]) if k in r else '-':>12}" for k, _, fmt in COLUMNS))
  trl = next((r for r in results if r["name"].startswith("TRL")), None)
  for r in results:
    if trl and r is not trl:
      print(f"{r['name']}: {r['pairs_per_s'] / trl['pairs_per_s']:.2f}x TRL's pairs/s, "
            f"{r['pairs_per_cpu_s'] / trl['pairs_per_cpu_s']:.2f}x its pairs per CPU-second")


def main(argv=None) -> None:
  args = parse_args(argv)
  if args.only:
    result = run_trl(args) if args.only == "trl" else run_jaxrm(args.only, args)
    with open(args.result, "w") as f:
      json.dump(result, f)
    return
  examples = make_pairs(args.batch_size * (args.warmup + args.steps), args.max_length,
                        SHAPES[args.model]["vocab_size"], args.seed)
  print(f"model {args.model}, {args.batch_size} pairs/step, {args.steps} timed steps after "
        f"{args.warmup}, max_length {args.max_length}, row_length {args.row_length}, "
        f"{args.dtype}, attention {args.attention}, remat {args.remat}")
  print("data:", json.dumps(data_summary(examples)))
  runs = [m for m in args.modes.split(",") if m] + (["trl"] if args.vs_trl else [])
  measured = {run: [] for run in runs}
  for r in range(args.rounds):
    # Odd rounds go backwards, so that a load that drifts over the run weighs on every run alike.
    for run in runs if r % 2 == 0 else runs[::-1]:
      result = _run_child(run, argv or sys.argv[1:])
      if result:
        measured[run].append(result)
        print(f"round {r}: {result['name']}: {result['pairs_per_s']:.4f} pairs/s", flush=True)
  results = [combine(m) for m in measured.values() if m]
  print_table(results)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "data": data_summary(examples), "results": results,
                 "rounds": measured}, f, indent=1)


def _run_child(run: str, argv: list[str]) -> dict | None:
  """Runs one mode (or TRL) in a fresh process; its result, or None after printing its error."""
  with tempfile.NamedTemporaryFile(suffix=".json") as f:
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--only", run, "--result", f.name]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
      print(f"{run} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
      return None
    return json.load(open(f.name))


if __name__ == "__main__":
  main()
