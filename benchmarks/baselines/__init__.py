"""Baselines the benchmarks compare tracestore with (same semantics, other designs)."""
