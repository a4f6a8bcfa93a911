"""Preference models: one reward per response, trained on ranked completions of a prompt
(``reward.type=bradley_terry``, or ``ranking`` with ``reward.ranking_loss``)."""

from __future__ import annotations

import numpy as np

from jaxrm.data import example_types
from jaxrm.data.batches import PackedPreferenceBatch, PreferenceBatch
from jaxrm.tasks import losses
from jaxrm.tasks.base import Task, ones


def example(spec) -> tuple[np.ndarray, PreferenceBatch]:
  """Rewards [1, 2] of one group of two ranked completions."""
  del spec
  ids = np.zeros((2, 1), np.int32)
  ranks = np.array([[0, 1]], np.int32)
  batch = PreferenceBatch(ids, ids, ranks, np.zeros(1, np.float32), ones(1), strength=ones(1))
  return np.zeros((1, 2), np.float32), batch


PREFERENCE = Task(
  name="preference",
  reward_types=("bradley_terry", "ranking"),
  data="preference",
  dataset="PreferenceDataset",
  example_types=(example_types.PREFERENCE,),
  evaluation="preference",
  batches={"none": PreferenceBatch, "packed": PackedPreferenceBatch, "shared_prompt": PackedPreferenceBatch},
  packing_refused="",
  head="sequence",
  scores="reward",
  num_labels=1,
  losses={
    ("bradley_terry", None): losses.bradley_terry,
    ("ranking", "plackett_luce"): losses.plackett_luce,
    ("ranking", "all_pairs"): losses.all_pairs,
  },
  samples=None,
  example=example,
  needs="a sequence-head reward model with one output (a preference reward model)",
  train="train one with reward.type=bradley_terry or ranking",
  loss_choice="ranking_loss",
)
