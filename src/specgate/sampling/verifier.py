"""The exact verifier: a batched, ragged rejection sampler (Leviathan et al. 2023, Chen et al. 2023).

Per row b with n_b drafts x_0..x_{n_b-1} (0 <= n_b <= G):
  1. accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), i = 0, 1, ...;
  2. at the first rejection i, emit one token from the normalised residual (p_i - q_i)+ and stop;
  3. if all n_b drafts are accepted, emit a bonus token from p_{n_b}.
A row with 0 drafts therefore emits one token from p_0 (plain target sampling). With draft_probs None
(token-only proposers such as n-gram lookup) q_i is the one-hot at x_i: accept with probability p_i(x_i);
the residual is p_i with x_i removed.

Random draws (the contract the loop reference in `reference.py` follows draw for draw):
  * `generators` a list of B torch.Generator (per-request seeds): row b draws, from its own generator,
    exactly n_b + 1 float64 uniforms in one `torch.rand(n_b + 1, dtype=float64)` call: the first n_b are the
    accept uniforms u_0..u_{n_b-1} (all of them are drawn, even those past the first rejection, so a row's
    stream advances by n_b + 1 whatever happens), the last is the sample uniform. A row with no drafts draws
    only the sample uniform.
  * `generators` one torch.Generator or None (the global generator): one `torch.rand(B, G)` of accept
    uniforms, then one `torch.rand(B)` of sample uniforms (entries past n_b are drawn and unused).
The accept test is `u_i * q_i(x_i) < p_i(x_i)` in float64 (= u_i < p/q without dividing, so q(x) = 0 is
never a division by zero: such a draft is accepted when p(x) > 0 and rejected when p(x) = 0).
The sample uniform is never reused by the accept test: sharing one uniform biases the output.

The emitted token is drawn by inverse CDF with the sample uniform over a two-level CDF: block totals of
block_size(V) = min(512, V) tokens (float32 sums, accumulated across blocks in float64), then the float64
cumulative sum inside the chosen block. It never builds a [B, V] float64 copy and never emits a
zero-probability token; its rounding is at float32 level, far below anything a statistical test can see.
An all-zero residual (p == q) falls back to p, without NaN.

Entry points: `rejection_sample` (processed probabilities), `rejection_sample_logits` (temperature-only
logits, without materialising [B, G+1, V] probabilities; same draws), `greedy_verify`, and `verify`, which
the engine calls and which picks one of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from specgate.sampling.processing import SamplingParams, logits_to_probs

BLOCK_SIZE = 512  # tokens per block of the two-level inverse CDF (min(BLOCK_SIZE, V) for small vocabularies)
_CHUNK_SIZE = 64 * BLOCK_SIZE  # V-columns processed at once when summing blocks (keeps temporaries small)
PROB_SUM_TOLERANCE = 1e-3  # a used probability row must sum to 1 within this (absolute)

Generators = Sequence[torch.Generator] | torch.Generator | None


@dataclass
class VerifierOutput:
    """What one verification step emitted.

    output_tokens: `# [B, G+1]` int64, the emitted tokens of each row, left-aligned, -1 padded.
    num_accepted: `# [B]` int64, accepted drafts per row; the row emitted num_accepted + 1 tokens.
    lossless: False for every labelled lossy mode (its output does not follow the target distribution).
    mode: "exact", "greedy", or the lossy mode's name (always containing "lossy").
    """

    output_tokens: Tensor
    num_accepted: Tensor
    lossless: bool = True
    mode: str = "exact"

    @property
    def num_emitted(self) -> Tensor:
        """`# [B]` tokens emitted per row (accepted drafts + the residual or bonus token)."""
        return self.num_accepted + 1


@dataclass(frozen=True)
class SparseProbs:
    """q on a few target columns: q[b, i, support[j]] += values[b, i, j], zero elsewhere (a repeated column adds up).

    values `# [B, G, K]` float32, support `# [K]` int64 target ids. A drafter whose outputs cover K of the target's V
    tokens (the EAGLE head: 12,288 of Gemma's 262,144) hands its q over in this form; building, stacking and reading
    [G, V] dense rows cost about a millisecond a step on CPU. The verifier's C path reads it as it is; every other
    path calls `to_dense`.
    """

    values: Tensor
    support: Tensor

    def to_dense(self, vocab_size: int) -> Tensor:
        """q as a dense `# [..., V]` float32 tensor."""
        dense = torch.zeros(*self.values.shape[:-1], vocab_size, dtype=self.values.dtype)
        return dense.index_add_(-1, self.support, self.values)


DraftProbs = Tensor | SparseProbs | None


def dense_draft_probs(draft_probs: DraftProbs, vocab_size: int) -> Tensor | None:
    """draft_probs as a dense `# [B, G, V]` tensor (or None)."""
    return draft_probs.to_dense(vocab_size) if isinstance(draft_probs, SparseProbs) else draft_probs


# ---------------------------------------------------------------------------------------------------------
# validation


def _shape(t: Tensor | None) -> str:
    return "None" if t is None else str(list(t.shape))


def validate_draft_inputs(draft_tokens: Tensor, num_draft_tokens: Tensor, vocab_size: int) -> Tensor:
    """Check draft tokens `# [B, G]` and lengths `# [B]`; return the valid-draft mask `# [B, G]`."""
    if not isinstance(draft_tokens, Tensor) or draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens has shape {_shape(draft_tokens)}; expected [B, G] (int64)")
    if not isinstance(num_draft_tokens, Tensor) or num_draft_tokens.dim() != 1:
        raise ValueError(f"num_draft_tokens has shape {_shape(num_draft_tokens)}; expected [B] (int64)")
    if draft_tokens.dtype.is_floating_point or num_draft_tokens.dtype.is_floating_point:
        raise ValueError(
            f"draft_tokens ({draft_tokens.dtype}) and num_draft_tokens ({num_draft_tokens.dtype}) must be "
            "integer tensors (int64); pass token ids, not probabilities"
        )
    batch, gamma = draft_tokens.shape
    if num_draft_tokens.shape[0] != batch:
        raise ValueError(
            f"num_draft_tokens has shape {_shape(num_draft_tokens)} but draft_tokens has shape "
            f"{_shape(draft_tokens)}; both need the same batch size B"
        )
    if batch and (num_draft_tokens.min() < 0 or num_draft_tokens.max() > gamma):
        bad = num_draft_tokens[(num_draft_tokens < 0) | (num_draft_tokens > gamma)][0].item()
        raise ValueError(f"num_draft_tokens contains {bad}; each entry must be in 0..G = 0..{gamma}")
    valid = torch.arange(gamma, device=draft_tokens.device)[None, :] < num_draft_tokens[:, None]  # [B, G]
    used = draft_tokens[valid]
    if used.numel() and (used.min() < 0 or used.max() >= vocab_size):
        bad = used[(used < 0) | (used >= vocab_size)][0].item()
        raise ValueError(
            f"draft_tokens contains token id {bad}; ids of used drafts must be in [0, V) = [0, {vocab_size})"
        )
    return valid


def validate_probs(name: str, probs: Tensor, used_rows: Tensor) -> None:
    """Check that every used row of `probs` `# [B, P, V]` is a probability vector (used_rows `# [B, P]`).

    Rows not used by the step (positions past a row's draft count) are not checked: engines may leave
    padding there. Costs two vectorised reductions over V.
    """
    if not probs.dtype.is_floating_point:
        raise ValueError(f"{name} has dtype {probs.dtype}; expected float probabilities (e.g. softmax output)")
    sums = probs.sum(-1)  # [B, P]
    mins = probs.amin(-1)  # [B, P]
    bad_nan = (torch.isnan(sums) | torch.isnan(mins)) & used_rows
    if bad_nan.any():
        b, i = bad_nan.nonzero()[0].tolist()
        raise ValueError(f"{name}[{b}, {i}] contains NaN; pass finite probabilities (check the logits)")
    bad_neg = (mins < 0) & used_rows
    if bad_neg.any():
        b, i = bad_neg.nonzero()[0].tolist()
        raise ValueError(
            f"{name}[{b}, {i}] contains a negative entry ({mins[b, i].item():.3g}); probabilities must be "
            ">= 0 (pass softmax(logits), not logits)"
        )
    bad_sum = ~((sums - 1.0).abs() <= PROB_SUM_TOLERANCE) & used_rows
    if bad_sum.any():
        b, i = bad_sum.nonzero()[0].tolist()
        raise ValueError(
            f"{name}[{b}, {i}] sums to {sums[b, i].item():.6g}; each used row must sum to 1 within "
            f"{PROB_SUM_TOLERANCE:g} (normalise it, e.g. with specgate.sampling.logits_to_probs)"
        )


def validate_sparse_probs(draft_probs: SparseProbs, batch: int, gamma: int, vocab_size: int, valid: Tensor) -> None:
    """Check a SparseProbs q against [B, G] = [batch, gamma] and the vocabulary (valid `# [B, G]`: the used rows)."""
    values, support = draft_probs.values, draft_probs.support
    if not isinstance(values, Tensor) or values.dim() != 3 or tuple(values.shape[:2]) != (batch, gamma):
        raise ValueError(f"draft_probs.values has shape {_shape(values)}; expected [B, G, K] = [{batch}, {gamma}, K]")
    if not isinstance(support, Tensor) or support.dim() != 1 or support.shape[0] != values.shape[2] or support.dtype.is_floating_point:
        raise ValueError(f"draft_probs.support has shape {_shape(support)}; expected int64 [K] = [{values.shape[2]}], "
                         "the target id of each column of values")
    if support.numel() and (support.min() < 0 or support.max() >= vocab_size):
        bad = support[(support < 0) | (support >= vocab_size)][0].item()
        raise ValueError(f"draft_probs.support contains token id {bad}; ids must be in [0, V) = [0, {vocab_size})")
    validate_probs("draft_probs.values", values, valid)


def validate_verifier_inputs(
    draft_tokens: Tensor, num_draft_tokens: Tensor, draft_probs: DraftProbs, target_probs: Tensor
) -> None:
    """All checks of `rejection_sample`; raises ValueError naming the argument, the value and the fix."""
    if not isinstance(target_probs, Tensor) or target_probs.dim() != 3:
        raise ValueError(f"target_probs has shape {_shape(target_probs)}; expected [B, G+1, V]")
    batch, positions, vocab_size = target_probs.shape
    valid = validate_draft_inputs(draft_tokens, num_draft_tokens, vocab_size)
    gamma = draft_tokens.shape[1]
    if (batch, positions) != (draft_tokens.shape[0], gamma + 1) or vocab_size < 1:
        raise ValueError(
            f"target_probs has shape {_shape(target_probs)} but draft_tokens has shape {_shape(draft_tokens)}; "
            f"target_probs must be [B, G+1, V] = [{draft_tokens.shape[0]}, {gamma + 1}, V]"
        )
    if isinstance(draft_probs, SparseProbs):
        validate_sparse_probs(draft_probs, batch, gamma, vocab_size, valid)
    elif draft_probs is not None:
        if not isinstance(draft_probs, Tensor) or tuple(draft_probs.shape) != (batch, gamma, vocab_size):
            raise ValueError(
                f"draft_probs has shape {_shape(draft_probs)} but target_probs has shape "
                f"{_shape(target_probs)}; draft_probs must be [B, G, V] = [{batch}, {gamma}, {vocab_size}] "
                "(or None for token-only proposers)"
            )
        validate_probs("draft_probs", draft_probs, valid)
    used_targets = torch.arange(positions, device=target_probs.device)[None, :] <= num_draft_tokens[:, None]
    validate_probs("target_probs", target_probs, used_targets)


# ---------------------------------------------------------------------------------------------------------
# random draws


def draw_uniforms(num_draft_tokens: Tensor, gamma: int, generators: Generators = None) -> tuple[Tensor, Tensor]:
    """Draw (accept_uniforms `# [B, G]`, sample_uniforms `# [B]`), float64 in [0, 1), in the documented order."""
    batch = num_draft_tokens.shape[0]
    device = num_draft_tokens.device
    if generators is None or isinstance(generators, torch.Generator):
        gen_device = device if generators is None else generators.device
        accept = torch.rand(batch, gamma, dtype=torch.float64, generator=generators, device=gen_device)
        sample = torch.rand(batch, dtype=torch.float64, generator=generators, device=gen_device)
        return accept.to(device), sample.to(device)
    if len(generators) != batch:
        raise ValueError(
            f"generators has {len(generators)} entries but the batch has B={batch} rows; pass one "
            "torch.Generator per row, a single torch.Generator, or None"
        )
    if batch == 0:  # an empty batch draws nothing (torch.cat of no draws would fail)
        return torch.ones(0, gamma, dtype=torch.float64, device=device), torch.ones(0, dtype=torch.float64, device=device)
    counts = num_draft_tokens.tolist()
    draws = [
        torch.rand(n + 1, dtype=torch.float64, generator=g, device=g.device).to(device)
        for g, n in zip(generators, counts)
    ]
    flat = torch.cat(draws)  # [sum(n_b + 1)]
    is_sample = torch.zeros(flat.shape[0], dtype=torch.bool, device=device)
    is_sample[torch.tensor(counts, device=device).add(1).cumsum(0) - 1] = True
    valid = torch.arange(gamma, device=device)[None, :] < num_draft_tokens[:, None]  # [B, G]
    accept = torch.ones(batch, gamma, dtype=torch.float64, device=device)
    accept.masked_scatter_(valid, flat[~is_sample])
    return accept, flat[is_sample]


# ---------------------------------------------------------------------------------------------------------
# building blocks shared with the lossy modes


def gather_token_probs(probs: Tensor, tokens: Tensor) -> Tensor:
    """probs `# [B, G, V]`, tokens `# [B, G]` (valid ids) -> probs[b, i, tokens[b, i]] as float64 `# [B, G]`."""
    return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).double()


def accepted_prefix_length(accepted: Tensor) -> Tensor:
    """accepted `# [B, G]` bool -> length of the all-accepted prefix `# [B]` int64."""
    return accepted.long().cumprod(-1).sum(-1)


def assemble_output(
    draft_tokens: Tensor, num_accepted: Tensor, final_tokens: Tensor, *, lossless: bool, mode: str
) -> VerifierOutput:
    """Accepted drafts, then the final (residual or bonus) token at index num_accepted, then -1 padding."""
    batch, gamma = draft_tokens.shape
    keep = torch.arange(gamma, device=draft_tokens.device)[None, :] < num_accepted[:, None]  # [B, G]
    output = torch.full((batch, gamma + 1), -1, dtype=torch.int64, device=draft_tokens.device)
    output[:, :gamma] = torch.where(keep, draft_tokens.long(), -1)
    output.scatter_(1, num_accepted[:, None], final_tokens[:, None])
    return VerifierOutput(output_tokens=output, num_accepted=num_accepted, lossless=lossless, mode=mode)


def block_size(vocab_size: int) -> int:
    """Tokens per block of the two-level CDF for this vocabulary: BLOCK_SIZE, or V when V is smaller."""
    return min(BLOCK_SIZE, vocab_size)


def block_sums(chunk_fn: Callable[[int, int], Tensor], vocab_size: int) -> Tensor:
    """Block totals `# [R, ceil(V / block_size(V))]` float64 of rows given column-chunk by column-chunk.

    chunk_fn(start, stop) returns the rows' entries in columns start..stop-1 as float32 `# [R, stop-start]`.
    The last block is zero-padded to the block size before summing, so every block is summed the same way.
    """
    size = block_size(vocab_size)
    sums = []
    for start in range(0, vocab_size, _CHUNK_SIZE):
        chunk = chunk_fn(start, min(start + _CHUNK_SIZE, vocab_size))  # [R, w]
        pad = -chunk.shape[1] % size
        if pad:
            chunk = F.pad(chunk, (0, pad))
        sums.append(chunk.unflatten(-1, (-1, size)).sum(-1))
    return torch.cat(sums, dim=-1).double()


def block_columns(blocks: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Token ids `# [R, block]` of each row's chosen block (clamped to V-1) and the in-vocabulary mask."""
    size = block_size(vocab_size)
    ids = blocks[:, None] * size + torch.arange(size, device=blocks.device)[None, :]
    in_vocab = ids < vocab_size
    return ids.clamp(max=vocab_size - 1), in_vocab


def row_columns(flat: Tensor, rows: Tensor, start: int, stop: int) -> Tensor:
    """flat[rows, start:stop] `# [R, stop-start]` (index_select: much faster than advanced indexing)."""
    return flat[:, start:stop].index_select(0, rows)


def block_entries(flat: Tensor, rows: Tensor, blocks: Tensor) -> Tensor:
    """Entries of block blocks[r] of row rows[r] of flat `# [N, V]` -> `# [R, block_size(V)]`, 0 past V."""
    vocab_size = flat.shape[1]
    if block_size(vocab_size) == vocab_size:  # one block: the whole row
        return flat.index_select(0, rows)
    ids, in_vocab = block_columns(blocks, vocab_size)
    entries = flat.reshape(-1).index_select(0, (rows[:, None] * vocab_size + ids).view(-1)).view(ids.shape)
    return entries.masked_fill_(~in_vocab, 0.0)


def inverse_cdf_sample(
    totals: Tensor, block_fn: Callable[[Tensor], Tensor], uniforms: Tensor, vocab_size: int
) -> Tensor:
    """Sample one token per row by two-level inverse CDF.

    totals: `# [R, nblocks]` float64 block totals (from `block_sums`), uniforms `# [R]` float64 in [0, 1),
    block_fn(blocks `# [R]`) -> the chosen blocks' entries `# [R, block_size(V)]` float32 (0 past V).
    Returns `# [R]` int64: the first token whose cumulative mass exceeds u * total; a token with zero mass
    is never returned (rows whose total is 0 get an arbitrary token; callers replace them).
    """
    block_cdf = totals.cumsum(-1)  # [R, nblocks]
    total = block_cdf[:, -1]
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    blocks = torch.searchsorted(block_cdf, target[:, None], right=True).squeeze(1)
    blocks.clamp_(max=block_cdf.shape[1] - 1)
    before = torch.where(blocks > 0, block_cdf.gather(1, (blocks - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    within = block_fn(blocks).double().cumsum(-1)  # [R, block]
    last = within[:, -1]
    offset = torch.minimum((target - before).clamp(min=0.0), torch.nextafter(last, torch.zeros_like(last)))
    size = block_size(vocab_size)
    column = torch.searchsorted(within, offset[:, None], right=True).squeeze(1).clamp_(max=size - 1)
    return (blocks * size + column).clamp_(max=vocab_size - 1)


def sample_final_tokens(
    target_probs: Tensor,
    draft_probs: Tensor | None,
    draft_tokens: Tensor,
    stop_positions: Tensor,
    use_residual: Tensor,
    sample_uniforms: Tensor,
) -> Tensor:
    """The token each row emits after its accepted prefix, `# [B]` int64.

    target_probs `# [B, G+1, V]`, draft_probs `# [B, G, V]` or None, draft_tokens `# [B, G]` (valid ids),
    stop_positions `# [B]` (= num_accepted), use_residual `# [B]` bool (True: the draft at stop_positions
    was rejected, sample the normalised (p - q)+; False: sample p at stop_positions), sample_uniforms `# [B]`.
    Residual rows whose residual is all zero (p == q) fall back to p.
    """
    batch, positions, vocab_size = target_probs.shape
    gamma = positions - 1
    rows = torch.arange(batch, device=target_probs.device)
    p_flat = target_probs.reshape(batch * positions, vocab_size)  # [B*(G+1), V], a view when contiguous
    q_flat = None if draft_probs is None else draft_probs.reshape(batch * gamma, vocab_size)  # [B*G, V]
    q_positions = stop_positions.clamp(max=max(gamma - 1, 0))
    removed = draft_tokens.gather(1, q_positions[:, None]).squeeze(1) if gamma else torch.zeros_like(rows)
    return sample_from_rows(
        p_flat, rows * positions + stop_positions, q_flat, rows * gamma + q_positions, removed,
        use_residual, sample_uniforms,
    )


def sample_from_rows(
    p_flat: Tensor,
    p_rows: Tensor,
    q_flat: Tensor | None,
    q_rows: Tensor,
    removed_tokens: Tensor,
    use_residual: Tensor,
    sample_uniforms: Tensor,
) -> Tensor:
    """One token per row b from p_flat[p_rows[b]] (`# [N, V]`), or, where use_residual[b], from the
    normalised residual (p_flat[p_rows[b]] - q_flat[q_rows[b]])+ (q_flat None: p without removed_tokens[b]).
    All per-row arguments are `# [B]`. Residual rows whose residual is all zero fall back to p.
    """
    vocab_size = p_flat.shape[1]
    tokens = torch.zeros(p_rows.shape[0], dtype=torch.int64, device=p_flat.device)
    plain = ~use_residual
    residual_idx = use_residual.nonzero().squeeze(1)
    if residual_idx.numel():
        totals, block_fn = _residual_rows(
            p_flat, p_rows[residual_idx], q_flat, q_rows[residual_idx], removed_tokens[residual_idx]
        )
        tokens[residual_idx] = inverse_cdf_sample(totals, block_fn, sample_uniforms[residual_idx], vocab_size)
        plain[residual_idx[totals.sum(-1) <= 0]] = True  # p == q: nothing to correct, sample p
    plain_idx = plain.nonzero().squeeze(1)
    if plain_idx.numel():
        rows = p_rows[plain_idx]
        totals = block_sums(lambda a, b: row_columns(p_flat, rows, a, b), vocab_size)

        def block_fn(blocks: Tensor) -> Tensor:
            return block_entries(p_flat, rows, blocks)

        tokens[plain_idx] = inverse_cdf_sample(totals, block_fn, sample_uniforms[plain_idx], vocab_size)
    return tokens


def _residual_rows(
    p_flat: Tensor, rows: Tensor, q_flat: Tensor | None, q_rows: Tensor, removed: Tensor
) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """Block totals and block accessor of the residual rows: (p - q)+, or p without the removed token."""
    vocab_size = p_flat.shape[1]
    if q_flat is None:

        def block_fn(blocks: Tensor) -> Tensor:
            ids, _ = block_columns(blocks, vocab_size)
            return block_entries(p_flat, rows, blocks).masked_fill_(ids == removed[:, None], 0.0)

        totals = block_sums(lambda a, b: row_columns(p_flat, rows, a, b), vocab_size)
        removed_block = removed // block_size(vocab_size)
        totals[torch.arange(rows.shape[0]), removed_block] = block_fn(removed_block).sum(-1).double()
        return totals, block_fn

    def chunk_fn(a: int, b: int) -> Tensor:
        return (row_columns(p_flat, rows, a, b) - row_columns(q_flat, q_rows, a, b)).clamp_min_(0.0)

    def block_fn(blocks: Tensor) -> Tensor:
        return (block_entries(p_flat, rows, blocks) - block_entries(q_flat, q_rows, blocks)).clamp_min_(0.0)

    return block_sums(chunk_fn, vocab_size), block_fn


# ---------------------------------------------------------------------------------------------------------
# public API


def rejection_sample_from_uniforms(
    draft_tokens: Tensor,
    num_draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    accept_uniforms: Tensor,
    sample_uniforms: Tensor,
) -> VerifierOutput:
    """The exact sampler given its uniforms (accept `# [B, G]`, sample `# [B]`, float64); no validation."""
    gamma = draft_tokens.shape[1]
    valid = torch.arange(gamma, device=draft_tokens.device)[None, :] < num_draft_tokens[:, None]  # [B, G]
    safe_tokens = torch.where(valid, draft_tokens, 0).long()  # [B, G] padding may be -1
    p_draft = gather_token_probs(target_probs[:, :gamma], safe_tokens)  # [B, G]
    if draft_probs is None:
        accepted = accept_uniforms < p_draft  # q one-hot: accept with probability p(x)
    else:
        q_draft = gather_token_probs(draft_probs, safe_tokens)  # [B, G]
        accepted = accept_uniforms * q_draft < p_draft
    num_accepted = accepted_prefix_length(accepted & valid)  # [B]
    rejected = num_accepted < num_draft_tokens  # [B]
    final = sample_final_tokens(target_probs, draft_probs, safe_tokens, num_accepted, rejected, sample_uniforms)
    return assemble_output(draft_tokens, num_accepted, final, lossless=True, mode="exact")


def rejection_sample(
    draft_tokens: Tensor,
    num_draft_tokens: Tensor,
    draft_probs: DraftProbs,
    target_probs: Tensor,
    generators: Generators = None,
    *,
    validate: bool = True,
) -> VerifierOutput:
    """Exact speculative sampling of a ragged batch (see the module docstring for semantics and draws).

    draft_tokens `# [B, G]` int64 (entries past num_draft_tokens[b] are ignored, -1 allowed),
    num_draft_tokens `# [B]` int64 in 0..G, draft_probs `# [B, G, V]`, a SparseProbs, or None (q one-hot at the
    draft), target_probs `# [B, G+1, V]`, generators: B torch.Generator (per-request seeds), one, or None.
    validate=False skips the input checks (two reductions over the used probability rows).
    """
    if validate:
        validate_verifier_inputs(draft_tokens, num_draft_tokens, draft_probs, target_probs)
    accept_u, sample_u = draw_uniforms(num_draft_tokens, draft_tokens.shape[1], generators)
    return rejection_sample_from_uniforms(
        draft_tokens, num_draft_tokens, dense_draft_probs(draft_probs, target_probs.shape[-1]), target_probs,
        accept_u, sample_u,
    )


def _sum_exp(logits_flat: Tensor, rows: Tensor, row_max: Tensor, temperature: float) -> Tensor:
    """sum_k exp((logits[r, k] - max_r) / T) for each row r of logits_flat `# [N, V]` -> `# [R]` float64."""
    total = torch.zeros(rows.shape[0], dtype=torch.float64, device=logits_flat.device)
    for start in range(0, logits_flat.shape[1], _CHUNK_SIZE):
        chunk = row_columns(logits_flat, rows, start, min(start + _CHUNK_SIZE, logits_flat.shape[1]))  # [R, w]
        chunk.sub_(row_max[:, None])
        if temperature != 1.0:
            chunk.div_(temperature)
        total += chunk.exp_().sum(-1).double()
    return total


def rejection_sample_logits(
    draft_tokens: Tensor,
    num_draft_tokens: Tensor,
    draft_probs: DraftProbs,
    target_logits: Tensor,
    temperature: float = 1.0,
    generators: Generators = None,
    *,
    validate: bool = True,
    row_max: Tensor | None = None,
    kernel: bool = True,
) -> VerifierOutput:
    """Exact sampling straight from target logits `# [B, G+1, V]` at a temperature (no top-k / top-p).

    The same semantics and random draws as `rejection_sample(..., logits_to_probs(target_logits,
    SamplingParams(temperature)))`, without materialising the [B, G+1, V] probabilities: a row computes the
    softmax normaliser only at the positions it verifies (it stops at its first rejection), then samples its
    stop position's residual or bonus row. draft_probs (dense, SparseProbs or None) must be processed with the
    same temperature. row_max `# [B, G+1]`: the logits' maxima where the caller has them (decode_step's
    finiteness pass), else computed here. On CPU float32 logits with the C kernels built this runs in C
    (models.native.verify_rows, one pass over V per verified position); elsewhere, or with kernel=False (the
    fallback, for its tests and the benchmark), in torch. Results equal the probability path except when a uniform
    falls within float rounding of a threshold.
    """
    if isinstance(temperature, bool) or not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature={temperature!r} is out of range: use a value > 0 (greedy: greedy_verify)")
    from specgate.models import native  # lazy: the sampler does not otherwise need the model runtime

    batch, positions, vocab_size = target_logits.shape if target_logits.dim() == 3 else (0, 0, 0)
    if validate:
        _validate_logits_inputs(draft_tokens, num_draft_tokens, draft_probs, target_logits)
    gamma = positions - 1
    logits = target_logits.float().contiguous()
    if row_max is None:
        row_max = native.amax(logits)  # [B, G+1]
    if validate:
        _check_finite_where_used(row_max, num_draft_tokens, "used (NaN, +inf or all -inf rows have no distribution)")
    accept_u, sample_u = draw_uniforms(num_draft_tokens, gamma, generators)
    valid = torch.arange(gamma, device=draft_tokens.device)[None, :] < num_draft_tokens[:, None]  # [B, G]
    safe_tokens = torch.where(valid, draft_tokens, 0).long()  # [B, G]
    if kernel and batch and native.verify_applies(logits):
        sparse = isinstance(draft_probs, SparseProbs)
        num_accepted, final = native.verify_rows(
            logits, row_max, temperature, safe_tokens, num_draft_tokens, draft_probs.values if sparse else draft_probs,
            draft_probs.support if sparse else None, accept_u, sample_u,
        )
        return assemble_output(draft_tokens, num_accepted, final, lossless=True, mode="exact")
    final, num_accepted = _sample_logits_torch(
        logits, row_max, safe_tokens, num_draft_tokens, dense_draft_probs(draft_probs, vocab_size), accept_u, sample_u,
        temperature,
    )
    return assemble_output(draft_tokens, num_accepted, final, lossless=True, mode="exact")


def _sample_logits_torch(
    logits: Tensor, row_max: Tensor, safe_tokens: Tensor, num_draft_tokens: Tensor, draft_probs: Tensor | None,
    accept_u: Tensor, sample_u: Tensor, temperature: float,
) -> tuple[Tensor, Tensor]:
    """rejection_sample_logits in torch: (final token `# [B]`, num_accepted `# [B]`) from logits `# [B, G+1, V]`."""
    batch, positions, vocab_size = logits.shape
    gamma = positions - 1
    logits_flat = logits.reshape(batch * positions, vocab_size)  # [B*(G+1), V]
    num_accepted, log_norm = _accept_from_logits(
        logits_flat, row_max, safe_tokens, num_draft_tokens, draft_probs, accept_u, temperature
    )
    rows = torch.arange(batch)
    stop_rows = rows * positions + num_accepted
    p_stop = logits_flat.index_select(0, stop_rows)  # [B, V] the only full probability rows needed
    p_stop.sub_(row_max.reshape(-1)[stop_rows, None])
    if temperature != 1.0:
        p_stop.div_(temperature)
    p_stop.exp_()
    p_stop.div_(log_norm.view(-1)[stop_rows].exp().float()[:, None])
    q_positions = num_accepted.clamp(max=max(gamma - 1, 0))
    removed = safe_tokens.gather(1, q_positions[:, None]).squeeze(1) if gamma else torch.zeros_like(rows)
    q_flat = None if draft_probs is None else draft_probs.reshape(batch * gamma, vocab_size)
    final = sample_from_rows(
        p_stop, rows, q_flat, rows * gamma + q_positions, removed, num_accepted < num_draft_tokens, sample_u
    )
    return final, num_accepted


def _validate_logits_inputs(draft_tokens: Tensor, num_draft_tokens: Tensor, draft_probs: DraftProbs, target_logits: Tensor) -> None:
    """rejection_sample_logits' shape and value checks: target_logits [B, G+1, V], draft_probs [B, G, V] or None."""
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits has shape {_shape(target_logits)}; expected [B, G+1, V]")
    batch, positions, vocab_size = target_logits.shape
    valid = validate_draft_inputs(draft_tokens, num_draft_tokens, vocab_size)
    if (batch, positions) != (draft_tokens.shape[0], draft_tokens.shape[1] + 1):
        raise ValueError(
            f"target_logits has shape {_shape(target_logits)} but draft_tokens has shape "
            f"{_shape(draft_tokens)}; target_logits must be [B, G+1, V] = [{draft_tokens.shape[0]}, "
            f"{draft_tokens.shape[1] + 1}, V]"
        )
    if isinstance(draft_probs, SparseProbs):
        validate_sparse_probs(draft_probs, batch, positions - 1, vocab_size, valid)
    elif draft_probs is not None:
        if not isinstance(draft_probs, Tensor) or tuple(draft_probs.shape) != (batch, positions - 1, vocab_size):
            raise ValueError(
                f"draft_probs has shape {_shape(draft_probs)} but target_logits has shape "
                f"{_shape(target_logits)}; draft_probs must be [B, G, V] (or None for token-only proposers)"
            )
        validate_probs("draft_probs", draft_probs, valid)


def _accept_from_logits(
    logits_flat: Tensor,
    row_max: Tensor,
    safe_tokens: Tensor,
    num_draft_tokens: Tensor,
    draft_probs: Tensor | None,
    accept_u: Tensor,
    temperature: float,
) -> tuple[Tensor, Tensor]:
    """The accept / reject loop over positions: a draft x at position i is accepted iff u * q(x) < p(x), p the
    target's softmax at the temperature, whose normaliser is computed only for rows still verifying.

    logits_flat `# [B*(G+1), V]`, row_max `# [B, G+1]`, safe_tokens `# [B, G]` (drafts, 0 past n_b), accept_u
    `# [B, G]` -> (num_accepted `# [B]`, log_norm `# [B, G+1]` float64, log Z filled where it was needed).
    """
    batch, positions = row_max.shape
    gamma, vocab_size = positions - 1, logits_flat.shape[1]
    q_values = None if draft_probs is None else draft_probs.reshape(-1)  # flat view for scalar gathers
    log_norm = torch.zeros(batch, positions, dtype=torch.float64)  # [B, G+1] log Z, filled where needed
    num_accepted = torch.zeros(batch, dtype=torch.int64)
    verifying = torch.ones(batch, dtype=torch.bool)  # drafts 0..i-1 accepted and i <= n_b
    for i in range(positions):  # loop over positions; the V-sized work inside is batched over rows
        idx = verifying.nonzero().squeeze(1)
        if not idx.numel():
            break
        flat_rows = idx * positions + i
        log_norm[idx, i] = _sum_exp(logits_flat, flat_rows, row_max[idx, i], temperature).log()
        testing = idx[num_draft_tokens[idx] > i]
        verifying[idx[num_draft_tokens[idx] == i]] = False  # all drafts accepted: bonus token at i
        if testing.numel():
            x = safe_tokens[testing, i]
            logit_x = logits_flat.reshape(-1)[(testing * positions + i) * vocab_size + x].double()
            p_x = torch.exp((logit_x - row_max[testing, i].double()) / temperature - log_norm[testing, i])
            q_x = 1.0 if draft_probs is None else q_values[(testing * gamma + i) * vocab_size + x].double()
            accepted = accept_u[testing, i] * q_x < p_x
            num_accepted[testing[accepted]] += 1
            verifying[testing[~accepted]] = False
    return num_accepted, log_norm


def fast_argmax(logits: Tensor) -> Tensor:
    """argmax over the last dim, the same indices as torch.argmax (first maximum; a NaN wins): the runtime's
    multi-threaded C pass for contiguous float32 CPU logits (4x torch's single-core pass over a 262k vocabulary),
    torch.argmax elsewhere."""
    from specgate.models.native import argmax  # lazy: the sampler does not otherwise need the model runtime

    return argmax(logits)


def greedy_verify(
    draft_tokens: Tensor, num_draft_tokens: Tensor, target_logits: Tensor, *, validate: bool = True,
    target_argmax: Tensor | None = None,
) -> VerifierOutput:
    """Greedy verification: accept a draft iff it equals argmax of the target at its position.

    draft_tokens `# [B, G]`, num_draft_tokens `# [B]`, target_logits (or probs) `# [B, G+1, V]`.
    The emitted tokens are the target's argmax chain, identical to target-only greedy decoding.
    target_argmax `# [B, G+1]`: target_logits.argmax(-1) where the caller has it already (the scheduler's
    finiteness pass computes it in the same read of the logits, native.max_argmax); None computes it here.
    """
    if validate:
        if not isinstance(target_logits, Tensor) or target_logits.dim() != 3:
            raise ValueError(f"target_logits has shape {_shape(target_logits)}; expected [B, G+1, V]")
        validate_draft_inputs(draft_tokens, num_draft_tokens, target_logits.shape[-1])
        gamma = draft_tokens.shape[1]
        if tuple(target_logits.shape[:2]) != (draft_tokens.shape[0], gamma + 1):
            raise ValueError(
                f"target_logits has shape {_shape(target_logits)} but draft_tokens has shape "
                f"{_shape(draft_tokens)}; target_logits must be [B, G+1, V] = [{draft_tokens.shape[0]}, "
                f"{gamma + 1}, V]"
            )
    gamma = draft_tokens.shape[1]
    if target_argmax is None:
        target_tokens = fast_argmax(target_logits)  # [B, G+1]
    elif tuple(target_argmax.shape) != tuple(target_logits.shape[:2]) or target_argmax.dtype != torch.int64:
        raise ValueError(
            f"target_argmax has shape {_shape(target_argmax)} and dtype {target_argmax.dtype}; expected int64 "
            f"{list(target_logits.shape[:2])} (target_logits.argmax(-1)), or None to compute it here"
        )
    else:
        target_tokens = target_argmax
    if validate:  # argmax picks a NaN as the maximum: check the chosen values (free: [B, G+1] gathered)
        chosen = target_logits.gather(-1, target_tokens[..., None]).squeeze(-1)  # [B, G+1]
        _check_finite_where_used(
            chosen, num_draft_tokens,
            "used (NaN, +inf or all -inf rows have no argmax to trust: check the model's forward pass)",
        )
    valid = torch.arange(gamma, device=draft_tokens.device)[None, :] < num_draft_tokens[:, None]  # [B, G]
    num_accepted = accepted_prefix_length((draft_tokens == target_tokens[:, :gamma]) & valid)
    final = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
    return assemble_output(draft_tokens, num_accepted, final, lossless=True, mode="greedy")


def verify(
    draft_tokens: Tensor,
    num_draft_tokens: Tensor,
    draft_probs: DraftProbs,
    target_logits: Tensor,
    params: SamplingParams,
    generators: Generators = None,
    lossy: object | None = None,
    *,
    validate: bool = True,
    row_max: Tensor | None = None,
) -> VerifierOutput:
    """The engine's entry point: process target logits `# [B, G+1, V]` with params, then verify.

    draft_probs must already be processed with the same params (see processing.py). Greedy params use
    `greedy_verify` (draft_probs ignored); temperature-only params use `rejection_sample_logits` (no
    [B, G+1, V] probabilities materialised); top-k / top-p use logits_to_probs then `rejection_sample`.
    `lossy`, an object from specgate.sampling.lossy, replaces the exact test with a labelled lossy one
    (output.lossless is False). draft_probs: dense `# [B, G, V]`, a SparseProbs (read as it is on the
    temperature-only path, made dense for the others) or None. row_max `# [B, G+1]`: the logits' maxima where the
    caller has them (the temperature-only path's normaliser), or None.
    """
    temperature_only = (params.top_k == 0 or params.top_k >= target_logits.shape[-1]) and params.top_p == 1.0
    if lossy is not None or not (params.greedy or temperature_only):  # greedy ignores q; the C path reads it sparse
        draft_probs = dense_draft_probs(draft_probs, target_logits.shape[-1])
    if lossy is not None:
        if not callable(getattr(lossy, "verify", None)):
            raise ValueError(
                f"lossy={lossy!r} is not a lossy mode; pass an object from specgate.sampling.lossy or None"
            )
        target_probs = logits_to_probs(target_logits, params)
        return lossy.verify(draft_tokens, num_draft_tokens, draft_probs, target_probs, generators, validate=validate)
    if params.greedy:
        return greedy_verify(draft_tokens, num_draft_tokens, target_logits, validate=validate)
    if temperature_only:
        return rejection_sample_logits(
            draft_tokens, num_draft_tokens, draft_probs, target_logits, params.temperature, generators,
            validate=validate, row_max=row_max,
        )
    target_probs = logits_to_probs(target_logits, params)
    return rejection_sample(draft_tokens, num_draft_tokens, draft_probs, target_probs, generators, validate=validate)


def _check_finite_where_used(row_max: Tensor, num_draft_tokens: Tensor, why: str) -> None:
    """ValueError naming the first position whose maximum logit is not finite among the positions a row uses.

    row_max [B, G+1]: each position's maximum (or chosen) logit; position i of row b is used iff
    i <= num_draft_tokens[b] (its drafts' scores plus the bonus / residual position).
    """
    used = torch.arange(row_max.shape[1], device=row_max.device)[None, :] <= num_draft_tokens[:, None]  # [B, G+1]
    bad = ~torch.isfinite(row_max) & used
    if bad.any():
        b, i = bad.nonzero()[0].tolist()
        raise ValueError(f"target_logits[{b}, {i}] has maximum {row_max[b, i].item()}; logits must be finite where {why}")
