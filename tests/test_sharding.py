"""Logical-axis rules, mesh construction, and sharded or multi-process training equal to one device."""

import json
import os
import sys

import jax
import numpy as np
import pytest
import tiny_run
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jaxrm import sharding
from jaxrm.hf.loader import abstract_model
from jaxrm.models.config import from_hf_config

MESH_222 = AbstractMesh((2, 2, 1, 2), sharding.MESH_AXES)  # data, fsdp, context, tensor

# The sharded and two-process runs compute the one-device run's float32 sums in other orders:
# gradients summed over 4 micro-batches and across devices or processes, losses over shards. Adam
# can blow rounding up: its first step g / (|g| + eps) is about +-lr whatever |g| is, so a gradient
# component that is 0 up to rounding may step either way (such components barely move the loss).
# The metrics agree to ~2e-7 here and move by ~4e-3 a step, so 1e-4 bounds rounding with room and
# stays far below what a step of training changes.
SAME_TRAINING_ATOL = 1e-4


# ------------------------------------------------------------------ rules


def test_logical_to_spec_uses_each_mesh_axis_once():
  # Tokens split over the context axis (context parallelism; of size 1 unless mesh.context is set).
  assert sharding.logical_to_spec(("batch", "length", "act_embed")) == P(("data", "fsdp"), "context", None)
  assert sharding.logical_to_spec(("layers", "embed", "heads")) == P(None, "fsdp", "tensor")
  assert sharding.logical_to_spec(("vocab", "embed")) == P("tensor", "fsdp")
  # fsdp is already taken by the batch: the second dimension stays whole.
  assert sharding.logical_to_spec(("batch", "embed")) == P(("data", "fsdp"), None)
  assert sharding.logical_to_spec((None, "labels")) == P(None, None)


def test_an_unknown_logical_axis_is_an_error_not_replicated():
  with pytest.raises(
    ValueError, match=r"logical axes \['embedd'\] have no sharding rule; the rules name batch, "
  ):
    sharding.logical_to_spec(("layers", "embedd", None))


def test_batch_sharding_splits_rows():
  assert sharding.batch_sharding(MESH_222, 2).spec == P(("data", "fsdp"), None)
  # Micro-batches stacked for accumulation: rows are the second axis.
  assert sharding.batch_sharding(MESH_222, 3, stacked=True).spec == P(None, ("data", "fsdp"), None)


def test_param_shardings_of_the_tiny_llama(model_dir):
  with open(os.path.join(model_dir, "config.json")) as f:
    cfg = from_hf_config(json.load(f))
  state = nnx.state(abstract_model(cfg))
  specs = {
    ".".join(map(str, path)): s.spec
    for path, s in nnx.to_flat_state(sharding.param_shardings(state, MESH_222))
  }
  assert specs["layers.q"] == P(None, "fsdp", "tensor")  # [L, D, heads*head_dim]
  assert specs["layers.k"] == P(None, "fsdp", "tensor")  # 2 kv heads split over 2 tensor shards
  assert specs["layers.o"] == P(None, "tensor", "fsdp")
  assert specs["layers.down"] == P(None, "tensor", "fsdp")
  assert specs["layers.input_norm"] == P(None, "fsdp")
  assert specs["embed"] == P("tensor", "fsdp")  # [vocab, D]
  assert specs["score"] == P("fsdp", None)  # [D, 1]


def test_context_devices_share_the_weights_shards():
  # fsdp 2 x context 2: a row's token shards split each weight's fsdp dimension four ways.
  mesh = AbstractMesh((1, 2, 2, 2), sharding.MESH_AXES)
  var = lambda *shape: nnx.Param(
    jax.ShapeDtypeStruct(shape, np.float32), logical_axes=("layers", "embed", "heads")
  )
  specs = sharding.param_shardings(nnx.State({"q": var(2, 64, 48), "odd": var(2, 6, 48)}), mesh)
  assert specs["q"].spec == P(None, ("fsdp", "context"), "tensor")
  assert specs["odd"].spec == P(None, "fsdp", "tensor")  # 6 splits 2 ways, not 4: fsdp alone
  # Without context parallelism the layout is fsdp's alone, as before.
  plain = AbstractMesh((1, 4, 1, 2), sharding.MESH_AXES)
  assert sharding.param_shardings(nnx.State({"q": var(2, 64, 48)}), plain)["q"].spec == P(
    None, "fsdp", "tensor"
  )


def test_param_shardings_drop_axes_that_do_not_divide():
  mesh = AbstractMesh((1, 1, 1, 4), sharding.MESH_AXES)
  var = nnx.Param(jax.ShapeDtypeStruct((2, 64, 48), np.float32), logical_axes=("layers", "embed", "kv_heads"))
  assert sharding.param_shardings(nnx.State({"k": var}), mesh)["k"].spec == P(None, "fsdp", "tensor")
  var = nnx.Param(jax.ShapeDtypeStruct((2, 64, 6), np.float32), logical_axes=("layers", "embed", "kv_heads"))
  assert sharding.param_shardings(nnx.State({"k": var}), mesh)["k"].spec == P(None, "fsdp", None)


def test_make_mesh_sizes_and_errors():
  mesh = sharding.make_mesh(sharding.MeshConfig(1, -1, 1))
  assert dict(mesh.shape) == {"data": 1, "fsdp": jax.device_count(), "context": 1, "tensor": 1}
  with pytest.raises(ValueError, match="at most one axis may be -1"):
    sharding.make_mesh(sharding.MeshConfig(-1, -1, 1))
  with pytest.raises(ValueError, match=r"data=2 x fsdp=1 x tensor=2 = 4 devices, but 1 are available"):
    sharding.make_mesh(sharding.MeshConfig(2, 1, 2), devices=jax.devices()[:1])
  with pytest.raises(
    ValueError,
    match=r"1 devices are not divisible by the fixed axes' product 2 "
    r"\(data=2 x tensor=1\); set mesh\.\* to sizes",
  ):
    sharding.make_mesh(sharding.MeshConfig(2, -1, 1), devices=jax.devices()[:1])
  with pytest.raises(ValueError, match=r"product 2 \(data=1 x context=2 x tensor=1\)"):
    sharding.make_mesh(sharding.MeshConfig(context=2), devices=jax.devices()[:1])


# ------------------------------------------------------------------ runs


@pytest.mark.slow
def test_2x2x2_mesh_trains_like_one_device(baseline, model_dir, tmp_path):
  """8 fake CPU devices, in a subprocess: JAX fixes the CPU device count when its backend starts
  (``jax_num_cpu_devices`` cannot change afterwards; jax 0.10 raises), and this process started it
  with one device, which the one-device baseline and the rest of the suite rely on."""
  out = str(tmp_path / "sharded")
  result = tiny_run.run(
    [sys.executable, os.path.join(tiny_run.ROOT, "tests", "tiny_run.py"), "sharded", model_dir, out]
  )
  assert result.returncode == 0, tiny_run.describe(result)
  report = json.loads(result.stdout.split("SHARDING ", 1)[1].splitlines()[0])
  assert report["devices"] == 8
  # q: [layers, embed, heads*head_dim] = [2, 64, 64]: embed over fsdp, heads over tensor.
  assert report["q_shape"] == [2, 64, 64] and report["q_spec"] == [None, "fsdp", "tensor"]
  assert report["q_shard_shape"] == [2, 32, 32]
  assert report["mu_q_spec"] == [None, "fsdp", "tensor"]  # Adam's moments sharded like the parameter
  assert report["step_spec"] == []
  assert "mesh: {'data': 2, 'fsdp': 2, 'tensor': 2} on 8 cpu devices" in result.stdout
  _assert_same_training(out, baseline, atol=SAME_TRAINING_ATOL)


@pytest.mark.slow
def test_two_processes_train_like_one(baseline, model_dir, tmp_path):
  """Two processes are the point: jax.distributed through a coordinator, one host's data each;
  with 2 micro-batches a step, each host takes its slice of every micro-batch (2 of 4 groups),
  each micro-batch padded to its own length, and the run logs what one device without
  accumulation logs."""
  out = str(tmp_path / "two_hosts")
  outputs = tiny_run.train_two_processes(model_dir, out, "--config.train.micro_batch_size=2")
  assert "2 process(es)" in outputs[0][0]
  assert "(x2 accumulation)" in outputs[0][0] and "each micro-batch padded to its own length" in outputs[0][0]
  assert "jaxrm:" not in outputs[1][0]  # only process 0 prints and logs
  _assert_same_training(out, baseline, atol=SAME_TRAINING_ATOL)
  assert sorted(int(d) for d in os.listdir(os.path.join(out, "checkpoints")) if d.isdigit()) == sorted(
    int(d) for d in os.listdir(os.path.join(baseline, "checkpoints")) if d.isdigit()
  )


def _assert_same_training(out, baseline, atol):
  rows, expected = tiny_run.read_metrics(out), tiny_run.read_metrics(baseline)
  assert [r["step"] for r in rows] == [r["step"] for r in expected]  # each event logged once
  for key in (
    "train/loss",
    "train/accuracy",
    "train/grad_norm",
    "validation-default_loss",
    "validation-train_sample_loss",
  ):
    got = [r[key] for r in rows if key in r]
    want = [r[key] for r in expected if key in r]
    assert len(got) == len(want) > 0, key
    np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=key)
