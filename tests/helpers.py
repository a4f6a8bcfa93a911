"""What several test files build by hand: chat messages, tokenized examples, records, loss inputs, a
tiny random decoder, and the tolerances they share."""

import contextlib
import copy
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrm import RewardModel
from jaxrm.data.batches import IGNORE_INDEX
from jaxrm.data.records import PreferenceRecord
from jaxrm.data.tokenize import PreferenceExample, StepwiseExample
from jaxrm.models import families
from jaxrm.models.config import ModelConfig, from_hf_config
from jaxrm.models.decoder import Decoder
from jaxrm.server import ServerConfig, make_server

VOCAB = 128  # of the tiny models below
PAD = 0
# SmolLM2's <|im_start|>, <|im_end|> (also its eos and pad token) and "\n".
IM_START, IM_END, NL = 1, 2, 198

# ------------------------------------------------------------------ tolerances

# jaxrm against transformers' PyTorch model, both in float32: the same arithmetic in other orders
# (XLA's fused matmuls and reductions against PyTorch's kernels), over 2-3 layers of the tiny models
# and 30 of SmolLM2-135M. Outputs are O(1); they differ by ~1e-6 on the tiny models and ~1e-5 on
# SmolLM2, while a weight loaded into the wrong place (every weight is perturbed away from its init)
# moves them by orders of magnitude more. 1e-4 is the usual float32 parity tolerance.
PARITY_ATOL = 1e-4

# The tiny decoder's outputs computed two ways in float32 (packed or unpacked rows, the einsum or
# jax.nn.dot_product_attention): the same sums in other orders and over other padded lengths.
# tiny_model's large weights give outputs up to ~6, whose float32 spacing is ~5e-7; the two ways
# differ by a few such steps (up to ~4e-6).
REORDERED_ATOL = 1e-5

# One row's reward scored in different batches, padded to other lengths: its float32 attention and
# reductions run over other shapes. Rewards are O(1), so a few float32 roundings are ~1e-7; atol
# covers rewards near 0, where rtol alone would ask for more than float32 holds.
REBATCHED = dict(rtol=1e-5, atol=1e-6)

# ------------------------------------------------------------------ chat messages


def user(text):
  return {"role": "user", "content": text}


def assistant(text):
  return {"role": "assistant", "content": text}


# ------------------------------------------------------------------ token rows and references


def right_padded(rows, pad, length=None, dtype=np.int32):
  """Token-id rows right-padded with ``pad`` to ``length`` (default: the longest row): ids and an
  attention mask, both [B, T] of ``dtype``."""
  length = length or max(map(len, rows))
  ids = np.full((len(rows), length), pad, dtype)
  mask = np.zeros((len(rows), length), dtype)
  for i, r in enumerate(rows):
    ids[i, : len(r)], mask[i, : len(r)] = r, 1
  return ids, mask


def softplus(x):
  """log(1 + exp(x)) = -log sigmoid(-x), in float64 numpy."""
  return np.log1p(np.exp(np.asarray(x, np.float64)))


# ------------------------------------------------------------------ examples and records


def pref(*seqs, margin=0.0, source="row", subset=None):
  """A preference example whose completions (best first) are token-id lists."""
  ids = tuple(np.asarray(s, np.int32) for s in seqs)
  return PreferenceExample(
    ids, tuple(range(len(ids))), margin, source, {} if subset is None else {"subset": subset}
  )


def stepwise(ids, labels, source="row"):
  """A stepwise example from a token-id list and its per-token labels (IGNORE_INDEX off the steps)."""
  return StepwiseExample(np.asarray(ids, np.int32), np.asarray(labels, np.int32), source, {})


def numbered_pref(i, n=2):
  """Preference example i: completion j's tokens are 1000*i + 100*j + 1, + 2, ...; lengths vary
  with i, so the example a batch row came from can be read off its tokens; ranks are 10, 11, ..."""
  length = 3 + (i * 7) % 30
  ids = tuple(np.arange(1, length + 1 - j, dtype=np.int32) + 1000 * i + 100 * j for j in range(n))
  return PreferenceExample(
    input_ids=ids, ranks=tuple(range(10, 10 + n)), margin=float(i), source=f"row {i}", meta={}
  )


def numbered_stepwise(i):
  """Stepwise example i: tokens 1000*i + 1, + 2, ...; one label (i % 2) on the last token."""
  length = 2 + i % 5
  labels = np.full(length, IGNORE_INDEX, np.int32)
  labels[-1] = i % 2
  return StepwiseExample(
    input_ids=np.arange(length, dtype=np.int32) + 1000 * i + 1, labels=labels, source=f"row {i}", meta={}
  )


def pair_record(context, chosen, rejected, source="t.jsonl:1", **kw):
  """A two-completion PreferenceRecord listing the rejected completion first (ranks 1, 0), as a
  dataset may: tokenizing must put the chosen one first."""
  return PreferenceRecord(context=context, completions=(rejected, chosen), ranks=(1, 0), source=source, **kw)


def preference_loss_args(rewards, ranks, example_mask=None, margin=None):
  """Keyword arguments of a preference loss: rewards [G, K] float32, ranks [G, K] int32,
  example_mask [G] (all ones unless given), and margin [G] when given."""
  rewards = np.asarray(rewards, np.float32)
  mask = np.ones(len(rewards), np.float32) if example_mask is None else example_mask
  batch = dict(
    rewards=jnp.asarray(rewards),
    ranks=jnp.asarray(ranks, jnp.int32),
    example_mask=jnp.asarray(mask, jnp.float32),
  )
  if margin is not None:
    batch["margin"] = jnp.asarray(margin, jnp.float32)
  return batch


def random_groups(rng, num_groups, k, prefix_case=True):
  """Groups sharing a prompt; one completion is a prefix of another when prefix_case."""
  groups = []
  for g in range(num_groups):
    prompt = rng.integers(3, VOCAB, rng.integers(3, 11))
    n = k if g % 3 else max(2, k - 1)  # some groups have an absent slot when k > 2
    seqs = [np.concatenate([prompt, rng.integers(3, VOCAB, rng.integers(1, 7))]) for _ in range(n)]
    if prefix_case and g == 0:
      seqs[1] = np.concatenate([seqs[0], rng.integers(3, VOCAB, 2)])
    groups.append(pref(*seqs, margin=float(g) / 4, source=f"group {g}"))
  return groups


# ------------------------------------------------------------------ models


def tiny_config(family: str, num_labels: int = 1, **overrides):
  """transformers' config of a tiny random ``family`` model (its spec's ``tiny_hf_config`` over
  sizes that run in seconds), with ``overrides``: hf_tiny builds models of it."""
  import transformers

  spec = families.get(family).tiny_hf_config
  kw = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=PAD,
    bos_token_id=1,
    eos_token_id=2,
    num_labels=num_labels,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
  )
  kw.update(copy.deepcopy(spec["kw"]))  # transformers may fill in the dicts it is given
  kw.update(overrides)
  return getattr(transformers, spec["cls"])(**kw)


def tiny_decoder_config(**overrides):
  """jaxrm's config of tiny_config's Mistral, made smaller still for the tests of
  the decoder alone, with ``overrides`` of its fields. A window on one layer of two exercises the
  window mask on packed rows."""
  hf = tiny_config(
    "mistral",
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    head_dim=8,
    sliding_window=6,
    layer_types=["sliding_attention", "full_attention"],
  )
  return from_hf_config(hf.to_dict(), **overrides)


def tiny_model(cfg, seed=0):
  """A model with large random weights (so that every mask matters), built without compiling."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(seed)

  def init(path, x):
    base = 1.0 if "norm" in jax.tree_util.keystr(path) else 0.0
    return jnp.asarray(base + 0.3 * rng.standard_normal(x.shape), x.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(init, state))


def jitted(model):
  """Jitted ``batch -> batch.outputs(model)``: rewards [G, K] or logits [G, T, C], packed or not."""
  graphdef, state = nnx.split(model)
  return jax.jit(lambda batch: batch.outputs(nnx.merge(graphdef, state)))


def params(rm):
  """A RewardModel's parameters as numpy arrays, by flat path."""
  return {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(rm.model))}


def assert_same_params(a, b):
  """Two RewardModels hold the same parameter paths with bit-equal values."""
  pa, pb = params(a), params(b)
  assert pa.keys() == pb.keys()
  for k in pa:
    np.testing.assert_array_equal(pa[k], pb[k], err_msg=str(k))


# ------------------------------------------------------------------ parameters and demo batches


def flat_params(state) -> dict[str, np.ndarray]:
  """``layers.q`` -> host array, for every Variable of an nnx state."""
  return {".".join(map(str, path)): np.array(var.get_value()) for path, var in nnx.to_flat_state(state)}


def assert_only_trained_moved(before: dict, after: dict, trained) -> None:
  """Every parameter named in ``trained`` changed; every other one is bit-identical, same dtype."""
  assert after.keys() == before.keys()
  for name in before:
    if name in trained:
      assert not np.array_equal(after[name], before[name]), f"{name} did not move"
    else:
      np.testing.assert_array_equal(after[name], before[name], err_msg=f"{name} of the base moved")
      assert after[name].dtype == before[name].dtype, name


def padded_tokens(vocab_size: int):
  """Three rows of 12 random token ids and their mask; the last row right-padded to 7."""
  ids = np.random.default_rng(0).integers(0, vocab_size, (3, 12)).astype(np.int32)
  mask = np.ones_like(ids)
  mask[2, 7:] = 0
  return ids, mask


def model_config_of(model_dir: str) -> ModelConfig:
  """The ModelConfig of an HF checkpoint directory."""
  import json
  import os

  from jaxrm.models.config import from_hf_config

  with open(os.path.join(model_dir, "config.json")) as f:
    return from_hf_config(json.load(f))


def demo_batches(tokenizer, n: int):
  """The first ``n`` training batches of 8 demo_arithmetic pairs (max_length 96, one bucket)."""
  from jaxrm.data import pipeline, registry
  from jaxrm.data.drops import DropReport
  from jaxrm.data.tokenize import TokenizeOptions, pad_id, tokenize_all

  records = registry.load_records("demo_arithmetic", None, split="train", drops=DropReport())[: 8 * n]
  examples = tokenize_all(records, tokenizer, TokenizeOptions(max_length=96), DropReport())
  batches = pipeline.make_train_iterator(
    examples, batch_size=8, seed=0, buckets=(96,), pad_id=pad_id(tokenizer)
  )[0]
  return [next(batches) for _ in range(n)]


def write_jsonl(path, rows) -> str:
  """``rows`` as a JSON Lines file at ``path``; returns the path as a string."""
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  return str(path)


# ------------------------------------------------------------------ the reward server on loopback

# Two buckets, so batches are length-bucketed; short timeouts, so stalled clients are dropped fast.
SERVER_CONFIG = ServerConfig(
  max_batch=4,
  max_request_bytes=2048,
  max_length=64,
  buckets=(32, 64),
  batch_size=4,
  batch_wait_ms=20,
  header_timeout=1,
  body_timeout=1,
)
# A prompt and six replies of it: rows long enough to share a prefix of 64 tokens (the server's GRPO tests).
GRPO_PROMPT = [
  user(
    "Name three colours that go well with a deep shade of green, for the walls of a small "
    "north-facing room with old oak floors, white window frames and a brass lamp; say why "
    "each works, and which one you would choose yourself."
  )
]
GRPO_COMPLETIONS = [
  [assistant(text)]
  for text in (
    "Cream, terracotta and ochre.",
    "Grey.",
    "White, because it is bright.",
    "Pink and gold, to warm the room.",
    "Blue.",
    "Mustard yellow, for contrast with the oak.",
  )
]

# Proxies from the environment must not see loopback requests.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

# Bounds every socket read, so that a server that fails to answer fails the test instead of hanging it.
SOCKET_TIMEOUT = 30

SERVER_TEXTS = [
  "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
  "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n",
  "Plain text, no template.",
]


def approx(rewards):
  # The server pads rows to its own buckets and batches them with other requests' rows: each
  # reward is rm.score's up to the float32 roundings of other shapes.
  return pytest.approx(list(rewards), rel=REBATCHED["rtol"], abs=REBATCHED["atol"])


@contextlib.contextmanager
def serving(rm, config=SERVER_CONFIG, *, all_shapes=False):
  """A ready server on a free loopback port, run in a thread; ``all_shapes``: once every batch
  shape is compiled (a test that counts padded tokens or compiled programs)."""
  server = make_server(rm, "127.0.0.1", 0, config=config, model_name="tiny").start()
  try:
    server.wait_ready(timeout=300, all_shapes=all_shapes)
    yield server
  finally:
    server.shutdown()


def call(url, path, body=None, *, raw=None, method=None, headers=None):
  """(status, decoded JSON reply, reply headers) of one request; ``raw`` bytes are sent as they are."""
  data = raw if raw is not None else None if body is None else json.dumps(body).encode()
  req = urllib.request.Request(
    url + path,
    data=data,
    method=method or ("GET" if data is None else "POST"),
    headers={"Content-Type": "application/json", **(headers or {})},
  )
  try:
    with OPENER.open(req, timeout=SOCKET_TIMEOUT) as reply:
      return reply.status, json.loads(reply.read()), reply.headers
  except urllib.error.HTTPError as e:
    with e:
      return e.code, json.loads(e.read()), e.headers


def metric(url, name):
  """The value of one sample of the server's /metrics (``name`` with its labels, if any)."""
  with OPENER.open(url + "/metrics", timeout=SOCKET_TIMEOUT) as reply:
    text = reply.read().decode()
  found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
  assert found, f"{name} is not in /metrics:\n{text}"
  return float(found.group(1))


def raw_connection(url):
  host, port = url.removeprefix("http://").split(":")
  return socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT)


def read_all(sock) -> bytes:
  """What the server sends until it closes the connection (or resets it, having left unread data)."""
  chunks = []
  try:
    while chunk := sock.recv(65536):
      chunks.append(chunk)
  except ConnectionResetError:
    pass
  return b"".join(chunks)


# ------------------------------------------------------------------ TRL's GRPOTrainer


def grpo_trainer(cache_root, tmp_path, reward_funcs, prompts, **config):
  """TRL's GRPOTrainer of one step on ``prompts``, with a tiny random 1-layer Llama policy over
  SmolLM2's tokenizer (4 completions a step, 2 per prompt, of at most 12 tokens) on the CPU;
  ``config`` adds to or overrides its GRPOConfig."""
  trl = pytest.importorskip("trl", minversion="1.16", reason="TRL's GRPOTrainer: pip install trl==1.16.0")
  import datasets
  import hf_tiny
  import tiny_run
  import torch
  import transformers

  tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_run.tokenizer_dir(cache_root))
  torch.manual_seed(0)
  policy = transformers.AutoModelForCausalLM.from_config(
    hf_tiny.tiny_config(
      "llama",
      vocab_size=len(tokenizer),
      num_hidden_layers=1,
      pad_token_id=tokenizer.pad_token_id,
      bos_token_id=tokenizer.bos_token_id,
      eos_token_id=tokenizer.eos_token_id,
    ),
    dtype=torch.float32,
  )
  args = dict(
    output_dir=str(tmp_path),
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=12,
    max_steps=1,
    learning_rate=1e-5,
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    use_cpu=True,
    seed=0,
  )
  return trl.GRPOTrainer(
    model=policy,
    reward_funcs=reward_funcs,
    args=trl.GRPOConfig(**(args | config)),
    train_dataset=datasets.Dataset.from_dict({"prompt": list(prompts)}),
    processing_class=tokenizer,
  )


# ------------------------------------------------------------------ a tokenizer held on purpose

MARK = "HOLD"  # texts holding it make GatedTokenizer wait


class GatedTokenizer:
  """The model's tokenizer, except that a text holding MARK waits for ``gate`` (or ``delay`` s) first:
  a tokenizer slow or stuck on one request, while the others behave. The server's copies of it
  share its gate and its count."""

  def __init__(self, tokenizer, *, gate: threading.Event | None = None, delay: float = 0.0):
    self._tokenizer = tokenizer
    self._gate = gate
    self._delay = delay
    self._marks: list[str] = []  # texts holding MARK tokenized so far

  @property
  def marked(self) -> int:
    return len(self._marks)

  def __getattr__(self, name):
    if name.startswith("__") or name == "_tokenizer":
      raise AttributeError(name)
    return getattr(self._tokenizer, name)

  def __deepcopy__(self, memo):
    twin = copy.copy(self)
    twin._tokenizer = copy.deepcopy(self._tokenizer, memo)
    return twin

  def __len__(self):
    return len(self._tokenizer)

  def __call__(self, text, *args, **kwargs):
    if MARK in str(text):
      self._marks.append(str(text)[:20])
      if self._gate is not None:
        self._gate.wait(SOCKET_TIMEOUT)
      else:
        time.sleep(self._delay)
    return self._tokenizer(text, *args, **kwargs)


def gated(rm, **kwargs) -> RewardModel:
  return RewardModel(rm.model, GatedTokenizer(rm.tokenizer, **kwargs), rm.info)


def wait_until(condition, what: str, tries: int = 1000) -> None:
  for _ in range(tries):
    if condition():
      return
    time.sleep(0.01)
  raise AssertionError(f"timed out waiting until {what}")


def timed(fn, *args, **kwargs):
  start = time.monotonic()
  result = fn(*args, **kwargs)
  return result, time.monotonic() - start


# ------------------------------------------------------------------ faults injected into the library


def around(monkeypatch, owner, name: str, wrapper) -> None:
  """``owner.name`` (a module's private function, named by string) replaced for the test by
  ``wrapper(real, *args, **kwargs)``: a fault or a signal injected at one moment of the real work.
  The one sanctioned way for a test to reach a private name (tests/test_layout.py)."""
  real = getattr(owner, name)
  monkeypatch.setattr(owner, name, lambda *args, **kwargs: wrapper(real, *args, **kwargs))
