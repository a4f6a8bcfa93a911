"""Other tools' recipes, read as they are: NeMo RL's reward-model YAML (:mod:`jaxrm.compat.nemo`)
and the flags of TRL's reward script (:mod:`jaxrm.compat.trl_args`).

Each reader turns the recipe into a :class:`Translation`: the jaxrm config keys it sets, and what
became of every key of the recipe (mapped onto a jaxrm key, or ignored and why). A key whose
setting would change the result but that jaxrm cannot honour is refused with a
:class:`~jaxrm.errors.ConfigError` naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrm.errors import ConfigError

# "Train until the epochs run out": train.max_steps above any run's length, so that
# min(max_steps, max_epochs x steps_per_epoch) is the epochs' count.
UNTIL_EPOCHS = 2**31 - 1


@dataclasses.dataclass
class Translation:
  """A recipe turned into jaxrm config keys, and the fate of each of its keys."""

  tool: str  # "NeMo RL" | "TRL"
  keys: dict[str, Any] = dataclasses.field(default_factory=dict)  # dotted jaxrm key -> value
  fates: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (recipe key, what it became)
  origins: dict[str, str] = dataclasses.field(default_factory=dict)  # dotted jaxrm key -> recipe key

  def set(self, source: str, **jaxrm_keys: Any) -> None:
    """``source`` (a recipe key) sets these jaxrm keys (``train__max_steps=`` for ``train.max_steps``)."""
    dotted = {k.replace("__", "."): v for k, v in jaxrm_keys.items()}
    self.keys.update(dotted)
    self.origins.update(dict.fromkeys(dotted, source))
    self.fates.append((source, ", ".join(f"{k}={v!r}" for k, v in dotted.items())))

  def ignore(self, source: str, why: str) -> None:
    """``source`` changes nothing jaxrm computes; ``why`` says so."""
    self.fates.append((source, f"ignored: {why}"))

  def run_config(self):
    """The :class:`jaxrm.config.RunConfig`: jaxrm's defaults with :attr:`keys` set."""
    from jaxrm.config import RunConfig

    tree = RunConfig().to_dict()
    for key, value in self.keys.items():
      *parents, leaf = key.split(".")
      node = tree
      for part in parents:
        node = node[part]
      node[leaf] = value
    try:
      return RunConfig.from_dict(tree)
    except ValueError as e:  # a section's own check, naming the jaxrm key first
      raise ConfigError(self._as_written(str(e))) from None

  def _as_written(self, message: str) -> str:
    """A jaxrm key's error led by the recipe key that set it, as the user wrote it."""
    key = message.split("=", 1)[0].split(" ", 1)[0]
    source = self.origins.get(key)
    if source is None:
      return f"{message} (from the {self.tool} recipe; see the mapping above)"
    return f"{source} ({self.tool}), which sets {message}"

  def table(self) -> str:
    """What each recipe key became, one line each (printed at the start of the run)."""
    width = min(max((len(k) for k, _ in self.fates), default=0), 48)  # a longer key pushes its own line only
    lines = [f"{self.tool} settings, as jaxrm reads them:"]
    lines += [f"  {key:<{width}}  -> {fate}" for key, fate in self.fates]
    return "\n".join(lines)


def refuse(key: str, value: Any, why: str) -> ConfigError:
  """The error for a recipe setting jaxrm cannot honour and that would change the result."""
  return ConfigError(f"{key}={value!r}: {why}")
