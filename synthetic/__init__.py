"""Synthetic checkpoints and LoRAs with the real releases' key names and shapes."""
