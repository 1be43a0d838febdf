"""Benchmark harnesses that run peers (TRL) beside rollplex's schedules (``scripts/bench_peers.py``)."""
