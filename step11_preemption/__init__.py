"""Lesson 11: preemption: a KV budget, and recompute when it runs out."""
