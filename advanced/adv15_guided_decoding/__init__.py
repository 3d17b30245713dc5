"""Advanced lesson 15: guided decoding (regex / choice / JSON schema -> DFA -> token masks in the sampler)."""
