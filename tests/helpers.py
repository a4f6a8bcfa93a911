"""What the packing and attention tests share: hand-made groups and a tiny random model."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrm.data.tokenize import PreferenceExample
from jaxrm.models.config import ModelConfig
from jaxrm.models.decoder import Decoder

VOCAB = 128


def pref(*seqs, margin=0.0, source="row"):
  """A preference example whose completions (best first) are token-id lists."""
  ids = tuple(np.asarray(s, np.int32) for s in seqs)
  return PreferenceExample(ids, tuple(range(len(ids))), margin, source, {})


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


def tiny_config(**overrides):
  # A window on one layer of two exercises the window mask on packed rows.
  kw = dict(family="mistral", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
            sliding_window=6, layer_types=("sliding_attention", "full_attention"))
  kw.update(overrides)
  return ModelConfig(**kw)


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
