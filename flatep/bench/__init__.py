"""Benchmarks: the ``flatep bench`` sweep, the planner benchmark, their configs and reports."""
