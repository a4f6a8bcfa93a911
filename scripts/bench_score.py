r"""Scoring throughput: ``rm.score``, the reward server under concurrent clients, and transformers.

CPU, the embedded SmolLM2-135M-Instruct (its GGUF weights, a new reward head), float32::

  python scripts/bench_score.py --items=128 --clients=16

One GPU, bfloat16 (transformers in bfloat16 on CUDA too)::

  python scripts/bench_score.py --dtype=bfloat16 --items=1024 --batch_size=32 --max_length=1024

The three score the same texts (rendered chats of long-tailed lengths, each ending in a newline so
that no reward is read at a pad token) with the same weights: the jaxrm model is exported to an HF
directory and loaded by ``AutoModelForSequenceClassification``; their rewards on one batch are
printed as a check that both run the same model. Each scores in batches of ``--batch_size`` rows:

* ``rm.score``: all texts in one call (tokenizing included); rows sorted by length, padded to
  multiples of 64 tokens.
* ``transformers``: the same length-sorted batches, each tokenized and padded to its longest row
  (dynamic padding, transformers' cheapest layout), one ``model(**batch)`` under ``torch.no_grad()``.
* ``server``: ``python -m jaxrm.serve``'s server in this process, with the same buckets and batch
  size, and ``--clients`` threads each sending requests of ``--items_per_request`` texts to
  ``/get_reward`` over loopback HTTP, one after another.

Compiling (jaxrm) and a first pass (transformers) happen before timing. The three then run in
turns, ``--repeats`` times (ABC ABC...), so that they meet the same machine load; each figure is
the median over repeats. Latency: per ``rm.score``/transformers batch, per server request.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

EMBEDDED = "embedded:SmolLM2-135M-Instruct"
WORDS = ("the model reads each answer and gives it a score so that training can prefer better "
         "replies over worse ones while rollouts keep arriving from many workers at once").split()


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default=EMBEDDED, help="What RewardModel.from_pretrained loads.")
  p.add_argument("--items", type=int, default=128, help="Texts scored per repeat.")
  p.add_argument("--batch_size", type=int, default=8, help="Rows per forward pass, for all three.")
  p.add_argument("--max_length", type=int, default=384, help="Longest text, in tokens.")
  p.add_argument("--median_length", type=int, default=96, help="Median text length, in tokens.")
  p.add_argument("--clients", type=int, default=16, help="Concurrent server clients.")
  p.add_argument("--items_per_request", type=int, default=4, help="Texts per server request.")
  p.add_argument("--repeats", type=int, default=3, help="Timed turns of each of the three.")
  p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", default=None, help="Also write the results here.")
  return p.parse_args(argv)


def make_texts(n: int, median: int, cap: int, tokenizer, seed: int) -> list[str]:
  """Rendered one-turn chats of lognormal lengths in tokens (at most ``cap``), ending in "\\n"."""
  rng = np.random.default_rng(seed)
  texts = []
  for i in range(n):
    target = int(min(cap, max(16, rng.lognormal(np.log(median), 0.6))))
    words = [WORDS[(i + k) % len(WORDS)] for k in range(target)]
    q = max(4, target // 4)
    text = (f"<|im_start|>user\n{' '.join(words[:q])}?<|im_end|>\n<|im_start|>assistant\n"
            f"{' '.join(words[q:])}.<|im_end|>\n")
    ids = tokenizer(text)["input_ids"]
    while len(ids) > cap:  # cut words until it fits; the words are 1-2 tokens each
      words = words[:-max(1, (len(ids) - cap) // 2)]
      text = (f"<|im_start|>user\n{' '.join(words[:q])}?<|im_end|>\n<|im_start|>assistant\n"
              f"{' '.join(words[q:])}.<|im_end|>\n")
      ids = tokenizer(text)["input_ids"]
    texts.append(text)
  return texts


def length_sorted_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
  order = sorted(range(len(lengths)), key=lambda i: lengths[i])
  return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def summary(name: str, seconds: list[float], latencies: list[list[float]], items: int, tokens: int) -> dict:
  """Median items/s and tokens/s over repeats; latency percentiles over all timed calls."""
  t = statistics.median(seconds)
  lat = np.asarray([x for run in latencies for x in run]) * 1000
  return dict(name=name, items_per_s=items / t, tokens_per_s=tokens / t, seconds=t,
              p50_ms=float(np.percentile(lat, 50)), p99_ms=float(np.percentile(lat, 99)),
              repeats=[items / s for s in seconds])


# ---------------------------------------------------------------------------------- the three runs


def run_rm_score(rm, texts, args):
  """(seconds, per-batch latencies): one rm.score call over all texts."""
  latencies = []
  score_tokens = rm.score_tokens

  def timed(ids, mask):
    start = time.perf_counter()
    out = score_tokens(ids, mask)
    latencies.append(time.perf_counter() - start)
    return out

  rm.score_tokens = timed  # the batches' own latency; the call's total time is measured outside
  try:
    start = time.perf_counter()
    rm.score(texts, batch_size=args.batch_size, max_length=args.max_length)
    return time.perf_counter() - start, latencies
  finally:
    del rm.score_tokens


def run_transformers(model, tokenizer, texts, batches, device):
  import torch
  latencies = []
  start = time.perf_counter()
  with torch.no_grad():
    for rows in batches:
      t0 = time.perf_counter()
      batch = tokenizer([texts[i] for i in rows], padding=True, return_tensors="pt").to(device)
      model(**batch).logits.float().cpu()
      latencies.append(time.perf_counter() - t0)
  return time.perf_counter() - start, latencies


def run_server(url, texts, args):
  opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
  k = args.items_per_request
  requests = [texts[i:i + k] for i in range(0, len(texts), k)]
  latencies, lock = [], threading.Lock()

  def post(chunk):
    body = json.dumps({"query": chunk}).encode()
    t0 = time.perf_counter()
    req = urllib.request.Request(url + "/get_reward", data=body, headers={"Content-Type": "application/json"})
    with opener.open(req, timeout=600) as reply:
      rewards = json.loads(reply.read())["rewards"]
    with lock:
      latencies.append(time.perf_counter() - t0)
    return rewards

  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
    list(pool.map(post, requests))
  return time.perf_counter() - start, latencies


# ---------------------------------------------------------------------------------- set-up


def load_transformers(rm, dtype: str):
  """transformers' AutoModelForSequenceClassification on the jaxrm model's own weights (an HF export)."""
  import torch
  import transformers
  device = "cuda" if torch.cuda.is_available() else "cpu"
  torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
  with tempfile.TemporaryDirectory() as out:
    rm.save_pretrained(out, dtype="float32")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch_dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  tokenizer.padding_side = "right"
  return model.to(device).eval(), tokenizer, device


def main(argv=None) -> None:
  args = parse_args(argv)
  import jax
  import torch
  import transformers

  from jaxrm import RewardModel
  from jaxrm.data.pipeline import length_buckets
  from jaxrm.server import ServerConfig, make_server

  rm = RewardModel.from_pretrained(args.model, dtype=args.dtype)
  hf_model, hf_tok, device = load_transformers(rm, args.dtype)
  texts = make_texts(args.items, args.median_length, args.max_length, rm.tokenizer, args.seed)
  encoded = [rm.encode(t, max_length=args.max_length) for t in texts]
  same_tokens = sum(e == hf_tok(t)["input_ids"] for e, t in zip(encoded, texts))
  lengths = [len(e) for e in encoded]
  tokens = sum(lengths)
  batches = length_sorted_batches(lengths, args.batch_size)
  print(f"{args.items} texts, {tokens} tokens (median {int(np.median(lengths))}, max {max(lengths)}); "
        f"jaxrm and transformers tokenize {same_tokens}/{args.items} identically", flush=True)

  # Untimed: jaxrm compiles each batch shape; transformers' first pass; a check that both score alike.
  ours = rm.score(texts, batch_size=args.batch_size, max_length=args.max_length)
  with torch.no_grad():
    first = hf_tok([texts[i] for i in batches[0]], padding=True, return_tensors="pt").to(device)
    theirs = hf_model(**first).logits[:, 0].float().cpu().numpy()
  run_transformers(hf_model, hf_tok, texts, batches[:2], device)
  print(f"max |jaxrm - transformers| reward on a batch: {np.abs(ours[batches[0]] - theirs).max():.2e}", flush=True)

  buckets = length_buckets(max(args.max_length, 64), 64)  # rm.score's
  config = ServerConfig(max_length=args.max_length, batch_size=args.batch_size, buckets=buckets,
                        max_batch=max(256, args.items_per_request), request_timeout=600)
  server = make_server(rm, "127.0.0.1", 0, config=config).start()
  try:
    server.wait_ready()
    run_server(server.url, texts[:2 * args.batch_size], args)  # untimed: the first connections and batches
    runs = {"rm.score": ([], []), "server": ([], []), "transformers": ([], [])}
    for _ in range(args.repeats):
      for name, fn in (("rm.score", lambda: run_rm_score(rm, texts, args)),
                       ("server", lambda: run_server(server.url, texts, args)),
                       ("transformers", lambda: run_transformers(hf_model, hf_tok, texts, batches, device))):
        seconds, latencies = fn()
        runs[name][0].append(seconds)
        runs[name][1].append(latencies)
        print(f"  {name}: {args.items / seconds:.1f} items/s", flush=True)
  finally:
    server.shutdown()

  results = [summary(name, s, lat, args.items, tokens) for name, (s, lat) in runs.items()]
  print_table(results, args)
  print(f"jax {jax.__version__} ({jax.default_backend()}), transformers {transformers.__version__}, "
        f"torch {torch.__version__} ({device}, attention {hf_model.config._attn_implementation}), "
        f"{os.cpu_count()} CPUs", flush=True)
  by = {r["name"]: r for r in results}
  print(f"rm.score / transformers: {by['rm.score']['items_per_s'] / by['transformers']['items_per_s']:.2f}x; "
        f"server / rm.score: {by['server']['items_per_s'] / by['rm.score']['items_per_s']:.0%}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(args=vars(args), results=results), f, indent=1)


def print_table(results: list[dict], args) -> None:
  print("\n| scorer | items/s | tokens/s | p50 latency | p99 latency |\n|---|---:|---:|---:|---:|")
  unit = {"rm.score": f"per batch of {args.batch_size}", "transformers": f"per batch of {args.batch_size}",
          "server": f"per request of {args.items_per_request}, {args.clients} clients"}
  for r in results:
    print(f"| {r['name']} ({unit[r['name']]}) | {r['items_per_s']:.1f} | {r['tokens_per_s']:.0f} | "
          f"{r['p50_ms']:.0f} ms | {r['p99_ms']:.0f} ms |")


if __name__ == "__main__":
  sys.exit(main())
