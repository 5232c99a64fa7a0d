"""`justapi bench serve`: the load generator for any OpenAI-compatible server (ours, vLLM,
llama-server): seeded workloads, streaming HTTP timing, percentiles, JSON and a latency CDF.

Torch-free: it talks HTTP only. The scenarios that start `justapi serve` themselves and
compare configurations live in tools/bench/ (`python -m tools.bench <scenario>`).
"""
