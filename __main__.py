"""``python -m comfyui_lowvram_dit``: doctor, synthetic checkpoints, benchmarks, workflow runner."""

from __future__ import annotations

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
