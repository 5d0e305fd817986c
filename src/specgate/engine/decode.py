"""The decode core: one speculative step over a ragged batch of requests, shared by single-request generation
(specgate.engine.generate, a batch of 1) and continuous batching (specgate.serving.Scheduler).

One step, numbered as in both callers:

  1. propose (the caller's drafter): up to gamma draft tokens per request, with q where the drafter has one.
  2. score (`decode_step`): ONE target forward; row b feeds its last committed token + its drafts at its own
     absolute positions (-1 pads shorter rows). The KV cache is indexed by position, so a rejected draft needs
     no undo: the next step writes over its entries. A row whose logits are not finite is reported, not verified.
  3. verify (`decode_step`): one greedy or rejection-sampling call for the batch, one torch.Generator per request.
  4. commit (`DecodeState.commit`): the accepted drafts + one corrected or bonus token, cut at the first EOS, the
     token budget or a stop string; nothing past them is emitted.

Finish reasons, OpenAI's vocabulary: "stop" (an EOS token or a stop string), "length" (the token budget).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specgate.drafting.base import DraftProposal
from specgate.models import native
from specgate.sampling import SamplingParams, SparseProbs, VerifierOutput, dense_draft_probs, greedy_verify, logits_to_probs, rejection_sample, verify
from specgate.text import OutputText

VERIFY_STREAM, DRAFT_STREAM = 0, 1  # a request's independent random streams


def seeded_generator(seed: int, stream: int) -> torch.Generator:
    """An independent generator per random stream of a request (VERIFY_STREAM, DRAFT_STREAM)."""
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + stream) % (2**63))


def eos_token_ids(target: Any) -> set[int]:
    """Every id that ends generation: the tokenizer's EOS and the model config's eos_token_id (int or list)."""
    ids: set[int] = set()
    if getattr(target.tokenizer, "eos_token_id", None) is not None:
        ids.add(int(target.tokenizer.eos_token_id))
    config_eos = getattr(getattr(target.model, "config", None), "eos_token_id", None)
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif isinstance(config_eos, (list, tuple)):
        ids.update(int(i) for i in config_eos)
    return ids


@dataclass(slots=True, kw_only=True, eq=False)
class DecodeState:
    """One request's committed tokens and stop conditions (what a decode step reads and commits to)."""

    context: Tensor  # [S] int64: prompt + committed tokens; positions from `length` on are scratch
    length: int  # tokens held in context (prompt + committed)
    tokens: list[int]  # committed output, prompt excluded (the scheduler passes its Request.tokens)
    max_new_tokens: int  # the token budget (>= 1)
    params: SamplingParams
    eos_ids: set[int] | frozenset[int]  # tokens that end the output (empty: EOS is ignored)
    text: OutputText
    verify_generator: torch.Generator

    def append(self, emitted: list[int]) -> str | None:
        """Commit a step's tokens up to the first EOS (kept) and the token budget: "stop", "length" or None."""
        finish = None
        for i, token in enumerate(emitted):
            if token in self.eos_ids:
                emitted, finish = emitted[: i + 1], "stop"
                break
        budget = self.max_new_tokens - len(self.tokens)
        if len(emitted) >= budget:
            emitted, finish = emitted[:budget], finish or "length"
        self.tokens.extend(emitted)
        self.context[self.length : self.length + len(emitted)] = torch.tensor(emitted, dtype=torch.int64)
        self.length += len(emitted)
        return finish

    def cut_at_stop(self, num_new: int) -> bool:
        """Decode the output (its last num_new tokens new); on a stop string cut the tokens back to it: True."""
        cut = self.text.update(self.tokens, num_new)
        if cut is None:
            return False
        del self.tokens[cut:]
        return True

    def commit(self, emitted: list[int]) -> str | None:
        """Step 4: append the step's tokens, then look for stop strings; the finish reason or None."""
        before = len(self.tokens)
        finish = self.append(emitted)
        return "stop" if self.cut_at_stop(len(self.tokens) - before) else finish


@dataclass(slots=True)
class StepResult:
    """What one decode step verified. Rows index the states given to decode_step."""

    kept: list[int]  # rows whose logits were finite, verified (in order)
    failed: list[int]  # rows whose scored logits held NaN/inf: not verified, their requests must fail
    num_accepted: list[int]  # per kept row: drafts accepted
    emitted: list[list[int]]  # per kept row: accepted drafts + the corrected / bonus token, before commit's cuts
    lossless: bool  # False when a labelled lossy verification ran
    forward_s: float  # seconds in the target forward alone
    # per kept row, the target's final-norm states at the scored positions `# [B_kept, G+1, H]` (return_features), else None.
    # Row b's first num_accepted[b] + 1 are the states after its committed tokens (positions L_b - 1 ..), for the drafter.
    features: Tensor | None = None


def decode_step(
    model: Any,
    cache: Any,
    slots: Tensor,
    states: Sequence[DecodeState],
    proposals: Sequence[DraftProposal],
    *,
    lossy: Any = None,
    logits_buffer: Any = None,
    return_features: bool = False,
) -> StepResult:
    """Steps 2-3 for a ragged batch: score every row's drafts in ONE target forward, then verify them.

    model: a specgate CausalLM; cache its KV cache; slots `# [B]` each row's cache row. proposals[b]: row b's
    drafts (draft_probs: q as a [G_b, V] tensor or G_b tensors [V]; None: one-hot). lossy: a
    specgate.sampling.lossy mode replacing the exact test, or None. logits_buffer: a models.LogitsBuffer reused
    across steps (the logits are tens of MB; memory already touched is not page-faulted again), or None.
    return_features: also return the scored positions' final-norm states (StepResult.features), for a drafter
    that reads them (Drafter.wants_features); off, the forward computes nothing extra.
    """
    ids, positions, draft_tokens, num_drafts = _score_inputs(states, proposals)
    batch, width = ids.shape
    out = None if logits_buffer is None else logits_buffer.view(batch, width)
    start = time.perf_counter()
    scored = model.forward(ids, positions, cache, slots, out=out, return_hidden=return_features)
    target_logits, features = scored if return_features else (scored, None)  # [B, G+1, V], [B, G+1, H] or None
    forward_s = time.perf_counter() - start
    peak, target_argmax = native.max_argmax(target_logits)  # [B, G+1] each: one pass for the check and greedy
    # a -inf logit alone is a legal zero probability; NaN or +inf, or a row of -inf, is not. Pads are not checked.
    finite = (torch.isfinite(peak) | (positions < 0)).all(dim=1)  # [B]
    kept, failed = list(range(batch)), []
    if not bool(finite.all()):
        kept, failed = finite.nonzero().flatten().tolist(), (~finite).nonzero().flatten().tolist()
        if not kept:
            return StepResult(kept, failed, [], [], True, forward_s)
        index = torch.tensor(kept, dtype=torch.int64)
        states, proposals = [states[i] for i in kept], [proposals[i] for i in kept]
        draft_tokens, num_drafts = draft_tokens[index], num_drafts[index]
        target_logits, target_argmax, peak = target_logits[index], target_argmax[index], peak[index]
        features = None if features is None else features[index]
    result = _verify(states, proposals, draft_tokens, num_drafts, target_logits, target_argmax, peak, lossy)
    num_accepted = result.num_accepted.tolist()
    output = result.output_tokens.tolist()
    emitted = [row[: accepted + 1] for row, accepted in zip(output, num_accepted)]
    return StepResult(kept, failed, num_accepted, emitted, bool(result.lossless), forward_s, features)


def _score_inputs(states: Sequence[DecodeState], proposals: Sequence[DraftProposal]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The ragged target input: ids and positions `# [B, G+1]` (last committed token + drafts, -1 pads), the
    drafts `# [B, G]` (0 pads) and their counts `# [B]`."""
    counts = [proposal.num_tokens for proposal in proposals]
    batch, width = len(states), max(counts)
    ids = torch.zeros(batch, width + 1, dtype=torch.int64)  # [B, G+1]
    positions = torch.full((batch, width + 1), -1, dtype=torch.int64)  # [B, G+1]
    draft_tokens = torch.zeros(batch, width, dtype=torch.int64)  # [B, G]
    for row, (state, proposal, count) in enumerate(zip(states, proposals, counts)):
        length = state.length
        ids[row, 0] = state.context[length - 1]
        ids[row, 1 : 1 + count] = proposal.tokens
        draft_tokens[row, :count] = proposal.tokens
        positions[row, : 1 + count] = torch.arange(length - 1, length + count)
    return ids, positions, draft_tokens, torch.tensor(counts, dtype=torch.int64)


def _verify(
    states: Sequence[DecodeState],
    proposals: Sequence[DraftProposal],
    draft_tokens: Tensor,  # [B, G]
    num_drafts: Tensor,  # [B]
    target_logits: Tensor,  # [B, G+1, V]
    target_argmax: Tensor,  # [B, G+1]
    target_max: Tensor,  # [B, G+1]
    lossy: Any,
) -> VerifierOutput:
    """One verification call for the batch: greedy when every row is, else rejection sampling (or lossy)."""
    params = [state.params for state in states]
    generators = [state.verify_generator for state in states]
    if lossy is None and all(p.greedy for p in params):
        return greedy_verify(draft_tokens, num_drafts, target_logits, target_argmax=target_argmax)
    draft_probs = _draft_probs(proposals, draft_tokens.shape[1], target_logits.shape[-1])  # [B, G, V], SparseProbs or None
    same_params = all(p == params[0] for p in params)
    if lossy is not None:  # labelled LOSSY verification: output.lossless is False
        dense = dense_draft_probs(draft_probs, target_logits.shape[-1])
        return lossy.verify(draft_tokens, num_drafts, dense, _target_probs(target_logits, params, same_params), generators)
    if same_params:
        return verify(draft_tokens, num_drafts, draft_probs, target_logits, params[0], generators, row_max=target_max)
    return rejection_sample(draft_tokens, num_drafts, draft_probs, _target_probs(target_logits, params, False), generators)


def _target_probs(target_logits: Tensor, params: list[SamplingParams], same_params: bool) -> Tensor:
    """p `# [B, G+1, V]`: each row's logits processed with its request's params."""
    if same_params:
        return logits_to_probs(target_logits, params[0])
    return torch.stack([logits_to_probs(target_logits[row], p) for row, p in enumerate(params)])


def _draft_probs(proposals: Sequence[DraftProposal], width: int, vocab: int) -> Tensor | SparseProbs | None:
    """q for the verifier: `# [B, G, V]` (one-hot where a row has none), or a SparseProbs when the rows with a q
    share one SparseProbs support (rows without one add their drafts as columns); None when no row has a q."""
    if width == 0 or all(proposal.draft_probs is None for proposal in proposals):
        return None
    given = [proposal.draft_probs for proposal in proposals if proposal.draft_probs is not None]
    if len(proposals) == 1 and isinstance(given[0], SparseProbs):  # batch 1: no copy
        return SparseProbs(given[0].values[None], given[0].support)
    if len(proposals) == 1 and isinstance(given[0], Tensor):
        return given[0][None]
    if all(isinstance(q, SparseProbs) and q.support is given[0].support for q in given):
        return _sparse_draft_probs(proposals, width, given[0].support)
    draft_probs = torch.zeros(len(proposals), width, vocab)  # [B, G, V]
    for row, proposal in enumerate(proposals):
        q = proposal.draft_probs.to_dense(vocab) if isinstance(proposal.draft_probs, SparseProbs) else proposal.draft_probs
        for i, token in enumerate(proposal.tokens.tolist()):
            if q is None:
                draft_probs[row, i, token] = 1.0
            else:
                draft_probs[row, i] = q[i]
    return draft_probs


def _sparse_draft_probs(proposals: Sequence[DraftProposal], width: int, support: Tensor) -> SparseProbs:
    """The batch's q on the shared support's K columns plus one column per draft of the rows without a q (one-hot
    there): values `# [B, G, K + E]`."""
    one_hot = [(row, i, token) for row, proposal in enumerate(proposals) if proposal.draft_probs is None
               for i, token in enumerate(proposal.tokens.tolist())]
    columns = support.shape[0]
    values = torch.zeros(len(proposals), width, columns + len(one_hot))  # [B, G, K + E]
    for row, proposal in enumerate(proposals):
        if proposal.draft_probs is not None:
            q = proposal.draft_probs.values  # [G_b, K]
            values[row, : q.shape[0], :columns] = q
    for extra, (row, i, _) in enumerate(one_hot):
        values[row, i, columns + extra] = 1.0
    extra_ids = torch.tensor([token for _, _, token in one_hot], dtype=torch.int64)
    return SparseProbs(values, torch.cat([support, extra_ids]))
