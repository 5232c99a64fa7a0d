"""Speculative decoding logic that needs no model: token trees, n-gram prompt lookup and the
adaptive draft budget. Torch-free; the scheduler core uses it (justapi/scheduler/spec/speculation.py)
and so may the data plane.
"""
