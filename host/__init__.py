"""Everything that touches ComfyUI's internals and is not a node schema: what each node does (block_swap,
qwen_stages, attention, ...), seam checks, the fp8 custom operations, mapped weights, shared helpers."""
