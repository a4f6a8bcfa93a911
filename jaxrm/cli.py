"""What every jaxrm command line shares: logging, and user errors printed as one line.

``python -m jaxrm.train | evaluate | serve | export`` each end in :func:`run`. A
:class:`~jaxrm.errors.UserError` (a bad config value, data row, checkpoint...) or an ``OSError``
(a missing file, a port in use) is printed as ``error: <message>`` and exits 1; a usage error
exits 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import logging
import sys
from typing import Callable, Sequence

from jaxrm.errors import UserError

# Libraries that log every compile, restore or file at INFO.
NOISY_LOGGERS = ("absl", "orbax", "jax._src", "tensorstore")


def setup_logging(level: int = logging.INFO, *, timestamps: bool = False) -> None:
  """jaxrm's own messages at ``level``; the libraries' at WARNING."""
  prefix = "%(asctime)s " if timestamps else ""
  logging.basicConfig(level=level, format=prefix + "%(levelname)s %(name)s: %(message)s")
  for name in NOISY_LOGGERS:
    logging.getLogger(name).setLevel(logging.WARNING)
  from absl import logging as absl_logging
  absl_logging.set_verbosity(absl_logging.WARNING)


def exit_usage(message: str) -> None:
  """Prints a usage error and exits 2 (as absl does for a bad flag)."""
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


def run(main: Callable[[], None], *, define_flags: Callable[[], None] | None = None,
        flags_parser: Callable[[list[str]], list[str]] | None = None) -> None:
  """Parses absl flags (``define_flags`` defines them first) and calls ``main()``.

  Positional arguments are refused; user errors end the program with their message.
  """
  from absl import app

  def guarded(argv: Sequence[str]) -> None:
    if len(argv) > 1:
      exit_usage(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
      main()
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
    check_config_keys(argv)
    try:
      return flag_values(argv)
    except flags.Error as e:  # a value of the wrong type, a config file that fails to load...
      message = str(e)
      if "Traceback" in message:  # the config file raised: keep the flag and the exception
        lines = [line.strip() for line in message.splitlines() if line.strip()]
        message = f"{lines[0]} {lines[-1]}"
      exit_usage(message)

  return parse


def run_config(config_dict):
  """The :class:`jaxrm.config.RunConfig` of a parsed ``--config`` (a ``ConfigDict``)."""
  from jaxrm.config import from_config_dict
  return from_config_dict(config_dict)


def check_config_keys(argv: list[str]) -> None:
  """Stops at an override of a key the config lacks."""
  import os
  spec = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--config=")), None)
  if spec is None:
    return
  path, _, variant = spec.partition(":")
  if not os.path.isfile(path):
    exit_usage(f"--config={spec}: no such config file {path!r}")
  try:
    config = _load_config(path, variant or None)
  except Exception:  # noqa: BLE001 -- reported by config_flags, with the file's own message
    return
  for arg in argv[1:]:
    name = arg.split("=", 1)[0]
    for prefix in ("--config.", "--noconfig."):
      if name.startswith(prefix):
        problem = _missing_key(config, name[len(prefix):])
        if problem:
          exit_usage(f"{name}: {problem}")


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
      return f"the config has no key {'.'.join(parts[:depth + 1])!r}; {where} has {has}"
    node = node[part]
  return None
