"""Lesson 08: static batching: one padded batch, left padding, an attention mask."""
