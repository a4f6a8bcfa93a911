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
