"""Benchmark scenarios: each starts what it measures (a `justapi serve` pool through
tools/harness.py, or the engine in-process), runs it, and prints its figures. Run one as
`python -m tools.bench <scenario> [flags]`; `python -m tools.bench --help` lists them.
The load generator they drive over HTTP is `justapi bench serve` (justapi/bench/).
"""
