"""Lesson 19: vLLM's offline API (LLM, SamplingParams, RequestOutput) on a real checkpoint."""
