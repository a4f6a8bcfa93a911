"""Parity of every family with transformers' PyTorch models, on tiny random checkpoints."""

import hf_tiny
import numpy as np
import pytest
from helpers import PARITY_ATOL

from jaxrm import RewardModel


@pytest.fixture(scope="module", params=hf_tiny.FAMILIES)
def family(request):
  return request.param


@pytest.mark.parametrize("head", ["sequence", "token"])
def test_parity_with_transformers(family, head, tmp_path):
  torch_model = hf_tiny.build(family, head)
  torch_model.save_pretrained(tmp_path)
  rm = RewardModel.from_pretrained(tmp_path, dtype="float32")
  assert rm.config.family == family and rm.config.head == head
  ids, mask = hf_tiny.batch(hf_tiny.LENGTHS)
  expected = hf_tiny.torch_forward(torch_model, ids, mask)
  got = rm.score_tokens(ids, mask)
  if head == "sequence":
    np.testing.assert_allclose(got, expected[:, 0], atol=PARITY_ATOL, rtol=0)
    # Left padding gives the rewards of the unpadded rows.
    lids, lmask = hf_tiny.batch(hf_tiny.LENGTHS, left=True)
    np.testing.assert_allclose(rm.score_tokens(lids, lmask), expected[:, 0], atol=PARITY_ATOL, rtol=0)
  else:
    assert got.shape == (3, max(hf_tiny.LENGTHS), 2)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], expected[real], atol=PARITY_ATOL, rtol=0)


def test_parity_with_transformers_through_the_pallas_kernel(family, tmp_path):
  """The flash kernel (interpret mode off a GPU) in each family's decoder: Gemma 2's soft-capping
  and sliding layers, Qwen's and Mistral's windows, rows of 24 tokens (the kernel pads to 32)."""
  torch_model = hf_tiny.build(family, "sequence")
  torch_model.save_pretrained(tmp_path)
  rm = RewardModel.from_pretrained(tmp_path, dtype="float32", attention_impl="pallas")
  assert rm.config.attention_impl == "pallas"
  ids, mask = hf_tiny.batch(hf_tiny.LENGTHS)
  expected = hf_tiny.torch_forward(torch_model, ids, mask)
  np.testing.assert_allclose(rm.score_tokens(ids, mask), expected[:, 0], atol=PARITY_ATOL, rtol=0)
