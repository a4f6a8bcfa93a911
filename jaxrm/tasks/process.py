"""Process reward models: a probability per step that the step is correct (``reward.type=stepwise``)."""

from __future__ import annotations

import numpy as np

from jaxrm.data import example_types
from jaxrm.data.batches import PackedStepwiseBatch, StepwiseBatch
from jaxrm.tasks import losses
from jaxrm.tasks.base import Task, ones


def example(spec) -> tuple[np.ndarray, StepwiseBatch]:
  """Logits [1, 1, 2] of one sequence of one labelled step."""
  del spec
  ids = np.zeros((1, 1), np.int32)
  return np.zeros((1, 1, 2), np.float32), StepwiseBatch(ids, ids, np.ones((1, 1), np.int32), ones(1))


PROCESS = Task(
  name="process",
  reward_types=("stepwise",),
  data="stepwise",
  dataset="StepwiseDataset",
  example_types=(example_types.STEPWISE,),
  evaluation="stepwise",
  batches={"none": StepwiseBatch, "packed": PackedStepwiseBatch},
  packing_refused="data.packing={packing!r} writes a preference group's prompt once; stepwise "
  "sequences have no group to share it: use data.packing='packed'",
  head="token",
  scores="steps",
  num_labels=2,  # step in error, step correct
  losses={("stepwise", None): losses.stepwise},
  samples=None,
  example=example,
  needs="a token-head (process reward) model with 2 labels (step in error, step correct)",
  train="train one with reward.type=stepwise",
  use_instead="a process reward model scores steps: rm.score_steps, or stepwise data "
  "(--dataset_name=StepwiseDataset or demo_arithmetic_steps)",
)
