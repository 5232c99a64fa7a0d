"""KV block accounting: the global block pool, the radix prefix cache, per-request block management."""
