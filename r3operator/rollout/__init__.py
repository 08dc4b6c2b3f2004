"""The driver's handle on engines: HTTP and Ray engines, retries, the producer, partial and multi-turn rollouts."""
