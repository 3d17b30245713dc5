"""Advanced lesson 06: pipeline parallelism, layers split into stages over processes, micro-batches in flight."""
