"""Serve configuration: frozen dataclass sections, TOML files and flags (torch-free)."""
