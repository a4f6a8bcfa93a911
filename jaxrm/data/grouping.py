"""Which groups go together: length-grouped epochs and micro-batches of similar lengths.

Unpacked batches are padded to their longest sequence, so groups of similar lengths waste less.
:func:`length_grouped_indices` is Hugging Face's ``group_by_length`` order (``transformers``'
``get_length_grouped_indices``): shuffle, cut into mega-batches of (up to) 50 batches, sort each by
length, longest first, and move the longest group of all to the front (so that a batch that does
not fit in memory fails at the first step). :class:`GroupedEpochs` serves that order epoch after
epoch to the Grain pipeline, and :func:`micro_batch_groups` splits a global batch into micro-batches
of similar lengths, each then padded to its own bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MAX_EPOCHS = 1 << 20  # GroupedEpochs is this many epochs long: endless for any run


def mega_batches(num_examples: int, batch_size: int) -> int:
  """Batches per mega-batch, as transformers chooses: 50, or fewer so that there are 4."""
  return max(min(num_examples // (batch_size * 4), 50), 1)


def length_grouped_indices(lengths: Sequence[int], batch_size: int, shuffled: np.ndarray) -> np.ndarray:
  """``shuffled`` (a permutation of ``range(len(lengths))``) sorted by length, longest first,
  within each mega-batch (:func:`mega_batches`), with the longest of all moved to the front."""
  lengths = np.asarray(lengths)
  order = np.asarray(shuffled)
  size = mega_batches(len(lengths), batch_size) * batch_size
  megas = [order[i : i + size] for i in range(0, len(order), size)]
  # A stable sort on -length: equal lengths keep their shuffled order.
  megas = [m[np.argsort(-lengths[m], kind="stable")] for m in megas]
  longest = int(np.argmax([lengths[m[0]] for m in megas]))
  megas[0][0], megas[longest][0] = megas[longest][0], megas[0][0]
  return np.concatenate(megas)


class GroupedEpochs:
  """The examples of epoch after epoch in length-grouped order, as a random-access sequence for
  ``grain.MapDataset.source``: item ``i`` is position ``i % used`` of epoch ``i // used``, where
  ``used`` leaves out the remainder of the last global batch. Epoch ``e``'s order comes from
  ``seed`` and ``e`` alone, so a resumed iterator reads what an uninterrupted one would.
  """

  def __init__(self, examples: Sequence, lengths: Sequence[int], global_batch_size: int, seed: int):
    self._examples = examples
    self._lengths = np.asarray(lengths)
    self._batch = global_batch_size
    self._seed = seed
    self._orders: dict[int, np.ndarray] = {}  # the epochs read last
    self.used = len(examples) // global_batch_size * global_batch_size

  def __len__(self) -> int:
    return self.used * MAX_EPOCHS

  def __getitem__(self, index: int):
    epoch, position = divmod(int(index), self.used)
    return self._examples[self.order(epoch)[position]]

  def order(self, epoch: int) -> np.ndarray:
    """Epoch ``epoch``'s example indices (the first ``used`` of a length-grouped permutation)."""
    if epoch not in self._orders:
      if len(self._orders) >= 2:
        self._orders.pop(min(self._orders))
      shuffled = np.random.default_rng([self._seed, epoch]).permutation(len(self._lengths))
      self._orders[epoch] = length_grouped_indices(self._lengths, self._batch, shuffled)[: self.used]
    return self._orders[epoch]


def micro_batch_groups(lengths: Sequence[int], n: int) -> list[np.ndarray]:
  """Indices of one global batch's groups split into ``n`` equal micro-batches of similar
  lengths: sorted by length, cut in order. Every group lands in exactly one."""
  if len(lengths) % n:
    raise ValueError(f"{len(lengths)} groups do not split into {n} equal micro-batches")
  order = np.argsort(np.asarray(lengths), kind="stable")
  return np.split(order, n)
