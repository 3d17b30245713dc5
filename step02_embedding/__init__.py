"""Lesson 02: token embedding and the tied LM head."""
from .embedding import TokenEmbedding, load_embedding, nearest_neighbours, tied_lm_head

__all__ = ["TokenEmbedding", "load_embedding", "nearest_neighbours", "tied_lm_head"]
