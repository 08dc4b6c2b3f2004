"""GRPO pieces: group-normalised advantages, the PPO-clip loss, verifiable toy tasks and rewards."""
