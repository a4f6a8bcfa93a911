"""The errors a user can fix: each CLI prints their message, without a traceback, and exits 1
(2 for a :class:`ConfigError`, a setting that cannot work, as for any other usage error).

Every error that a config value, a data row, a checkpoint or a request can cause derives from
:class:`UserError`; anything else is a bug and keeps its traceback. They also derive from
``ValueError``, which is what they are to Python code that calls the library.
"""

import difflib
from collections.abc import Sequence


class UserError(ValueError):
  """A problem with the user's config, data, model or request; the message says what to do."""


class ConfigError(UserError):
  """A config value (or a combination of them) that cannot work."""


class DataError(UserError):
  """A data file or row that cannot be read: the message names the file, line/row and field."""


class CheckpointError(UserError):
  """A checkpoint does not fit the model (missing/unexpected keys, wrong shapes, bad files)."""


class UnsupportedModelError(UserError):
  """The checkpoint's architecture or one of its settings is not supported."""


class EvaluationError(UserError):
  """The model and the data do not fit together."""


def did_you_mean(names: Sequence[str], known: Sequence[str], spelled=lambda name: name) -> str:
  """`` (did you mean 'x'?)`` where ``names`` are close to some of ``known`` (each as ``spelled``
  gives it); else empty: the end of a message refusing a misspelled name."""
  close = [spelled(m[0]) for name in names if (m := difflib.get_close_matches(name, known, n=1))]
  return f" (did you mean {' and '.join(map(repr, close))}?)" if close else ""
