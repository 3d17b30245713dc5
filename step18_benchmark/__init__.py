"""Lesson 18: the benchmark: the optimisation ladder offline, and online serving metrics."""
