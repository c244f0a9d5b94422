"""The Doctor: what this machine and this ComfyUI can do, and the selftest."""
