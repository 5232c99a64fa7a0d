"""KV memory of a worker: the pool tensor, PD copies, blocks to and from the wire."""
