"""Drafters: propose draft tokens (with q where they have one), then hear how many were accepted."""

from specgate.drafting.base import DraftProposal, Drafter, NoDrafter
from specgate.drafting.batched import BatchedModelDrafter
from specgate.drafting.model_drafter import ModelDrafter
from specgate.drafting.ngram import NgramDrafter
from specgate.drafting.registry import DEFAULT_DRAFTS, make_drafter
from specgate.drafting.synthetic import SyntheticDrafter

__all__ = [
    "BatchedModelDrafter",
    "DEFAULT_DRAFTS",
    "DraftProposal",
    "Drafter",
    "ModelDrafter",
    "NgramDrafter",
    "NoDrafter",
    "SyntheticDrafter",
    "make_drafter",
]
