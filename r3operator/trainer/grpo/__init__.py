"""GRPO pieces: group-normalised advantages and the PPO-clip loss."""
