"""The drafter interface: propose draft tokens (with q where the drafter has one), then hear what was accepted.

Shaped like transformers' candidate generators and vLLM's proposers: a drafter knows nothing about
verification. One request's life:

    drafter.begin(prompt_ids, params, generator)        # once per request
    [drafter.observe_features(0, prompt_features)]      # wants_features only: the prefilled prompt's states
    loop:
        proposal = drafter.propose(context_ids, gamma)  # context = prompt + tokens committed so far
        ... target scores and verifies ...
        [drafter.observe_features(start, features)]     # wants_features only: the newly committed positions' states
        drafter.feedback(num_accepted)                  # how many of proposal.tokens were accepted

Target features: a drafter with `wants_features = True` (the EAGLE head) reads the target's final-norm hidden
states. The engine then asks the target's passes for them (`CausalLM.forward(..., return_hidden=True)`; other
drafters never pay for it) and hands over, by absolute position, the state at every position whose token is
committed and whose successors up to the next token are known: the prompt's prefill (positions 0..P-2), then
after each verification the last committed token and the accepted drafts (positions L-1..L-1+n). The state at
the newest committed token is not known until the next verification pass scores it.

`q` (`draft_probs`) must be the distribution each draft token was actually sampled from, over the TARGET's
vocabulary, processed with the same SamplingParams as p. Drafters whose tokens are a deterministic function of
the context (n-gram lookup, greedy) return None: q is then one-hot, which is exactly right for them.
Drafters that keep state (a KV cache) index it by absolute position, so rejected drafts need no undo: the next
write at that position overwrites them. The model drafter keeps its KV rows in CausalLM cache slots, which is
what lets a batching engine later give each request its own slot.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specgate.sampling import SparseProbs


@dataclass
class DraftProposal:
    """What a drafter proposes for one request at one step."""

    tokens: Tensor  # [G'] int64, G' <= gamma (may be 0: nothing to propose)
    # q: [G', V_target] float32, or G' tensors [V_target] (a batched drafter's per-token rows), or a
    # specgate.sampling.SparseProbs with values [G', K] on K target columns, or None (one-hot on `tokens`)
    draft_probs: Tensor | Sequence[Tensor] | SparseProbs | None
    forward_passes: int = 0  # draft-model forward calls spent on this proposal (0 for lookup drafters)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())


class Drafter(ABC):
    """A proposer of draft tokens for one request at a time.

    Attributes: `name` (shown in stats), `lossless` (False for drafters whose acceptance is not the exact
    rejection test, e.g. the synthetic cost-study drafter), `lossy` (the specgate.sampling.lossy mode the
    engine must pass to the verifier, or None for exact verification), `wants_features` (the engine hands the
    target's final-norm states to `observe_features`; see the module docstring).
    """

    name: str = "drafter"
    lossless: bool = True
    lossy: Any = None
    wants_features: bool = False  # True: the engine passes the target's final-norm states to observe_features

    def begin(self, prompt_ids: Tensor, params: Any, generator: torch.Generator | None, max_seq_len: int) -> None:
        """Start a request. prompt_ids [L] int64; max_seq_len bounds every position the request will use."""
        self.params = params
        self.generator = generator

    @abstractmethod
    def propose(self, context_ids: Tensor, gamma: int) -> DraftProposal:
        """Propose up to `gamma` tokens to follow context_ids [L] int64 (prompt + committed output)."""

    def feedback(self, num_accepted: int) -> None:
        """Hear how many of the last proposal's tokens the target accepted (0..G')."""

    def observe_features(self, start: int, features: Tensor) -> None:
        """(wants_features drafters) The target's final-norm states features [T, H] at positions start..start+T-1,
        each the state after a committed token; called in position order, without gaps."""


class NoDrafter(Drafter):
    """Target-only decoding: proposes nothing, so each step verifies 0 drafts, which is plain target sampling.

    The baseline runs through the same loop as every method, so tokens and passes are counted the same way.
    """

    name = "none"

    def propose(self, context_ids: Tensor, gamma: int) -> DraftProposal:
        return DraftProposal(tokens=torch.empty(0, dtype=torch.int64), draft_probs=None)
