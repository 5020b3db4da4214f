"""Rewards besides the reward model: verifiers, a worker pool for reward functions, a code sandbox,
a reward server."""
