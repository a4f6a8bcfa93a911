r"""Will this run fit on that hardware? Asked before any GPU is allocated, on any machine.

  python -m jaxrm.plan --config=configs/rm.py --gpu=h100-80gb --topology=1x8 [--config.key=value ...]
  python -m jaxrm.plan --config=configs/skywork_v2_llama31_8b.py --gpu=h200 --topology=1x8
  python -m jaxrm.plan --config=configs/rm.py --gpu=h200 --choose  # the remat and micro-batch to train with

The run's config and overrides are read exactly as ``python -m jaxrm.train`` reads them; the model
needs only its ``config.json`` (or a GGUF file's header), no weights. The run's train and
validation steps are compiled by XLA's GPU compiler for compile-only devices of ``--gpu``
(:mod:`jaxrm.planning.gpu_targets`), over ``--topology`` hosts x GPUs per host, and their memory per device
is printed against the card with a stated margin (:mod:`jaxrm.planning.fit_check`), beside the step's
time estimated from the compiled program (:mod:`jaxrm.planning.step_time`: tokens/s, MFU, the hours of the
run) with that estimate's error against the steps measured on GPUs. ``--choose`` compiles the run
again to pick the remat policy and micro-batch that fill the card, and prints them with why. Exit
status: 0 when the run (or, with ``--choose``, the choice) fits, 1 when it does not (the output
names what to change), 2 for a usage error.

What a compile cannot tell: numerics on the device, and what an on-device compile would autotune;
the time is an estimate, not a measurement. The trainer on a GPU logs the same memory lines from
its own compile, to compare.
"""

from __future__ import annotations

import sys

from absl import flags
from ml_collections import config_flags

from jaxrm import cli

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
  "config", None, "Training config file (configs/rm.py, configs/prm.py...).", lock_config=True
)
flags.DEFINE_string("gpu", "h100-80gb", "The GPU: h100-80gb, h200, a100-80gb, b200.")
flags.DEFINE_string("topology", "1x1", "Hosts x GPUs per host, e.g. 1x8 or 2x8.")
flags.DEFINE_integer("completions", 2, "Completions per preference group (ranked data: its largest group).")
flags.DEFINE_bool(
  "choose",
  False,
  "Pick the remat policy (elementwise where it fits, dots or full only where it must) and the largest "
  "micro-batch that fits, compiling once per try; print the choice and the run's plan with it.",
)


def plan(config, gpu: str, topology: str, completions: int = 2, choose: bool = False):
  """Prints and returns the :class:`jaxrm.planning.fit_check.FitReport` of the run ``config`` (as
  :func:`jaxrm.cli.run_config` reads it) on ``topology`` GPUs of ``gpu``; with ``choose``, the
  :class:`jaxrm.planning.fit_check.Choice` of remat and micro-batch instead. Raises
  :class:`jaxrm.errors.UserError` for a usage error."""
  from jaxrm.errors import UserError
  from jaxrm.planning import fit_check, gpu_targets

  gpu_targets.get(gpu)
  gpu_targets.parse_topology(topology)
  if completions < 2:
    raise UserError(f"--completions={completions}: a preference group has 2 or more")
  if choose:
    choice = fit_check.choose(config, gpu, topology, completions=completions)
    if choice.report is not None:
      print("\n".join(choice.report.lines()), flush=True)
    print("\n".join(choice.lines()), flush=True)
    return choice
  report = fit_check.check(config, gpu, topology, completions=completions)
  print("\n".join(report.lines()), flush=True)
  return report


def main() -> None:
  cli.setup_logging()
  if FLAGS.config is None:
    cli.exit_usage("give --config=configs/rm.py (the run to plan), --gpu and --topology")
  from jaxrm.errors import UserError

  try:
    report = plan(cli.run_config(FLAGS.config), FLAGS.gpu, FLAGS.topology, FLAGS.completions, FLAGS.choose)
  except UserError as e:
    cli.exit_usage(str(e))
  sys.exit(report.exit_status)


if __name__ == "__main__":
  cli.run(main, flags_parser=cli.config_flags_parser(FLAGS))
