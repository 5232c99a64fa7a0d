"""Model files, torch-free: the GGUF reader, the facts the control plane needs, start-up checks."""
