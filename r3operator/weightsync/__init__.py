"""Weight sync, trainer to engines: the NCCL/HTTP sender, the driver's wiring, engine faults, the post-sync canary."""
