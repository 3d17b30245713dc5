"""Advanced lesson 12: a Qwen3-MoE layer (router, top-k, experts as grouped matmuls), expert
parallel over processes, and expert-parallel load balancing (EPLB)."""
