"""Calibrating the adaptive policy's cost model on the running machine: time target forwards over a grid of batch
sizes x tokens per row, and draft forwards over batch sizes (calibrate_cost_model)."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

from specgate.serving.policy.base import check_gamma
from specgate.serving.policy.constants import CALIBRATION_BATCH_SIZES, DEFAULT_GAMMA_MAX
from specgate.serving.policy.cost_model import CostModel, monotone


def calibration_tokens(gamma_max: int) -> list[int]:
    """Tokens per row to measure: every count 1..min(gamma_max + 1, 9), then 2^k + 1 up to gamma_max + 1
    (gamma_max 8 -> 1..9; 16 -> 1..9, 17).

    Every count, not a few to interpolate between, because the cost is a staircase in rows = batch x tokens, not
    a line: the C products take 6 rows per pass over a weight block (AVX-512; 3 on AVX2), and past 64 rows a
    layer's product goes to oneDNN. At batch 2, 3 tokens per row (6 rows) take one pass and 4 tokens (8 rows) two,
    as 5 tokens do; a grid of 1, 2, 3, 5, 9 priced 4 tokens halfway between and the policy misjudged both widths.
    """
    dense = set(range(1, min(gamma_max + 1, 9) + 1))
    return sorted(dense | {2**k + 1 for k in range(3, 7) if 2**k + 1 <= gamma_max + 1} | {gamma_max + 1})


def calibrate_cost_model(
    target_model,
    draft_model=None,
    *,
    gamma_max: int = DEFAULT_GAMMA_MAX,
    batch_sizes: Sequence[int] = CALIBRATION_BATCH_SIZES,
    context_len: int = 64,
    repeats: int = 5,
) -> CostModel:
    """Measure target forwards (batch x calibration_tokens(gamma_max) per row) and draft forwards (batch x 1).

    target_model / draft_model: specgate CausalLM (draft None for lookup drafters). Runs on a scratch cache of
    max(batch_sizes) slots whose first context_len positions are filled, so attention reads a realistic context.
    The grid is swept `repeats` times after a warm-up sweep, interleaved, and each point keeps its fastest sample:
    interference only ever adds time, and on a shared 2-core machine it is large (an oversubscribed multi-token
    GEMM measured 4-10x its quiet time), so a burst must not land on every sample of one point. The grid is then
    made monotone (see monotone). Calibrate on a quiet machine: the policy is only as good as these numbers.
    """
    import torch

    check_gamma(gamma_max, "gamma_max")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1 (calibration sweeps per point)")
    tokens_grid = calibration_tokens(gamma_max)
    models = {"target": target_model} | ({"draft": draft_model} if draft_model is not None else {})
    points = [("target", b, t) for b in batch_sizes for t in tokens_grid]
    points += [("draft", b, 1) for b in batch_sizes] if draft_model is not None else []
    with torch.inference_mode():
        scratch = {
            role: _scratch(model, max(batch_sizes), context_len, gamma_max, max(tokens_grid)) for role, model in models.items()
        }
        samples = _sweep(models, scratch, points, context_len, repeats)
    target_ms = {(b, t): min(times) for (role, b, t), times in samples.items() if role == "target"}
    draft_ms = {b: min(times) for (role, b, _), times in samples.items() if role == "draft"}
    return monotone(CostModel(target_ms=target_ms, draft_ms=draft_ms))


def _scratch(model, max_batch: int, context_len: int, gamma_max: int, max_tokens: int) -> tuple:
    """A cache of max_batch slots with its first context_len positions filled, and a logits buffer allocated at its
    largest before any timing (kept across the sweep, as the scheduler keeps one across steps)."""
    import torch

    from specgate.models.transformer import LogitsBuffer

    cache = model.new_cache(max_batch, context_len + gamma_max + 1)
    buffer = LogitsBuffer(model.vocab_size)
    buffer.view(max_batch, max_tokens)
    ids = torch.ones(max_batch, context_len, dtype=torch.int64)  # [B, L]
    model.forward(ids, torch.arange(context_len)[None].expand(max_batch, -1), cache, torch.arange(max_batch), logits=False)
    return cache, buffer


def _sweep(models: dict, scratch: dict, points: list, context_len: int, repeats: int) -> dict[tuple[str, int, int], list[float]]:
    """Time every (role, batch, tokens) point once per sweep, `repeats` sweeps after a warm-up one: ms samples."""
    import torch

    from specgate.models import native

    samples: dict[tuple[str, int, int], list[float]] = {point: [] for point in points}
    for sweep in range(repeats + 1):  # sweep 0 warms up
        # each sweep in another (seeded) order: the pass right after a wide one measured ~1.4x slow (caches,
        # threads), and a fixed order, or a rotation of it, would put the same point there every sweep
        order = list(points)
        random.Random(sweep).shuffle(order)
        for role, batch, tokens in order:
            cache, buffer = scratch[role]
            step_ids = torch.ones(batch, tokens, dtype=torch.int64)  # [B, T]
            positions = torch.arange(context_len, context_len + tokens)[None].expand(batch, -1)  # [B, T]
            start = time.perf_counter()
            out = buffer.view(batch, tokens)  # warm memory, as serving's
            logits = models[role].forward(step_ids, positions, cache, torch.arange(batch), out=out)  # [B, T, V]
            if role == "target":  # the step's passes over the logits scale with B x T too: NaN check, greedy verify
                native.max_argmax(logits)  # as the scheduler does (its check and greedy_verify's argmax)
            if sweep:
                samples[(role, batch, tokens)].append((time.perf_counter() - start) * 1e3)
    return samples
