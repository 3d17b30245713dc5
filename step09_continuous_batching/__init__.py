"""Lesson 09: continuous batching: a scheduler, sequences that join and leave every step."""
