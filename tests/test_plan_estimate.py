"""The plan's time estimate (``jaxrm.planning.step_time``) and its choice of remat and micro-batch.

The estimate's arithmetic is checked on programs whose FLOPs and bytes are counted by hand: one
compiled by XLA's GPU compiler for an H100 (a product, and a loop over stacked weights), and one
written as HLO text (a flash-attention kernel, a collective). The choice runs on the tiny model.
"""

import dataclasses
import json
import math
import os
import types

import pytest
import tiny_run

from jaxrm import cli
from jaxrm.planning import fit_check, gpu_targets, step_time

H100 = gpu_targets.TARGETS["h100-80gb"]
EFF = step_time.Efficiency()


def roofline(flops: float, moved: float, rate: float) -> float:
  """One kernel's time as the estimate states it: the longer of its FLOPs and its bytes, plus a launch."""
  return max(flops / (rate * EFF.matmul), moved / (H100.memory_bandwidth * EFF.memory)) + EFF.launch_s


@pytest.fixture(scope="module")
def small_program():
  """``x @ w`` in bfloat16 ([512, 1024] x [1024, 2048]), then a loop of 3 trips, each taking one
  [1024, 1024] slice of stacked weights: compiled for an H100, estimated."""
  import jax
  import jax.numpy as jnp

  one = jax.sharding.SingleDeviceSharding(gpu_targets.devices(H100, "1x1")[0])

  def f(x, w, stack):
    def layer(c, wl):
      return jnp.tanh(c @ wl), None

    y, _ = jax.lax.scan(layer, x, stack)
    return (x @ w).astype(jnp.float32).sum(), y

  shapes = [(512, 1024), (1024, 2048), (3, 1024, 1024)]
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=one) for s in shapes]
  with gpu_targets.uncached():
    text = jax.jit(f).lower(*args).compile().as_text()
  return step_time.estimate(text, H100)


def test_a_product_costs_its_flops_and_bytes_at_the_cards_rates(small_program):
  e = small_program
  (product,) = [k for k in e.kernels if k.kind == "gemm" and k.runs == 1]
  assert product.flops == 2 * 512 * 1024 * 2048
  assert product.bytes == 2 * (512 * 1024 + 1024 * 2048 + 512 * 2048)  # bf16: read x and w, write x @ w
  assert math.isclose(product.seconds, roofline(product.flops, product.bytes, H100.peak_bf16_flops))
  # 2.1 GFLOP and 7.3 MB: at 989 TFLOP/s x 0.7 and 3.35 TB/s x 0.8 its FLOPs take longer.
  assert product.flops / (H100.peak_bf16_flops * EFF.matmul) > product.bytes / (
    H100.memory_bandwidth * EFF.memory
  )
  assert math.isclose(e.seconds, sum(k.seconds * k.runs for k in e.kernels))


def test_a_loop_counts_its_body_per_trip_and_a_slice_as_the_slice(small_program):
  e = small_program
  in_loop = [k for k in e.kernels if k.kind == "gemm" and k.runs == 3]
  assert in_loop and sum(k.flops for k in in_loop) == 2 * 512 * 1024 * 1024  # each trip's c @ wl
  # The slice of the [3, 1024, 1024] stack is read and written: 2 MiB each, and its s32 index.
  (sliced,) = [k for k in e.kernels if "dynamic_slice" in k.name]
  assert sliced.runs == 3 and sliced.bytes == 2 * (2 * 1024 * 1024) + 4
  assert e.flops >= 2 * 512 * 1024 * (2048 + 3 * 1024)


FLASH_HLO = """HloModule jit_step, entry_computation_layout={()->bf16[2,256,4,64]{3,2,1,0}}

ENTRY %main (q: bf16[2,256,4,64], k: bf16[2,256,2,64], v: bf16[2,256,2,64]) -> bf16[2,256,4,64] {
  %q = bf16[2,256,4,64]{3,2,1,0} parameter(0)
  %k = bf16[2,256,2,64]{3,2,1,0} parameter(1)
  %v = bf16[2,256,2,64]{3,2,1,0} parameter(2)
  %all-reduce-start = bf16[2,256,2,64]{3,2,1,0} all-reduce-start(%v), replica_groups={{0,1}}, to_apply=%add
  %all-reduce-done = bf16[2,256,2,64]{3,2,1,0} all-reduce-done(%all-reduce-start)
  ROOT %pallas_call = bf16[2,256,4,64]{3,2,1,0} custom-call(%q, %k, %all-reduce-done), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/jaxrm_flash_forward/pallas_call"}
}
"""


def test_a_flash_kernel_counts_the_attended_pairs_at_its_efficiency_and_a_collective_its_bytes():
  e = step_time.estimate(FLASH_HLO, H100, attended=0.5)
  collective, flash = e.kernels
  q, kv = 2 * 256 * 4 * 64 * 2, 2 * 256 * 2 * 64 * 2  # bytes of q and of k or v
  assert (collective.kind, collective.bytes) == ("collective", 2 * kv)
  assert math.isclose(collective.seconds, kv / EFF.link_bytes_per_s + EFF.launch_s)
  # 4 FLOPs (QK^T and PV) x batch 2 x 4 heads x 64 dims x half of 256 x 257 causal pairs.
  assert flash.name == "jaxrm_flash_forward" and flash.flops == 4 * 2 * 4 * 64 * (256 * 257 / 2) * 0.5
  assert flash.bytes == 2 * q + 2 * kv
  expect = max(
    flash.flops / (H100.peak_bf16_flops * EFF.pallas), flash.bytes / (H100.memory_bandwidth * EFF.memory)
  )
  assert math.isclose(flash.seconds, expect + EFF.launch_s)


def test_the_calibration_is_every_measured_step_and_fits_each_within_20_percent():
  """The table in the package is the measured GPU record's, and the estimate scaled by one factor
  is within the issue's 20% of every measured step (in-sample: the factor is fitted to them)."""
  with open(os.path.join(tiny_run.ROOT, "benchmarks", "gpu_check_h200.json")) as f:
    measured = json.load(f)["steps"]
  with open(os.path.join(tiny_run.ROOT, "benchmarks", "step_time_calibration.json")) as f:
    record = json.load(f)
  recorded = {p["name"]: p for p in record["points"]}
  # Estimated with today's efficiencies: changing them means running the calibration again.
  assert record["efficiency"] == dataclasses.asdict(step_time.Efficiency())
  points = {p.name: p for p in step_time.CALIBRATION}
  assert set(points) == set(recorded)
  for name, p in points.items():
    assert math.isclose(p.measured_s, recorded[name]["measured_s"], rel_tol=1e-3)
    assert math.isclose(p.estimated_s, recorded[name]["estimated_s"], rel_tol=1e-3)
  bench = measured["bench"]["result"]["totals"]
  assert math.isclose(points["qwen2.5-1.5b shared_prompt"].measured_s, bench["seconds"] / 8, rel_tol=1e-3)
  assert points["qwen3-8b full fine-tuning"].measured_s == measured["fit"]["result"]["step_s"]
  factor = step_time.calibration_factor()
  ratios = [p.measured_s / p.estimated_s for p in step_time.CALIBRATION]
  assert min(ratios) <= factor <= max(ratios)
  for p in step_time.CALIBRATION:
    assert abs(factor * p.estimated_s / p.measured_s - 1) < 0.2, p
  assert step_time.calibrated(1.0) == factor
  assert "scaled x" in step_time.calibration_line() and step_time.calibration_line(()).startswith(
    "calibration: none"
  )


def test_the_choice_on_the_tiny_model_without_validation_in_the_peak(model_dir):
  """On the tiny model, without a validation set: elementwise remat fits at once (growing the
  micro-batch is the fake checks' below: each try is a compile); nothing is compiled for
  validation, whose step is neither in the peak nor printed as if it ran; the estimate reads the
  real program's products and flash kernels."""
  c = tiny_run.set_keys(tiny_run.get_config(model_dir), {"data.val_data_paths": {}})
  config = cli.run_config(c)
  assert not fit_check.validates_during(config)
  choice = fit_check.choose(config, "h100-80gb", "1x1", max_growth=1)
  assert (choice.remat, choice.micro_batch_size, choice.global_batch_size) == ("elementwise", 8, 8)
  r = choice.report
  assert r.fits and r.eval is None and r.eval_peak_bytes == 0 and r.peak_bytes == r.train.total_bytes
  lines = r.lines()
  assert (
    "  eval step:      none (the run does not validate: no data.val_data_paths, or no round in eval.*)"
    in lines
  )
  timing = next(line for line in lines if line.startswith("time (estimated"))
  assert "tokens/s" in timing and "MFU" in timing and r.tokens == 8 * 2 * 96
  assert r.step_s == step_time.calibrated(r.estimate.seconds) > 0
  assert any(line.startswith("  a run of 4 steps (train.max_steps) takes about") for line in lines)
  assert any("calibration:" in line for line in lines)
  assert choice.lines()[0] == "choice: " + choice.overrides() and choice.exit_status == 0
  # The program computes at least the model's FLOPs (the rest is recomputation), in products and
  # in the three flash kernels of each of the 2 layers.
  e = r.estimate
  assert e.flops >= r.model_flops and {"gemm", "pallas", "fusion"} <= {k.kind for k in e.kernels}
  flash = {k.name: k.runs for k in e.kernels if k.kind == "pallas" and k.flops > 0}
  assert set(flash) == set(step_time.FLASH_FLOPS) and sum(flash.values()) >= 3 * 2


def test_a_run_validates_only_with_a_set_and_a_round(model_dir):
  keys = lambda **k: cli.run_config(tiny_run.set_keys(tiny_run.get_config(model_dir), k))
  assert fit_check.validates_during(keys())
  assert not fit_check.validates_during(keys(**{"data.val_data_paths": {}}))
  rounds = {"eval.val_period": 0, "eval.val_at_end": False, "eval.val_at_start": False}
  assert not fit_check.validates_during(keys(**rounds))


def fake_check(fits):
  """A stand-in for ``fit_check.check`` whose verdict is ``fits(remat, micro_batch_size)``, and
  whose step takes longer the more its remat policy recomputes."""

  def check(config, target, topology, **kwargs):
    ok = fits(config.model.remat, config.train.micro_batch_size)
    return types.SimpleNamespace(
      fits=ok,
      peak_bytes=2**30,
      mesh_shape={"data": 1, "fsdp": 2},
      tokens=8192,
      step_s={"elementwise": 1.0, "dots": 1.2, "full": 1.4}[config.model.remat],
      mfu=0.3,
      advice=("model.lora.rank=16",),
      config=config,
    )

  return check


@pytest.mark.parametrize(
  "fits, chosen",
  [
    # elementwise never fits: dots, grown from 4 while it fits (32 does not), the global batch
    # raised to a whole micro-batch on each of the 2 data-parallel devices.
    (lambda remat, micro: remat != "elementwise" and micro <= 16, ("dots", 16, 32)),
    # only full fits, and only at 1 group a micro-batch: the global batch is kept.
    (lambda remat, micro: remat == "full" and micro == 1, ("full", 1, 8)),
    # elementwise fits on micro-batches of 2, full on up to 16: the faster estimate wins.
    (
      lambda remat, micro: (
        (remat, micro) in {("elementwise", 2), ("elementwise", 1)} or (remat == "full" and micro <= 16)
      ),
      ("elementwise", 2, 8),
    ),
  ],
)
def test_dots_or_full_only_where_the_cheaper_policy_does_not_fit(model_dir, fits, chosen):
  c = tiny_run.set_keys(tiny_run.get_config(model_dir), {"train.micro_batch_size": 4})
  choice = fit_check.choose(cli.run_config(c), "h100-80gb", check_fn=fake_check(fits))
  assert (choice.remat, choice.micro_batch_size, choice.global_batch_size) == chosen
  assert choice.report.config.model.remat == chosen[0]
  assert any(w.startswith(f"model.remat={chosen[0]}: ") for w in choice.why)
  compared = "estimated tokens/s of each policy's largest micro-batch that fits" in "\n".join(choice.why)
  assert compared == (chosen[0] == "elementwise")  # only the third case has two policies that fit


def test_nothing_that_fits_is_said_with_what_to_change(model_dir):
  config = cli.run_config(tiny_run.get_config(model_dir))
  choice = fit_check.choose(config, "h100-80gb", check_fn=fake_check(lambda remat, micro: False))
  assert choice.report is None and choice.exit_status == 1
  assert choice.lines()[0] == "choice: nothing tried fits" and "  model.lora.rank=16" in choice.lines()
