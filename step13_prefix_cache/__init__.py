"""Lesson 13: prefix caching: full KV blocks found again by the hash of their tokens."""
