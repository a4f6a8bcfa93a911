"""Scoring with a trained model and its uses: loading any model source, :class:`RewardModel`, rows
sharing a prefix scored together, RL reward functions and the reward's health, what an export writes."""
