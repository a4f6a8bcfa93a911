"""The model families jaxrm reads and writes, one module each (see ``docs/adding-a-family.md``).

Each module defines one :class:`~jaxrm.models.families.base.Family` as ``FAMILY``; this registry
finds them by name (``ModelConfig.family``), by a config.json's ``model_type`` and by a GGUF file's
architecture. A family whose spec leaves a field at its default has no such thing (no GGUF
layout, no vision-language checkpoint). Nothing outside this package names a family.
"""

from __future__ import annotations

from typing import Any

from jaxrm.errors import UnsupportedModelError
from jaxrm.models.families import gemma2, gemma3, llama, mistral, phi3, qwen2, qwen3
from jaxrm.models.families.base import Family

FAMILIES: tuple[Family, ...] = tuple(m.FAMILY for m in (llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3))


def names() -> tuple[str, ...]:
  """Every family's name, in the order error messages list them."""
  return tuple(f.name for f in FAMILIES)


def get(name: str) -> Family:
  """The family called ``name`` (``ModelConfig.family``)."""
  for family in FAMILIES:
    if family.name == name:
      return family
  raise UnsupportedModelError(f"model family {name!r} is not supported; supported: {', '.join(names())}")


def of_config(hf: dict[str, Any]) -> Family:
  """The family of a transformers config.json dict, by its ``model_type`` (the decoder's, or that of
  a vision-language checkpoint holding it)."""
  model_type = hf.get("model_type")
  for family in FAMILIES:
    if model_type is not None and model_type in (family.model_type, family.multimodal_model_type):
      return family
  archs = ", ".join(hf.get("architectures") or []) or "unknown"
  raise UnsupportedModelError(
    f"model_type {model_type!r} (architectures: {archs}) is not supported; jaxrm supports: {', '.join(names())}"
  )


def gguf_architectures() -> tuple[str, ...]:
  """The GGUF ``general.architecture`` values jaxrm reads."""
  return tuple(f.gguf.architecture for f in FAMILIES if f.gguf is not None)


def of_gguf(architecture: str) -> Family | None:
  """The family whose GGUF files have this ``general.architecture``, or None."""
  return next((f for f in FAMILIES if f.gguf is not None and f.gguf.architecture == architecture), None)
