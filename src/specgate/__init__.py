"""specgate: speculative decoding, run exactly, predicted, measured, and gated."""

__version__ = "0.1.0"
