"""Lesson 20: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over lesson 19's LLM."""
