"""ComfyUI glue that is not a node: seam checks, shared node helpers, the fp8 custom operations, mapped weights."""
