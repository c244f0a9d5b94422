"""Model files: safetensors I/O, checkpoint formats, fp8 state dicts, the embedding cache, safe writes. Never imports ComfyUI."""
