"""The scheduler core over pools on several hosts: host costs, cost-aware routing, prefix imports."""
