"""The attention route where the installed JAX lacks Pallas's Triton lowering (announced for removal):
the Pallas kernel's place on a GPU goes to cuDNN where cuDNN runs the config, else to the reference
einsum; the run says why, once. Each test hides one of the modules the lowering needs, as a JAX
without it would fail to import them."""

import importlib.abc
import logging
import sys

import jax
import jax.numpy as jnp
import pytest
from helpers import tiny_decoder_config

from jaxrm.models import flash_attention as F
from jaxrm.models import layers as L
from jaxrm.models.decoder import attention_fn, attention_route, attention_summary


def hide(monkeypatch, name: str, why: str) -> None:
  """Makes ``import name`` fail with ``why`` until the test ends."""

  class Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
      if fullname == name:
        raise ImportError(why)
      return None

  monkeypatch.delitem(sys.modules, name, raising=False)
  monkeypatch.setattr(sys, "meta_path", [Hidden(), *sys.meta_path])


@pytest.mark.parametrize("module", F.TRITON_MODULES)
def test_without_triton_a_gpu_takes_cudnn_where_it_runs_else_the_reference(monkeypatch, module):
  plain = tiny_decoder_config(sliding_window=None, layer_types=(), dtype="bfloat16")
  assert F.triton_missing() is None and attention_route(plain, "gpu") == "pallas"
  hide(monkeypatch, module, f"{module} removed")
  assert module in F.triton_missing()
  for impl in ("auto", "pallas"):
    cfg = plain.replace(attention_impl=impl)
    assert attention_route(cfg, "gpu") == "cudnn"
    route = attention_fn(cfg, "gpu")
    assert route.func is L.fused_attention and route.keywords["implementation"] == "cudnn"
    # cuDNN cannot run these: no soft-capping, bfloat16/float16 only, head dims up to 128.
    for cannot in (
      dict(attn_logit_softcapping=50.0),
      dict(dtype="float32"),
      dict(head_dim=256),
      dict(head_dim=12),
    ):
      assert attention_route(cfg.replace(**cannot), "gpu") == "reference", cannot
  # Off a GPU nothing changes: the kernel's interpret mode needs no Triton.
  assert attention_route(plain, "cpu") == "reference"
  assert attention_route(plain.replace(attention_impl="pallas"), "cpu") == "pallas"
  assert attention_summary(plain, "gpu") == (
    "attention: cuDNN (jax.nn.dot_product_attention) instead of the pallas flash kernel: "
    f"this JAX ({jax.__version__}) has no Pallas Triton lowering ({module}: {module} removed) on all 2 layers"
  )


def test_the_missing_lowering_is_said_once(monkeypatch, caplog):
  hide(monkeypatch, F.TRITON_MODULES[0], "gone for good")
  F.say_once.cache_clear()
  cfg = tiny_decoder_config(dtype="bfloat16")
  with caplog.at_level(logging.WARNING, logger=F.__name__):
    routes = {attention_route(cfg, "gpu") for _ in range(3)} | {attention_fn(cfg, "gpu").func}
  said = [r.getMessage() for r in caplog.records if "Pallas Triton lowering" in r.getMessage()]
  assert len(said) == 1 and "gone for good" in said[0] and "takes the next route" in said[0], said
  assert routes == {"cudnn", L.fused_attention}


def test_the_kernel_still_builds_in_interpret_mode_without_triton(monkeypatch):
  """Off a GPU the kernel takes no Triton parameters: it traces with the module gone."""
  hide(monkeypatch, F.TRITON_MODULES[0], "gone")
  q = jax.ShapeDtypeStruct((1, 16, 2, 16), jnp.float32)
  ids = F.layout(jnp.ones((1, 16), jnp.int32))
  attend = jax.jit(lambda q, k: F.flash_attention(q, k, k, ids, scale=0.25, interpret=True))
  jaxpr = str(attend.trace(q, q).jaxpr)
  assert "pallas_call" in jaxpr and "CompilerParams" not in jaxpr
