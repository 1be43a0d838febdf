"""Phase-aware memory: tensor groups, analytical estimator, residency planner, offload mechanism, measurement (docs/memory.md)."""
