"""Model execution: configs, KV caches, our own forward, drafters, loaders and the decode loops."""
