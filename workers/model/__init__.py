"""The forward pass: model functions, paged attention backends, native CPU kernels."""
