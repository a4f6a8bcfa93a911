"""Training and validation metrics: ``<output_dir>/metrics.jsonl`` and TensorBoard events."""

from __future__ import annotations

import json
import math
import os


class MetricsWriter:
  """Appends one JSON object per event (with its ``step``) and mirrors scalars to TensorBoard."""

  def __init__(self, output_dir: str, *, tensorboard: bool = True, log_dir: str | None = None,
               enabled: bool = True):
    self.enabled = enabled
    self._tb = None
    if not enabled:
      return
    os.makedirs(output_dir, exist_ok=True)
    self._jsonl = open(os.path.join(output_dir, "metrics.jsonl"), "a")
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(log_dir or os.path.join(output_dir, "tensorboard"))

  def write(self, step: int, metrics: dict[str, float]) -> None:
    if not self.enabled:
      return
    row = {"step": int(step)}
    row.update({k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()})
    self._jsonl.write(json.dumps(row) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for k, v in metrics.items():
        self._tb.add_scalar(k, float(v), int(step))
      self._tb.flush()

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      if self._tb is not None:
        self._tb.close()
