"""Benchmark peers: other frameworks run next to r3operator on the same machine (verl 0.9.1: verl_vs_r3.py).

Nothing here is imported by the r3operator package or by the test suite's default run that needs a peer installed:
the tests read recorded logs (tests/benchmarks/test_verl_peer.py)."""
