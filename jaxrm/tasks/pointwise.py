"""Pointwise (binary) reward models (``reward.type=pointwise``): a sequence head with one output,
the log-odds that a completion is good, trained with the logistic loss on labelled items.

A labelled item is TRL's unpaired preference row, ``{"prompt", "completion", "label": true/false}``
(strings or message lists), read by ``PreferenceDataset`` as a verifier's labelled items are
(:data:`jaxrm.data.example_types.LABELLED`). The head's one output ``s`` of a row is read as
``log p(good) - log p(bad)``; the loss is ``-log sigmoid(s)`` for a good item and
``-log sigmoid(-s)`` for a bad one (:func:`jaxrm.tasks.losses.labelled_loss`, the same binary
cross-entropy a verifier takes over its two answers), and validation ranks the items by ``s``
(AUROC). A model of it scores one reward per row, its log-odds, so it serves wherever a preference
model does, and a verifier's labelled items evaluate it.
"""

from __future__ import annotations

import numpy as np

from jaxrm.data import example_types
from jaxrm.data.batches import LabelledBatch, PackedLabelledBatch
from jaxrm.tasks import losses
from jaxrm.tasks.base import Task, ones
from jaxrm.tasks.preference import PREFERENCE

NAME = "pointwise"


def example(spec) -> tuple[np.ndarray, LabelledBatch]:
  """Log-odds [1] of one good item."""
  del spec
  ids = np.zeros((1, 1), np.int32)
  return np.zeros(1, np.float32), LabelledBatch(ids, ids, ones(1), ones(1))


POINTWISE = Task(
  name=NAME,
  reward_types=(NAME,),
  data="preference",  # labelled items are read from preference files (PreferenceDataset)
  dataset="PreferenceDataset",
  example_types=(example_types.LABELLED,),
  evaluation=example_types.LABELLED.key,  # the verifier's reading: accuracy, AUROC, ECE
  batches={"none": LabelledBatch, "packed": PackedLabelledBatch},
  packing_refused="data.packing={packing!r} writes a preference group's prompt once; labelled items "
  "are one sequence each, with no group to share it: use data.packing='packed'",
  head="sequence",
  scores="reward",
  num_labels=1,
  # The head's one output per row, reshaped as the labels [G]: the log-odds labelled_loss takes.
  losses={(NAME, None): losses.labelled},
  samples=losses.labelled_scores,
  example=example,
  needs="a pointwise reward model (a sequence head with one output: the log-odds that a response is good)",
  train="train one with reward.type=pointwise on labelled items (prompt, completion, label)",
  use_instead="a pointwise reward model scores one reward per response: rm.score, or labelled items "
  "or preference data",
  # One log-odds per row: a preference model's uses (a verifier's labelled items evaluate it too:
  # they are its own evaluation, Task.evaluations).
  serves=(PREFERENCE.name,),
)
