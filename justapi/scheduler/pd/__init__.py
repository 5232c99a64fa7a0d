"""Prefill/decode disaggregation in the scheduler core: PdScheduler and its KV hand-offs."""
