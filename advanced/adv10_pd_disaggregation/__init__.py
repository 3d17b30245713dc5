"""Advanced lesson 10: prefill/decode disaggregation with a KV connector."""
