"""The command line: ``python -m comfyui_lowvram_dit`` (run, convert, doctor, synth, selftest, memwatch)."""
