"""r3operator: Kubernetes operator for MoE RL post-training with Rollout Routing Replay (R3)."""

__version__ = "0.1.0"

__all__ = ["__version__"]
