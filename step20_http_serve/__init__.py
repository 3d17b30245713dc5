"""Lesson 21: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over lesson 20's LLM."""
