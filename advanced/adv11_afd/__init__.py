"""Advanced lesson 11: attention/FFN disaggregation, each layer's MLP in other processes, micro-batches ping-ponging."""
