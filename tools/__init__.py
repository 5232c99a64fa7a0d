"""Benchmarks and labs that drive justapi from outside, run from the repository root as
modules: `python -m tools.bench <scenario>`, `python -m tools.simulate`, `python -m
tools.netns_lab`. tools/harness.py starts `justapi serve` for them and for tests/.

Not installed with the package; the operations commands are `justapi ...` (justapi/ops/).
"""
