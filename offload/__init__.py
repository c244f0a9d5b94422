"""Block Swap's engine: the plan, the GPU ring, pinned host memory, timings. Never imports ComfyUI."""
