"""Plain-PyTorch references of every tk-engram op (CPU or GPU)."""
