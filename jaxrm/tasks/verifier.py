"""Generative verifiers: a causal LM's log-odds of answering yes to a question about the response
(``reward.type=verifier``, :mod:`jaxrm.verifier`), trained on preferences as a preference model is,
and used wherever one reward per response is."""

from __future__ import annotations

from jaxrm import losses
from jaxrm import verifier as verifiers
from jaxrm.batches import LabelledBatch, PackedLabelledBatch
from jaxrm.data import example_types
from jaxrm.tasks import preference
from jaxrm.tasks.base import Task
from jaxrm.tasks.preference import PREFERENCE


def _or_labelled(pairwise: losses.SpecLoss) -> losses.SpecLoss:
  """A verifier's loss: ``pairwise`` on preference batches, the cross-entropy over its two answers
  on labelled items."""

  def loss(spec, outputs, batch):
    if isinstance(batch, LABELLED_BATCHES):
      return losses.labelled(spec, outputs, batch)
    return pairwise(spec, outputs, batch)

  return loss


# A verifier's batches of labelled items, unpacked or packed: their outputs are alike, log-odds [G].
LABELLED_BATCHES = (LabelledBatch, PackedLabelledBatch)


def _labelled_scores(spec, outputs, batch):
  """Validation's scores of labelled items (their AUROC); none of preference batches."""
  return losses.labelled_scores(spec, outputs, batch) if isinstance(batch, LABELLED_BATCHES) else {}


VERIFIER = Task(
  name="verifier",
  reward_types=("verifier",),
  data="preference",
  dataset="PreferenceDataset",
  example_types=(example_types.PREFERENCE, example_types.LABELLED),
  evaluation="preference",
  # Labelled items become LABELLED_BATCHES instead; data.packing='shared_prompt' is refused for
  # them once their rows are read (jaxrm.data.packing.check_packable).
  batches=PREFERENCE.batches,
  packing_refused="",
  head="lm",
  scores="reward",
  num_labels=1,
  losses={
    ("verifier", None): _or_labelled(losses.bradley_terry),
    ("verifier", "plackett_luce"): _or_labelled(losses.plackett_luce),
    ("verifier", "all_pairs"): _or_labelled(losses.all_pairs),
  },
  samples=_labelled_scores,
  example=preference.example,
  needs="a verifier (a causal LM scoring the log-odds of its answers to a question)",
  train="train one with reward.type=verifier, or load a causal LM with "
  "RewardModel.from_pretrained(path, verifier=True)",
  use_instead="a verifier scores conversations: rm.score, or preference data",
  loss_choice="verifier_loss",
  serves=(PREFERENCE.name,),
  asker=verifiers.Verifier,
)
