"""What crosses a process boundary for weight sync: the chunk format, the kernel layout, the sync's typed messages,
the receipt, the phase clock, shared buffers and the IPC doorbell. Also `retry.py`, the retry policy of every call
across a process boundary: its users (the HTTP reward of `tasks`, the engine handles of `rollout`, the supervisor of
`weightsync`) share no part above this one."""
