"""Optimizer state in fewer bits: block-wise 8-bit codes for optax states."""
