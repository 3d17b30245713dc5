"""Advanced lesson 03: speculative decoding (prompt lookup, a layer-skip draft) with rejection sampling."""
