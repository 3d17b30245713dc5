"""Advanced lesson 13: a hybrid model (gated DeltaNet + attention) with per-sequence recurrent state."""
