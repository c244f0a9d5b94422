"""Benchmarks: our path against ComfyUI's native path, same run, same GPU (README.md)."""
