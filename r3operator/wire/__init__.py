"""What crosses a process boundary of the data plane: the rollout sample, the weight chunk format, a sync's
receipt and phase clock, retried calls."""
