"""Compiled for NVIDIA GPUs on any machine: the Pallas kernels and the trainer's steps, by XLA's GPU
compiler and Triton, for compile-only H100 and H200 devices (``jaxrm.planning.gpu_targets``).

Checked: the flash kernel's forward, dq and dk/dv under every mask (padded, packed, shared-prompt,
sliding window, soft-capping) at head dims 64 to 256; that a tile too large for a block's shared
memory is refused; that the attention route follows the mesh's devices, not the process's
backend; the train step of every family, with LoRA and QLoRA, and of a 1.5B shape, their memory
against the parameter arithmetic; context parallelism and fsdp over two hosts; and the scoring
forward at the server's bucket lengths. Nothing here runs a kernel: numerics are
tests/test_flash_attention.py's (interpret mode) and ``pytest -m gpu``'s.

The compiler is installed by ``make test`` (``make gpu-compiler``); without it every test fails,
saying how to install it.
"""

import collections
import dataclasses
import functools
import os
import re
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest
import tiny_run
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.join(tiny_run.ROOT, "scripts"))
from bench_common import HF_CONFIGS  # noqa: E402
from memory_plan import compile_programs, plan_config, planned_batch, planned_update  # noqa: E402

from jaxrm import sharding
from jaxrm.hf.loader import placed_abstract_model  # noqa: E402
from jaxrm.models import families  # noqa: E402
from jaxrm.models import flash_attention as F  # noqa: E402
from jaxrm.models.config import from_hf_config  # noqa: E402
from jaxrm.models.decoder import attention_fn, attention_route  # noqa: E402
from jaxrm.models.lora import LoraConfig  # noqa: E402
from jaxrm.planning import fit_check, gpu_targets  # noqa: E402
from jaxrm.planning.memory import ProgramMemory, bytes_per_device  # noqa: E402
from jaxrm.run import steps
from jaxrm.server import ServerConfig  # noqa: E402

H100, H200 = "h100-80gb", "h200"
KERNELS = ("jaxrm_flash_forward", "jaxrm_flash_dq", "jaxrm_flash_dkv")
TRITON = 'custom_call_target="__gpu$xla.gpu.triton"'


def one_gpu(target: str):
  """A 1x1x1 mesh on one compile-only GPU of ``target``."""
  return sharding.make_mesh(sharding.MeshConfig(1, 1, 1), devices=gpu_targets.devices(target))


def compile_for_gpu(jitted, *args):
  with gpu_targets.uncached():
    return jitted.lower(*args).compile()


# ------------------------------------------------------------------ the kernels alone

MASKS = ("padded", "packed", "tree", "window", "softcap")
HEAD_DIMS = (64, 80, 96, 128, 256)  # 80 and 96 are padded to 128 inside the kernel
ROWS, T, HEADS, KV_HEADS = 2, 128, 4, 2  # two blocks of the default 64 queries; grouped-query heads


def masked_losses(q, k, v, mask, positions, segment_ids, branch_ids, window, scope=""):
  """The summed outputs of the kernel under each mask, each call in a named scope (``scope`` +
  the mask's name) that its kernels' op names carry."""
  cases = {
    "padded": (F.layout(mask, None, positions), None, None),
    "packed": (F.layout(segment_ids, None, positions), None, None),
    "tree": (F.layout(segment_ids, branch_ids, positions), None, None),
    "window": (F.layout(segment_ids, None, positions), window, None),
    "softcap": (F.layout(mask, None, positions), None, 50.0),
  }
  total = 0.0
  for name, (ids, w, softcap) in cases.items():
    with jax.named_scope(scope + name):
      out = F.flash_attention(q, k, v, ids, w, scale=0.1, softcap=softcap)
    total += jnp.sum(out.astype(jnp.float32))
  return total


def every_head_dim_loss(qkv_by_head_dim, *ids):
  return sum(masked_losses(*qkv, *ids, scope=f"d{d}_") for d, qkv in qkv_by_head_dim.items())


def kernels_by_scope(hlo_text: str) -> collections.Counter:
  """(scope, kernel) -> Triton custom calls, read from op names such as
  ``jit(every_head_dim_loss)/transpose(jvp(d64_tree))/jaxrm_flash_dq/pallas_call``."""
  found = collections.Counter()
  for line in hlo_text.splitlines():
    if TRITON in line:
      name = re.search(r"(\w+)\)*/(jaxrm_flash_\w+)/pallas_call", line)
      found[name.groups() if name else ("?", line[:120])] += 1
  return found


def abstract_on(mesh):
  """``(shape, dtype) -> jax.ShapeDtypeStruct`` replicated over ``mesh``."""
  return lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))


def test_h100_and_h200_give_triton_the_same_device():
  """What Triton's compile reads of a target is the same for both (the same Hopper SM): a kernel
  compiled for one is the kernel of the other, so the kernels below compile once, for an H100
  (the oversized tile is refused on an H200). They differ in memory, which the steps' plans read."""
  h100, h200 = gpu_targets.TARGETS[H100], gpu_targets.TARGETS[H200]
  for field in (
    "compute_capability",
    "core_count",
    "shared_memory_per_core",
    "shared_memory_per_block_optin",
    "clock_rate_ghz",
  ):
    assert getattr(h100, field) == getattr(h200, field), field
  assert h100.memory_bytes < h200.memory_bytes


def test_kernels_compile_forward_and_backward_for_every_mask_and_head_dim():
  """Triton compiles each kernel, checking its tiles against the GPU's shared memory and
  registers: forward, dq and dk/dv once per mask and head dim in jax.grad (w.r.t. q, k, v in
  bfloat16) of one program, which compiles in half the time of one program per head dim."""
  sds = abstract_on(one_gpu(H100))
  row = sds((ROWS, T), jnp.int32)
  qkv = {
    d: (sds((ROWS, T, HEADS, d), jnp.bfloat16), *[sds((ROWS, T, KV_HEADS, d), jnp.bfloat16)] * 2)
    for d in HEAD_DIMS
  }
  compiled = compile_for_gpu(
    jax.jit(jax.grad(every_head_dim_loss)), qkv, row, row, row, row, sds((), jnp.int32)
  )
  assert kernels_by_scope(compiled.as_text()) == {
    (f"d{d}_{m}", k): 1 for d in HEAD_DIMS for m in MASKS for k in KERNELS
  }


def test_an_oversized_tile_is_refused_for_shared_memory():
  """Blocks of 512 at head dim 256 ask Triton for 1.3 MB of shared memory per block; an H200
  gives 227 KiB. The default blocks compile at that head dim (above)."""
  sds = abstract_on(one_gpu(H200))
  q, kv = sds((1, 512, 2, 256), jnp.bfloat16), sds((1, 512, 1, 256), jnp.bfloat16)
  attend = jax.jit(
    lambda q, k, v, segment_ids: F.flash_attention(
      q, k, v, F.layout(segment_ids), scale=0.1, blocks=F.BlockSizes(512, 512, 512, 512)
    )
  )
  available = gpu_targets.TARGETS[H200].shared_memory_per_block_optin
  with pytest.raises(
    jax.errors.JaxRuntimeError,
    match=f"Shared memory size limit exceeded: requested \\d+, available: {available}",
  ):
    compile_for_gpu(attend, q, kv, kv, sds((1, 512), jnp.int32))


def device_of(target: str):
  return gpu_targets.devices(target)[0]


def test_tiles_are_chosen_per_gpu_from_shared_memory_and_registers():
  """The largest tiles that fit each GPU: a Hopper's 227 KiB of shared memory a block holds the
  dk/dv kernel's 128 x 64 tiles at head dim 128, an A100's 163 KiB does not; each choice fits its
  GPU, and doubling any of its tiles would not (or passes 128 rows)."""
  chosen = {(t, d): F.blocks_for(device_of(t), d) for t in (H100, H200, "a100-80gb") for d in (64, 128, 256)}
  assert chosen[H100, 128] == chosen[H200, 128] == F.BlockSizes(q=128, k=64, q_dkv=128, k_dkv=64)
  assert chosen["a100-80gb", 128] == F.BlockSizes(q=128, k=64, q_dkv=64, k_dkv=64)
  assert chosen[H100, 256] != chosen["a100-80gb", 256]
  for (t, d), blocks in chosen.items():
    smem = gpu_targets.TARGETS[t].shared_memory_per_block_optin
    assert blocks.fits(smem, d), (t, d, blocks)
    for field in ("q", "k", "q_dkv", "k_dkv"):
      doubled = dataclasses.replace(blocks, **{field: 2 * getattr(blocks, field)})
      assert 2 * getattr(blocks, field) > 128 or not doubled.fits(smem, d), (t, d, field)
  # Off a GPU (interpret mode) the generic tiles.
  assert F.blocks_for(jax.devices("cpu")[0], 128) == F.GENERIC
  # The kernel's table of GPUs by name agrees with the compiler's specs of each target.
  for name, target in gpu_targets.TARGETS.items():
    assert F.shared_memory_per_block(device_of(name)) == target.shared_memory_per_block_optin, name


def test_the_tiles_shared_memory_is_the_compilers_count():
  """On a GPU offering one byte less than the estimate of the H100's largest kernel at head dim
  128 (dk/dv), Triton refuses, asking for exactly the estimate (``BlockSizes.shared_memory``). The
  tiles themselves compile in the 1.5B step below."""
  blocks = F.blocks_for(device_of(H100), 128)
  need = blocks.shared_memory(128)
  assert max(need, key=need.get) == "dkv"
  short = dataclasses.replace(
    gpu_targets.TARGETS[H100], name="h100-short", shared_memory_per_block_optin=need["dkv"] - 1
  )
  sds = abstract_on(sharding.make_mesh(sharding.MeshConfig(1, 1, 1), devices=gpu_targets.devices(short)))
  q, kv = sds((1, 256, 4, 128), jnp.bfloat16), sds((1, 256, 2, 128), jnp.bfloat16)

  def loss(q, k, v, segment_ids):
    return jnp.sum(
      F.flash_attention(q, k, v, F.layout(segment_ids), scale=0.1, blocks=blocks).astype(jnp.float32)
    )

  with pytest.raises(
    jax.errors.JaxRuntimeError, match=f"requested {need['dkv']}, available: {need['dkv'] - 1}"
  ):
    compile_for_gpu(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, kv, kv, sds((1, 256), jnp.int32))


# ------------------------------------------------------------------ the trainer's step

# Tiny shapes of each family: two layers, 4 query heads over 2 key heads, each family's switches as
# its spec's tiny test config sets them (jaxrm.models.families; read without importing torch).
TINY_HF = dict(
  vocab_size=128,
  hidden_size=64,
  intermediate_size=96,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=512,
  pad_token_id=0,
)


def family_hf(name: str) -> dict:
  family = families.get(name)
  kw = family.tiny_hf_config["kw"]
  # A family whose layers differ (Gemma 3's sliding and global layers) sets one type per layer.
  layers = {"num_hidden_layers": len(kw["layer_types"])} if "layer_types" in kw else {}
  return {"model_type": family.model_type, **kw, **layers}


TINY_LENGTH = 64  # tokens per completion: one pair is input_ids [2, 64]
# Every family's train step, two of them training adapters: the backward pass still runs through
# each of their layers' ops, only which weights get gradients differs (a full-training step of
# each would add 6 s of compiling apiece).
ADAPTED = {
  "qwen3": ("+lora", LoraConfig(rank=8)),
  "gemma2": ("+qlora-nf4", LoraConfig(rank=8, base_dtype="nf4")),
}
STEP_CASES = {
  name + ADAPTED.get(name, ("",))[0]: (name, ADAPTED.get(name, ("", LoraConfig()))[1])
  for name in families.names()
}


def tiny_shape(family: str, lora: LoraConfig = LoraConfig(), **overrides):
  """The family's tiny shape as the memory plan trains it: bf16 compute, float32 parameters."""
  return from_hf_config(
    {**TINY_HF, **family_hf(family)}, dtype="bfloat16", param_dtype="float32", lora=lora, **overrides
  )


class Step:
  """The trainer's train step, or with ``evaluate`` its validation step (``update.build_update``,
  as scripts/memory_plan.py builds them), on abstract parameters over ``mesh``, compiled for one
  abstract pair per data-parallel shard."""

  def __init__(self, cfg, mesh, length: int, evaluate: bool = False):
    self.cfg, self.mesh = cfg, mesh
    built = planned_update(placed_abstract_model(cfg, mesh), mesh)
    self.state, self.batch = built.state, planned_batch(cfg, length, mesh)
    with gpu_targets.uncached():
      if evaluate:
        self.compiled = built.eval_step.compile(steps.model_params(self.state), self.batch)
      else:
        self.compiled = compile_programs(built, self.batch)["step"]
    self.text = self.compiled.as_text()
    self.memory = ProgramMemory.of(self.compiled)

  def count(self, part: str) -> int:
    return sum(x.size for x in jax.tree.leaves(self.state.get(part, {})))

  def bytes(self, part: str) -> int:
    return bytes_per_device(self.state.get(part, {}))

  @property
  def counter_bytes(self) -> int:
    """The optimizer's scalar step counts (int32), beside its moments."""
    return sum(x.dtype.itemsize for x in jax.tree.leaves(self.state["opt_state"]) if x.ndim == 0)


@functools.cache
def tiny_step(case: str) -> Step:
  """One module-wide compile per case on one H100: the route test shares llama's."""
  family, lora = STEP_CASES[case]
  return Step(tiny_shape(family, lora), one_gpu(H100), TINY_LENGTH)


def widths(cfg) -> tuple[int, int, int, int]:
  """D, H Dh, K Dh and I: the hidden, query, key/value and MLP widths."""
  return (
    cfg.hidden_size,
    cfg.num_heads * cfg.head_dim,
    cfg.num_kv_heads * cfg.head_dim,
    cfg.intermediate_size,
  )


def activation_bytes(cfg, tokens: int, itemsize: int) -> int:
  """One layer's activations over ``tokens``: the two norms' inputs and outputs, the attention's
  and the MLP's output projections (6 D), queries and the attention's output (2 H Dh), keys and
  values (2 K Dh), the MLP's gate, up and their product (3 I)."""
  d, q, kv, f = widths(cfg)
  return tokens * (6 * d + 2 * q + 2 * kv + 3 * f) * itemsize


def projections(cfg) -> list[tuple[int, int]]:
  """(in, out) of a layer's seven projections: q, k, v, o, gate, up, down."""
  d, q, kv, f = widths(cfg)
  return [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]


def lora_count(cfg) -> int:
  """Trained parameters of LoRA: A [in, r] and B [r, out] on each projection of each layer, and
  the reward head [D, 1]."""
  adapters = sum(a + b for a, b in projections(cfg)) * cfg.lora.rank
  return cfg.num_layers * adapters + cfg.hidden_size * cfg.num_labels


@pytest.mark.parametrize("case", STEP_CASES)
def test_train_step_of_each_family_compiles_with_the_kernel_and_fits_its_arithmetic(case):
  step = tiny_step(case)
  cfg, m = step.cfg, step.memory
  assert set(KERNELS) <= set(fit_check.triton_kernels(step.text)), case
  trained = step.count("params")
  if cfg.lora.enabled:
    assert trained == lora_count(cfg)
  if cfg.lora.base_dtype == "nf4":  # the projections' weights as 4-bit codes, two to a byte
    codes = sum(x.size for x in jax.tree.leaves(step.state["frozen"]) if x.dtype == jnp.uint8)
    assert 2 * codes == cfg.num_layers * sum(a * b for a, b in projections(cfg))
  # float32 master weights of what trains and AdamW's two float32 moments of each: exact, but for
  # the optimizer's step counts.
  assert step.bytes("params") == 4 * trained
  assert step.bytes("opt_state") == 2 * step.bytes("params") + step.counter_bytes and step.counter_bytes <= 16
  # The step takes the train state and the batch, nothing more, and writes the new state over
  # the donated one.
  state = bytes_per_device(step.state)
  assert m.argument_bytes == state + bytes_per_device(step.batch)
  assert m.alias_bytes == state
  # Beyond its arguments the step holds float32 gradients of what trains, a bf16 copy of each
  # weight at most (an nf4 base's count is of its codes, two weights a byte: twice it), and
  # without remat every layer's activations for the backward pass, their gradients, and float32
  # intermediates beside them (the norms', the kernel's padded inputs): 3 float32 copies at most.
  # Measured: 0.55-0.65 of this bound.
  weights = trained + step.count("frozen") * (1 if cfg.lora.base_dtype is None else 2)
  acts = cfg.num_layers * activation_bytes(cfg, step.batch.input_ids.size, 4)
  bound = m.argument_bytes + 4 * trained + 2 * weights + 3 * acts
  assert m.argument_bytes + m.temp_bytes <= m.total_bytes <= bound, (m.as_dict(), bound)


def test_elementwise_remat_runs_the_kernel_once_and_holds_less():
  """The default ``elementwise`` on the Pallas route keeps the forward kernel's output and
  log-sum-exp by name: the step calls each kernel as often as under ``none`` (``dots`` would run
  the forward again), and holds less than ``none``, which keeps every layer's norms, rope and
  activation too."""
  default = tiny_step("llama")
  assert default.cfg.remat == "elementwise"
  kept = Step(default.cfg.replace(remat="none"), one_gpu(H100), TINY_LENGTH)
  assert fit_check.triton_kernels(default.text) == fit_check.triton_kernels(kept.text)
  assert default.memory.temp_bytes < kept.memory.temp_bytes, (default.memory.as_dict(), kept.memory.as_dict())


def test_the_attention_route_follows_the_mesh_devices_not_the_process():
  """In one process, whatever its backend: a mesh of compile-only GPUs takes the Pallas kernel
  through Triton, and a CPU mesh the reference einsum, for the same config (``auto``)."""
  gpu = tiny_step("llama")
  cfg = gpu.cfg
  assert cfg.attention_impl == "auto"
  on_gpu = sharding.platform(sharding.Placement(gpu.mesh))
  assert on_gpu == "gpu" and attention_route(cfg, on_gpu) == "pallas"
  assert attention_fn(cfg, on_gpu).keywords["interpret"] is False
  assert fit_check.triton_kernels(gpu.text) == dict.fromkeys(KERNELS, 1)
  cpu_mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), devices=jax.devices("cpu")[:1])
  assert attention_route(cfg, sharding.platform(cpu_mesh)) == "reference"
  assert jax.default_backend() != "cpu" or attention_route(cfg) == "reference"  # no mesh: the process's
  # The validation step: the train step's forward, at a fifth of its compile time on a CPU. Not
  # even the kernel in interpret mode (its ops would carry the kernels' names).
  cpu = Step(cfg, cpu_mesh, TINY_LENGTH, evaluate=True)
  assert TRITON not in cpu.text and "jaxrm_flash" not in cpu.text


def qwen2_count(hf: dict) -> int:
  """A Qwen2 reward model's parameters from its config.json: the embedding (tied: no LM head), per
  layer q/k/v/o with q/k/v biases, the gated MLP and two norms, the final norm, and a one-label
  head."""
  d, f = hf["hidden_size"], hf["intermediate_size"]
  head_dim = d // hf["num_attention_heads"]
  q, kv = d, hf["num_key_value_heads"] * head_dim
  layer = d * q + 2 * d * kv + (q + 2 * kv) + q * d + 3 * d * f + 2 * d
  return hf["vocab_size"] * d + hf["num_hidden_layers"] * layer + d + d


@functools.cache
def step_15b() -> Step:
  """Qwen2.5-1.5B, bf16 compute, remat full, one pair of 2048-token completions (as
  ``scripts/memory_plan.py --plan_models=qwen2.5-1.5b --plan_remat=full`` plans it), on an H200."""
  return Step(plan_config("qwen2.5-1.5b", "full", "auto"), one_gpu(H200), 2048)


def test_a_15b_step_on_an_h200_holds_its_state_exactly_and_one_layer_at_a_time():
  step = step_15b()
  cfg = step.cfg
  m, n = step.memory, step.count("params")
  assert n == qwen2_count(HF_CONFIGS["qwen2.5-1.5b"]) == 1_543_715_840
  assert fit_check.triton_kernels(step.text) == {  # remat full recomputes the forward in the backward
    "jaxrm_flash_forward": 2,
    "jaxrm_flash_dq": 1,
    "jaxrm_flash_dkv": 1,
  }
  assert step.bytes("params") == 4 * n
  assert step.bytes("opt_state") == 8 * n + step.counter_bytes and step.counter_bytes <= 16
  state = bytes_per_device(step.state)
  assert m.argument_bytes == state + bytes_per_device(step.batch) and m.alias_bytes == state
  tokens = step.batch.input_ids.size
  # Every gradient is alive at once before the global-norm clip: at least in bf16 (2 bytes), at
  # most in float32. Remat full keeps each layer's bf16 input for the backward pass, and
  # recomputes one layer at a time: its activations, their gradients, and float32 copies of some
  # (matmul accumulators, norms), 4x one layer's bf16 activations at most. Measured: 6.21 GB of a
  # 7.83 GB bound; remat "dots" (10.9 GB) and none (18.3 GB) keep more layers and exceed it.
  saved = cfg.num_layers * tokens * cfg.hidden_size * 2
  one_layer = activation_bytes(cfg, tokens, 2)
  assert 2 * n <= m.temp_bytes <= 4 * n + saved + 4 * one_layer, m.as_dict()
  # The kernels' tiles are the H200's (flash_attention.blocks_for): a forward program holds 128
  # queries at head dim 128, twice the generic tiles.
  blocks = F.blocks_for(step.mesh.devices.flat[0], cfg.head_dim)
  assert blocks.q == 128 and blocks != F.GENERIC
  assert kernel_grids(step.text)["jaxrm_flash_forward"] == (2048 // blocks.q, 2, cfg.num_heads)
  assert kernel_grids(step.text)["jaxrm_flash_dkv"] == (2048 // blocks.k_dkv, 2, cfg.num_kv_heads)


def kernel_grids(hlo_text: str) -> dict[str, tuple[int, int, int]]:
  """Each flash kernel's Triton grid (x, y, z), read from its custom call's backend config."""
  grids = {}
  for line in hlo_text.splitlines():
    if TRITON in line and (name := re.search(r'name = "(jaxrm_flash_\w+)"', line)):
      grid = tuple(int(re.search(rf"grid_{a} = (\d+)", line).group(1)) for a in "xyz")
      grids[name.group(1)] = grid
  return grids


# ------------------------------------------------------------------ the compiled step, read
# What the GPU compiler made of the train step, read from its optimized HLO: the tiny shapes of
# every family on an H100 (LoRA and QLoRA among them) and the 1.5B shape on an H200, each
# compiled once for the tests above.

INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = (.*?) ([a-z][\w-]*)\((.*)$")
# A float32 dot may stay where its reason is written here, by the jaxrm function it comes from.
# None does today: the reward head (heads.sequence_rewards) reads one hidden state a completion
# in float32, a matrix-vector product that XLA compiles to a multiply and a reduction, not a dot.
FLOAT32_DOTS: dict[str, str] = {}
# XLA:GPU's GEMMs here are Triton's (no autotuning without a GPU; on one, cuBLAS may take some),
# whose accumulator for bfloat16 operands is float32: a bf16 result only says where it is rounded.
GEMM_FUSION = '"kind":"__triton_nested_gemm_fusion"'
# The custom calls a step may make: the flash kernels (Triton) and, on a device, cuBLAS / cuDNN.
DEVICE_CALLS = re.compile(r"__gpu\$xla\.gpu\.triton|__cublas\$|__cudnn\$")
HOST_OPS = {"send", "recv", "send-done", "recv-done", "infeed", "outfeed"}


class Instruction(NamedTuple):
  type: str
  op: str
  operands: list[str]
  line: str


def instructions(lines) -> dict[str, Instruction]:
  found = {}
  for line in lines:
    if m := INSTRUCTION.match(line):
      name, type_, op, rest = m.groups()
      found[name] = Instruction(type_, op, re.findall(r"%([\w.-]+)", rest.split("), ")[0]), line)
  return found


def source(hlo_text: str, line: str) -> list[str]:
  """The jaxrm functions an instruction comes from, innermost first, read from the module's
  stack frames (``stack_frame_id``; a frame's parent is ``parent_frame_id - 1``, 0 for none)."""

  def table(name):
    rows = re.search(rf"^{name}\n((?:\d+ .*\n)+)", hlo_text, re.M).group(1).splitlines()
    return {int(r.split(" ", 1)[0]): r.split(" ", 1)[1] for r in rows}

  files, functions, locations, frames = (
    table(n) for n in ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
  )
  fields = lambda row: {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", row)}
  found, frame = [], int(re.search(r"stack_frame_id=(\d+)", line).group(1))
  while frame:
    row = fields(frames[frame])
    where = fields(locations[row["file_location_id"]])
    if "/jaxrm/" in files[where["file_name_id"]]:
      found.append(functions[where["function_name_id"]].strip('"'))
    frame = row["parent_frame_id"] - 1
  return found


def dots(hlo_text: str) -> list[tuple[str, list[str], str]]:
  """(result dtype, operand dtypes, line) of every dot in the program."""
  found = instructions(hlo_text.splitlines())
  dtype = lambda t: t.split("[")[0]
  return [
    (dtype(i.type), [dtype(found[o].type) for o in i.operands], i.line)
    for i in found.values()
    if i.op == "dot"
  ]


STEPS = {
  **{f"{case} on an H100": functools.partial(tiny_step, case) for case in STEP_CASES},
  "qwen2.5-1.5b on an H200": step_15b,
}


@pytest.mark.parametrize("name", STEPS)
def test_every_dot_of_the_step_is_bfloat16_accumulated_in_float32(name):
  step = STEPS[name]()
  found = dots(step.text)
  assert found and len(found) == step.text.count(GEMM_FUSION), name
  for result, operands, line in found:
    if operands != ["bf16", "bf16"]:
      where = source(step.text, line)
      assert set(where) & set(FLOAT32_DOTS), f"{name}: a {operands} dot from {where}"
    assert result in ("f32", "bf16"), line


@pytest.mark.parametrize("name", STEPS)
def test_the_step_makes_no_host_transfer_callback_or_synchronisation(name):
  """Nothing in the step goes to or waits on the host: no send/recv, infeed/outfeed, host
  callback (a custom call of its own), host memory space (S(5)) or transfer to it."""
  text = STEPS[name]().text
  ops = {i.op for i in instructions(text.splitlines()).values()}
  assert not ops & HOST_OPS, ops & HOST_OPS
  calls = set(re.findall(r'custom_call_target="([^"]*)"', text))
  assert calls and all(DEVICE_CALLS.match(c) for c in calls), calls
  assert "S(5)" not in text and "MoveToHost" not in text


def update_writers(hlo_text: str) -> dict[str, dict[str, str]]:
  """For each trained array, the kernels of the step that write its new value and its two AdamW
  moments: ``{array: {"params": kernel, "mu": kernel, "nu": kernel}}``. The step's outputs alias
  its donated arguments (``input_output_alias``), whose names are the state's paths."""
  body = re.search(r"^ENTRY .*?\n((?:.*\n)*?)}", hlo_text, re.M).group(1).splitlines()
  found = instructions(body)
  arguments = {
    int(a): n
    for n, i in found.items()
    if i.op == "parameter"
    for a in re.findall(r"parameter\((\d+)\)", i.line)
  }
  outputs = next(i for i in found.values() if i.line.lstrip().startswith("ROOT")).operands
  aliases = re.findall(r"\{(\d+)\}: \((\d+), \{\}", hlo_text.split("\n", 1)[0])

  def writer(name):  # through tuples, their elements, bitcasts and copies to the kernel
    while found[name].op in ("get-tuple-element", "bitcast", "copy"):
      inner = found[found[name].operands[0]]
      if found[name].op == "get-tuple-element" and inner.op == "tuple":
        name = inner.operands[int(re.search(r"index=(\d+)", found[name].line).group(1))]
      else:
        name = found[name].operands[0]
    return name

  writers = collections.defaultdict(dict)
  for out, arg in aliases:
    path = re.match(r"state__(?:params_|opt_state_\w*?_(mu|nu))_+(\w+?)_*(?:\.\d+)?$", arguments[int(arg)])
    if path:
      writers[path.group(2)][path.group(1) or "params"] = writer(outputs[int(out)])
  return dict(writers)


@pytest.mark.parametrize("name", STEPS)
def test_the_optimizer_update_is_one_kernel_per_trained_array(name):
  """AdamW's update of an array (clip scale, moments, bias correction, weight decay, the step)
  is a dozen elementwise operations; the compiler fuses them into one kernel that writes the
  array and both moments: at most one kernel per trained array (small arrays of one shape may
  share one: the tiny models' norms do). The global norm's sums are reductions of their own (two
  or three an array) and not counted here."""
  step = STEPS[name]()
  writers = update_writers(step.text)
  assert len(writers) == len(jax.tree.leaves(step.state["params"])), sorted(writers)
  for array, written in writers.items():
    assert sorted(written) == ["mu", "nu", "params"] and len(set(written.values())) == 1, (array, written)
    assert written["params"].startswith("loop_"), written  # a fusion, not a copy


# ------------------------------------------------------------------ several GPUs


def split_step(topology: str, mesh_cfg: sharding.MeshConfig, evaluate: bool = False) -> Step:
  """The tiny mistral's step on ``topology`` H100s. Without its window: every parameter has a
  64-wide embed dimension, which 8 devices divide, so each device holds exactly an eighth of each
  (windows across context shards are tests/test_context_parallel.py's)."""
  cfg = tiny_shape("mistral", sliding_window=None, layer_types=())
  devices = gpu_targets.devices(H100, topology)
  return Step(cfg, sharding.make_mesh(mesh_cfg, devices=devices), TINY_LENGTH, evaluate)


def collective_lines(text: str, kind: str) -> list[str]:
  return [line for line in text.splitlines() if re.search(rf"\s{kind}(?:-start)?\(", line)]


@pytest.mark.parametrize("context", [2, 4, 8])
def test_context_parallel_gathers_each_rows_keys_and_splits_the_weights(context):
  """fsdp x context = 8 devices of one host: each device holds a slice of each row's tokens and
  gathers the row's keys and values over the context axis. Compiled: the validation step (the
  forward pass). The train step's backward through the per-shard attention takes 3-5x as long
  to compile (20 s at context 8); its gradients' reduce-scatter is the fsdp test's below."""
  step = split_step("1x8", sharding.MeshConfig(fsdp=8 // context, context=context), evaluate=True)
  cfg = step.cfg
  rows = step.batch.input_ids.sharding.shard_shape(step.batch.input_ids.shape)[0]
  whole_row_keys = f"bf16[{rows},{TINY_LENGTH},{cfg.num_kv_heads},{cfg.head_dim}]"
  gathered = [line for line in collective_lines(step.text, "all-gather") if whole_row_keys in line]
  assert gathered, f"no all-gather gives a whole row's keys ({whole_row_keys})"
  # The weights are split over fsdp x context (sharding.param_shardings): an eighth each.
  assert step.bytes("params") * 8 == 4 * step.count("params")
  assert step.memory.argument_bytes == step.bytes("params") + bytes_per_device(step.batch)


def test_fsdp_over_two_hosts_splits_the_state_eight_ways():
  step = split_step("2x4", sharding.MeshConfig(fsdp=8))
  hosts = collections.Counter(d.process_index for d in step.mesh.devices.flat)
  assert hosts == {0: 4, 1: 4}
  # FSDP gathers each layer's weights and reduce-scatters its gradients; the kernel runs per shard.
  assert collective_lines(step.text, "all-gather") and collective_lines(step.text, "reduce-scatter")
  assert set(KERNELS) <= set(fit_check.triton_kernels(step.text))
  n = step.count("params")
  assert step.bytes("params") * 8 == 4 * n
  assert (step.bytes("opt_state") - step.counter_bytes) * 8 == 8 * n
  # The compiled program takes these shards: its arguments are this device's state and batch.
  assert step.memory.argument_bytes == bytes_per_device(step.state) + bytes_per_device(step.batch)


# ------------------------------------------------------------------ scoring

SERVER = ServerConfig(batch_size=4, max_length=256)


def test_scoring_compiles_the_forward_kernel_alone_at_every_bucket():
  """The tiny llama's scoring forward (``Decoder.__call__``, as ``RewardModel`` scores) on one
  H100, its activations placed on the mesh, at each length the server compiles."""
  cfg = tiny_shape("llama")
  mesh = one_gpu(H100)
  graphdef, state = nnx.split(placed_abstract_model(cfg, mesh))

  def rewards(state, input_ids, attention_mask):
    return nnx.merge(graphdef, state)(input_ids, attention_mask, placement=sharding.Placement(mesh))

  buckets = SERVER.resolved(cfg.max_position_embeddings).buckets
  assert buckets == (64, 128, 256)
  for t in buckets:
    ids = jax.ShapeDtypeStruct((SERVER.batch_size, t), jnp.int32, sharding=sharding.batch_sharding(mesh, 2))
    text = compile_for_gpu(jax.jit(rewards), state, ids, ids).as_text()
    # One layer body in the scan: one forward kernel; nothing of the backward pass.
    assert fit_check.triton_kernels(text) == {"jaxrm_flash_forward": 1}, t
