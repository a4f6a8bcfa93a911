"""Regression models: one prediction per rated attribute (``reward.type=regression``)."""

from __future__ import annotations

import numpy as np

from jaxrm.data import example_types
from jaxrm.data.batches import PackedRegressionBatch, RegressionBatch
from jaxrm.tasks import losses
from jaxrm.tasks.base import Task, ones


def example(spec) -> tuple[np.ndarray, RegressionBatch]:
  """Predictions [1, A] of one response rated on every attribute."""
  ids, rated = np.zeros((1, 1), np.int32), np.ones((1, len(spec.attribute_names)), np.float32)
  batch = RegressionBatch(ids, ids, rated, rated, np.zeros(1, np.int32), ones(1))
  return np.zeros_like(rated), batch


REGRESSION = Task(
  name="regression",
  reward_types=("regression",),
  data="rated",
  dataset="RatedDataset",
  example_types=(example_types.RATED,),
  evaluation="regression",
  batches={"none": RegressionBatch, "packed": PackedRegressionBatch},
  packing_refused="data.packing={packing!r} writes a preference group's prompt once; rated responses "
  "are one sequence each, with no group to share it: use data.packing='packed'",
  head="sequence",
  scores="attributes",
  num_labels=None,
  losses={("regression", None): losses.regression},
  samples=losses.regression_pair_samples,
  example=example,
  needs="a regression model (one output per attribute, trained with reward.type=regression)",
  train="train one with reward.type=regression",
  use_instead="a regression model is evaluated on rated data (--dataset_name=RatedDataset, HelpSteer2 "
  "or demo_attributes)",
)
