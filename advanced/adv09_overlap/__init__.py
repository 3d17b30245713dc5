"""Advanced lesson 09: two-batch overlap of tensor-parallel all-reduces with compute."""
