"""Advanced lesson 08: data-parallel engine replicas behind a cache-aware router."""
