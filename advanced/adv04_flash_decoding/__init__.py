"""Advanced lesson 04: flash-decoding (split-KV decode) on lesson 15's paged pool: torch, C++ and Triton."""
