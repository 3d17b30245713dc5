"""Lesson 03: scaled dot-product attention, causal mask, RoPE, grouped-query attention."""
