"""Lesson 04: RMSNorm, SwiGLU, q/k-norm, the decoder layer, the full model, a strict loader."""
