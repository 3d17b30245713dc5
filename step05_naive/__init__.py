"""Lesson 05: the naive generation loop (recompute everything, every step)."""
