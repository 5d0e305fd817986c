"""specgate.sampling: the verifier.

processing (temperature / top-k / top-p), the batched ragged rejection sampler and greedy verification
(verifier), the loop-based oracle (reference), labelled lossy modes (lossy) and the statistical lossless
suite (lossless_check). `target_probs` is p (target), `draft_probs` is q (draft), always.
"""

from specgate.sampling.lossy import (
    EntropyGatedLossy,
    LossyMode,
    SyntheticAcceptanceLossy,
    TypicalAcceptanceLossy,
)
from specgate.sampling.processing import SamplingParams, logits_to_probs
from specgate.sampling.verifier import (
    PROB_SUM_TOLERANCE,
    SparseProbs,
    VerifierOutput,
    dense_draft_probs,
    greedy_verify,
    rejection_sample,
    rejection_sample_logits,
    verify,
)

__all__ = [
    "PROB_SUM_TOLERANCE",
    "EntropyGatedLossy",
    "LossyMode",
    "SamplingParams",
    "SparseProbs",
    "SyntheticAcceptanceLossy",
    "TypicalAcceptanceLossy",
    "VerifierOutput",
    "dense_draft_probs",
    "greedy_verify",
    "logits_to_probs",
    "rejection_sample",
    "rejection_sample_logits",
    "verify",
]
