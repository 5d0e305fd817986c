"""A plain, loop-based reference of the verifier: the oracle the vectorised sampler is tested against.

It loops over rows, positions and tokens in Python floats and consumes the same random draws in the same
order as `verifier.rejection_sample` (see the verifier's module docstring): for per-row generators, row b
draws n_b + 1 float64 uniforms from its own generator (n_b accept uniforms, then the sample uniform).
The emitted token follows the same two-level inverse CDF (block totals of block_size(V) tokens, each a torch
float32 sum of one zero-padded block, accumulated in float64; then the float64 running sum inside the
chosen block), written out as loops, so the two implementations agree draw for draw, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from specgate.sampling.verifier import VerifierOutput, block_size


def _block_total(values: list[float], size: int) -> float:
    """The float32 sum of one block, zero-padded to `size` (the same torch reduction as the fast path)."""
    block = torch.zeros(1, size, dtype=torch.float32)
    block[0, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return float(block.sum(-1)[0])


def reference_inverse_cdf(dist: list[float], uniform: float) -> int:
    """Token drawn from the (unnormalised, non-negative) float32 weights `dist` with one uniform in [0, 1)."""
    size = block_size(len(dist))
    blocks = [dist[start : start + size] for start in range(0, len(dist), size)]
    totals = [_block_total(block, size) for block in blocks]
    cumulative = []
    running = 0.0
    for total in totals:
        running += total
        cumulative.append(running)
    grand_total = cumulative[-1]
    target = min(uniform * grand_total, math.nextafter(grand_total, 0.0))
    chosen = len(blocks) - 1
    for index, value in enumerate(cumulative):
        if value > target:
            chosen = index
            break
    before = cumulative[chosen - 1] if chosen > 0 else 0.0
    within = []
    running = 0.0
    for value in blocks[chosen] + [0.0] * (size - len(blocks[chosen])):
        running += value
        within.append(running)
    offset = min(max(target - before, 0.0), math.nextafter(within[-1], 0.0))
    column = size - 1
    for index, value in enumerate(within):
        if value > offset:
            column = index
            break
    return min(chosen * size + column, len(dist) - 1)


def _f32(x: float) -> float:
    """Round a Python float to float32, as a torch float32 operation would."""
    return float(torch.tensor(x, dtype=torch.float32))


def reference_rejection_sample(
    draft_tokens: Tensor,
    num_draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    generators: Sequence[torch.Generator],
) -> VerifierOutput:
    """Loop-based rejection sampling with one torch.Generator per row (same contract as rejection_sample)."""
    batch, gamma = draft_tokens.shape
    vocab_size = target_probs.shape[-1]
    output = torch.full((batch, gamma + 1), -1, dtype=torch.int64)
    num_accepted = torch.zeros(batch, dtype=torch.int64)
    for b in range(batch):
        n = int(num_draft_tokens[b])
        draws = torch.rand(n + 1, dtype=torch.float64, generator=generators[b]).tolist()
        accept_uniforms, sample_uniform = draws[:n], draws[n]
        emitted: list[int] = []
        final_dist: list[float] | None = None
        for i in range(n):
            x = int(draft_tokens[b, i])
            p_x = float(target_probs[b, i, x])
            q_x = 1.0 if draft_probs is None else float(draft_probs[b, i, x])
            if accept_uniforms[i] * q_x < p_x:  # u < p/q, without dividing by q
                emitted.append(x)
                continue
            p_row = target_probs[b, i].tolist()
            if draft_probs is None:
                residual = [0.0 if k == x else p_row[k] for k in range(vocab_size)]
            else:
                q_row = draft_probs[b, i].tolist()
                residual = [max(_f32(p_row[k] - q_row[k]), 0.0) for k in range(vocab_size)]
            final_dist = residual if any(v > 0.0 for v in residual) else p_row
            break
        if final_dist is None:  # every draft accepted: bonus token from p at the next position
            final_dist = target_probs[b, len(emitted)].tolist()
        emitted.append(reference_inverse_cdf(final_dist, sample_uniform))
        num_accepted[b] = len(emitted) - 1
        output[b, : len(emitted)] = torch.tensor(emitted)
    return VerifierOutput(output_tokens=output, num_accepted=num_accepted, lossless=True, mode="exact")


def reference_greedy_verify(draft_tokens: Tensor, num_draft_tokens: Tensor, target_logits: Tensor) -> VerifierOutput:
    """Loop-based greedy verification: walk the drafts while each equals the target's argmax."""
    batch, gamma = draft_tokens.shape
    output = torch.full((batch, gamma + 1), -1, dtype=torch.int64)
    num_accepted = torch.zeros(batch, dtype=torch.int64)
    for b in range(batch):
        emitted: list[int] = []
        for i in range(int(num_draft_tokens[b]) + 1):
            row = target_logits[b, i].tolist()
            best = max(range(len(row)), key=lambda k: (row[k], -k))  # first index of the maximum
            emitted.append(best)
            if i == int(num_draft_tokens[b]) or int(draft_tokens[b, i]) != best:
                break
        num_accepted[b] = len(emitted) - 1
        output[b, : len(emitted)] = torch.tensor(emitted)
    return VerifierOutput(output_tokens=output, num_accepted=num_accepted, lossless=True, mode="greedy")
