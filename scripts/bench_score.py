r"""Scoring throughput: ``rm.score``, the reward server under concurrent clients, and transformers.

CPU, the embedded SmolLM2-135M-Instruct (its GGUF weights, a new reward head), float32::

  python scripts/bench_score.py --items=128 --clients=16

One GPU, bfloat16 (transformers in bfloat16 on CUDA too)::

  python scripts/bench_score.py --dtype=bfloat16 --items=1024 --batch_size=32 --max_length=1024

GRPO-shaped scoring: P prompts with G completions each, for each G of ``--group_sizes``::

  python scripts/bench_score.py --workload=grpo --prompts=2 --group_sizes=8,16 --max_length=1024

A generative verifier (the same GGUF, zero-shot: ``log p(Yes) - log p(No)`` after its question)
against transformers' causal LM, on either workload::

  python scripts/bench_score.py --workload=grpo --verifier --prompts=2 --group_sizes=8,16 --max_length=1024
  python scripts/bench_score.py --verifier --items=128 --clients=16

A pairwise judge (zero-shot: ``log p(A) - log p(B)`` after its question) scoring each GRPO group's
comparisons, for each strategy of ``--strategies``, against transformers' causal LM on the same
judge texts one by one; ``--random_shape`` scores with a random Llama of that shape and SmolLM2's
tokenizer instead of ``--model``::

  python scripts/bench_score.py --workload=grpo --judge --random_shape=4,256,768,4,2 --prompts=2 \
      --group_sizes=8,16 --strategies=round_robin,circular --max_length=2048

Padding buckets: ``rm.score`` on the chats with rows padded to multiples of each of ``--buckets``,
cold (JAX's caches cleared: every shape compiles) and warm, in turns::

  python scripts/bench_score.py --workload=buckets --items=64 --max_length=256 --buckets=16,32,64,128

``--workload=chats`` (the default): one completion per prompt. rm.score, the server and
transformers score the same texts (rendered chats of long-tailed lengths, each ending in a newline
so that no reward is read at a pad token) with the same weights: the jaxrm model is exported to an
HF directory and loaded by ``AutoModelForSequenceClassification``; their rewards on one batch are
printed as a check that both run the same model. Each scores in batches of ``--batch_size`` rows:

* ``rm.score``: all texts in one call (tokenizing included); rows sorted by length, padded to
  multiples of 64 tokens (these chats share no prefix worth sharing; the count is printed).
* ``transformers``: the same length-sorted batches, each tokenized and padded to its longest row
  (dynamic padding, transformers' cheapest layout), one ``model(**batch)`` under ``torch.no_grad()``.
* ``server``: ``python -m jaxrm.serve``'s server in this process, with the same buckets and batch
  size, and ``--clients`` threads each sending requests of ``--items_per_request`` texts to
  ``/get_reward`` over loopback HTTP, one after another.

``--workload=grpo``: rendered prompts (a system turn and a question) of lognormal lengths, median
``--prompt_median`` tokens, each with G completions of lognormal lengths, median
``--completion_median`` (both sigma 0.6; a prompt takes at most half of ``--max_length``, its
completions the rest). Scored by ``rm.score`` sharing each prompt's tokens between its completions
(the default), ``rm.score`` with ``share_prefix=False`` (every row alone, right-padded, as before
sharing), transformers as above, and the server (its default buckets, sharing prefixes across the
requests it batches) under ``--clients`` concurrent clients, each request one group's texts to
``/get_reward`` (OpenRLHF's flat strings: the server finds the shared prompt in the token ids).

``--verifier``: the model is loaded with ``RewardModel.from_pretrained(..., verifier=True)`` and
the items are conversations (message lists) instead of their rendered texts, so that each ends with
the verifier's question (a user turn) and the generation prompt; the generated chats leave room for
them within ``--max_length``. ``rm.score`` takes the conversations (rendering them is timed), the
server takes them at ``/score`` (``{"conversations": [...]}``), and transformers runs
``AutoModelForCausalLM`` on the jaxrm export, a causal LM of the same weights, given the texts
jaxrm renders (:meth:`jaxrm.tasks.verifier.Verifier.render`, untimed), whose ids must equal the ids jaxrm
scores. Its batches are length-sorted as above, left-padded to the batch's longest row with the
matching position ids, so that the last position is every row's last real token: it computes the
logits there only (``logits_to_keep=1``, no KV cache) and scores ``log_softmax(logits)[yes] -
[no]``. jaxrm computes the two answers' logits alone. The results and tables are marked as a
verifier's.

``--judge``: the model is loaded as a zero-shot pairwise judge (``judge=True``) and each group is
scored by :func:`jaxrm.tasks.pairwise.score_groups` (``rm.score_group`` for one group): its judge
texts (:meth:`~jaxrm.tasks.pairwise.Judge.render`: the conversation, responses A and B and the
question in one user turn), both orders of each compared pair, scored with shared prefixes, then
unshared (``share_prefix=False``); transformers' causal LM scores the same texts one by one as for
a verifier (length-sorted batches, left-padded, ``log_softmax`` at the last position of answer A
minus answer B), and the same Bradley-Terry strengths are computed from its log-odds; the server,
where it has ``/compare``, gets one group per request. Besides items/s (an item is one response
of a group: G per group) the run counts the tokens: all judge texts one by one, the layouts the
decoder's two-level tree mask allows (one shared prefix per packed row and a branch per row: the
conversation once per group, or the conversation and response A once per response A), and the
tokens jaxrm's grouping actually feeds; it reports the speedup over transformers as a share of
the token reduction of the best allowed layout.

Both sides' scores of one batch are printed; in float32 on a CPU they must agree within
:data:`AGREE_ATOL` (the run stops otherwise); in bfloat16, or on a GPU, the difference is only shown.

Compiling (jaxrm) and a first pass (transformers) happen before timing. The scorers then run in
turns, ``--repeats`` times (ABC ABC...), so that they meet the same machine load; each figure is
the median over repeats (grpo: with the spread). Latency (chats): per ``rm.score``/transformers
batch, per server request.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import dataclasses
import inspect
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import numpy as np
from bench_common import commit

EMBEDDED = "embedded:SmolLM2-135M-Instruct"
WORDS = (
  "the model reads each answer and gives it a score so that training can prefer better "
  "replies over worse ones while rollouts keep arriving from many workers at once"
).split()
# The largest |jaxrm - transformers| score on a batch, in float32 on a CPU: both sum in float32, in
# different orders (~1e-5 apart on SmolLM2-135M, rewards and log-odds alike), while a wrong weight,
# token or position moves a score by far more. bfloat16 or a GPU's float32 dots (TF32) round more.
AGREE_ATOL = 1e-3


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default=EMBEDDED, help="What RewardModel.from_pretrained loads.")
  p.add_argument(
    "--workload",
    choices=["chats", "grpo", "buckets"],
    default="chats",
    help="One completion per prompt (chats), P prompts x G completions (grpo), or rm.score's "
    "padding buckets (buckets).",
  )
  p.add_argument(
    "--verifier",
    action="store_true",
    help="Score with the model as a zero-shot generative verifier (verifier=True), against "
    "transformers' AutoModelForCausalLM.",
  )
  p.add_argument(
    "--judge",
    action="store_true",
    help="grpo: score each group's comparisons with the model as a zero-shot pairwise judge "
    "(judge=True), against transformers' AutoModelForCausalLM on the same judge texts.",
  )
  p.add_argument(
    "--strategies", default="round_robin,circular", help="--judge: the comparison strategies, one run each."
  )
  p.add_argument(
    "--random_shape",
    default=None,
    help="Score with a random LlamaForCausalLM of this shape (layers,hidden,intermediate,heads,kv_heads) "
    "and SmolLM2's tokenizer, in place of --model.",
  )
  p.add_argument("--buckets", default="16,32,64,128", help="buckets: the length multiples to compare.")
  p.add_argument("--items", type=int, default=128, help="Chats scored per repeat.")
  p.add_argument("--batch_size", type=int, default=8, help="Rows per forward pass, for all three.")
  p.add_argument("--max_length", type=int, default=384, help="Longest text, in tokens.")
  p.add_argument("--median_length", type=int, default=96, help="Median text length, in tokens.")
  p.add_argument("--clients", type=int, default=16, help="Concurrent server clients.")
  p.add_argument(
    "--batch_wait_ms", type=float, default=None, help="grpo: the server's --batch_wait_ms (default: its own)."
  )
  p.add_argument("--items_per_request", type=int, default=4, help="Texts per server request.")
  p.add_argument("--prompts", type=int, default=4, help="grpo: prompts P.")
  p.add_argument("--group_sizes", default="8,16", help="grpo: completions G per prompt, one run each.")
  p.add_argument("--prompt_median", type=int, default=256, help="grpo: median prompt length, in tokens.")
  p.add_argument("--completion_median", type=int, default=128, help="grpo: median completion length.")
  p.add_argument("--repeats", type=int, default=3, help="Timed turns of each scorer.")
  p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", default=None, help="Also write the results here.")
  return p.parse_args(argv)


def chatml(messages: list[dict]) -> str:
  """``messages`` as SmolLM2's chat template writes them (without the system turn it adds)."""
  return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def make_chats(n: int, median: int, cap: int, tokenizer, seed: int) -> list[list[dict]]:
  """One-turn chats (a question, an answer) of lognormal lengths in tokens once rendered by
  :func:`chatml` (at most ``cap``)."""
  rng = np.random.default_rng(seed)
  chats = []
  for i in range(n):
    target = int(min(cap, max(16, rng.lognormal(np.log(median), 0.6))))
    words = [WORDS[(i + k) % len(WORDS)] for k in range(target)]
    q = max(4, target // 4)
    ids = tokenizer(chatml(question_and_answer(words, q)))["input_ids"]
    while len(ids) > cap:  # cut words until it fits; the words are 1-2 tokens each
      words = words[: -max(1, (len(ids) - cap) // 2)]
      ids = tokenizer(chatml(question_and_answer(words, q)))["input_ids"]
    chats.append(question_and_answer(words, q))
  return chats


def question_and_answer(words: list[str], q: int) -> list[dict]:
  """A user turn asking the first ``q`` words, an assistant turn answering with the rest."""
  return [
    {"role": "user", "content": " ".join(words[:q]) + "?"},
    {"role": "assistant", "content": " ".join(words[q:]) + "."},
  ]


def make_groups(
  num_prompts: int, group_size: int, args, tokenizer, seed: int, room: int = 0
) -> list[list[list[dict]]]:
  """``num_prompts`` groups of ``group_size`` chats: a prompt (a system turn and a question, about
  ``args.prompt_median`` tokens, lognormal) and one answer of its own (about
  ``args.completion_median``), at most ``args.max_length - room`` tokens once rendered by
  :func:`chatml`. Words are drawn at random, so the prompts share only their template's opening
  and the completions nothing."""
  rng = np.random.default_rng(seed)
  count = lambda text: len(tokenizer(text)["input_ids"])
  max_length = args.max_length - room

  def words(target: int) -> str:  # random words of at most ``target`` tokens (each is 1-2)
    out = list(rng.choice(WORDS, max(1, target)))
    while len(out) > 1 and count(" ".join(out)) > target:
      out = out[: -max(1, (count(" ".join(out)) - target) // 2)]
    return " ".join(out)

  lognormal = lambda median, cap: int(min(cap, max(8, rng.lognormal(np.log(median), 0.6))))
  groups = []
  for _ in range(num_prompts):
    n = lognormal(args.prompt_median, max_length // 2)
    prompt = [
      {"role": "system", "content": words(n // 4) + "."},
      {"role": "user", "content": words(n - n // 4 - 12) + "?"},
    ]
    left = max_length - count(chatml(prompt) + "<|im_start|>assistant\n") - 4  # for ".<|im_end|>\n"
    groups.append(
      [
        [*prompt, {"role": "assistant", "content": words(lognormal(args.completion_median, left)) + "."}]
        for _ in range(group_size)
      ]
    )
  return groups


def items_of(rm, chats: list[list[dict]]) -> list:
  """What jaxrm scores of each chat: its :func:`chatml` text, or a verifier's the conversation
  itself (which it renders with its question)."""
  return chats if rm.verifier is not None else [chatml(c) for c in chats]


def question_room(rm, roles: tuple[str, ...]) -> int:
  """Tokens a verifier adds to the :func:`chatml` text of a chat of ``roles`` (its question turn,
  the generation prompt, a system turn the chat template adds): what generated chats leave free,
  so that no row is cut to ``--max_length``. 0 for a reward model."""
  if rm.verifier is None:
    return 0
  stub = [{"role": role, "content": "x"} for role in roles]
  return len(rm.encode(stub)) - len(rm.tokenizer(chatml(stub))["input_ids"])


def length_sorted_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
  order = sorted(range(len(lengths)), key=lambda i: lengths[i])
  return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def summary(name: str, seconds: list[float], latencies: list[list[float]], items: int, tokens: int) -> dict:
  """Median items/s and tokens/s over repeats; latency percentiles over all timed calls (None
  where none were timed)."""
  t = statistics.median(seconds)
  lat = np.asarray([x for run in latencies for x in run]) * 1000
  percentile = lambda q: float(np.percentile(lat, q)) if lat.size else None
  return dict(
    name=name,
    items_per_s=items / t,
    tokens_per_s=tokens / t,
    seconds=t,
    p50_ms=percentile(50),
    p99_ms=percentile(99),
    repeats=[items / s for s in seconds],
  )


# ---------------------------------------------------------------------------------- the three runs


def run_rm_score(rm, items, args):
  """(seconds, per-batch latencies): one rm.score call over all items."""
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
    rm.score(items, batch_size=args.batch_size, max_length=args.max_length)
    return time.perf_counter() - start, latencies
  finally:
    del rm.score_tokens


def run_transformers(hf, texts, batches):
  latencies = []
  start = time.perf_counter()
  for rows in batches:
    t0 = time.perf_counter()
    hf.score([texts[i] for i in rows])
    latencies.append(time.perf_counter() - t0)
  return time.perf_counter() - start, latencies


def run_server(url, items, args):
  opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
  k = args.items_per_request
  requests = [items[i : i + k] for i in range(0, len(items), k)]
  latencies, lock = [], threading.Lock()

  def post(chunk):
    t0 = time.perf_counter()
    rewards = post_items(url, chunk, opener)
    with lock:
      latencies.append(time.perf_counter() - t0)
    return rewards

  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
    list(pool.map(post, requests))
  return time.perf_counter() - start, latencies


def post_items(url: str, items: list, opener=None) -> list[float]:
  """The server's rewards of ``items``: texts in OpenRLHF's ``/get_reward`` request,
  conversations (a verifier's) in jaxrm's ``/score`` request."""
  opener = opener or urllib.request.build_opener(urllib.request.ProxyHandler({}))
  chats = bool(items) and isinstance(items[0], list)
  path, body = ("/score", {"conversations": items}) if chats else ("/get_reward", {"query": items})
  req = urllib.request.Request(
    url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
  )
  with opener.open(req, timeout=600) as reply:
    return json.loads(reply.read())["rewards"]


# ---------------------------------------------------------------------------------- set-up


@dataclasses.dataclass(frozen=True)
class Transformers:
  """transformers' model of the jaxrm model's weights, scoring texts: a sequence classifier's
  reward, or a causal LM's ``log p(yes) - log p(no)`` of the token after each text (a verifier's)."""

  model: Any
  tokenizer: Any
  device: str
  answers: tuple[int, int] | None = None  # a verifier's yes and no token ids
  keep: dict = dataclasses.field(default_factory=dict)  # the one position whose logits it needs

  def ids(self, text: str) -> list[int]:
    """``text``'s ids as :meth:`score` tokenizes it (a verifier's text holds its special tokens)."""
    return self.tokenizer(text, add_special_tokens=self.answers is None)["input_ids"]

  def score(self, texts: list[str]) -> np.ndarray:
    """Scores float32 [B] of ``texts``: one forward pass, padded to the longest."""
    import torch

    batch = self.tokenizer(
      texts, padding=True, return_tensors="pt", add_special_tokens=self.answers is None
    ).to(self.device)
    with torch.no_grad():
      if self.answers is None:
        return self.model(**batch).logits[:, 0].float().cpu().numpy()
      # Left-padded: the last position is each row's last real token, the only one scored.
      positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # [B, T]
      logits = self.model(**batch, position_ids=positions, use_cache=False, **self.keep).logits[:, -1]
      log_probs = torch.log_softmax(logits.float(), -1)  # [B, V]
      yes, no = self.answers
      return (log_probs[:, yes] - log_probs[:, no]).cpu().numpy()


def load_transformers(rm, dtype: str) -> Transformers:
  """transformers on the jaxrm model's own weights (an HF export): its
  AutoModelForSequenceClassification, or a verifier's AutoModelForCausalLM."""
  import torch
  import transformers

  device = "cuda" if torch.cuda.is_available() else "cpu"
  torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
  auto = transformers.AutoModelForCausalLM if rm.verifier else transformers.AutoModelForSequenceClassification
  with tempfile.TemporaryDirectory() as out:
    rm.save_pretrained(out, dtype="float32")
    model = auto.from_pretrained(out, dtype=torch_dtype).to(device).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  hf, logits = Transformers(model, tokenizer, device), ""
  tokenizer.padding_side = "right"
  if rm.verifier is not None:
    tokenizer.padding_side = "left"
    takes = inspect.signature(model.forward).parameters  # older versions: num_logits_to_keep
    keep = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in takes), None)
    answers = rm.verifier.token_ids(tokenizer)
    hf = dataclasses.replace(hf, answers=answers, keep={keep: 1} if keep else {})
    logits = f", logits of the last position ({keep}=1)" if keep else ", logits of every position"
  print(
    f"transformers on {device}, {type(model).__name__}, attention {model.config._attn_implementation}{logits}",
    flush=True,
  )
  return hf


def transformers_texts(
  rm, hf: Transformers, items: list, encoded: list[list[int]], max_length: int
) -> tuple[list[str], int]:
  """What transformers scores of each of ``items`` (texts as they are; a verifier's conversations
  rendered as jaxrm renders them), and how many of them it tokenizes as jaxrm does (``encoded``).
  A verifier's must all be: else a row was cut to ``--max_length``."""
  texts = items if rm.verifier is None else [rm.verifier.render(rm.tokenizer, c) for c in items]
  same = sum(e == hf.ids(t) for e, t in zip(encoded, texts))
  if rm.verifier is not None and same < len(texts):
    raise SystemExit(
      f"{len(texts) - same} of {len(texts)} verifier texts give transformers other ids than jaxrm "
      f"scores: jaxrm cuts rows longer than --max_length={max_length}; raise it"
    )
  return texts, same


def check_agreement(ours: np.ndarray, theirs: np.ndarray, rm, hf: Transformers, args) -> None:
  """Prints jaxrm's and transformers' scores of the same rows and their largest difference; in
  float32 on CPUs, stops the run where it is over :data:`AGREE_ATOL`."""
  import jax
  from flax import nnx

  asks = "judge" if rm.judge is not None else "verifier"
  what = f"log-odds ({asks})" if rm.verifier is not None else "rewards"
  print(f"jaxrm's {what} on a batch:        " + " ".join(f"{x:.5f}" for x in ours), flush=True)
  print(f"transformers' {what} on a batch: " + " ".join(f"{x:.5f}" for x in theirs), flush=True)
  diff = float(np.abs(ours - theirs).max())
  platforms = {d.platform for x in jax.tree.leaves(nnx.state(rm.model)) for d in x.devices()}
  checked = args.dtype == "float32" and hf.device == "cpu" and platforms == {"cpu"}
  bound = f"at most {AGREE_ATOL:g} in float32 on a CPU" if checked else "not checked: bfloat16 or a GPU"
  print(f"max |jaxrm - transformers| {what} on a batch: {diff:.2e} ({bound})", flush=True)
  if checked and not diff <= AGREE_ATOL:
    raise SystemExit(
      f"jaxrm's and transformers' {what} differ by {diff:.2e} > {AGREE_ATOL:g}: they do not score "
      "the same model, tokens or position"
    )


def main(argv=None) -> None:
  args = parse_args(argv)
  import jax
  import torch
  import transformers

  from jaxrm import RewardModel

  if args.judge and args.workload != "grpo":
    raise SystemExit("--judge scores groups: give --workload=grpo")
  model = random_model(args.random_shape, args.seed) if args.random_shape else args.model
  if args.judge:
    rm = load_judge(model, args.dtype)
    print(
      f"pairwise judge, zero-shot: log p({rm.judge.answers[0]}) - log p({rm.judge.answers[1]}) "
      f"after {rm.judge.question!r}",
      flush=True,
    )
  else:
    rm = RewardModel.from_pretrained(model, dtype=args.dtype, verifier=args.verifier)
  if args.verifier:
    print(
      f"verifier, zero-shot: log p({rm.verifier.answers[0]}) - log p({rm.verifier.answers[1]}) after "
      f"{rm.verifier.question!r}",
      flush=True,
    )
  workload = {"chats": chats_workload, "grpo": grpo_workload, "buckets": buckets_workload}[args.workload]
  if args.judge:
    workload = judge_workload
  results = [dict(r, verifier=args.verifier, judge=args.judge) for r in workload(rm, args)]
  print(
    f"jax {jax.__version__} ({jax.default_backend()}), transformers {transformers.__version__}, "
    f"torch {torch.__version__}, {os.cpu_count()} CPUs",
    flush=True,
  )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(args=vars(args), commit=commit(), results=results), f, indent=1)


def chats_workload(rm, args) -> list[dict]:
  """One completion per prompt: rm.score, the server and transformers, in turns."""
  from jaxrm.data.pipeline import length_buckets
  from jaxrm.server import ServerConfig, make_server

  hf = load_transformers(rm, args.dtype)

  cap = args.max_length - question_room(rm, ("user", "assistant"))
  items = items_of(rm, make_chats(args.items, args.median_length, cap, rm.tokenizer, args.seed))
  encoded = [rm.encode(x, max_length=args.max_length) for x in items]
  texts, same_tokens = transformers_texts(rm, hf, items, encoded, args.max_length)
  lengths = [len(e) for e in encoded]
  tokens = sum(lengths)
  batches = length_sorted_batches(lengths, args.batch_size)
  print(
    f"{args.items} {'conversations' if rm.verifier else 'texts'}, {tokens} tokens (median "
    f"{int(np.median(lengths))}, max {max(lengths)}); rm.score computes {shared_tokens(rm, encoded, args)} "
    f"of them once prefixes are shared; jaxrm and transformers tokenize {same_tokens}/{args.items} identically",
    flush=True,
  )

  # Untimed: jaxrm compiles each batch shape; transformers' first pass; a check that both score alike.
  ours = rm.score(items, batch_size=args.batch_size, max_length=args.max_length)
  theirs = hf.score([texts[i] for i in batches[0]])
  run_transformers(hf, texts, batches[:2])
  check_agreement(ours[batches[0]], theirs, rm, hf, args)

  buckets = length_buckets(max(args.max_length, 64), 64)  # rm.score's
  config = ServerConfig(
    max_length=args.max_length,
    batch_size=args.batch_size,
    buckets=buckets,
    max_batch=max(256, args.items_per_request),
    request_timeout=600,
  )
  server = make_server(rm, "127.0.0.1", 0, config=config).start()
  try:
    server.wait_ready(3600, all_shapes=True)  # throughput is timed without compiles beside it
    run_server(server.url, items[: 2 * args.batch_size], args)  # untimed: the first connections and batches
    runs = {"rm.score": ([], []), "server": ([], []), "transformers": ([], [])}
    for _ in range(args.repeats):
      for name, fn in (
        ("rm.score", lambda: run_rm_score(rm, items, args)),
        ("server", lambda: run_server(server.url, items, args)),
        ("transformers", lambda: run_transformers(hf, texts, batches)),
      ):
        seconds, latencies = fn()
        runs[name][0].append(seconds)
        runs[name][1].append(latencies)
        print(f"  {name}: {args.items / seconds:.1f} items/s", flush=True)
  finally:
    server.shutdown()

  results = [summary(name, s, lat, args.items, tokens) for name, (s, lat) in runs.items()]
  print_table(results, args)
  by = {r["name"]: r for r in results}
  print(
    f"rm.score / transformers: {by['rm.score']['items_per_s'] / by['transformers']['items_per_s']:.2f}x; "
    f"server / rm.score: {by['server']['items_per_s'] / by['rm.score']['items_per_s']:.0%}"
  )
  return results


# ---------------------------------------------------------------------------------- grpo


def grpo_scorers(rm, hf, items, texts, batches, args, server_url=None, group_size=None) -> dict:
  """Name -> a function that scores ``items`` once and returns (seconds, rewards [N]); transformers
  scores ``texts``, theirs. With ``server_url``, also the server, each request one group of
  ``group_size`` items."""

  def rm_score(share_prefix):
    start = time.perf_counter()
    rewards = rm.score(
      items, batch_size=args.batch_size, max_length=args.max_length, share_prefix=share_prefix
    )
    return time.perf_counter() - start, rewards

  def transformers():
    rewards = np.zeros(len(texts), np.float32)
    start = time.perf_counter()
    for rows in batches:
      rewards[rows] = hf.score([texts[i] for i in rows])
    return time.perf_counter() - start, rewards

  def server():
    groups = [items[i : i + group_size] for i in range(0, len(items), group_size)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(min(args.clients, len(groups))) as pool:
      rewards = [r for group in pool.map(lambda g: post_items(server_url, g), groups) for r in group]
    return time.perf_counter() - start, np.asarray(rewards, np.float32)

  scorers = {
    "rm.score shared": lambda: rm_score(True),
    "rm.score unshared": lambda: rm_score(False),
    "transformers": transformers,
  }
  return {**scorers, "server": server} if server_url else scorers


def grpo_workload(rm, args) -> list[dict]:
  """For each G: P prompts x G completions, scored by each of :func:`grpo_scorers` in turns."""
  from jaxrm.server import ServerConfig, make_server

  hf = load_transformers(rm, args.dtype)
  # The server as `python -m jaxrm.serve --max_length=... --batch_size=...` runs it: its own
  # buckets (powers of two), sharing prefixes across the rows of all requests it batches.
  config = ServerConfig(
    max_length=args.max_length, batch_size=args.batch_size, max_batch=256, request_timeout=600
  )
  if args.batch_wait_ms is not None:
    config = dataclasses.replace(config, batch_wait_ms=args.batch_wait_ms)
  server = make_server(rm, "127.0.0.1", 0, config=config).start()
  start = time.perf_counter()
  server.wait_ready()
  ready = time.perf_counter() - start
  server.wait_ready(3600, all_shapes=True)  # throughput is timed without compiles beside it
  warm_up = dict(
    name="server warm-up",
    warm_up=config.warm_up,
    ready_s=ready,
    all_compiled_s=time.perf_counter() - start,
    shapes=len(server.batcher.shapes()),
    packed_shapes=len(server.batcher.packed_shapes()),
  )
  print(
    f"server: ready in {ready:.0f} s (--warm_up={config.warm_up}); its {warm_up['shapes']} padded and "
    f"{warm_up['packed_shapes']} packed batch shapes all compiled in {warm_up['all_compiled_s']:.0f} s",
    flush=True,
  )
  try:
    return [warm_up, *_grpo_runs(rm, hf, server.url, args)]
  finally:
    server.shutdown()


def _grpo_runs(rm, hf, server_url, args) -> list[dict]:
  results = []
  room = question_room(rm, ("system", "user", "assistant"))
  for g in (int(x) for x in args.group_sizes.split(",")):
    groups = make_groups(args.prompts, g, args, rm.tokenizer, args.seed, room)
    items = items_of(rm, [chat for group in groups for chat in group])
    encoded = [rm.encode(x, max_length=args.max_length) for x in items]
    texts, same = transformers_texts(rm, hf, items, encoded, args.max_length)
    lengths = [len(e) for e in encoded]
    tokens = sum(lengths)
    print(
      f"\nP={args.prompts} prompts x G={g}: {len(items)} {'conversations' if rm.verifier else 'texts'}, "
      f"{tokens} tokens (median {int(np.median(lengths))}, max {max(lengths)}); the groups' rows share "
      f"{prompt_lengths(encoded, g)} tokens; shared scoring computes {shared_tokens(rm, encoded, args)} "
      f"tokens; jaxrm and transformers tokenize {same}/{len(items)} identically",
      flush=True,
    )
    batches = length_sorted_batches(lengths, args.batch_size)
    scorers = grpo_scorers(rm, hf, items, texts, batches, args, server_url, g)
    rewards = {name: fn()[1] for name, fn in scorers.items()}  # untimed: compiling, first passes
    want = rewards.pop("rm.score unshared")
    check_agreement(want[batches[0]], rewards["transformers"][batches[0]], rm, hf, args)
    print(
      "max |reward - rm.score unshared|: "
      + ", ".join(f"{name} {np.abs(r - want).max():.1e}" for name, r in rewards.items()),
      flush=True,
    )
    seconds = {name: [] for name in scorers}
    for _ in range(args.repeats):
      for name, fn in scorers.items():
        seconds[name].append(fn()[0])
        print(f"  {name}: {len(items) / seconds[name][-1]:.2f} items/s", flush=True)
    rows = [dict(summary(name, s, [], len(items), tokens), group_size=g) for name, s in seconds.items()]
    print_grpo_table(rows, g, args)
    by = {r["name"]: r["items_per_s"] for r in rows}
    print(f"server / rm.score shared: {by['server'] / by['rm.score shared']:.0%}", flush=True)
    results += rows
  return results


# ---------------------------------------------------------------------------------- judge


# Tokens a judge text adds to a prompt and two responses (its headings and question, a default system
# turn and the generation prompt: 78 with SmolLM2's template), with some to spare.
JUDGE_WORDS = 96


def random_model(shape: str, seed: int) -> str:
  """A directory holding a random LlamaForCausalLM of ``shape`` ("layers,hidden,intermediate,heads,
  kv_heads", tied embeddings as SmolLM2's) with SmolLM2's tokenizer (from the embedded GGUF)."""
  import torch
  import transformers

  from jaxrm.hf import gguf

  layers, hidden, intermediate, heads, kv_heads = (int(x) for x in shape.split(","))
  path = gguf.embedded_model_path()
  tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
  config = transformers.LlamaConfig(
    vocab_size=len(tok),
    hidden_size=hidden,
    intermediate_size=intermediate,
    num_hidden_layers=layers,
    num_attention_heads=heads,
    num_key_value_heads=kv_heads,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    # wider than transformers' 0.02, so that log-odds are of order 1 and the two sides' agreement
    # on them says something
    initializer_range=0.1,
    pad_token_id=tok.pad_token_id,
    bos_token_id=tok.bos_token_id,
    eos_token_id=tok.eos_token_id,
  )
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(config)
  out = tempfile.mkdtemp(prefix="bench_judge_")
  atexit.register(shutil.rmtree, out, True)
  model.save_pretrained(out)
  tok.save_pretrained(out)
  print(
    f"random LlamaForCausalLM: {layers} layers, hidden {hidden}, MLP {intermediate}, {heads} heads "
    f"({kv_heads} key/value), SmolLM2's tokenizer ({len(tok)} tokens), in {out}",
    flush=True,
  )
  return out


def load_judge(model: str, dtype: str):
  """``model`` as a zero-shot pairwise judge (``RewardModel.from_pretrained(model, judge=True)``)."""
  from jaxrm import RewardModel

  return RewardModel.from_pretrained(model, dtype=dtype, judge=True)


@dataclasses.dataclass(frozen=True)
class JudgeGroups:
  """One draw of groups as a judge compares them under one strategy.

  Attributes:
    prompts, groups: the conversations (system and user turns) and each one's G responses.
    pairs: per group, the ordered comparisons (A, B) (:func:`jaxrm.tasks.pairwise.comparisons`).
    texts: the judge text of every comparison, group after group (what transformers scores).
    ids: jaxrm's ids of each text (:meth:`jaxrm.tasks.pairwise.Judge.encode`).
  """

  prompts: list
  groups: list
  pairs: list
  texts: list
  ids: list

  def log_odds(self, scores: np.ndarray) -> list[np.ndarray]:
    """Each group's log-odds [G, G] from the scores of :attr:`texts`, both orders averaged, as
    :func:`jaxrm.tasks.pairwise.score_groups` computes them."""
    out, k = [], 0
    for group, pairs in zip(self.groups, self.pairs):
      raw = np.full((len(group), len(group)), np.nan, np.float32)
      for i, j in pairs:
        raw[i, j], k = scores[k], k + 1
      out.append(((raw - raw.T) / np.float32(2)).astype(np.float32))
    return out


def judge_groups(rm, args, g: int, strategy: str) -> JudgeGroups:
  """``--prompts`` GRPO groups of ``g`` responses and their judge texts under ``strategy``. A judge
  text holds the prompt and two responses, so the groups are drawn (:func:`make_groups`) for half
  of ``--max_length`` less the judge's own words (:data:`JUDGE_WORDS`)."""
  from jaxrm.tasks import pairwise

  drawn = make_groups(args.prompts, g, args, rm.tokenizer, args.seed, room=args.max_length // 2 + JUDGE_WORDS)
  prompts = [group[0][:-1] for group in drawn]
  groups = [[chat[-1]["content"] for chat in group] for group in drawn]
  judge, pairs, texts, ids = rm.judge, [], [], []
  for prompt, responses in zip(prompts, groups):
    pairs.append(pairwise.comparisons(len(responses), strategy))
    for i, j in pairs[-1]:
      texts.append(judge.render(rm.tokenizer, prompt, responses[i], responses[j]))
      encoded = judge.encode(rm.tokenizer, prompt, responses[i], responses[j], args.max_length, "bench")
      if encoded is None or encoded[1]:
        raise SystemExit(f"a judge text is longer than --max_length={args.max_length}: raise it")
      ids.append(encoded[0])
  return JudgeGroups(prompts, groups, pairs, texts, ids)


def judge_tokens(rm, drawn: JudgeGroups, args) -> dict:
  """Tokens of the judge texts: one by one; in the layouts the decoder's two-level tree mask allows
  (one shared prefix per packed row, a branch per text): the conversation once per group, or the
  conversation and response A once per response A; and as jaxrm's grouping feeds them (its real
  tokens, and the token slots of its passes, padding included)."""
  from jaxrm.scoring import shared_prefix

  ids, k = drawn.ids, 0
  per_group, per_a = [], []
  for pairs in drawn.pairs:
    rows = list(range(k, k + len(pairs)))
    per_group.append(rows)
    by_a: dict[int, list[int]] = {}
    for r, (i, _) in zip(rows, pairs):
      by_a.setdefault(i, []).append(r)
    per_a += by_a.values()
    k += len(pairs)
  packed = lambda groups: sum(shared_prefix.packed_length(ids, grp) for grp in groups)
  fed = rm.prefix_groups(ids, batch_size=args.batch_size, max_length=args.max_length)
  return dict(
    one_by_one=sum(map(len, ids)),
    conversation_shared=packed(per_group),
    conversation_and_a_shared=packed(per_a),
    fed=packed(fed),
    packed_rows=sum(len(grp) > 1 for grp in fed),
    rows_alone=sum(len(grp) == 1 for grp in fed),
  )


def fed_shapes(rm, call) -> tuple[object, list[tuple[int, int]]]:
  """(what ``call()`` returns, the [rows, tokens] of every forward pass rm ran in it)."""
  shapes = []
  score_tokens, score_shared = rm.score_tokens, rm.score_shared

  def plain(ids, mask):
    shapes.append(tuple(np.shape(ids)))
    return score_tokens(ids, mask)

  def shared(rows):
    shapes.append(tuple(rows.batch.input_ids.shape))
    return score_shared(rows)

  rm.score_tokens, rm.score_shared = plain, shared
  try:
    return call(), shapes
  finally:
    del rm.score_tokens, rm.score_shared


def judge_scorers(rm, hf, drawn: JudgeGroups, strategy: str, args, server_url=None) -> dict:
  """Name -> a function that scores every group once and returns (seconds, log-odds [G, G] per
  group): jaxrm's score_group shared and unshared, transformers on the judge texts, the server's
  /compare (with ``server_url``)."""
  from jaxrm.tasks import pairwise

  def score_group(share_prefix):
    start = time.perf_counter()
    out = pairwise.score_groups(
      rm,
      drawn.prompts,
      drawn.groups,
      strategy=strategy,
      batch_size=args.batch_size,
      max_length=args.max_length,
      share_prefix=share_prefix,
    )
    return time.perf_counter() - start, [s.log_odds for s in out]

  lengths = [len(x) for x in drawn.ids]
  batches = length_sorted_batches(lengths, args.batch_size)

  def transformers():
    scores = np.zeros(len(drawn.texts), np.float32)
    start = time.perf_counter()
    for rows in batches:
      scores[rows] = hf.score([drawn.texts[i] for i in rows])
    log_odds = drawn.log_odds(scores)
    for d in log_odds:  # the rewards too, as score_group gives them
      pairwise.aggregate_rewards(d, "bradley_terry")
    return time.perf_counter() - start, log_odds

  def server():
    def post(g):
      body = {"prompt": drawn.prompts[g], "responses": drawn.groups[g], "strategy": strategy}
      req = urllib.request.Request(
        server_url + "/compare", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
      )
      opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
      with opener.open(req, timeout=600) as reply:
        return np.asarray(json.loads(reply.read())["log_odds"], np.float64).astype(np.float32)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(min(args.clients, len(drawn.groups))) as pool:
      log_odds = list(pool.map(post, range(len(drawn.groups))))
    return time.perf_counter() - start, log_odds

  scorers = {
    "score_group shared": lambda: score_group(True),
    "score_group unshared": lambda: score_group(False),
    "transformers": transformers,
  }
  return {**scorers, "server /compare": server} if server_url else scorers


def judge_server(rm, args):
  """The reward server on the judge, started, if it serves ``/compare``; else (None, why not)."""
  from jaxrm.server import ServerConfig, make_server

  config = ServerConfig(
    max_length=args.max_length, batch_size=args.batch_size, max_batch=1024, request_timeout=600
  )
  try:
    server = make_server(rm, "127.0.0.1", 0, config=config).start()
  except Exception as e:  # a server that does not take a judge yet
    return None, f"the server does not take a judge: {e}"
  server.wait_ready(3600, all_shapes=True)
  probe = {"prompt": "2 + 2?", "responses": ["4", "5"]}
  req = urllib.request.Request(
    server.url + "/compare", data=json.dumps(probe).encode(), headers={"Content-Type": "application/json"}
  )
  try:
    urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=600).read()
  except urllib.error.HTTPError as e:
    server.shutdown()
    return None, f"POST /compare answers {e.code}"
  return server, ""


def judge_workload(rm, args) -> list[dict]:
  """For each G and strategy: a judge's score_group (shared, unshared), transformers on the same
  judge texts and the server's /compare, in turns, with the tokens each layout computes."""
  hf = load_transformers(rm, args.dtype)
  server, why = judge_server(rm, args)
  if server is None:
    print(f"server: not measured ({why})", flush=True)
  results = []
  try:
    for g in (int(x) for x in args.group_sizes.split(",")):
      for strategy in args.strategies.split(","):
        results += _judge_run(rm, hf, server and server.url, args, g, strategy)
  finally:
    if server is not None:
      server.shutdown()
  if server is None:
    results.append(dict(name="server /compare", measured=False, why=why))
  return results


def _judge_run(rm, hf, server_url, args, g: int, strategy: str) -> list[dict]:
  drawn = judge_groups(rm, args, g, strategy)
  same = sum(e == hf.ids(t) for e, t in zip(drawn.ids, drawn.texts))
  if same < len(drawn.texts):
    raise SystemExit(f"{len(drawn.texts) - same} judge texts give transformers other ids than jaxrm scores")
  tokens = judge_tokens(rm, drawn, args)
  allowed = min(tokens["conversation_shared"], tokens["conversation_and_a_shared"])
  reduction = tokens["one_by_one"] / allowed
  lengths = [len(x) for x in drawn.ids]
  items = args.prompts * g
  print(
    f"\n{strategy}, P={args.prompts} x G={g}: {len(drawn.texts)} judge texts, {tokens['one_by_one']} tokens "
    f"(median {int(np.median(lengths))}, max {max(lengths)}), identical ids {same}/{len(drawn.texts)}; "
    f"shared layouts: the conversation once per group {tokens['conversation_shared']}, conversation and "
    f"response A once per A {tokens['conversation_and_a_shared']} ({reduction:.2f}x fewer than one by one); "
    f"jaxrm feeds {tokens['fed']} ({tokens['packed_rows']} packed rows, {tokens['rows_alone']} alone)",
    flush=True,
  )
  scorers = judge_scorers(rm, hf, drawn, strategy, args, server_url)
  # Untimed: compiling, first passes; the forward passes of jaxrm's scorers and the server counted.
  log_odds, passes = {}, {}
  for name, fn in scorers.items():
    (_, log_odds[name]), passes[name] = fed_shapes(rm, fn)
  tokens.update(
    {f"{name} passes": [list(shape) for shape in shapes] for name, shapes in passes.items() if shapes}
  )
  want = log_odds.pop("score_group unshared")
  # each group's compared pairs above the diagonal (those below are their negatives); one group checked
  upper = lambda d: d[np.triu_indices_from(d, 1)]
  flat = lambda ds: np.concatenate([upper(d)[~np.isnan(upper(d))] for d in ds])
  check_agreement(flat(want[:1]), flat(log_odds["transformers"][:1]), rm, hf, args)
  print(
    "max |log-odds - score_group unshared|: "
    + ", ".join(f"{name} {np.abs(flat(d) - flat(want)).max():.1e}" for name, d in log_odds.items()),
    flush=True,
  )
  seconds = {name: [] for name in scorers}
  for _ in range(args.repeats):
    for name, fn in scorers.items():
      seconds[name].append(fn()[0])
      print(f"  {name}: {items / seconds[name][-1]:.2f} items/s", flush=True)
  rows = [
    dict(
      summary(name, s, [], items, tokens["one_by_one"]),
      group_size=g,
      strategy=strategy,
      texts=len(drawn.texts),
      tokens=tokens,
    )
    for name, s in seconds.items()
  ]
  by = {r["name"]: r["items_per_s"] for r in rows}
  speedup = by["score_group shared"] / by["transformers"]
  sharing = by["score_group shared"] / by["score_group unshared"]
  for r in rows:
    r["vs_transformers"] = r["items_per_s"] / by["transformers"]
  rows[0].update(
    token_reduction=reduction, of_reduction=speedup / reduction, of_reduction_vs_unshared=sharing / reduction
  )
  for name in ("score_group shared", "server /compare"):
    shapes = tokens.get(f"{name} passes")
    if shapes:
      print(
        f"{name}: {len(shapes)} forward passes, {sum(b * t for b, t in shapes)} token slots with padding "
        f"({', '.join(f'{b}x{t}' for b, t in shapes)})",
        flush=True,
      )
  print_judge_table(rows, args)
  print(
    f"score_group shared / transformers: {speedup:.2f}x, {speedup / reduction:.0%} of the {reduction:.2f}x "
    f"token reduction (target 85%); over jaxrm unshared: {sharing:.2f}x, {sharing / reduction:.0%}"
    + (
      f"; server / score_group shared: {by['server /compare'] / by['score_group shared']:.0%}"
      if server_url
      else ""
    ),
    flush=True,
  )
  return rows


def print_judge_table(rows: list[dict], args) -> None:
  r0 = rows[0]
  print(
    f"\n| scorer (judge, {r0['strategy']}, P={args.prompts}, G={r0['group_size']}) | items/s (median) | spread "
    f"over {args.repeats} repeats | vs transformers |\n|---|---:|---:|---:|"
  )
  for r in rows:
    print(
      f"| {r['name']} | {r['items_per_s']:.2f} | {min(r['repeats']):.2f}-{max(r['repeats']):.2f} | "
      f"{r['vs_transformers']:.2f}x |",
      flush=True,
    )


# ---------------------------------------------------------------------------------- buckets


def buckets_workload(rm, args) -> list[dict]:
  """rm.score's padding multiple: compiled shapes and padded tokens against time, cold and warm."""
  import jax

  from jaxrm.data.pipeline import bucket_length, length_buckets, scoring_rows

  cap = args.max_length - question_room(rm, ("user", "assistant"))
  items = items_of(rm, make_chats(args.items, args.median_length, cap, rm.tokenizer, args.seed))
  lengths = sorted(len(rm.encode(x, max_length=args.max_length)) for x in items)
  print(f"{args.items} items, {sum(lengths)} tokens (median {lengths[len(lengths) // 2]}, max {lengths[-1]})")
  multiples = [int(b) for b in args.buckets.split(",")]
  runs = {b: ([], []) for b in multiples}
  for _ in range(args.repeats):
    for b in multiples:
      jax.clear_caches()
      for times in runs[b]:  # cold, then warm
        start = time.perf_counter()
        rm.score(items, batch_size=args.batch_size, bucket=b, max_length=args.max_length, share_prefix=False)
        times.append(time.perf_counter() - start)
      print(f"  bucket {b}: cold {runs[b][0][-1]:.1f} s, warm {runs[b][1][-1]:.1f} s", flush=True)
  print(
    "\n| multiple | shapes | padded tokens | cold s (median) | warm s (median) |\n|---:|---:|---:|---:|---:|"
  )
  results = []
  for b, (cold, warm) in runs.items():
    buckets = length_buckets(max(args.max_length, b), b)
    shapes = [
      (scoring_rows(len(rows), args.batch_size), bucket_length(max(rows), buckets))
      for rows in (lengths[i : i + args.batch_size] for i in range(0, len(lengths), args.batch_size))
    ]
    slots = sum(n * t for n, t in shapes)
    results.append(dict(multiple=b, shapes=len(set(shapes)), slots=slots, cold=cold, warm=warm))
    print(
      f"| {b} | {len(set(shapes))} | {slots} (+{slots / sum(lengths) - 1:.0%}) | {statistics.median(cold):.1f} "
      f"({min(cold):.1f}-{max(cold):.1f}) | {statistics.median(warm):.1f} ({min(warm):.1f}-{max(warm):.1f}) |"
    )
  return results


def prompt_lengths(encoded: list[list[int]], g: int) -> str:
  """The tokens each group's rows share, comma-separated."""
  return ", ".join(str(len(os.path.commonprefix(encoded[i : i + g]))) for i in range(0, len(encoded), g))


def shared_tokens(rm, encoded: list[list[int]], args) -> int:
  """Tokens the shared layout holds, as rm.score groups the rows: each group's packed row, and
  the rows that score alone."""
  from jaxrm.scoring import shared_prefix

  groups = rm.prefix_groups(encoded, batch_size=args.batch_size, max_length=args.max_length)
  return sum(shared_prefix.packed_length(encoded, g) for g in groups)


def scorer_column(args) -> str:
  """The tables' first header: a verifier's runs say so."""
  return "scorer (verifier, zero-shot)" if args.verifier else "scorer"


def print_table(results: list[dict], args) -> None:
  print(
    f"\n| {scorer_column(args)} | items/s | tokens/s | p50 latency | p99 latency |\n|---|---:|---:|---:|---:|"
  )
  unit = {
    "rm.score": f"per batch of {args.batch_size}",
    "transformers": f"per batch of {args.batch_size}",
    "server": f"per request of {args.items_per_request}, {args.clients} clients",
  }
  for r in results:
    print(
      f"| {r['name']} ({unit[r['name']]}) | {r['items_per_s']:.1f} | {r['tokens_per_s']:.0f} | "
      f"{r['p50_ms']:.0f} ms | {r['p99_ms']:.0f} ms |"
    )


def print_grpo_table(rows: list[dict], g: int, args) -> None:
  transformers = next(r for r in rows if r["name"] == "transformers")["items_per_s"]
  print(
    f"\n| {scorer_column(args)} (P={args.prompts}, G={g}) | items/s (median) | spread over {args.repeats} repeats | tokens/s "
    "| vs transformers |\n|---|---:|---:|---:|---:|"
  )
  for r in rows:
    print(
      f"| {r['name']} | {r['items_per_s']:.2f} | {min(r['repeats']):.2f}-{max(r['repeats']):.2f} | "
      f"{r['tokens_per_s']:.0f} | {r['items_per_s'] / transformers:.2f}x |",
      flush=True,
    )


if __name__ == "__main__":
  sys.exit(main())
