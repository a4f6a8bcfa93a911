"""Damage to the tokenized-example cache, seeded, for fault-injection tests.

``corrupt_cache(directory, seed)`` picks one file of one cache entry found under ``directory``
(a cache directory, or any folder holding one, such as a run's) and damages it one of three ways:
``truncate`` (cut short at a random byte), ``flip`` (one bit of a random byte inverted) or
``empty`` (a data file emptied; in a JSON file, one of its values replaced by an empty one).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random

KINDS = ("truncate", "flip", "empty")


@dataclasses.dataclass(frozen=True)
class Corruption:
  entry: str  # the cache entry's directory
  path: str  # the damaged file
  kind: str  # one of KINDS

  @property
  def name(self) -> str:
    return os.path.basename(self.path)


def cache_entries(directory: str) -> list[str]:
  """The cache entries under ``directory``: folders holding a manifest.json (sorted)."""
  return sorted(d for d, _, names in os.walk(directory) if "manifest.json" in names)


def corrupt_cache(
  directory: str, seed: int, kinds: tuple[str, ...] = KINDS, name: str | None = None
) -> Corruption:
  """Damages one non-empty file (named ``name``, if given) of one cache entry under
  ``directory``, chosen by ``seed``, in one of ``kinds``."""
  rng = random.Random(seed)
  files = [
    os.path.join(entry, file)
    for entry in cache_entries(directory)
    for file in sorted(os.listdir(entry))
    if os.path.getsize(os.path.join(entry, file)) > 0 and name in (None, file)
  ]
  if not files:
    raise ValueError(f"{directory}: no cache entry with a non-empty file")
  path, kind = rng.choice(files), rng.choice(kinds)
  with open(path, "rb") as f:
    data = f.read()
  if kind == "truncate":
    data = data[: rng.randrange(len(data))]
  elif kind == "flip":
    at = rng.randrange(len(data))
    data = data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1 :]
  elif path.endswith(".json"):
    data = json.dumps(_emptied(json.loads(data), rng)).encode("utf-8")
  else:
    data = b""
  with open(path, "wb") as f:
    f.write(data)
  return Corruption(entry=os.path.dirname(path), path=path, kind=kind)


def _emptied(doc, rng: random.Random):
  """``doc`` with one of its non-empty values (at any depth) replaced by an empty one of its type."""
  places = []  # (container, key) of every value that is not already empty

  def walk(node):
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
      if value not in ("", 0, [], {}, None, False):
        places.append((node, key))
      walk(value)

  walk(doc)
  container, key = rng.choice(places)
  value = container[key]
  container[key] = type(value)() if isinstance(value, (str, list, dict, int, float)) else None
  return doc
