"""Advanced lesson 17: logits processors, a batch-level interface in the sampler (min_tokens, allowed_token_ids, logit_bias, custom)."""
