"""Lesson 01: byte-level BPE tokenizer and the Qwen3 chat template."""
from step01_tokenizer.bpe import QWEN_PATTERN, ByteLevelBPE, bytes_to_unicode
from step01_tokenizer.chat import render_chat

__all__ = ["ByteLevelBPE", "QWEN_PATTERN", "bytes_to_unicode", "render_chat"]
