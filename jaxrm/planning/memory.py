"""A compiled step's memory per device, as XLA's compiler counts it, in one set of words.

The trainer logs these lines when it compiles a step, and ``python -m jaxrm.plan`` prints the same
ones from a compile for a GPU it does not have, so that the planned and the measured figures can
be put side by side.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
  """One compiled program's bytes per device (``compiled.memory_analysis()``).

  ``total`` = arguments + temporaries + outputs not aliased to donated arguments + ``held``
  (buffers alive beside the program, such as a micro-batched step's gradient sums).
  """

  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  held_bytes: int = 0

  @classmethod
  def of(cls, compiled, held: int = 0) -> ProgramMemory | None:
    """``compiled``'s analysis; None where the backend gives none."""
    m = compiled.memory_analysis()
    if m is None:
      return None
    return cls(
      m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes, held
    )

  @property
  def total_bytes(self) -> int:
    return (
      self.argument_bytes + self.temp_bytes + max(self.output_bytes - self.alias_bytes, 0) + self.held_bytes
    )

  def as_dict(self) -> dict[str, int]:
    return {**dataclasses.asdict(self), "total_bytes": self.total_bytes}

  def line(self) -> str:
    """The log's words: ``arguments 1.2 GiB, temporaries ..., total ... per device``."""
    parts = [
      ("arguments", self.argument_bytes),
      ("temporaries", self.temp_bytes),
      ("outputs", self.output_bytes),
      ("aliased", self.alias_bytes),
    ]
    if self.held_bytes:
      parts.append(("held beside it", self.held_bytes))
    return ", ".join(f"{name} {gib(n)}" for name, n in parts) + f"; total {gib(self.total_bytes)} per device"


def step_memory(
  programs: dict[str, Any], resident_bytes: int = 0
) -> tuple[ProgramMemory, dict[str, ProgramMemory]]:
  """A train step's memory per device from its compiled programs: ``{"step": c}``, or a
  micro-batched step's ``{"gradient": c, "update": c}``. The gradient program runs with the sums
  of the micro-batches before it alive (as large as its outputs) and ``resident_bytes`` of the
  state that it does not read (the optimizer state), held beside it. Returns the program with the
  larger total, and each program's figures."""
  if "step" in programs:
    one = ProgramMemory.of(programs["step"])
    return one, {"step": one}
  gradient = ProgramMemory.of(programs["gradient"])
  each = {
    "gradient": dataclasses.replace(gradient, held_bytes=gradient.output_bytes + resident_bytes),
    "update": ProgramMemory.of(programs["update"]),
  }
  return max(each.values(), key=lambda m: m.total_bytes), each


def bytes_per_device(tree) -> int:
  """Bytes of one device's shards of ``tree`` (arrays or ShapeDtypeStructs with shardings)."""
  import jax
  import numpy as np

  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def gib(n: float) -> str:
  return f"{n / 2**30:.2f} GiB"
