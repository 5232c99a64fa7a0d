"""Speculative decoding in the worker: the step, tree attention layouts, verification, draft models."""
