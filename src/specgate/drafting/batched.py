"""Draft for many requests at once with a draft CausalLM: one draft forward per draft position for the whole batch.

The continuous-batching scheduler (specgate.serving) gives each request a KV-cache slot; the draft model keeps
its own cache with the same slot per request, indexed by absolute position, so drafts the target rejected need
no undo: the drafter remembers which token each position holds and re-feeds from the first one that changed.
Sampling (and the draft <-> target vocabulary maps) is ModelDrafter's: one sampler for single and batched drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from specgate.drafting.base import DraftProposal
from specgate.drafting.model_drafter import ModelDrafter


class BatchedModelDrafter:
    """Draft tokens for many requests at once with a draft CausalLM; one cache slot per scheduler slot.

    Reuses ModelDrafter for the tokenizer check, the draft<->target vocabulary maps and the sampler; q is each
    row's draft logits processed with that request's SamplingParams (None for greedy rows: one-hot).
    """

    def __init__(self, draft: Any, target: Any, num_slots: int, max_seq_len: int) -> None:
        self.maps = ModelDrafter(draft, target)
        self.name = self.maps.name
        self.model = draft.model
        self.cache = self.model.new_cache(num_slots, max_seq_len)
        self.cached_tokens = torch.full((num_slots, max_seq_len), -1, dtype=torch.int64)  # [S, L] target id per position

    def begin(self, slot: int) -> None:
        self.cached_tokens[slot] = -1

    def _feed(self, slots: list[int], chunks: list[Tensor], starts: list[int]) -> Tensor:
        """Feed each row's target-id chunk [T_b] at positions start_b..; logits of each row's last token [B, V_d']."""
        width = max(int(c.numel()) for c in chunks)
        ids = torch.zeros(len(chunks), width, dtype=torch.int64)  # [B, T]
        positions = torch.full((len(chunks), width), -1, dtype=torch.int64)  # [B, T]
        for row, (chunk, start, slot) in enumerate(zip(chunks, starts, slots)):
            n = int(chunk.numel())
            ids[row, :n] = self.maps.t2d[chunk]
            positions[row, :n] = torch.arange(start, start + n)
            self.cached_tokens[slot, start : start + n] = chunk
        logits = self.model.forward(ids, positions, self.cache, torch.tensor(slots, dtype=torch.int64), last_only=True)
        return logits[:, : self.maps.num_outputs].float()  # [B, V_d']

    def _catch_up(self, slots: list[int], contexts: list[Tensor]) -> Tensor:
        """Feed each row's context from the first position its slot does not hold; each row's last logits [B, V_d']."""
        chunks, starts = [], []
        for context, slot in zip(contexts, slots):
            length = int(context.numel())
            differs = (self.cached_tokens[slot, :length] != context).nonzero()
            valid = min(int(differs[0]) if differs.numel() else length, length - 1)  # always feed >= 1 token
            chunks.append(context[valid:])
            starts.append(valid)
        return self._feed(slots, chunks, starts)

    def propose(
        self,
        slots: Sequence[int],
        contexts: Sequence[Tensor],
        gammas: Sequence[int],
        params: Sequence[Any],
        generators: Sequence[torch.Generator],
    ) -> list[DraftProposal]:
        """Draft gammas[i] tokens after contexts[i] `# [L_i]` for the request in slots[i], sampled with its
        params[i] and generators[i]; rows with gamma 0 get nothing. Each proposal's draft_probs is its list of
        per-token q `# [V_t]` (None for greedy rows); forward_passes stays 0, the passes being shared by the batch.
        A row whose draft logits are not finite stops drafting (its proposal is shorter)."""
        tokens: list[list[int]] = [[] for _ in slots]
        probs: list[list[Tensor]] = [[] for _ in slots]  # q per drafted token (sampling rows only)
        active = [i for i, g in enumerate(gammas) if g > 0]
        if active:
            logits = self._catch_up([slots[i] for i in active], [contexts[i] for i in active])  # [B, V_d']
        rows = list(range(len(active)))  # rows of logits still drafting
        for step in range(max((gammas[i] for i in active), default=0)):
            finite = torch.isfinite(logits).all(dim=-1)  # [B]: a row with NaN/inf draft logits stops drafting
            next_rows, next_tokens = [], []
            for row in (r for r in rows if finite[r]):
                i = active[row]
                draft, q = self.maps.sample(logits[row : row + 1], params[i], generators[i])  # [1], [1, V_t] or None
                tokens[i].append(int(draft[0]))
                if q is not None:
                    probs[i].append(q[0])
                if step + 1 < gammas[i]:
                    next_rows.append(row)
                    next_tokens.append(tokens[i][-1])
            if not next_rows:
                break
            chunks = [torch.tensor([t], dtype=torch.int64) for t in next_tokens]
            positions = [int(contexts[active[r]].numel()) + step for r in next_rows]
            new_logits = self._feed([slots[active[r]] for r in next_rows], chunks, positions)  # [B', V_d']
            logits = torch.zeros(len(active), new_logits.shape[1])
            logits[next_rows] = new_logits
            rows = next_rows
        return [DraftProposal(tokens=torch.tensor(row, dtype=torch.int64), draft_probs=qs or None) for row, qs in zip(tokens, probs)]
