r"""Start-up cost of a training set: reading and tokenizing it, first and from the cache.

  python scripts/bench_data.py --sizes=10000,100000,1000000 --skip=today@100000 --synthetic=1000000 \
      --work_dir=/tmp/jaxrm_bench_data --json=/tmp/jaxrm_bench_data/results.json

For each size, a JSON Lines file of generated multi-turn preference rows (NeMo RL layout: a
context of one to three user turns, two ranked assistant completions; log-normal word counts over
whole-word tokens of the vocabulary, about 350 tokens a sequence) is written once under
``--work_dir``. Each measurement runs in a fresh process with SmolLM2's tokenizer (converted from
the embedded GGUF) and ``--max_length``; peak RSS is sampled every 50 ms, of that process alone
and together with its tokenizer processes:

* ``today``: ``registry.load_records`` then ``tokenize_all`` in one process, every record and
  example held in memory (what a run did before the cache).
* ``first``: ``cache.load_tokenized`` on a cold cache with ``--num_proc`` processes, the records
  streamed from the file and the examples written to the cache as they come.
* ``cached``: the same call again: the file's fingerprint (a full xxh3 hash) and the entry opened.
* ``cached+pass``: that, then every example built once (what a run's set-up does to count
  tokens and completions).

``--padding`` measures something else: the share of fed token slots that hold real tokens in
unpacked training batches (no tokenizer process; a single pass over one epoch of batches), for
global-batch padding (every micro-batch as long as the global batch's longest sequence), each
micro-batch padded to its own bucket, and that with ``data.group_by_length``, on the demo set and
on a long-tailed generated mix, at NeMo RL-like settings::

  python scripts/bench_data.py --padding --work_dir=/tmp/jaxrm_bench_data

``--skip`` leaves out runs (e.g. ``today@100000``). A size in ``--synthetic`` gets its cache entry
from random token ids of the same length distribution, written under the real key without
tokenizing, so that the cached start of a set too large to tokenize here is measured (its
``today`` and ``first`` runs are left out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("today", "first", "cached", "cached+pass")
SYNTHETIC_MEDIAN_TOKENS = 310  # per sequence: about what the generated rows tokenize to


# ------------------------------------------------------------------ generated rows


def write_rows(path: str, num_rows: int, words: list[str], seed: int = 0) -> None:
  """Multi-turn preference rows: contexts of 1-3 user turns (with the assistant's replies between),
  two completions; turn lengths long-tailed (log-normal word counts) over ``words``."""
  import numpy as np

  rng = np.random.default_rng(seed)

  def text(median_words: float) -> str:
    n = int(np.clip(rng.lognormal(np.log(median_words), 0.7), 3, 20 * median_words))
    return " ".join(words[i] for i in rng.integers(0, len(words), n))

  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    for _ in range(num_rows):
      turns = int(rng.integers(1, 4))
      context = []
      for t in range(turns):
        context.append({"role": "user", "content": text(40)})
        if t < turns - 1:
          context.append({"role": "assistant", "content": text(60)})
      completions = [
        {"rank": r, "completion": [{"role": "assistant", "content": text(90)}]} for r in range(2)
      ]
      f.write(json.dumps({"context": context, "completions": completions}) + "\n")
  os.rename(tmp, path)


def vocabulary(tokenizer: str, size: int = 20_000) -> list[str]:
  """Whole words of the tokenizer's vocabulary (one token each with their leading space), most
  frequent merges first: text that tokenizes at English-like rates."""
  import transformers

  tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
  words = [(i, t[1:]) for t, i in tok.get_vocab().items() if t.startswith("\u0120") and t[1:].isalpha()]
  return [w for _, w in sorted(words)[:size]]


def tokenizer_dir(work_dir: str) -> str:
  """SmolLM2's tokenizer, converted from the embedded GGUF once into ``work_dir``."""
  saved = os.path.join(work_dir, "smollm2_tokenizer")
  if not os.path.exists(os.path.join(saved, "tokenizer.json")):
    import transformers

    from jaxrm.hf import gguf

    path = gguf.embedded_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok.save_pretrained(saved)
  return saved


# ------------------------------------------------------------------ one measurement (a child process)


class PeakRss:
  """Peak RSS of this process and of its processes together, sampled every 50 ms (ru_maxrss
  would count what the parent held before exec, and not sum the workers)."""

  def __init__(self):
    import psutil

    self.me = psutil.Process()
    self.peak_self = self.peak_tree = 0
    self.done = threading.Event()
    self.thread = threading.Thread(target=self._run, daemon=True)
    self.thread.start()

  def _run(self):
    while not self.done.wait(0.05):
      self.sample()

  def sample(self):
    import psutil

    try:
      own = self.me.memory_info().rss
      tree = own + sum(c.memory_info().rss for c in self.me.children(recursive=True))
    except psutil.Error:  # a worker ended between listing and reading
      return
    self.peak_self, self.peak_tree = max(self.peak_self, own), max(self.peak_tree, tree)

  def stop(self) -> tuple[float, float]:
    self.sample()
    self.done.set()
    self.thread.join()
    return self.peak_self / 2**20, self.peak_tree / 2**20


def child(mode: str, path: str, cache_dir: str, tokenizer: str, max_length: int, num_proc: int) -> dict:
  import transformers

  from jaxrm.data import cache, formats, registry, sources
  from jaxrm.data.drops import DropReport
  from jaxrm.data.tokenize import TokenizeOptions, tokenize_all

  tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
  opts = TokenizeOptions(max_length=max_length)
  drops = DropReport()
  source = {"dataset_name": "PreferenceDataset", "split": "train"}
  if mode == "synthetic":
    return write_synthetic_entry(path, cache_dir, tok, opts, source)
  rss = PeakRss()
  base = rss.me.memory_info().rss / 2**20
  t0 = time.perf_counter()
  if mode == "today":
    records = registry.load_records("PreferenceDataset", path, drops=drops)
    examples = tokenize_all(records, tok, opts, drops)
    tokens = sum(len(ids) for e in examples for ids in e.input_ids)
  else:

    def read(d):
      for row_source, row in sources.read_rows(path):
        record = formats.parse_preference(row, row_source, d, subset_field="subset")
        if record is not None:
          yield record

    source["source"] = sources.fingerprint(path)
    examples = cache.load_tokenized(
      read, tokenizer=tok, options=opts, drops=drops, source=source, cache_dir=cache_dir, num_proc=num_proc
    )
    tokens = examples.num_tokens()
    if mode == "cached+pass":
      for _ in examples:
        pass
  seconds = time.perf_counter() - t0
  peak_self, peak_tree = rss.stop()
  return {
    "seconds": seconds,
    "examples": len(examples),
    "dropped": drops.total,
    "tokens": tokens,
    "base_rss_mb": base,
    "peak_rss_mb": peak_self,
    "tree_peak_rss_mb": peak_tree,
  }


def write_synthetic_entry(path: str, cache_dir: str, tok, opts, source: dict) -> dict:
  """A cache entry for ``path`` holding random token ids of the generated rows' length
  distribution, written without tokenizing (for the cached start of a set too large to tokenize
  here); its key is the real one, so the ``cached`` runs read it."""
  import numpy as np

  from jaxrm.data import cache, sources
  from jaxrm.data.drops import DropReport
  from jaxrm.data.tokenize import PreferenceExample

  source["source"] = sources.fingerprint(path)
  key = cache.cache_key(source, tok, opts)
  entry = os.path.join(cache_dir, cache.key_hash(key))
  os.makedirs(entry)
  writer, rng = cache._Writer(entry), np.random.default_rng(0)  # pylint: disable=protected-access
  with open(path, "rb") as f:
    n = sum(1 for _ in f)
  for start in range(0, n, 10_000):
    chunk = []
    for i in range(start, min(start + 10_000, n)):
      lengths = np.clip(rng.lognormal(np.log(SYNTHETIC_MEDIAN_TOKENS), 0.5, 2), 40, opts.max_length).astype(
        int
      )
      ids = tuple(rng.integers(0, 49152, k, dtype=np.int32) for k in lengths)
      chunk.append(PreferenceExample(ids, (0, 1), 0.0, f"{path}:{i + 1}", {}))
    writer.add(chunk)
  writer.finish(key, DropReport())
  return {"examples": n}


def measure(mode: str, path: str, cache_dir: str, tokenizer: str, args) -> dict:
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    "--child",
    mode,
    "--child_path",
    path,
    "--child_cache",
    cache_dir,
    "--tokenizer",
    tokenizer,
    f"--max_length={args.max_length}",
    f"--num_proc={args.num_proc}",
  ]
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false")
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
  if out.returncode:
    raise SystemExit(f"{mode} on {path} failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ padding efficiency

# (global batch, micro-batch per device, data-parallel devices): NeMo RL's RM recipe on one node of
# 8 GPUs, and on one device.
PADDING_SETTINGS = ((128, 4, 8), (128, 8, 8), (128, 4, 1))
PADDING_MODES = {
  "global batch": {},
  "per micro-batch": {"micro": True},
  "per micro-batch + group_by_length": {"micro": True, "group_by_length": True},
}


def long_tailed_lengths(num_groups: int, max_length: int, seed: int = 0) -> list[tuple[int, int]]:
  """Pairs' sequence lengths: a log-normal prompt (median 250 tokens) and completion (median 150)
  each, clipped to ``max_length``: most pairs short, a long tail up to ``max_length``."""
  import numpy as np

  rng = np.random.default_rng(seed)
  prompt = rng.lognormal(np.log(250), 1.0, num_groups)
  done = rng.lognormal(np.log(150), 0.8, (num_groups, 2))
  return [tuple(int(min(max(p + c, 8), max_length)) for c in cs) for p, cs in zip(prompt, done)]


def demo_lengths(tokenizer: str, max_length: int) -> list[tuple[int, ...]]:
  """The demo set's pairs as the SmolLM2 tokenizer makes them."""
  import transformers

  from jaxrm.data import registry
  from jaxrm.data.drops import DropReport
  from jaxrm.data.tokenize import TokenizeOptions, tokenize_all

  tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
  records = registry.load_records("demo_arithmetic", None, split="train", drops=DropReport())
  examples = tokenize_all(records, tok, TokenizeOptions(max_length=max_length), DropReport())
  return [tuple(len(ids) for ids in e.input_ids) for e in examples]


def padding_efficiency(
  lengths: list[tuple[int, ...]],
  *,
  global_batch: int,
  micro_batch: int,
  data_parallel: int,
  max_length: int,
  bucket_multiple: int,
  micro: bool = False,
  group_by_length: bool = False,
  seed: int = 0,
) -> float:
  """Real tokens / fed token slots over one epoch of the pipeline's training batches of groups
  with these sequence ``lengths``; ``micro``: each micro-batch padded to its own bucket."""
  import numpy as np

  from jaxrm.data import pipeline
  from jaxrm.data.tokenize import PreferenceExample

  examples = [
    PreferenceExample(
      tuple(np.ones(n, np.int32) for n in group), tuple(range(len(group))), 0.0, f"group {i}", {}
    )
    for i, group in enumerate(lengths)
  ]
  grad_accum = global_batch // (micro_batch * data_parallel)
  it, stream = pipeline.make_train_iterator(
    examples,
    batch_size=global_batch,
    seed=seed,
    buckets=pipeline.length_buckets(max_length, bucket_multiple),
    micro_batches=grad_accum if micro else 1,
    group_by_length=group_by_length,
  )
  real = fed = 0
  for _ in range(stream.steps_per_epoch):
    n, share = pipeline.token_counts(next(it))
    real, fed = real + n, fed + n / share
  return real / fed


def padding_table(args) -> str:
  """The table of :func:`padding_efficiency` per data set, setting and mode (markdown)."""
  demo = demo_lengths(args.tokenizer or tokenizer_dir(args.work_dir), 128)
  mix = long_tailed_lengths(args.padding_groups, args.max_length)
  # (name, lengths, max_length, bucket_multiple): the demo as configs/rm.py and at the default buckets.
  sets = [
    ("demo_arithmetic", demo, 128, 16),
    ("demo_arithmetic", demo, 128, 64),
    (f"long-tailed mix (<= {args.max_length})", mix, args.max_length, args.bucket_multiple),
  ]
  lines = [
    "| data | buckets of | global batch | micro-batch x devices | accumulation | "
    + " | ".join(PADDING_MODES)
    + " |",
    "|---|---:|---:|---:|---:|" + "---:|" * len(PADDING_MODES),
  ]
  for name, lengths, max_length, multiple in sets:
    for gbs, mbs, dp in PADDING_SETTINGS:
      cells = [
        padding_efficiency(
          lengths,
          global_batch=gbs,
          micro_batch=mbs,
          data_parallel=dp,
          max_length=max_length,
          bucket_multiple=multiple,
          **options,
        )
        for options in PADDING_MODES.values()
      ]
      lines.append(
        f"| {name} | {multiple} | {gbs} | {mbs} x {dp} | {gbs // (mbs * dp)} | "
        + " | ".join(f"{c:.1%}" for c in cells)
        + " |"
      )
      print(lines[-1], flush=True)
  return "\n".join(lines)


# ------------------------------------------------------------------ the table


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--sizes", default="10000,100000")
  p.add_argument("--work_dir", default="/tmp/jaxrm_bench_data")
  p.add_argument("--max_length", type=int, default=2048)
  p.add_argument("--num_proc", type=int, default=os.cpu_count() or 1)
  p.add_argument("--skip", default="", help="comma-separated mode@size runs to leave out, e.g. today@1000000")
  p.add_argument(
    "--synthetic",
    default="",
    help="comma-separated sizes whose cache entry is written from "
    "random ids instead of tokenized (cached runs only)",
  )
  p.add_argument("--tokenizer", default=None)
  p.add_argument("--json", default=None, help="also write the results here")
  p.add_argument(
    "--padding",
    action="store_true",
    help="report the real/fed token efficiency of unpacked batches instead (see above)",
  )
  p.add_argument("--padding_groups", type=int, default=8192, help="pairs of the long-tailed mix")
  p.add_argument(
    "--bucket_multiple", type=int, default=64, help="data.bucket_multiple of the long-tailed mix (--padding)"
  )
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  p.add_argument("--child_path", default=None, help=argparse.SUPPRESS)
  p.add_argument("--child_cache", default=None, help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    print(
      json.dumps(
        child(args.child, args.child_path, args.child_cache, args.tokenizer, args.max_length, args.num_proc)
      )
    )
    return
  os.makedirs(args.work_dir, exist_ok=True)
  if args.padding:
    print(padding_table(args))
    return
  tokenizer = args.tokenizer or tokenizer_dir(args.work_dir)
  skip = set(filter(None, args.skip.split(",")))
  synthetic = set(map(int, filter(None, args.synthetic.split(","))))
  results, words = [], None
  for size in map(int, args.sizes.split(",")):
    path = os.path.join(args.work_dir, f"pairs_{size}.jsonl")
    if not os.path.exists(path):
      t = time.perf_counter()
      write_rows(path, size, words or (words := vocabulary(tokenizer)))
      print(
        f"wrote {path} ({os.path.getsize(path) / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s", flush=True
      )
    cache_dir = os.path.join(args.work_dir, f"cache_{size}")
    shutil.rmtree(cache_dir, ignore_errors=True)
    if size in synthetic:
      measure("synthetic", path, cache_dir, tokenizer, args)
    for mode in MODES:
      if f"{mode}@{size}" in skip or (size in synthetic and mode in ("today", "first")):
        continue
      r = {
        "mode": mode,
        "pairs": size,
        "file_gb": os.path.getsize(path) / 1e9,
        **measure(mode, path, cache_dir, tokenizer, args),
      }
      results.append(r)
      print(_row(r), flush=True)
  print(_table(results))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(
        {
          "num_proc": args.num_proc,
          "max_length": args.max_length,
          "cpus": os.cpu_count(),
          "results": results,
        },
        f,
        indent=2,
      )


def _row(r: dict) -> str:
  return (
    f"{r['mode']:>12} {r['pairs']:>8} pairs: {r['seconds']:8.1f} s, {r['pairs'] / r['seconds']:9.0f} pairs/s, "
    f"peak RSS {r['peak_rss_mb']:7.0f} MB (after imports {r['base_rss_mb']:5.0f} MB; with workers "
    f"{r['tree_peak_rss_mb']:7.0f} MB), tokens {r['tokens'] / 1e6:7.1f}M = {r['tokens'] * 4 / 2**20:7.0f} MB "
    f"int32, {r['examples']} examples, {r['dropped']} dropped"
  )


def _table(results: list[dict]) -> str:
  lines = [
    "| pairs | file | mode | seconds | pairs/s | peak RSS (after imports) | with workers | tokens as int32 |",
    "|---:|---:|---|---:|---:|---:|---:|---:|",
  ]
  for r in results:
    lines.append(
      f"| {r['pairs']:,} | {r['file_gb']:.2f} GB | {r['mode']} | {r['seconds']:.1f} | "
      f"{r['pairs'] / r['seconds']:,.0f} | {r['peak_rss_mb']:,.0f} MB ({r['base_rss_mb']:,.0f} MB) | "
      f"{r['tree_peak_rss_mb']:,.0f} MB | {r['tokens'] / 1e6:,.1f}M = {r['tokens'] * 4 / 2**20:,.0f} MB |"
    )
  return "\n".join(lines)


if __name__ == "__main__":
  main()
