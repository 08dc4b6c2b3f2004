"""Pure manifest builders: RLJob in, Kubernetes object dicts out. No client, no I/O."""
