"""The single-request speculative engine: generate() and its stats."""

from specgate.engine.generate import GenerationResult, generate
from specgate.engine.stats import GenerationStats

__all__ = ["GenerationResult", "GenerationStats", "generate"]
