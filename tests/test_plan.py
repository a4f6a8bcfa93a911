"""``python -m jaxrm.plan``: a run's memory on a GPU target, compiled here, with its verdict.

The model is only a ``config.json`` (the tiny model's, and public 8B shapes'); the steps are the
trainer's, compiled by XLA's GPU compiler for compile-only devices (``jaxrm.planning.gpu_targets``).
"""

import json
import math
import os
import re
import sys

import pytest
import tiny_run

sys.path.insert(0, os.path.join(tiny_run.ROOT, "scripts"))
from bench_common import HF_CONFIGS  # noqa: E402

from jaxrm import cli, plan  # noqa: E402
from jaxrm.errors import UserError  # noqa: E402
from jaxrm.planning import fit_check, gpu_targets

GIB = 2**30


def config_only(tmp_path, name: str, architecture: str) -> str:
  """A model directory holding nothing but ``name``'s config.json."""
  path = tmp_path / name
  path.mkdir()
  (path / "config.json").write_text(json.dumps({**HF_CONFIGS[name], "architectures": [architecture]}))
  return str(path)


def run_config(model_dir: str, **overrides):
  c = tiny_run.get_config(model_dir)
  return cli.run_config(tiny_run.set_keys(c, {k.replace("__", "."): v for k, v in overrides.items()}))


@pytest.fixture(scope="module")
def tiny_report(model_dir):
  """The tiny run planned on one H100, packed as configs/rm.py trains."""
  return fit_check.check(run_config(model_dir, data__packing="shared_prompt"), "h100-80gb", "1x1")


def test_a_tiny_run_fits_with_the_kernel_and_exact_state_bytes(tiny_report):
  r = tiny_report
  assert r.fits and r.lines()[-1] == "FITS"
  # float32 master weights and AdamW's two float32 moments, all on the one device: exact, but for
  # the optimizer's int32 step counters (a few scalars).
  assert r.param_bytes == 4 * r.params and 0 <= r.opt_state_bytes - 2 * r.param_bytes <= 64
  # The GPU mesh takes the Pallas kernel through Triton: forward, dq and dkv in the train step.
  assert {"jaxrm_flash_forward", "jaxrm_flash_dq", "jaxrm_flash_dkv"} <= set(r.triton_kernels)
  assert r.attention.startswith("attention: pallas flash kernel on all 2 layers")
  assert r.collectives == dict.fromkeys(fit_check.COLLECTIVES, 0)  # one device: nothing to exchange
  # The donated state is an argument of the step: its arguments hold at least params + moments.
  assert r.train.argument_bytes >= r.param_bytes + r.opt_state_bytes
  assert r.budget_bytes == int(gpu_targets.TARGETS["h100-80gb"].memory_bytes * fit_check.JAX_MEM_FRACTION)
  assert r.margin_bytes == max(int(r.budget_bytes * fit_check.MARGIN_FRACTION), fit_check.MARGIN_MIN_BYTES)
  assert "packed rows" in r.batch and "every sequence 96 tokens" in r.batch


def test_an_8b_model_on_one_gpu_does_not_fit_and_says_what_to_change(tmp_path, capsys):
  """What ``python -m jaxrm.plan`` prints and its exit status (its flags and usage errors are
  the next test's)."""
  model = config_only(tmp_path, "llama3.1-8b", "LlamaForCausalLM")
  config = run_config(
    model, model__remat="dots", data__max_length=512, train__micro_batch_size=2, eval__batch_size=2
  )
  r = plan.plan(config, "h100-80gb", "1x1")
  # 7.5e9 float32 weights and two moments: 84 GiB before any activation, over a 59 GiB budget.
  assert r.params > 7.4e9 and r.param_bytes + r.opt_state_bytes > 80 * GIB
  assert not r.fits and r.exit_status == 1
  printed = capsys.readouterr().out.splitlines()
  assert printed == r.lines() and printed.index("DOES NOT FIT") < printed.index("to fit, change one of:")
  advice = "\n".join(r.advice)
  for change in ("model.remat=full", "train.micro_batch_size=1", "model.lora.rank=16", "more GPUs"):
    assert change in advice


def test_the_cli_exits_0_when_it_fits_and_2_for_a_usage_error(model_dir):
  """The command as a user runs it (exit 1 is the previous test's, on the report it prints)."""
  base = [sys.executable, "-m", "jaxrm.plan", f"--config={tiny_run.ROOT}/tests/tiny_run.py:{model_dir}"]
  fits = tiny_run.run(base + ["--gpu=h200", "--topology=1x2", "--config.train.micro_batch_size=4"])
  assert fits.returncode == 0, tiny_run.describe(fits)
  out = fits.stdout
  assert out.splitlines()[-1] == "FITS" and "NVIDIA H200 141GB HBM3e (h200), 1x2" in out
  assert "train step:" in out and "margin" in out and "jaxrm_flash_forward" in out
  typo = tiny_run.run(base + ["--gpu=h100"])
  assert typo.returncode == 2, tiny_run.describe(typo)
  assert "--gpu='h100': unknown GPU; choose one of h100-80gb, h200, a100-80gb, b200" in typo.stderr
  assert "Traceback" not in typo.stderr


def test_usage_errors_are_named_before_anything_compiles(model_dir):
  config = run_config(model_dir)
  for args, message in (
    (("h100", "1x1"), "--gpu='h100': unknown GPU"),
    (("h200", "8x"), "hosts x GPUs per host"),
    (("h200", "1x1", 1), "--completions=1: a preference group has 2 or more"),
  ):
    with pytest.raises(UserError, match=re.escape(message)):
      plan.plan(config, *args)


def test_targets_carry_xla_specs():
  for name, t in gpu_targets.TARGETS.items():
    assert t.source.startswith("xla/backends/gpu/target_config/specs/") and name in gpu_targets.TARGETS
    assert f'device_description_str: "{t.description}"' in t.spec()
  assert math.isclose(gpu_targets.TARGETS["h200"].memory_gib, 141, rel_tol=0.01)
  # Dense bf16 peaks from NVIDIA's data sheets, what MFU and the time estimate divide by; float32
  # products run as TF32 at half, 8-bit floats at twice.
  peaks = {name: t.peak_bf16_flops for name, t in gpu_targets.TARGETS.items()}
  assert peaks == {"h100-80gb": 989e12, "h200": 989e12, "a100-80gb": 312e12, "b200": 2250e12}
  h100 = gpu_targets.TARGETS["h100-80gb"]
  assert (h100.peak_flops("f32"), h100.peak_flops("bf16"), h100.peak_flops("f8e4m3fn")) == (
    494.5e12,
    989e12,
    1978e12,
  )
  with pytest.raises(ValueError, match="hosts x GPUs per host"):
    gpu_targets.parse_topology("2x")
  assert gpu_targets.parse_topology("8") == (1, 8)


def test_a_verifier_run_is_planned_with_its_lm_head_and_no_score_head(model_dir, tiny_report):
  """``reward.type=verifier`` keeps the model's LM head (its own [vocab, hidden] matrix here, the
  embeddings being untied) and adds no score head: its parameters are the sequence-head run's
  less the head's [hidden, 1] weight, plus the LM head's."""
  with open(os.path.join(model_dir, "config.json")) as f:
    hf = json.load(f)
  r = fit_check.check(
    run_config(model_dir, data__packing="shared_prompt", reward__type="verifier"), "h100-80gb", "1x1"
  )
  assert r.fits and r.lines()[-1] == "FITS"
  lm_head = 0 if hf.get("tie_word_embeddings") else hf["vocab_size"] * hf["hidden_size"]
  assert r.params == tiny_report.params - hf["hidden_size"] + lm_head, (r.params, tiny_report.params)
  assert r.param_bytes == 4 * r.params
