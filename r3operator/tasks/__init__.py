"""Prompts, datasets, rewards and multi-turn environments: what a rollout is asked and how it is scored."""
