"""The training driver: run set-up, the step loop (synchronous and asynchronous), checkpoints, report, status."""
