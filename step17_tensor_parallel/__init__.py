"""Lesson 17: tensor parallelism with real processes (gloo on CPU, NCCL on CUDA)."""
