"""Lesson 20: vLLM's offline API (LLM, SamplingParams, RequestOutput) on a real checkpoint."""
