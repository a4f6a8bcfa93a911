r"""Trains a reward model.

  python -m jaxrm.train --config=configs/rm.py [--config.train.max_steps=200 ...]

Rerunning the same command continues from the latest checkpoint in the output directory.
Multi-host: under Slurm ``jax.distributed`` is initialised from the environment (see
``scripts/slurm_train.sh``); elsewhere pass ``--coordinator_address=host:port --num_processes=N
--process_id=i`` to every process. The loop itself is :func:`jaxrm.trainer.train_and_evaluate`.
"""

from __future__ import annotations

import os

from absl import flags
from ml_collections import config_flags

from jaxrm import cli

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Training config file (configs/rm.py, configs/prm.py...).",
                                lock_config=True)
flags.DEFINE_string("coordinator_address", None, "Multi-host: host:port of process 0.")
flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.")


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> None:
  """Joins a multi-process run: with an explicit coordinator, or under Slurm from its environment.

  Must run before anything else touches JAX's devices. CPU processes exchange collectives
  through gloo.
  """
  import jax
  if coordinator_address:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
  elif int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
    jax.distributed.initialize()  # Slurm cluster auto-detection


def main() -> None:
  cli.setup_logging()
  if FLAGS.config is None:
    cli.exit_usage("--config is required, e.g. --config=configs/rm.py")
  config = cli.run_config(FLAGS.config)  # read once, here; the library takes the dataclasses
  initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  from jaxrm import trainer
  trainer.train_and_evaluate(config)


if __name__ == "__main__":
  cli.run(main, flags_parser=cli.config_flags_parser(FLAGS))
