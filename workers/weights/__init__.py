"""Weights: GGUF loading and dequantization, quantized blocks and their kernels, weight paths, synthetic models."""
