"""jaxrm: reward models for LLM post-training in JAX/Flax.

What a notebook needs is here, imported on first use (so that ``python -m jaxrm.train --help`` and
config errors stay fast): :class:`RewardModel`; :class:`RunConfig` and its sections
(:class:`ModelSpec`, :class:`LoraSpec`, :class:`DataSpec`, :class:`RewardSpec`, :class:`TrainSpec`,
:class:`EvalSpec`, :class:`CheckpointSpec`, :class:`LoggerSpec`, :class:`MeshConfig`);
:func:`train_and_evaluate`; :func:`load_dataset` and :func:`plot_scores`; and the reward
functions :func:`as_reward_funcs` (one per attribute of a regression model) and
:func:`remote_reward_func`.

The commands are the top-level modules named in :data:`COMMANDS` (``python -m jaxrm.<command>``),
each a ``main`` over the library and nothing else runs as a script; evaluation in Python is
:func:`jaxrm.evaluation.evaluate`.
"""

import importlib

__version__ = "0.1.0"

# The command lines, each ``python -m jaxrm.<name>``: a module of this package's top level with a
# ``main()``; the library they call lives beside them (trainer, evaluation, hf.export, server, plan).
COMMANDS = ("train", "evaluate", "export", "serve", "plan")

# Each public name -> the module that defines it.
_EXPORTS = {
  "RewardModel": "jaxrm.scoring.reward_model",
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
  "train_and_evaluate": "jaxrm.run.trainer",
  "load_dataset": "jaxrm.evaluation",
  "plot_scores": "jaxrm.evaluation",
  "as_reward_funcs": "jaxrm.scoring.reward_funcs",
  "remote_reward_func": "jaxrm.scoring.reward_funcs",
}
__all__ = list(_EXPORTS)


# Commands (modules run with ``python -m``) that a notebook might call as functions.
_IN_PYTHON = {"evaluate": "jaxrm.evaluation.evaluate", "train": "jaxrm.train_and_evaluate"}


def __getattr__(name):
  if name in _IN_PYTHON:
    raise AttributeError(
      f"jaxrm.{name} is the command line (python -m jaxrm.{name}); in Python, call {_IN_PYTHON[name]}"
    )
  if name not in _EXPORTS:
    raise AttributeError(f"module 'jaxrm' has no attribute {name!r}")
  return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__():
  return sorted({*globals(), *_EXPORTS})
