"""The Ray-only pieces of multi-host serving: actors, the worker supervisor, the KV relay between hosts."""
