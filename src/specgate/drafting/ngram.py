"""Prompt-lookup drafting: continue the longest recent n-gram match found in the prompt and the output so far.

The drafts are a deterministic function of the context, so q is one-hot (draft_probs None) and the
verification stays exact. An incremental hash index (n-gram -> end of its most recent occurrence) makes each
step O(max_n + new tokens) instead of a scan of the whole context.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specgate.drafting.base import DraftProposal, Drafter


class NgramDrafter(Drafter):
    """Propose the tokens that followed the most recent earlier occurrence of the context's last n tokens.

    n runs from max_n down to min_n; the first (longest) n with an earlier occurrence wins. Defaults 1..3
    (vLLM's prompt_lookup_min / prompt_lookup_max style; transformers matches up to 2).
    """

    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"n-gram sizes min_n={min_n}, max_n={max_n} are invalid: need 1 <= min_n <= max_n (e.g. 1 and 3)"
            )
        self.min_n, self.max_n = min_n, max_n
        self._reset()

    def _reset(self) -> None:
        self._tokens: list[int] = []
        # one dict per n: tuple of n tokens -> index just after its most recent occurrence that has a successor
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(self.min_n, self.max_n + 1)}

    def begin(self, prompt_ids, params, generator, max_seq_len) -> None:
        super().begin(prompt_ids, params, generator, max_seq_len)
        self._reset()

    def _extend(self, context_ids: Tensor) -> None:
        """Append the context's new tail to the token list and index every n-gram that now has a successor."""
        old_len = len(self._tokens)
        if context_ids.numel() < old_len:  # a different request or a rewound context: rebuild
            self._reset()
            old_len = 0
        self._tokens.extend(context_ids[old_len:].tolist())
        tokens = self._tokens
        # an n-gram ending at `end` (exclusive) is indexed once tokens[end] exists, i.e. for end <= len - 1
        for end in range(max(old_len, 1), len(tokens)):
            for n, table in self._index.items():
                if end >= n:
                    table[tuple(tokens[end - n : end])] = end

    def propose(self, context_ids: Tensor, gamma: int, min_n: int | None = None) -> DraftProposal:
        """The continuation of the longest match of max_n..min_n tokens (min_n: a stricter floor for this call, at
        least the drafter's own; None: the drafter's)."""
        self._extend(context_ids)
        tokens = self._tokens
        length = len(tokens)
        drafts: list[int] = []
        if gamma > 0:
            for n in range(min(self.max_n, length), max(self.min_n, min_n or 0) - 1, -1):
                end = self._index[n].get(tuple(tokens[length - n :]))
                if end is not None:
                    drafts = tokens[end : end + gamma]
                    break
        return DraftProposal(tokens=torch.tensor(drafts, dtype=torch.int64), draft_probs=None)
