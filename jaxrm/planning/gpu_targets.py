"""NVIDIA GPUs as data, and compile-only devices for them on any machine, GPU or not.

XLA's GPU compiler runs on a host without a GPU when it is told the target: a
``GpuTargetConfigProto`` (what XLA keeps per GPU in ``xla/backends/gpu/target_config/specs/``).
``jax.experimental.topologies`` turns one into devices that jit can lower and compile for, but
not run on, so a program's GPU memory (``compiled.memory_analysis()``) and its Triton kernels
(with their shared-memory checks) are known before any GPU is allocated.

What such a compile cannot tell: speed, numerics on the device, and what an on-device compile
would autotune (it may pick cuBLAS or cuDNN where this one keeps a Triton fusion, shifting memory
a little); cuBLAS/cuDNN/NCCL workspaces and the CUDA context lie outside ``memory_analysis()``.

The compiler is the ``jax-cuda12-plugin`` (its PJRT library and Triton handler) with
``nvidia-cuda-nvcc-cu12`` (ptxas). Where they are installed as usual (``jax[cuda12]`` on a GPU
machine) they are used as they are; elsewhere they are kept out of site-packages, in the folder
``JAXRM_GPU_COMPILER`` names (default ``<venv>/gpu-compile``, which ``make test`` fills), and
loaded only when a GPU target is asked for: installed where JAX finds plugins, the plugin prints a
traceback at every start on a machine with no CUDA driver.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import sys
import tempfile

from jaxrm.errors import ConfigError, UserError

COMPILER_ENV = "JAXRM_GPU_COMPILER"
PTXAS = "nvidia-cuda-nvcc-cu12==12.9.86"  # ptxas, which Triton calls; the release this was tested with


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """One GPU model as XLA's compiler sees it: the fields of ``gpu_device_info`` in XLA's spec
  file ``source`` that jaxlib 0.10 and later read (the newer ``collective_memory_granularity`` and
  the per-unit rate tables, which only the scheduler's cost model reads, are left out)."""

  name: str  # the CLI's name, e.g. "h100-80gb"
  description: str  # the device kind JAX reports, e.g. "NVIDIA H100 80GB HBM3"
  source: str  # XLA's spec file these values come from
  memory_bytes: int  # device_memory_size: what the driver reports as the card's memory
  core_count: int
  fpus_per_core: int
  shared_memory_per_core: int
  shared_memory_per_block_optin: int
  memory_bandwidth: int  # bytes/s
  l2_cache_size: int
  clock_rate_ghz: float
  compute_capability: tuple[int, int]
  accelerated_features: bool  # sm_90a/sm_100a: Hopper's and Blackwell's arch-specific instructions
  dnn_version: tuple[int, int, int]
  # Dense bfloat16 tensor-core peak in FLOP/s, from NVIDIA's data sheet (not XLA's spec files):
  # what MFU is measured against and the time estimate (jaxrm.planning.step_time) divides by.
  peak_bf16_flops: float = 0.0

  def peak_flops(self, dtype: str) -> float:
    """The card's dense tensor-core peak for products of ``dtype`` (HLO's name): bfloat16 and
    float16 at :attr:`peak_bf16_flops`, 8-bit floats at twice it, float32 as TF32 at half (JAX's
    default precision on these cards)."""
    if dtype.startswith("f8"):
      return 2 * self.peak_bf16_flops
    if dtype in ("f32", "f64"):
      return self.peak_bf16_flops / 2
    return self.peak_bf16_flops

  def spec(self) -> str:
    """This GPU as ``GpuTargetConfigProto`` text."""
    major, minor = self.compute_capability
    feature = "ACCELERATED_FEATURES" if self.accelerated_features else "NONE"
    dnn = dict(zip(("major", "minor", "patch"), self.dnn_version))
    info = {
      "threads_per_block_limit": 1024,
      "threads_per_warp": 32,
      "shared_memory_per_block": 49152,
      "shared_memory_per_core": self.shared_memory_per_core,
      "threads_per_core_limit": 2048,
      "core_count": self.core_count,
      "fpus_per_core": self.fpus_per_core,
      "block_dim_limit_x": 2147483647,
      "block_dim_limit_y": 65535,
      "block_dim_limit_z": 65535,
      "memory_bandwidth": self.memory_bandwidth,
      "l2_cache_size": self.l2_cache_size,
      "clock_rate_ghz": self.clock_rate_ghz,
      "device_memory_size": self.memory_bytes,
      "shared_memory_per_block_optin": self.shared_memory_per_block_optin,
    }
    lines = [
      "gpu_device_info {",
      *(f"  {k}: {v}" for k, v in info.items()),
      "  cuda_compute_capability {",
      f"    major: {major}",
      f"    minor: {minor}",
      f"    feature_extension: {feature}",
      "  }",
      "  registers_per_core_limit: 65536",
      "  registers_per_block_limit: 65536",
      "  thread_dim_limit_x: 1024",
      "  thread_dim_limit_y: 1024",
      "  thread_dim_limit_z: 64",
      f'  name: "{self.description}"',
      "}",
      'platform_name: "CUDA"',
      "dnn_version_info {",
      *(f"  {k}: {v}" for k, v in dnn.items()),
      "}",
      f'device_description_str: "{self.description}"',
    ]
    return "\n".join(lines) + "\n"

  @property
  def memory_gib(self) -> float:
    return self.memory_bytes / 2**30


_SPECS = "xla/backends/gpu/target_config/specs/"
_HOPPER = dict(
  core_count=132,
  fpus_per_core=128,
  shared_memory_per_core=233472,
  shared_memory_per_block_optin=232448,
  l2_cache_size=52428800,
  clock_rate_ghz=1.98,
  compute_capability=(9, 0),
  accelerated_features=True,
)

TARGETS: dict[str, GpuTarget] = {
  t.name: t
  for t in (
    GpuTarget(
      "h100-80gb",
      "NVIDIA H100 80GB HBM3",
      _SPECS + "h100_sxm.txtpb",
      memory_bytes=84942979072,
      memory_bandwidth=3352320000000,
      dnn_version=(8, 9, 4),
      peak_bf16_flops=989e12,
      **_HOPPER,
    ),
    GpuTarget(
      "h200",
      "NVIDIA H200 141GB HBM3e",
      _SPECS + "h200.txtpb",
      memory_bytes=151397597184,
      memory_bandwidth=4800000000000,
      dnn_version=(9, 10, 0),
      peak_bf16_flops=989e12,
      **_HOPPER,
    ),
    GpuTarget(
      "a100-80gb",
      "NVIDIA A100-SXM4-80GB",
      _SPECS + "a100_sxm_80.txtpb",
      memory_bytes=85100068864,
      core_count=108,
      fpus_per_core=64,
      shared_memory_per_core=167936,
      shared_memory_per_block_optin=166912,
      memory_bandwidth=2039040000000,
      l2_cache_size=41943040,
      clock_rate_ghz=1.41,
      compute_capability=(8, 0),
      accelerated_features=False,
      dnn_version=(8, 9, 4),
      peak_bf16_flops=312e12,
    ),
    GpuTarget(
      "b200",
      "NVIDIA B200",
      _SPECS + "b200.txtpb",
      memory_bytes=191514411008,
      core_count=148,
      fpus_per_core=128,
      shared_memory_per_core=233472,
      shared_memory_per_block_optin=232448,
      memory_bandwidth=7672320000000,
      l2_cache_size=132644864,
      clock_rate_ghz=1.965,
      compute_capability=(10, 0),
      accelerated_features=True,
      dnn_version=(9, 7, 0),
      peak_bf16_flops=2250e12,
    ),
  )
}


def get(name: str) -> GpuTarget:
  """The target called ``name``; an unknown name is a ConfigError naming the choices."""
  if name not in TARGETS:
    raise ConfigError(f"--gpu={name!r}: unknown GPU; choose one of {', '.join(TARGETS)}")
  return TARGETS[name]


def parse_topology(topology: str) -> tuple[int, int]:
  """'2x8' -> (2 hosts, 8 GPUs each); a bare '8' is one host of 8."""
  parts = topology.lower().split("x")
  try:
    sizes = tuple(int(p) for p in parts)
  except ValueError:
    sizes = ()
  if len(sizes) == 1:
    sizes = (1,) + sizes
  if len(sizes) != 2 or min(sizes) < 1:
    raise ConfigError(f"--topology={topology!r}: give hosts x GPUs per host, e.g. 1x8 or 2x8")
  return sizes


def devices(target: str | GpuTarget, topology: str = "1x1") -> list:
  """Compile-only devices of ``topology`` (hosts x GPUs per host) of ``target``, in JAX's order:
  host by host, each device's ``process_index`` its host. Lowering and compiling for them runs
  XLA's GPU pipeline and Triton; running on them is impossible."""
  target = get(target) if isinstance(target, str) else target
  hosts, per_host = parse_topology(topology)
  enable_compiler()
  from jax.experimental import topologies

  with _quiet_stderr():
    desc = topologies.get_topology_desc(
      platform="cuda", topology_name="", target_config=target.spec(), topology=f"1x{hosts}x{per_host}"
    )
  return list(desc.devices)


@contextlib.contextmanager
def uncached():
  """Compiles for compile-only devices without writing JAX's persistent compilation cache: their
  executables cannot be loaded back (there is no GPU to load them on), so an entry would only be
  read, refused with a warning, and compiled again."""
  import jax

  before = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
  try:
    yield
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


# ------------------------------------------------------------------ the compiler


def compiler_dir() -> str:
  """Where the GPU compiler is kept when it is not installed as usual."""
  return os.environ.get(COMPILER_ENV) or os.path.join(sys.prefix, "gpu-compile")


def install_command() -> str:
  """The pip command that puts the GPU compiler matching this jaxlib in :func:`compiler_dir`."""
  import jaxlib

  v = jaxlib.__version__
  return (
    f"{sys.executable} -m pip install --no-deps --target {compiler_dir()} "
    f"jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v} {PTXAS}"
  )


_ENABLED: list[bool] = []


def enable_compiler() -> None:
  """Makes the CUDA compiler available to ``jax.experimental.topologies``: the plugin JAX found
  itself, or the one kept in :func:`compiler_dir`, loaded now. Raises a UserError saying how to
  install it where there is neither."""
  if _ENABLED:
    return
  import jax
  from jax._src import xla_bridge

  jax.devices()  # this process's own backends first: the plugin loaded below must not become one
  if "cuda" not in xla_bridge._topology_factories:
    where = compiler_dir()
    if not os.path.isdir(os.path.join(where, "jax_plugins", "xla_cuda12")):
      raise UserError(
        f"compiling for a GPU needs the CUDA compiler, not found in {where} ({COMPILER_ENV}); "
        f"install it with: {install_command()}"
      )
    if where not in sys.path:
      sys.path.append(where)
    # The version check wants a driver; a compile-only use has none.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    with _quiet_stderr():
      importlib.import_module("jax_plugins.xla_cuda12").initialize()
    _use_ptxas(where)
  _ENABLED.append(True)


def _use_ptxas(where: str) -> None:
  """Points XLA at the ptxas kept beside the plugin (jax looks for it once, at import)."""
  from jax._src import lib

  nvcc = os.path.join(where, "nvidia", "cuda_nvcc")
  found = lib.cuda_path is not None and os.path.exists(os.path.join(str(lib.cuda_path), "bin", "ptxas"))
  if not found and os.path.exists(os.path.join(nvcc, "bin", "ptxas")):
    lib.cuda_path = nvcc


@contextlib.contextmanager
def _quiet_stderr():
  """Holds back what the plugin's native code writes to stderr (a line per library it finds no
  driver for); shown if the block fails."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      yield
    except BaseException:
      os.dup2(saved, 2)
      held.seek(0)
      sys.stderr.write(held.read().decode(errors="replace"))
      raise
    finally:
      os.dup2(saved, 2)
      os.close(saved)
