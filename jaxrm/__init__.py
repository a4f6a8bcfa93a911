"""jaxrm: reward models for LLM post-training in JAX/Flax."""

from jaxrm.reward_model import RewardModel

__all__ = ["RewardModel"]
__version__ = "0.1.0"
