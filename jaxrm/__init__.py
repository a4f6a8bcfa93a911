"""jaxrm: reward models for LLM post-training in JAX/Flax.

What a notebook needs is here, imported on first use (so that ``python -m jaxrm.train --help`` and
config errors stay fast): :class:`RewardModel`; :class:`RunConfig` and its sections
(:class:`ModelSpec`, :class:`LoraSpec`, :class:`DataSpec`, :class:`RewardSpec`, :class:`TrainSpec`,
:class:`EvalSpec`, :class:`CheckpointSpec`, :class:`LoggerSpec`, :class:`MeshConfig`);
:func:`train_and_evaluate`; :func:`evaluate`, :func:`load_dataset` and :func:`plot_scores`; and
:func:`remote_reward_func`.

``jaxrm.evaluate`` is the function :func:`jaxrm.evaluation.evaluate`. The module of the same name,
``jaxrm/evaluate.py``, is the command line (``python -m jaxrm.evaluate``); importing it leaves the
attribute the function.
"""

import importlib
import sys
import types

__version__ = "0.1.0"

# Each public name -> the module that defines it.
_EXPORTS = {
  "RewardModel": "jaxrm.reward_model",
  "RunConfig": "jaxrm.config",
  "ModelSpec": "jaxrm.config",
  "LoraSpec": "jaxrm.config",
  "DataSpec": "jaxrm.config",
  "RewardSpec": "jaxrm.config",
  "TrainSpec": "jaxrm.config",
  "EvalSpec": "jaxrm.config",
  "CheckpointSpec": "jaxrm.config",
  "LoggerSpec": "jaxrm.config",
  "MeshConfig": "jaxrm.sharding",
  "train_and_evaluate": "jaxrm.trainer",
  "evaluate": "jaxrm.evaluation",
  "load_dataset": "jaxrm.evaluation",
  "plot_scores": "jaxrm.evaluation",
  "remote_reward_func": "jaxrm.reward_funcs",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'jaxrm' has no attribute {name!r}")
  return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__():
  return sorted({*globals(), *_EXPORTS})


class _Package(types.ModuleType):
  """The jaxrm module, whose ``evaluate`` stays the function once the CLI module is imported."""

  @property
  def evaluate(self):
    return __getattr__("evaluate")

  @evaluate.setter
  def evaluate(self, module):
    # Importing jaxrm.evaluate (the CLI) binds the submodule here; it stays in sys.modules.
    del module


sys.modules[__name__].__class__ = _Package
