"""Lesson 19: the benchmark: the optimisation ladder offline, and online serving metrics."""
