"""Training and validation metrics: ``<output_dir>/metrics.jsonl`` and TensorBoard events."""

from __future__ import annotations

import json
import math
import os

METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
  """Appends one JSON object per event (with its ``step``) and mirrors scalars to TensorBoard.

  A run resumed from step ``resume_step`` first drops the rows its previous attempt wrote after
  that step (they are about to be recomputed), and TensorBoard purges the same steps; a run that
  starts at step 0 starts the file afresh. Non-finite values are written as ``null``.
  """

  def __init__(self, output_dir: str, *, tensorboard: bool = True, log_dir: str | None = None,
               enabled: bool = True, resume_step: int = 0):
    self.enabled = enabled
    self._tb = None
    if not enabled:
      return
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, METRICS_FILE)
    _keep_rows_up_to(path, resume_step)
    self._jsonl = open(path, "a")
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(log_dir or os.path.join(output_dir, "tensorboard"),
                               purge_step=resume_step + 1 if resume_step else 0)

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


def _keep_rows_up_to(path: str, step: int) -> None:
  """Rewrites ``path`` with its complete rows of steps <= ``step`` (none when ``step`` is 0)."""
  if not os.path.exists(path):
    return
  kept = []
  if step:
    with open(path) as f:
      for line in f:
        if not line.endswith("\n"):  # cut short by a kill
          break
        if json.loads(line)["step"] <= step:
          kept.append(line)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.writelines(kept)
  os.replace(tmp, path)
