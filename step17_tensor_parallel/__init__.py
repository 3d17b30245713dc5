"""Lesson 18: tensor parallelism with real processes (gloo on CPU, NCCL on CUDA)."""
