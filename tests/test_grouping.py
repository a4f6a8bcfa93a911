"""Length-grouped order (Hugging Face's group_by_length) and micro-batches of similar lengths."""

import numpy as np
import pytest
import torch
from transformers.trainer_pt_utils import get_length_grouped_indices

from jaxrm.data import grouping


@pytest.mark.parametrize("n, batch", [(1000, 8), (37, 4), (5, 8)])
def test_order_is_transformers_group_by_length(n, batch):
  lengths = np.random.default_rng(n).integers(1, 60, n).tolist()  # many ties
  generator = torch.Generator().manual_seed(3)
  want = get_length_grouped_indices(lengths, batch, generator=generator)
  shuffled = torch.randperm(n, generator=torch.Generator().manual_seed(3)).numpy()
  np.testing.assert_array_equal(grouping.length_grouped_indices(lengths, batch, shuffled), want)


def test_grouped_epochs_differ_and_repeat_from_the_seed():
  lengths = np.random.default_rng(0).integers(1, 500, 1003)
  examples = [f"ex{i}" for i in range(1003)]
  epochs = grouping.GroupedEpochs(examples, lengths, global_batch_size=10, seed=7)
  assert epochs.used == 1000  # the last 3 wait for another epoch
  first = [epochs[i] for i in range(1000)]
  second = [epochs[1000 + i] for i in range(1000)]
  assert len(set(first)) == 1000 and first != second
  assert [grouping.GroupedEpochs(examples, lengths, 10, seed=7)[1000 + i] for i in range(1000)] == second
  # Batches of similar lengths (mega-batches of 25 batches here): a batch's spread of lengths is
  # a small fraction of a shuffled batch's; the longest group of all comes first.
  spread = lambda order: np.mean([np.ptp(lengths[order[i : i + 10]]) for i in range(0, 1000, 10)])
  assert spread(epochs.order(0)) < 0.2 * spread(np.random.default_rng(1).permutation(1003)[:1000])
  assert lengths[epochs.order(0)[0]] == lengths.max()


def test_micro_batches_take_every_group_once_by_length():
  lengths = [5, 90, 7, 60, 3, 80, 20, 10]
  parts = grouping.micro_batch_groups(lengths, 2)
  assert [p.tolist() for p in parts] == [[4, 0, 2, 7], [6, 3, 5, 1]]
  with pytest.raises(ValueError, match="8 groups do not split into 3 equal micro-batches"):
    grouping.micro_batch_groups(lengths, 3)
