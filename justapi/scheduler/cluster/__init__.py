"""The scheduler core's pieces for pools on several hosts: host costs, prefix imports."""
