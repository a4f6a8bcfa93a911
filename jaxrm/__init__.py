"""jaxrm: reward models for LLM post-training in JAX/Flax."""

__all__ = ["RewardModel", "remote_reward_func"]
__version__ = "0.1.0"


def __getattr__(name):
  # Imported on first use: `python -m jaxrm.train --help` and config errors stay fast.
  if name == "RewardModel":
    from jaxrm.reward_model import RewardModel
    return RewardModel
  if name == "remote_reward_func":
    from jaxrm.reward_funcs import remote_reward_func
    return remote_reward_func
  raise AttributeError(f"module 'jaxrm' has no attribute {name!r}")
