"""Advanced lesson 01: weight-only quantization (W8A16, W4A16) and the embedded GGUF file's own Q4_1 blocks."""
