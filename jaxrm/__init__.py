"""jaxrm: reward models for LLM post-training in JAX/Flax."""

__all__ = ["RewardModel"]
__version__ = "0.1.0"


def __getattr__(name):
  # Imported on first use: `python -m jaxrm.train --help` and config errors stay fast.
  if name == "RewardModel":
    from jaxrm.reward_model import RewardModel
    return RewardModel
  raise AttributeError(f"module 'jaxrm' has no attribute {name!r}")
