"""What every jaxrm command line shares: logging, and user errors printed as one line.

``python -m jaxrm.train | evaluate | serve | export`` each end in :func:`run`. A
:class:`~jaxrm.errors.UserError` (a data row, a checkpoint, a model that does not fit...) or an
``OSError`` (a missing file, a port in use) is printed as ``error: <message>`` and exits 1; a usage
error, a setting that cannot work (:class:`~jaxrm.errors.ConfigError`) included, exits 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from jaxrm.errors import ConfigError, UserError

# The commands never use PyTorch, which need not be installed: where it is not, transformers'
# advice as it is imported ("PyTorch was not found. Models won't be available...") would mislead.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# Libraries that log every compile, restore or file at INFO.
NOISY_LOGGERS = ("absl", "orbax", "jax._src", "tensorstore")


def setup_logging(level: int = logging.INFO, *, timestamps: bool = False) -> None:
  """jaxrm's own messages at ``level``; the libraries' at WARNING."""
  prefix = "%(asctime)s " if timestamps else ""
  # force: absl's app.run has put its own handler on the root logger, which would keep this format out.
  logging.basicConfig(
    level=logging.WARNING, format=prefix + "%(levelname)s %(name)s: %(message)s", force=True
  )
  for name in NOISY_LOGGERS:
    logging.getLogger(name).setLevel(logging.WARNING)
  from absl import logging as absl_logging

  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("jaxrm").setLevel(level)


def exit_usage(message: str) -> None:
  """Prints a usage error and exits 2 (as absl does for a bad flag)."""
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


_CLUSTER_ENV = "SLURM_JOB_ID"  # jax.distributed finds the processes itself under Slurm
_EXAMPLE = (
  "--coordinator_address=host0:1234 --num_processes=2 --process_id=0 (and --process_id=1 on the other)"
)


def check_distributed_flags(
  coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> None:
  """Exits 2 naming the flags where the multi-host flags cannot start a run: some of them without
  the others (outside Slurm, which supplies what is missing), or a process id outside the count."""
  given = {
    "--coordinator_address": coordinator_address,
    "--num_processes": num_processes,
    "--process_id": process_id,
  }
  named = [f"{k}={v}" for k, v in given.items() if v is not None and v != ""]
  if named and len(named) < 3 and _CLUSTER_ENV not in os.environ:
    missing = [k for k, v in given.items() if v is None or v == ""]
    exit_usage(
      f"{' '.join(named)} without {' and '.join(missing)}: a multi-host run outside Slurm gives all "
      f"three to every process, e.g. {_EXAMPLE}"
    )
  if num_processes is not None and num_processes < 1:
    exit_usage(f"--num_processes={num_processes}: give the number of processes, at least 1")
  if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
    exit_usage(
      f"--process_id={process_id} with --num_processes={num_processes}: the processes are numbered "
      f"0 to {num_processes - 1}"
    )


def run(
  main: Callable[[], None],
  *,
  define_flags: Callable[[], None] | None = None,
  flags_parser: Callable[[list[str]], list[str]] | None = None,
) -> None:
  """Parses absl flags (``define_flags`` defines them first) and calls ``main()``.

  Positional arguments are refused; user errors end the program with their message.
  """
  from absl import app

  def guarded(argv: Sequence[str]) -> None:
    if len(argv) > 1:
      exit_usage(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
      main()
    except ConfigError as e:
      exit_usage(str(e))
    except (UserError, OSError) as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(1)

  if define_flags is not None:
    define_flags()
  if flags_parser is None:
    app.run(guarded)
  else:
    app.run(guarded, flags_parser=flags_parser)


# ------------------------------------------------------------------ config files


def config_flags_parser(flag_values):
  """absl's flag parsing for a command with a ``--config`` file flag, with config errors printed
  as one line naming the key (config_flags alone raises a bare KeyError or a traceback)."""
  from absl import flags

  def parse(argv: list[str]) -> list[str]:
    config = _config_of(argv)
    _check_keys(config, argv)
    argv, added = _added_entries(config, argv)
    # config_flags reads its overrides from sys.argv, not from the argv it is given.
    sys.argv = [a for a in sys.argv if a not in {f"--config.{k}={v}" for k, v in added}]
    try:
      rest = flag_values(argv)
    except flags.Error as e:  # a value of the wrong type, a config file that fails to load...
      message = str(e)
      if "Traceback" in message:  # the config file raised: keep the flag and the exception
        lines = [line.strip() for line in message.splitlines() if line.strip()]
        message = f"{lines[0]} {lines[-1]}"
      exit_usage(message)
    _add_entries(flag_values["config"].value, added)
    return rest

  return parse


# Config keys that are dicts of the user's own names: an override may add a name.
OPEN_DICTS = ("data.val_data_paths",)


def added_entries(argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
  """``argv`` without the overrides that add a name to an :data:`OPEN_DICTS` dict of its
  ``--config`` file's config, and those ``(key, value)`` pairs."""
  return _added_entries(_config_of(argv), argv)


def _added_entries(config, argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
  """``argv`` without the overrides that add a name to an :data:`OPEN_DICTS` dict of ``config``
  (config_flags refuses a key the config lacks), and those ``(key, value)`` pairs."""
  if config is None:
    return argv, []
  kept, added = [], []
  for arg in argv:
    key, eq, value = arg.partition("=")
    key = key[len("--config.") :] if key.startswith("--config.") else ""
    if eq and key.rpartition(".")[0] in OPEN_DICTS and _missing_key(config, key):
      added.append((key, value))
    else:
      kept.append(arg)
  return kept, added


def _add_entries(config, added: list[tuple[str, str]]) -> None:
  for key, value in added:
    *parents, name = key.split(".")
    node = config
    for part in parents:
      node = node[part]
    with node.unlocked():  # config_flags locks the config; these dicts take new names
      node[name] = value


def define_verifier_flags(flag_values: Any = None) -> None:
  """The flags of each task's LM-head asker (:attr:`jaxrm.tasks.Task.asker`, its ``SWITCH`` and
  ``FLAGS``): ``--verifier``, ``--verifier_question``, ``--verifier_answers`` score a causal LM as a
  generative verifier (:mod:`jaxrm.tasks.verifier`), ``--judge``, ``--judge_question``,
  ``--judge_answers`` load one as a pairwise judge; :func:`asker_requests` gives
  ``RewardModel.from_pretrained`` what they ask.

  Args:
    flag_values: where the flags are defined (default: absl's ``flags.FLAGS``).
  """
  from absl import flags

  where = dict(flag_values=flags.FLAGS if flag_values is None else flag_values)
  main = sys.argv[0]  # listed by --help with the command's own flags, not only by --helpfull
  for asker in _askers():
    flags.DEFINE_bool(asker.WORD, False, asker.SWITCH, module_name=main, **where)
    for field, (default, help_) in asker.FLAGS.items():
      flags.DEFINE_string(f"{asker.WORD}_{field}", default, help_, module_name=main, **where)


def asker_requests(f) -> dict[str, Any]:
  """``RewardModel.from_pretrained``'s asker keywords (``verifier=``, ``judge=``) of the flags
  :func:`define_verifier_flags` defines: each asker's fields its flags give (True: none given, its
  own), or None where its switch is off.

  Args:
    f: the parsed flags (absl's ``flags.FLAGS``).

  Raises:
    ConfigError: a field's flag given without its asker's switch.
  """
  return {asker.WORD: _asker_request(f, asker) for asker in _askers()}


def _asker_request(f, asker: Any) -> dict[str, Any] | bool | None:
  names = [f"{asker.WORD}_{field}" for field in asker.FLAGS]
  if not f[asker.WORD].value:
    for name in names:
      if f[name].present:
        raise ConfigError(f"--{name} applies with --{asker.WORD}")
    return None
  asked = {field: f[name].value for field, name in zip(asker.FLAGS, names)}
  return {k: v for k, v in asked.items() if v is not None} or True


def _askers() -> list[Any]:
  """The LM-head tasks' asker classes, in the tasks' order."""
  from jaxrm import tasks

  return [t.asker for t in tasks.TASKS.values() if t.asker is not None]


def located_model(model: str, step: int | None):
  """``--model`` located (:func:`jaxrm.scoring.loading.locate`) with ``--step``; a training run's
  checkpoint is chosen here, and which one and why printed before anything loads."""
  import dataclasses

  from jaxrm.scoring import loading

  source = loading.locate(model, step)
  if isinstance(source, loading.RunSource):
    choice = loading.choose_checkpoint(source)
    print(choice.describe("--step=N"), flush=True)
    source = dataclasses.replace(source, step=choice.step)
  return source


def define_compute_flags() -> None:
  """``--dtype`` and ``--attention``: how the model a command loads computes."""
  from absl import flags

  main = sys.argv[0]  # listed by --help with the command's own flags, not only by --helpfull
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.", module_name=main)
  flags.DEFINE_string(
    "attention",
    "auto",
    "Attention implementation: auto (a fused kernel on GPU, the "
    "reference path elsewhere) | reference | pallas | cudnn.",
    module_name=main,
  )


def define_step_flag() -> None:
  """``--step``: which checkpoint of a training output directory ``--model`` loads."""
  from absl import flags

  flags.DEFINE_integer(
    "step",
    None,
    "Checkpoint step of a training output dir --model (default: the best by the run's metric, "
    "else the latest).",
    module_name=sys.argv[0],
  )


def run_config(config_dict):
  """The :class:`jaxrm.config.RunConfig` of a parsed ``--config`` (a ``ConfigDict``)."""
  from jaxrm.config import from_config_dict

  return from_config_dict(config_dict)


def check_config_keys(argv: list[str]) -> None:
  """Stops at an override of a key the config lacks (a new name in an :data:`OPEN_DICTS` dict,
  such as ``--config.data.val_data_paths.second=val2.jsonl``, is a key it gains)."""
  _check_keys(_config_of(argv), argv)


def _check_keys(config, argv: list[str]) -> None:
  if config is None:
    return
  for arg in argv[1:]:
    name = arg.split("=", 1)[0]
    for prefix in ("--config.", "--noconfig."):
      if name.startswith(prefix):
        key = name[len(prefix) :]
        if prefix == "--config." and "=" in arg and key.rpartition(".")[0] in OPEN_DICTS:
          continue
        value = arg.partition("=")[2]
        if key in OPEN_DICTS and "=" in arg and not value.lstrip().startswith("{"):
          exit_usage(
            f"{arg}: {key} maps validation set names to files; give each set its own key: "
            f"--config.{key}.default={value} (another set: --config.{key}.<name>=<file>)"
          )
        problem = _missing_key(config, key)
        if problem:
          exit_usage(f"{name}: {problem}")


def _config_of(argv: list[str]):
  """The ConfigDict of ``--config`` in ``argv``; None without the flag, or when the file fails to
  load (config_flags then reports it, with the file's own message)."""
  spec = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--config=")), None)
  if spec is None:
    return None
  path, _, variant = spec.partition(":")
  if not os.path.isfile(path):
    exit_usage(f"--config={spec}: no such config file {path!r}")
  try:
    return _load_config(path, variant or None)
  except Exception:  # noqa: BLE001 -- reported by config_flags, with the file's own message
    return None


def _load_config(path: str, variant: str | None):
  import importlib.util

  spec = importlib.util.spec_from_file_location("jaxrm_train_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant) if variant is not None else module.get_config()


def _missing_key(config, key: str) -> str | None:
  """Why ``key`` (dotted) is not a key of ``config``, or None if it is."""
  node, parts = config, key.split(".")
  for depth, part in enumerate(parts):
    if not hasattr(node, "keys") or part not in node:
      where = "config." + ".".join(parts[:depth]) if depth else "the config"
      has = ", ".join(sorted(node.keys())) if hasattr(node, "keys") else "no keys (it is a value)"
      return f"the config has no key {'.'.join(parts[: depth + 1])!r}; {where} has {has}"
    node = node[part]
  return None
