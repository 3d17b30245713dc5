"""Lesson 07: a per-request KV cache: prefill once, then one token per step."""
