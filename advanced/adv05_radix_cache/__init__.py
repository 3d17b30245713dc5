"""Advanced lesson 05: a radix-tree prefix cache over the paged KV pool, with copy-on-write."""
