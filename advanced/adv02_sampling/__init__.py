"""Advanced lesson 02: sampling beyond the basics (penalties, logit_bias, bad words, beam search)."""
