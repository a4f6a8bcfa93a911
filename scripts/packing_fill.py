r"""Real tokens per fed token slot of packed rows, as the packer plans them, per mix and packing.

  python scripts/packing_fill.py --json=benchmarks/packing_fill.json

For each mix of preference pairs, every global batch of one pass is packed as the trainer packs it
(``PackedCollator``: every host's micro-batches, rows in multiples of the data-parallel devices)
and ``packing.fill`` reads the share of the fed token slots that hold a written token (a shared
prompt counts once: it is written once). Each mix is packed ``packed`` and ``shared_prompt``:

* ``first-fit``: rows as packing did before fitting: ``row_length`` long (or, where the mix's
  rows are sized automatically, as long as the batch's longest group, in steps of the bucket),
  filled first-fit decreasing, as many as needed.
* ``fitted /M up to T``: ``PackSpec(fit_multiple=M)``: each batch's row length (a multiple of M
  up to T, or the length first-fit rows of at most T would have) and row count chosen together,
  the pair with the fewest slots that holds the batch.

The mixes:

* ``benchmark``: the GPU benchmark's rows (``scripts/bench.py --gpu``: ``bench_common.make_pairs``
  at max_length 2048, 8 pairs a step, seed 0), its 8 timed steps (the warm-up batch left out),
  and 400 batches of the same generator; the benchmark packs them into rows of 4096
  (``--row_length=4096``).
* ``demo``: demo_arithmetic as ``configs/rm.py`` trains it (SmolLM2's tokenizer, max_length 128,
  8 pairs a step, buckets of 16).
* ``NeMo-shaped``: a long-tailed mix (prompts log-normal about 250 tokens, completions about 150,
  left-truncated to 4096) at NeMo RL's reward-model recipe on 8 GPUs (global batch 128, 4 pairs
  per device, accumulation 4).
* ``TRL-shaped``: the same long-tailed distribution at TRL RewardTrainer's defaults
  (max_length 1024, 8 pairs per device, one device).

Each row of the table says how many distinct batch shapes [B, T] the pass took: a step compiles
once per shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, ROOT)

from bench_common import SHAPES, make_pairs  # noqa: E402

from jaxrm.data import packing  # noqa: E402
from jaxrm.data.tokenize import PreferenceExample  # noqa: E402

MODES = ("packed", "shared_prompt")
TARGET = 0.95  # real tokens per fed slot, packed and shared_prompt, on the benchmark's rows


@dataclasses.dataclass(frozen=True)
class Mix:
  """Pairs and how a run batches them."""

  name: str
  examples: list
  per_host: int  # pairs per global batch (one host)
  max_length: int
  bucket: int  # data.bucket_multiple: automatic rows grow in steps of this
  micro_batches: int = 1
  # Rows per batch in multiples of the data-parallel devices x a quarter of the pairs each takes
  # per micro-batch (run_data.batching): 8 for NeMo's, 2 for 8 pairs a step on one device; 1 in
  # the benchmark, whose collator leaves it at 1.
  rows_multiple: int = 1
  row_length: int = 0  # data.packed_row_length (0: rows sized from each batch's longest group)
  first_batch: int = 0  # batches before this one are not measured (the benchmark's warm-up)


def benchmark_pairs(num_batches: int, seed: int = 0) -> list[PreferenceExample]:
  """The GPU benchmark's pairs (``bench.py --gpu``: 8 a step, max_length 2048), its warm-up batch
  first."""
  return make_pairs(8 * (num_batches + 1), 2048, SHAPES["qwen2.5-1.5b"].vocab_size, seed)


def long_tailed_pairs(num_pairs: int, max_length: int, seed: int = 0) -> list[PreferenceExample]:
  """Pairs with a log-normal prompt (median 250 tokens) and completions (median 150), as
  ``bench_data.long_tailed_lengths`` draws them, the prompt left-truncated so both fit
  ``max_length``; the two completions share the prompt."""
  rng = np.random.default_rng(seed)
  prompt = rng.lognormal(np.log(250), 1.0, num_pairs)
  done = rng.lognormal(np.log(150), 0.8, (num_pairs, 2))
  out = []
  for i, (p, cs) in enumerate(zip(prompt, done)):
    cs = [int(min(max(c, 1), max_length - 1)) for c in cs]
    p = int(min(max(p, 1), max_length - max(cs)))
    context = np.arange(16, 16 + p, dtype=np.int32)
    # The completions differ from their first token: the prompt is all the pair shares.
    ids = tuple(np.concatenate([context, np.full(c, 10_000 + j, np.int32)]) for j, c in enumerate(cs))
    out.append(PreferenceExample(ids, (0, 1), 0.0, f"pair {i}", {}))
  return out


def demo_pairs(work_dir: str) -> list[PreferenceExample]:
  """demo_arithmetic tokenized as configs/rm.py does (SmolLM2's tokenizer, max_length 128)."""
  import transformers
  from bench_data import tokenizer_dir

  from jaxrm.data import registry
  from jaxrm.data.drops import DropReport
  from jaxrm.data.tokenize import TokenizeOptions, tokenize_all

  tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir(work_dir))
  records = registry.load_records("demo_arithmetic", None, split="train", drops=DropReport())
  return tokenize_all(records, tok, TokenizeOptions(max_length=128), DropReport())


def global_batches(mix: Mix, seed: int = 0) -> list[list]:
  """One pass of ``mix`` in global batches: the benchmark's in order, the others shuffled."""
  order = np.arange(len(mix.examples))
  if mix.name != "benchmark":
    order = np.random.default_rng(seed).permutation(len(order))
  n = len(order) // mix.per_host
  return [[mix.examples[i] for i in order[b * mix.per_host : (b + 1) * mix.per_host]] for b in range(n)][
    mix.first_batch :
  ]


def packings(mix: Mix, shared_prompt: bool) -> dict[str, packing.PackSpec]:
  """The first-fit packing the mix is trained with today, and fitted ones."""
  auto = 2 * mix.max_length  # a pair of max_length tokens: run_data's automatic row length
  base = packing.PackSpec(
    mix.row_length or auto,
    length_multiple=0 if mix.row_length else mix.bucket,
    shared_prompt=shared_prompt,
    rows_multiple=mix.rows_multiple,
  )
  fitted = [
    (mix.bucket, base.row_length),
    (4 * mix.bucket, base.row_length),
    (8 * mix.bucket, 2 * base.row_length),
  ]
  out = {"first-fit": base}
  for m, cap in fitted:
    out[f"fitted /{m} up to {cap}"] = dataclasses.replace(base, row_length=cap, fit_multiple=m)
  return out


def measure(mix: Mix, batches: list[list], spec: packing.PackSpec) -> dict:
  """``packing.fill`` over ``batches``, the distinct shapes, and the planning time per batch."""
  collate = packing.PackedCollator(mix.per_host, spec, num_completions=2, micro_batches=mix.micro_batches)
  t0 = time.perf_counter()
  fill = packing.fill(batches, collate)
  seconds = (time.perf_counter() - t0) / len(batches)
  shapes = {collate(groups).input_ids.shape[-2:] for groups in batches}
  return {"fill": fill, "shapes": len(shapes), "plan_ms_per_batch": 1000 * seconds}


def mixes(args) -> list[tuple[Mix, int]]:
  """(mix, batches measured)."""
  bench = dict(per_host=8, max_length=2048, bucket=64, row_length=4096, first_batch=1)
  out = [
    Mix("benchmark", benchmark_pairs(8), **bench),
    Mix("benchmark (400 batches)", benchmark_pairs(400, seed=1), **bench),
    Mix("NeMo-shaped", long_tailed_pairs(8192, 4096), 128, 4096, 64, micro_batches=4, rows_multiple=8),
    Mix("TRL-shaped", long_tailed_pairs(4096, 1024, seed=1), 8, 1024, 64, rows_multiple=2),
  ]
  if not args.no_demo:
    out.insert(2, Mix("demo", demo_pairs(args.work_dir), 8, 128, 16, rows_multiple=2))
  return out


def commit() -> str:
  out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
  dirty = subprocess.run(
    ["git", "status", "--porcelain", "--", "jaxrm/data"], cwd=ROOT, capture_output=True, text=True
  )
  return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--json", default=None, help="write the rows here, with the command and commit")
  p.add_argument("--work_dir", default="/tmp/jaxrm_bench_data", help="where the demo's tokenizer is kept")
  p.add_argument("--no_demo", action="store_true", help="leave out the demo (it needs the tokenizer)")
  args = p.parse_args(argv)
  rows = []
  print("| mix | packing | rows | real / fed | shapes | plan ms/batch |")
  print("|---|---|---|---:|---:|---:|")
  for mix in mixes(args):
    batches = global_batches(mix)
    for mode in MODES:
      for name, spec in packings(mix, mode == "shared_prompt").items():
        row = {
          "mix": mix.name,
          "packing": mode,
          "rows": name,
          "batches": len(batches),
          **measure(mix, batches, spec),
        }
        rows.append(row)
        print(
          f"| {mix.name} | {mode} | {name} | {row['fill']:.1%} | {row['shapes']} | "
          f"{row['plan_ms_per_batch']:.2f} |",
          flush=True,
        )
  if args.json:
    record = {
      "command": "python scripts/packing_fill.py " + " ".join(argv if argv is not None else sys.argv[1:]),
      "commit": commit(),
      "target": TARGET,
      "rows": rows,
    }
    with open(args.json, "w") as f:
      json.dump(record, f, indent=1)
      f.write("\n")


if __name__ == "__main__":
  main()
