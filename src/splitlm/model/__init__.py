"""Model configs, weights, our compact transformer, KV cache and the split into shards."""
