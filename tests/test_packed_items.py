"""Labelled items (a verifier's unpaired data) and rated responses (regression) packed into rows
(data.packing=packed): exact layouts; outputs, losses and gradients equal to the unpacked batch's
on a tiny random model; short packed runs that train, validate and checkpoint; and shared-prompt
packing refused for them by name."""

import os

import jax
import numpy as np
import pytest
import tiny_run
from flax import nnx
from helpers import REORDERED_ATOL, VOCAB, jitted, tiny_decoder_config, tiny_model, write_jsonl

from jaxrm.config import RewardSpec
from jaxrm.data import packing, pipeline, registry
from jaxrm.data.batches import LabelledBatch, PackedLabelledBatch, PackedRegressionBatch, RegressionBatch
from jaxrm.data.drops import DropReport
from jaxrm.data.tokenize import LabelledExample, RatedExample
from jaxrm.errors import ConfigError
from jaxrm.run import steps

ROW = 64  # packed row length of the model tests
UNPACKED = 32  # unpacked bucket of the model tests
# The gradient of a packed batch against the unpacked one, over its largest element: float32 sums
# over every row taken in another order (rows of other lengths, several items side by side), which
# measured 0.8e-6 (rated) and 1.2e-6 (labelled) here. Tokens that see the other items of their row
# (one segment per row) move elements by about the largest (measured 1.0).
GRAD_RTOL = 1e-5


def labelled(ids, label, source="item"):
  return LabelledExample(np.asarray(ids, np.int32), label, source, {})


def rated(ids, labels, mask, group, source="response"):
  return RatedExample(
    np.asarray(ids, np.int32), np.asarray(labels, np.float32), np.asarray(mask, np.float32), group, source, {}
  )


# ------------------------------------------------------------------------------------- layouts


def test_labelled_layout():
  items = [labelled([5, 6, 7], True), labelled([8, 9], False), labelled([10, 11, 12, 13], True)]
  spec = packing.PackSpec(row_length=6, pad_id=1, rewards_multiple=1)
  batch = packing.pack_items(items, spec, num_examples=4)
  assert isinstance(batch, PackedLabelledBatch)
  # Longest first: item 2 (4 tokens), then item 1 beside it; item 0 (3) no longer fits there.
  np.testing.assert_array_equal(batch.input_ids, [[10, 11, 12, 13, 8, 9], [5, 6, 7, 1, 1, 1]])
  np.testing.assert_array_equal(batch.attention_mask, [[1] * 6, [1] * 3 + [0] * 3])
  np.testing.assert_array_equal(batch.positions, [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 0, 0]])
  np.testing.assert_array_equal(batch.segment_ids, [[1, 1, 1, 1, 2, 2], [1, 1, 1, 0, 0, 0]])
  np.testing.assert_array_equal(batch.branch_ids, np.zeros((2, 6)))
  np.testing.assert_array_equal(batch.reward_positions, [[3, 5], [2, -1]])
  # Item g's log-odds at reward_index[g] of the [B * R] outputs; the filler reads slot 0.
  np.testing.assert_array_equal(batch.reward_index, [2, 1, 0, 0])
  np.testing.assert_array_equal(batch.labels, [1, 0, 1, 0])
  np.testing.assert_array_equal(batch.example_mask, [1, 1, 1, 0])
  # The filler takes no room: every attended token is real, counted as the unpacked batch does.
  assert batch.token_counts() == (9, 9 / 12)
  assert pipeline.Collator(batch_size=4, buckets=(6,))(items).token_counts()[0] == 9


def test_rated_layout():
  responses = [
    rated([3, 4], [1, 2], [1, 0], group=7),
    rated([5, 6, 7], [3, 4], [1, 1], group=7),
    rated([8], [0, 1], [0, 1], group=9),
  ]
  batch = packing.pack_items(responses, packing.PackSpec(row_length=4, rewards_multiple=2), num_examples=4)
  assert isinstance(batch, PackedRegressionBatch)
  np.testing.assert_array_equal(batch.input_ids, [[5, 6, 7, 8], [3, 4, 0, 0]])
  np.testing.assert_array_equal(batch.positions, [[0, 1, 2, 0], [0, 1, 0, 0]])
  np.testing.assert_array_equal(batch.segment_ids, [[1, 1, 1, 2], [1, 1, 0, 0]])
  np.testing.assert_array_equal(batch.reward_positions, [[2, 3], [1, -1]])
  np.testing.assert_array_equal(batch.reward_index, [2, 0, 1, 0])
  # Ratings as the unpacked batch has them; the filler's are all masked.
  np.testing.assert_array_equal(batch.labels, [[1, 2], [3, 4], [0, 1], [0, 0]])
  np.testing.assert_array_equal(batch.label_mask, [[1, 0], [1, 1], [0, 1], [0, 0]])
  np.testing.assert_array_equal(batch.group, [7, 7, 9, 0])
  np.testing.assert_array_equal(batch.example_mask, [1, 1, 1, 0])
  assert batch.token_counts() == (6, 6 / 8)


def test_micro_batches_of_two_hosts_index_the_global_batch():
  """Two hosts, two micro-batches each: every item's output is read back from the global batch
  that to_global_batch assembles, at its own last token, as the unpacked micro-batch orders them."""
  rng = np.random.default_rng(0)
  items = [rated(rng.integers(3, 99, 2 + i % 4), [i, -i], [1, i % 2], group=i // 2) for i in range(8)]
  spec = packing.PackSpec(row_length=8, length_multiple=4, rewards_multiple=1)
  hosts = [
    packing.PackedCollator(4, spec, process_index=p, process_count=2, micro_batches=2)(items)
    for p in range(2)
  ]
  assert {k: v.shape for k, v in vars(hosts[0]).items()} == {k: v.shape for k, v in vars(hosts[1]).items()}
  whole = jax.tree.map(lambda *xs: np.concatenate(xs, axis=1), *hosts)  # rows (and items) on axis 1
  for m in range(2):  # micro-batch m holds host 0's items m, m + 2, then host 1's 4 + m, 6 + m
    order = [m, m + 2, 4 + m, 6 + m]
    last = np.take_along_axis(whole.input_ids[m], np.maximum(whole.reward_positions[m], 0), axis=1)
    np.testing.assert_array_equal(
      packing.group_rewards(last, whole.reward_index[m]), [items[i].input_ids[-1] for i in order]
    )
    np.testing.assert_array_equal(whole.labels[m], [items[i].labels for i in order])
    np.testing.assert_array_equal(whole.group[m], [items[i].group for i in order])


# --------------------------------------------------------------------- equality with unpacked


def random_items(kind, n=6, seed=0):
  rng = np.random.default_rng(seed)
  ids = lambda: rng.integers(3, VOCAB, int(rng.integers(3, UNPACKED)))
  if kind == "labelled":
    return [labelled(ids(), i % 3 == 0, f"item {i}") for i in range(n)]
  return [
    rated(ids(), rng.uniform(0, 4, 2), [1, i % 2], group=i // 2, source=f"response {i}") for i in range(n)
  ]


MODELS = {
  # A verifier's head: the log-odds of two answer tokens of the LM head (tied to the embedding).
  "labelled": (dict(head="lm", verifier_tokens=(3, 4), tie_word_embeddings=True), RewardSpec("verifier")),
  "rated": (dict(num_labels=2), RewardSpec("regression", attributes="a,b")),
}


@pytest.mark.parametrize("kind", MODELS)
def test_packed_outputs_loss_and_gradients_equal_unpacked(kind):
  overrides, spec = MODELS[kind]
  model = tiny_model(tiny_decoder_config(**overrides), seed=1)
  items = random_items(kind)
  # 8 items of which 2 fillers: repeated rows unpacked, no room packed.
  unpacked = pipeline.Collator(batch_size=8, buckets=(UNPACKED,))(items)
  batch = packing.pack_items(items, packing.PackSpec(ROW), num_examples=8)
  assert isinstance(unpacked, (LabelledBatch, RegressionBatch))
  assert batch.input_ids.shape[0] < len(items)  # items did share rows
  expected, got = (np.asarray(jitted(model)(b)) for b in (unpacked, batch))
  assert got.shape == expected.shape == np.shape(unpacked.labels)
  real = slice(0, len(items))
  np.testing.assert_allclose(got[real], expected[real], atol=REORDERED_ATOL, rtol=0)
  assert np.ptp(expected[real]) > 0.1  # outputs differ from item to item: the check above can fail
  np.testing.assert_array_equal(batch.labels[real], unpacked.labels[real])

  loss_and_grad = jax.jit(jax.value_and_grad(steps.make_loss_fn(model, spec), has_aux=True))
  params = nnx.state(model)
  (_, want), want_grads = loss_and_grad(params, unpacked)
  (_, metrics), grads = loss_and_grad(params, batch)
  # The mean of terms whose slopes in the outputs are below 1 (cross-entropy), or 2|p - y| (the
  # squared error): the loss differs by the outputs' difference times that slope.
  slope = 1.0 if kind == "labelled" else 2 * np.abs(expected[real] - unpacked.labels[real]).max()
  mean = lambda m: m["loss"].total / m["loss"].count
  np.testing.assert_allclose(mean(metrics), mean(want), atol=slope * REORDERED_ATOL, rtol=0)
  assert metrics["loss"].count == want["loss"].count  # fillers count in neither
  if kind == "labelled":  # a count of right items: exact in float32
    np.testing.assert_allclose(metrics["accuracy"].total, want["accuracy"].total)
  flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
  scale = np.abs(flat(want_grads)).max()
  assert scale > 0
  np.testing.assert_allclose(flat(grads), flat(want_grads), rtol=0, atol=GRAD_RTOL * scale)


# ------------------------------------------------------------------------------- packed runs

# 2 steps of 8 items; validation and a checkpoint at step 2, in batches of 3 (the last holds a filler).
RUN = {
  "data.packing": "packed",
  "train.max_steps": 2,
  "eval.val_period": 2,
  "eval.batch_size": 3,
  "logger.tensorboard": False,
}


def labelled_file(path, split: str, rows: int) -> str:
  """TRL's unpaired rows from the demo's pairs: the better completion labelled true, the worse false."""
  records = registry.load_records("demo_arithmetic", None, split=split, drops=DropReport())[: rows // 2]
  return write_jsonl(
    path,
    [
      {"prompt": r.context, "completion": completion, "label": rank == 0}
      for r in records
      for completion, rank in zip(r.completions, r.ranks)
    ],
  )


def labelled_config(cache_root, tmp_path, **overrides):
  c = tiny_run.config(
    tiny_run.tiny_model_dir(cache_root, head="causal"),
    str(tmp_path / "run"),
    reward__type="verifier",
    data__dataset_name="PreferenceDataset",
    data__train_data_path=labelled_file(tmp_path / "train.jsonl", "train", 16),
  )
  c.data.val_data_paths = {"default": labelled_file(tmp_path / "val.jsonl", "validation", 8)}
  return tiny_run.set_keys(c, {**RUN, **{k.replace("__", "."): v for k, v in overrides.items()}})


def rated_config(model_dir, tmp_path):
  rng = np.random.default_rng(0)
  rows = lambda n, name: [
    {"prompt": f"Item {name}-{i // 2}:", "response": " good" * (1 + i % 3), "quality": int(rng.integers(5))}
    | ({"polish": int(rng.integers(5))} if i % 2 else {})
    for i in range(n)
  ]
  c = tiny_run.config(
    model_dir,
    str(tmp_path / "run"),
    reward__type="regression",
    reward__attributes="quality,polish",
    reward__attribute_range="0,4",
    data__dataset_name="RatedDataset",
    data__train_data_path=write_jsonl(tmp_path / "train.jsonl", rows(16, "t")),
    data__max_length=32,
    data__bucket_multiple=32,
    train__micro_batch_size=4,  # 2 micro-batches per step, packed apart and stacked
  )
  c.data.val_data_paths = {"default": write_jsonl(tmp_path / "val.jsonl", rows(8, "v"))}
  return tiny_run.set_keys(c, RUN)


def assert_packed_run(out, val_keys):
  rows = tiny_run.read_metrics(out)
  train = [r for r in rows if "train/loss" in r]
  assert [r["step"] for r in train] == [1, 2]
  assert all(0 < r["train/packing_efficiency"] <= 1 and np.isfinite(r["train/loss"]) for r in train)
  (val,) = [r for r in rows if "validation-default_loss" in r]
  assert val["step"] == 2
  for key in val_keys:
    assert np.isfinite(val[f"validation-default_{key}"]), key
  assert os.path.isdir(os.path.join(out, "checkpoints", "2"))


def test_packed_labelled_run_trains_and_validates(cache_root, tmp_path):
  c = labelled_config(cache_root, tmp_path)
  tiny_run.train(c)
  assert_packed_run(c.output_dir, ("loss", "accuracy", "auroc", "ece"))


def test_packed_regression_run_trains_and_validates(model_dir, tmp_path):
  c = rated_config(model_dir, tmp_path)
  tiny_run.train(c)
  assert_packed_run(c.output_dir, ("loss", "mse", "spearman_quality", "pairwise_accuracy"))


def test_shared_prompt_is_refused_for_labelled_items(cache_root, tmp_path):
  c = labelled_config(cache_root, tmp_path, data__packing="shared_prompt")
  with pytest.raises(
    ConfigError,
    match=r"^data.packing='shared_prompt' writes a preference group's prompt once; labelled items "
    r"\(prompt, completion, label\) are one sequence each, with no group to share it: use "
    r"data.packing='packed'$",
  ):
    tiny_run.train(c)
  assert not os.path.exists(c.output_dir)
