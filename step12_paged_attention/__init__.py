"""Lesson 12: paged attention: a block manager over one physical KV pool."""
