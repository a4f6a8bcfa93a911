"""Hides torch from the suite's subprocesses (their ``PYTHONPATH`` names this folder first, so
Python imports this module as it starts): jaxrm's commands run as they do where users run them,
without torch, which only the tests' reference models need. transformers imports torch whenever it
finds it (its configuration module does), which costs a command a second or two of start-up.

Every import finder is wrapped so that it finds no ``torch``: ``import torch`` raises
ModuleNotFoundError and ``importlib.util.find_spec("torch")`` (what transformers, datasets and
scipy ask) returns None, as where torch is not installed. (A ``None`` in ``sys.modules`` would
not do: scipy then takes torch for imported.)
"""

import sys


class _WithoutTorch:
  def __init__(self, finder):
    self._finder = finder

  def find_spec(self, name, path=None, target=None):
    if name.partition(".")[0] == "torch":
      return None
    find = getattr(self._finder, "find_spec", None)
    return None if find is None else find(name, path, target)

  def __getattr__(self, name):
    return getattr(self._finder, name)


sys.meta_path[:] = [_WithoutTorch(finder) for finder in sys.meta_path]
