"""`r3operator up`: the operator's rendered pods as local processes (plan.py says what runs, runner.py runs it)."""
