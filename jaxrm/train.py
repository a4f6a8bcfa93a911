r"""Trains a reward model.

  python -m jaxrm.train --config=configs/rm.py [--config.train.max_steps=200 ...]
  python -m jaxrm.train --nemo_config=rm.yaml [policy.model_name=... section.key=value ...]
  python -m jaxrm.train --trl_args --model_name_or_path ... --dataset_name ... [TRL's reward-script flags]

``--nemo_config`` reads NeMo RL's reward-model YAML (:mod:`jaxrm.compat.nemo`) and ``--trl_args``
the flags of TRL's reward script (:mod:`jaxrm.compat.trl_args`): the rest of the command line is
theirs, and the run starts by printing what each of their settings became. They live here rather
than in commands of their own so that every way in shares the multi-host flags below and the
one trainer.

Rerunning the same command continues from the latest checkpoint in the output directory.
SIGTERM (a scheduler's preemption notice) or Ctrl-C saves a checkpoint at the end of the step
under way, prints where it is, and exits 128 + the signal's number (143, 130).
Multi-host: under Slurm ``jax.distributed`` is initialised from the environment (see
``scripts/slurm_train.sh``); elsewhere pass ``--coordinator_address=host:port --num_processes=N
--process_id=i`` to every process. The loop itself is :func:`jaxrm.run.trainer.train_and_evaluate`.
"""

from __future__ import annotations

import os
import sys

from jaxrm.run import host_memory

if __name__ == "__main__":  # first: glibc reads its tunables only when a process starts
  host_memory.restart_with_huge_pages()

from absl import flags
from ml_collections import config_flags

from jaxrm import cli

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
  "config", None, "Training config file (configs/rm.py, configs/prm.py...).", lock_config=True
)
flags.DEFINE_string(
  "nemo_config",
  None,
  "NeMo RL reward-model YAML (its examples/configs/rm.yaml); section.key=value overrides follow.",
)
flags.DEFINE_boolean("trl_args", False, "The rest of the command line is TRL's reward-script flags.")
flags.DEFINE_string("coordinator_address", None, "Multi-host: host:port of process 0.")
flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.")


def initialize_distributed(
  coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> None:
  """Joins a multi-process run: with an explicit coordinator, or under Slurm from its environment.

  Must run before anything else touches JAX's devices. CPU processes exchange collectives
  through gloo.
  """
  import jax

  if coordinator_address:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )
  elif int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
    jax.distributed.initialize()  # Slurm cluster auto-detection


# What follows --trl_args, and the section.key=value words after --nemo_config (set by parse_flags).
FOREIGN: dict[str, list[str]] = {"trl": [], "nemo": []}


def main() -> None:
  cli.setup_logging()
  given = [
    name
    for name, on in (
      ("--config", FLAGS.config is not None),
      ("--nemo_config", FLAGS.nemo_config),
      ("--trl_args", FLAGS.trl_args),
    )
    if on
  ]
  if len(given) != 1:
    cli.exit_usage(
      f"give one of --config=configs/rm.py, --nemo_config=rm.yaml or --trl_args ...; got "
      f"{' and '.join(given) or 'none'}"
    )
  cli.check_distributed_flags(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  if FLAGS.config is not None:
    config = cli.run_config(FLAGS.config)  # read once, here; the library takes the dataclasses
    initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  else:
    config = _foreign_config()
  from jaxrm.run import preemption, trainer

  # Once the run is saved and over (or stopped), a scheduler's SIGTERM while the process exits
  # changes nothing, and the exit code says how the run ended.
  preemption.ignore_sigterm_after_watch()
  try:
    trainer.train_and_evaluate(config)
  except preemption.Stopped as e:  # SIGTERM/SIGINT: a checkpoint saved; one line says where
    import jax

    if jax.process_index() == 0:
      print(e, file=sys.stderr, flush=True)
    sys.exit(e.exit_code)


def _foreign_config():
  """The RunConfig of a NeMo RL YAML or TRL flags, read here; their mapping printed by process 0.

  The device count enters the mapping (TRL's per-device batch, NeMo RL's cluster), so the
  processes join first.
  """
  from jaxrm.compat import nemo, trl_args

  if FLAGS.nemo_config:  # read (and its errors shown) before the processes wait on each other
    recipe, translate = nemo.load(FLAGS.nemo_config, FOREIGN["nemo"]), nemo.translate
  else:
    recipe, translate = trl_args.parse(FOREIGN["trl"]), _trl_translate
  initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  import jax

  translation = translate(recipe, device_count=jax.device_count())
  if jax.process_index() == 0:
    print(translation.table(), flush=True)
  return translation.run_config()


def _trl_translate(recipe, *, device_count: int):
  """TRL's flags translated, ``--bf16``'s default decided by the run's devices, as TRL decides it."""
  import jax

  from jaxrm.compat import trl_args

  devices = jax.devices()
  return trl_args.translate(
    recipe,
    device_count=device_count,
    bf16_supported=trl_args.computes_bf16(devices),
    platform=devices[0].platform,
  )


def _without_trl_args(argv: list[str]) -> None:
  """Stops at a flag of TRL's reward script given without ``--trl_args`` before it (absl would
  call it unknown), saying where it goes."""
  from jaxrm.compat import trl_args

  for arg in argv[1:]:
    name = arg[2:].partition("=")[0]
    if not arg.startswith("--") or name in FLAGS or name.startswith(("config.", "noconfig.")):
      continue
    if name.startswith("no") and name[2:] in FLAGS:  # absl's --noflag
      continue
    if trl_args.is_flag(arg):
      cli.exit_usage(
        f"{arg.partition('=')[0]} is a flag of TRL's reward script: give TRL's flags after "
        f"--trl_args, e.g. python -m jaxrm.train --trl_args {arg} ... (jaxrm's own keys are "
        "--config.<section>.<key>, with --config=configs/rm.py)"
      )


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parsing of jaxrm's own flags; TRL's flags and NeMo RL's overrides are set aside."""
  FOREIGN.update(trl=[], nemo=[])  # this command line's only
  if "--trl_args" in argv:
    at = argv.index("--trl_args")
    argv, FOREIGN["trl"] = argv[: at + 1], argv[at + 1 :]
  elif any(a.startswith("--nemo_config") for a in argv):
    ours = [argv[0]]
    for i, arg in enumerate(argv[1:], 1):
      if arg.startswith("-") or argv[i - 1] == "--nemo_config":  # a flag, or --nemo_config's own value
        ours.append(arg)
      else:
        FOREIGN["nemo"].append(arg)
    argv = ours
  else:
    _without_trl_args(argv)
  return cli.config_flags_parser(FLAGS)(argv)


if __name__ == "__main__":
  cli.run(main, flags_parser=parse_flags)
