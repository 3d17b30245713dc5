"""Advanced lesson 07: context-parallel prefill, ring attention over zigzag chunks, KV into the paged pool."""
