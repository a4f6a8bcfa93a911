"""The Makefile's install: the torch pip installs before uv installs the rest is the test extra's pin."""

import os
import re
import tomllib

import tiny_run


def _make_variable(name: str) -> str:
  with open(os.path.join(tiny_run.ROOT, "Makefile")) as f:
    (value,) = re.findall(rf"^{name} := (.+)$", f.read(), re.M)
  return value


def test_the_makefiles_torch_is_the_test_extras_pin():
  """pip installs torch before uv installs the test extra, so that uv finds it satisfied and never
  takes PyPI's CUDA wheel of that version: the two pins must be the same."""
  with open(os.path.join(tiny_run.ROOT, "pyproject.toml"), "rb") as f:
    extra = tomllib.load(f)["project"]["optional-dependencies"]["test"]
  (pin,) = [req for req in extra if re.match(r"torch\b", req)]
  assert _make_variable("TORCH") == pin
