"""Small helpers that several packages need: atomic writes, URLs and sizes (files), object-store
access (storage) and logging setup (logs)."""
