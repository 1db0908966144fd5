"""Torch-free typed messages that cross processes and ranks (DESIGN.md, layer 1): nothing here imports
another part of Hearth, so every layer may import it."""
