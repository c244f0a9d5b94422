"""Plain-torch kernels (Triton where it pays), one capability per module. Never imports ComfyUI."""
