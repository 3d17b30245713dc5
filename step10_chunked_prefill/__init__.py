"""Lesson 10: chunked prefill: a per-step token budget shared by decodes and prompt chunks."""
