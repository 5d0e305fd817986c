"""Statistical proof that the verifier is lossless, with negative controls that must fail.

The claim tested: sequences produced by draft-then-verify have exactly the law of sampling from the target
autoregressively. The experiment makes that claim checkable:
  * each synthetic case fixes per-position target distributions p_0, p_1, ..., p_{2G} and draft distributions
    q_t over a vocabulary of 5..50 tokens; p_t does not depend on earlier tokens, so autoregressive target
    sampling gives independent tokens with marginals p_0, p_1, ... (the product law);
  * one sequence = the tokens at absolute positions 0..G, produced by chaining verifier calls: a call that
    starts at position o drafts x_i ~ q_{o+i} for the G - o positions still missing, verifies them against
    p_{o..o+G} and appends what it emits; rows that stopped early continue from where they stopped (rows with
    0, 1, ..., G drafts in the same ragged batch, so the batched path is what is tested);
  * for every position t = 0..G the emitted token's counts are tested against p_t, and the joint counts of
    the first two tokens against p_0 x p_1, with Pearson's chi-square (cells with expected count < 5 pooled;
    a token with p = 0 that is ever emitted fails the test outright, p-value 0).
Four exact samplers are tested: `rejection_sample` (probabilities), `rejection_sample_logits` (the path
verify() takes for temperature-only params: the C kernel where it is built), its torch fallback (kernel=False),
and the logits path with q handed over as a SparseProbs (what the EAGLE head drafts with: shuffled columns, some
listed twice with their mass split). Family-wise significance `significance` (default 0.01) with
Bonferroni: each test is rejected when its p-value is below significance / (number of tests on the exact
samplers). The same tests, at the same
per-test level, are run on each negative control; a control reads "fail" (caught) when any of its tests
rejects. The suite's verdict is "pass" only when no test of the exact sampler rejects AND every control is
caught (a suite that cannot fail proves nothing).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from scipy import stats
from torch import Tensor

from specgate.sampling.lossy import EntropyGatedLossy, SyntheticAcceptanceLossy, TypicalAcceptanceLossy
from specgate.sampling.verifier import (
    SparseProbs,
    VerifierOutput,
    accepted_prefix_length,
    assemble_output,
    draw_uniforms,
    gather_token_probs,
    rejection_sample,
    rejection_sample_from_uniforms,
    rejection_sample_logits,
    sample_final_tokens,
)

# sampler(draft_tokens [B, G], num_draft_tokens [B], draft_probs [B, G, V] | None, target_probs [B, G+1, V],
#         generator) -> VerifierOutput
Sampler = Callable[[Tensor, Tensor, Tensor | None, Tensor, torch.Generator], VerifierOutput]

MIN_EXPECTED_COUNT = 5.0  # chi-square cells below this expected count are pooled
_ROWS_PER_CALL = 25_000  # sequences verified in one batched call (bounds memory)


@dataclass(frozen=True)
class SyntheticCase:
    """Per-position target / draft distributions, `# [2G+1, V]` each (positions 0..2G)."""

    name: str
    kind: str
    vocab_size: int
    gamma: int
    target_table: Tensor  # [2G+1, V] float32, p_t
    draft_table: Tensor  # [2G+1, V] float32, q_t (drafts are drawn from it)
    token_only: bool = False  # verify with draft_probs=None (q one-hot), as for n-gram proposers


# ---------------------------------------------------------------------------------------------------------
# cases


def _normalise(x: Tensor) -> Tensor:
    return (x / x.sum(-1, keepdim=True)).float()


def _random_dist(rows: int, vocab: int, gen: torch.Generator, *, sharpness: float = 1.0) -> Tensor:
    """`# [rows, V]` softmax of Gaussian logits; larger sharpness gives more peaked distributions."""
    return _normalise(torch.softmax(sharpness * torch.randn(rows, vocab, generator=gen, dtype=torch.float64), -1))


def _zero_out(dist: Tensor, fraction: float, gen: torch.Generator) -> Tensor:
    """Zero a random `fraction` of each row's tokens (never all of them) and renormalise."""
    keep = torch.rand(dist.shape, generator=gen) >= fraction
    keep[torch.arange(dist.shape[0]), dist.argmax(-1)] = True
    return _normalise(dist * keep)


def build_cases(seed: int = 0) -> list[SyntheticCase]:
    """The synthetic (p, q) cases: q missing part of p's support, p with zeros, peaked and flat, disjoint
    supports, p == q, token-only proposers; vocab 5..50, G in {1, 3, 5}."""
    gen = torch.Generator().manual_seed(seed)
    specs = [  # (kind, vocab, gamma)
        ("q_misses_support", 5, 1),
        ("q_misses_support", 20, 3),
        ("p_with_zeros", 12, 5),
        ("peaked_p_flat_q", 50, 3),
        ("flat_p_peaked_q", 30, 1),
        ("similar_p_q", 8, 5),
        ("p_equals_q", 10, 3),
        ("disjoint_support", 6, 3),
        ("token_only", 10, 3),
        ("token_only_peaked", 40, 5),
        ("peaked_both", 50, 5),
    ]
    cases = []
    for kind, vocab, gamma in specs:
        rows = 2 * gamma + 1
        if kind == "q_misses_support":
            p = _random_dist(rows, vocab, gen)
            q = _zero_out(_random_dist(rows, vocab, gen), 0.4, gen)
        elif kind == "p_with_zeros":
            p = _zero_out(_random_dist(rows, vocab, gen), 0.4, gen)
            q = _random_dist(rows, vocab, gen)
        elif kind == "peaked_p_flat_q":
            p = _random_dist(rows, vocab, gen, sharpness=3.0)
            q = _normalise(torch.ones(rows, vocab))
        elif kind == "flat_p_peaked_q":
            p = _random_dist(rows, vocab, gen, sharpness=0.3)
            q = _random_dist(rows, vocab, gen, sharpness=3.0)
        elif kind == "similar_p_q":
            p = _random_dist(rows, vocab, gen, sharpness=2.0)
            q = _normalise(p * torch.exp(0.3 * torch.randn(rows, vocab, generator=gen)))
        elif kind == "p_equals_q":
            p = _random_dist(rows, vocab, gen)
            q = p.clone()
        elif kind == "disjoint_support":
            half = torch.arange(vocab) < vocab // 2
            p = _normalise(_random_dist(rows, vocab, gen) * half)
            q = _normalise(_random_dist(rows, vocab, gen) * ~half)
        elif kind in ("token_only", "token_only_peaked"):
            sharp = 3.0 if kind == "token_only_peaked" else 1.0
            p = _random_dist(rows, vocab, gen, sharpness=sharp)
            q = _random_dist(rows, vocab, gen, sharpness=sharp)
        else:  # peaked_both
            p = _random_dist(rows, vocab, gen, sharpness=3.0)
            q = _random_dist(rows, vocab, gen, sharpness=3.0)
        name = f"{kind}/V{vocab}/G{gamma}"
        cases.append(SyntheticCase(name, kind, vocab, gamma, p, q, token_only=kind.startswith("token_only")))
    return cases


# ---------------------------------------------------------------------------------------------------------
# the experiment


def _rows_of(table: Tensor, positions: Tensor) -> Tensor:
    """table `# [P, V]` rows at positions `# [A, K]` -> `# [A, K, V]`."""
    return table.index_select(0, positions.reshape(-1)).view(*positions.shape, table.shape[1])


def _sample_drafts(cdf_table: Tensor, positions: Tensor, generator: torch.Generator) -> Tensor:
    """One independent inverse-CDF draw per entry of positions `# [A, G]` from cdf_table `# [P, V]`."""
    uniforms = torch.rand(positions.shape[0], cdf_table.shape[0], dtype=torch.float64, generator=generator)
    total = cdf_table[:, -1]  # [P]
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total))).T.contiguous()  # [P, A]
    per_position = torch.stack(  # [A, P] a draw for every absolute position; keep the ones asked for
        [torch.searchsorted(cdf_table[t], target[t], right=True) for t in range(cdf_table.shape[0])], dim=1
    )
    return per_position.gather(1, positions)


def generate_sequences(case: SyntheticCase, sampler: Sampler, num_samples: int, generator: torch.Generator) -> Tensor:
    """Tokens at absolute positions 0..G of `num_samples` sequences, `# [N, G+1]`, by chaining verifier calls."""
    gamma = case.gamma
    draft_cdf = case.draft_table.double().cumsum(-1)  # [2G+1, V]
    tokens = torch.full((num_samples, gamma + 1), -1, dtype=torch.int64)
    for start in range(0, num_samples, _ROWS_PER_CALL):
        rows = torch.arange(start, min(start + _ROWS_PER_CALL, num_samples))
        offset = torch.zeros(rows.shape[0], dtype=torch.int64)  # next position each row still needs
        active = torch.arange(rows.shape[0])
        while active.numel():
            positions = offset[active, None] + torch.arange(gamma + 1)  # [A, G+1]
            target_probs = _rows_of(case.target_table, positions)  # [A, G+1, V]
            draft_dist = _rows_of(case.draft_table, positions[:, :gamma])  # [A, G, V]
            drafts = _sample_drafts(draft_cdf, positions[:, :gamma], generator)  # [A, G], x_i ~ q_{o+i}
            num_drafts = gamma - offset[active]  # [A] only the positions still missing up to G
            draft_probs = None if case.token_only else draft_dist
            result = sampler(drafts, num_drafts, draft_probs, target_probs, generator)
            emitted = result.num_accepted + 1  # [A]
            for k in range(gamma + 1):  # copy emitted token k of each row to its absolute position
                has_k = emitted > k
                tokens[rows[active[has_k]], offset[active[has_k]] + k] = result.output_tokens[has_k, k]
            offset[active] += emitted
            active = active[offset[active] <= gamma]
    return tokens


def chi_square_test(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int, float]:
    """Pearson's chi-square of observed `counts` against `probs` (same shape, flattened).

    Cells with expected count < MIN_EXPECTED_COUNT are pooled; an observation in a zero-probability cell
    gives (inf, dof, 0.0). Returns (statistic, degrees of freedom, p-value).
    """
    counts = counts.ravel().astype(np.float64)
    probs = probs.ravel().astype(np.float64)
    probs = probs / probs.sum()
    expected = counts.sum() * probs
    possible = probs > 0
    dof_full = max(int(possible.sum()) - 1, 0)
    if counts[~possible].sum() > 0:
        return math.inf, dof_full, 0.0
    observed, expected = counts[possible], expected[possible]
    sparse = expected < MIN_EXPECTED_COUNT
    if sparse.any():
        observed = np.append(observed[~sparse], observed[sparse].sum())
        expected = np.append(expected[~sparse], expected[sparse].sum())
        if expected[-1] < MIN_EXPECTED_COUNT and expected.shape[0] > 1:  # still sparse: merge into smallest
            smallest = int(np.argmin(expected[:-1]))
            observed[smallest] += observed[-1]
            expected[smallest] += expected[-1]
            observed, expected = observed[:-1], expected[:-1]
    dof = expected.shape[0] - 1
    if dof < 1:
        return 0.0, 0, 1.0
    statistic = float(((observed - expected) ** 2 / expected).sum())
    return statistic, dof, float(stats.chi2.sf(statistic, dof))


def case_tests(case: SyntheticCase, tokens: Tensor) -> list[dict]:
    """The chi-square tests of one case: every position's marginal, and the first two tokens' joint."""
    vocab = case.vocab_size
    p = case.target_table.double().numpy()
    results = []
    for t in range(case.gamma + 1):
        counts = np.bincount(tokens[:, t].numpy(), minlength=vocab)
        statistic, dof, p_value = chi_square_test(counts, p[t])
        results.append({"test": f"position {t}", "statistic": statistic, "dof": dof, "p_value": p_value})
    joint_counts = np.bincount((tokens[:, 0] * vocab + tokens[:, 1]).numpy(), minlength=vocab * vocab)
    statistic, dof, p_value = chi_square_test(joint_counts, np.outer(p[0], p[1]))
    results.append({"test": "joint 0,1", "statistic": statistic, "dof": dof, "p_value": p_value})
    for r in results:
        r.update(case=case.name, vocab=vocab, gamma=case.gamma, name=f"{case.name}: {r['test']}")
    return results


# ---------------------------------------------------------------------------------------------------------
# samplers: the exact one and the broken / lossy controls


def exact_sampler(draft_tokens, num_draft_tokens, draft_probs, target_probs, generator) -> VerifierOutput:
    """The verifier under test (public API, with input validation)."""
    return rejection_sample(draft_tokens, num_draft_tokens, draft_probs, target_probs, generator)


def exact_logits_sampler(draft_tokens, num_draft_tokens, draft_probs, target_probs, generator) -> VerifierOutput:
    """The verifier's logits path (what verify() runs for temperature-only params), fed log p (log 0 = -inf)."""
    return rejection_sample_logits(draft_tokens, num_draft_tokens, draft_probs, target_probs.log(), 1.0, generator)


def as_sparse(draft_probs: Tensor) -> SparseProbs:
    """q `# [B, G, V]` as a SparseProbs over every column in a shuffled order, its first V // 4 columns listed twice
    with half the mass in each entry (a repeated column adds up): the form the EAGLE head's q takes, made harder."""
    vocab = draft_probs.shape[-1]
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(vocab))
    repeated = order[: max(1, vocab // 4)]
    values = torch.cat([draft_probs[..., order], draft_probs[..., repeated]], dim=-1)  # [B, G, V + V // 4]
    values[..., : repeated.numel()] *= 0.5
    values[..., vocab:] *= 0.5
    return SparseProbs(values, torch.cat([order, repeated]))


def exact_sparse_logits_sampler(draft_tokens, num_draft_tokens, draft_probs, target_probs, generator) -> VerifierOutput:
    """The logits path with q as a SparseProbs (as_sparse)."""
    q = None if draft_probs is None else as_sparse(draft_probs)
    return rejection_sample_logits(draft_tokens, num_draft_tokens, q, target_probs.log(), 1.0, generator)


def exact_torch_logits_sampler(draft_tokens, num_draft_tokens, draft_probs, target_probs, generator) -> VerifierOutput:
    """The logits path in torch (kernel=False: what runs where the C kernels do not build)."""
    return rejection_sample_logits(draft_tokens, num_draft_tokens, draft_probs, target_probs.log(), 1.0, generator, kernel=False)


def exact_samplers() -> dict[str, Sampler]:
    """The exact samplers under test: the probability path, the logits path (C where built, and torch), the logits
    path with a sparse q."""
    return {"rejection_sample": exact_sampler, "rejection_sample_logits": exact_logits_sampler,
            "rejection_sample_logits, torch": exact_torch_logits_sampler,
            "rejection_sample_logits, SparseProbs q": exact_sparse_logits_sampler}


def shared_uniform_sampler(draft_tokens, num_draft_tokens, draft_probs, target_probs, generator) -> VerifierOutput:
    """BROKEN: the residual token reuses the uniform that rejected the draft (a bug seen in a real engine)."""
    gamma = draft_tokens.shape[1]
    accept_u, sample_u = draw_uniforms(num_draft_tokens, gamma, generator)
    valid = torch.arange(gamma)[None, :] < num_draft_tokens[:, None]
    tokens = torch.where(valid, draft_tokens, 0)
    q_draft = torch.ones_like(accept_u) if draft_probs is None else gather_token_probs(draft_probs, tokens)
    accepted = (accept_u * q_draft < gather_token_probs(target_probs[:, :gamma], tokens)) & valid
    num_accepted = accepted_prefix_length(accepted)
    rejected = num_accepted < num_draft_tokens
    rejecting_u = accept_u.gather(1, num_accepted.clamp(max=max(gamma - 1, 0))[:, None]).squeeze(1)
    shared_u = torch.where(rejected, rejecting_u, sample_u)
    final = sample_final_tokens(target_probs, draft_probs, tokens, num_accepted, rejected, shared_u)
    return assemble_output(draft_tokens, num_accepted, final, lossless=False, mode="shared_uniform_bug")


def unnormalised_residual_sampler(
    draft_tokens, num_draft_tokens, draft_probs, target_probs, generator
) -> VerifierOutput:
    """BROKEN: inverse CDF over the unnormalised residual (p - q)+; mass it lacks falls on the last token."""
    gamma, vocab = draft_tokens.shape[1], target_probs.shape[-1]
    exact = rejection_sample(draft_tokens, num_draft_tokens, draft_probs, target_probs, generator)
    rejected = (exact.num_accepted < num_draft_tokens).nonzero().squeeze(1)
    if rejected.numel():
        stop = exact.num_accepted[rejected]
        p_rows = target_probs[rejected, stop].double()  # [R, V]
        if draft_probs is None:
            residual = p_rows.scatter(1, draft_tokens[rejected, stop][:, None], 0.0)
        else:
            residual = (p_rows - draft_probs[rejected, stop.clamp(max=gamma - 1)].double()).clamp(min=0)
        u = torch.rand(rejected.shape[0], dtype=torch.float64, generator=generator)
        token = torch.searchsorted(residual.cumsum(-1), u[:, None], right=True).squeeze(1).clamp(max=vocab - 1)
        exact.output_tokens[rejected, stop] = token
    exact.lossless, exact.mode = False, "unnormalised_residual_bug"
    return exact


def swapped_sampler(draft_tokens, num_draft_tokens, draft_probs, target_probs, generator) -> VerifierOutput:
    """BROKEN: p and q swapped (accept with min(1, q/p), residual (q - p)+); the bonus still comes from p."""
    gamma = draft_tokens.shape[1]
    if draft_probs is None:  # a token-only proposer's q is the one-hot at its draft
        draft_probs = torch.zeros_like(target_probs[:, :gamma]).scatter_(-1, draft_tokens[..., None].clamp(min=0), 1.0)
    accept_u, sample_u = draw_uniforms(num_draft_tokens, gamma, generator)
    swapped_target = torch.cat([draft_probs, target_probs[:, gamma:]], dim=1)  # [B, G+1, V]
    out = rejection_sample_from_uniforms(
        draft_tokens, num_draft_tokens, target_probs[:, :gamma], swapped_target, accept_u, sample_u
    )
    out.lossless, out.mode = False, "swapped_p_q_bug"
    return out


def dropped_repeat_sampler(draft_tokens, num_draft_tokens, draft_probs, target_probs, generator) -> VerifierOutput:
    """BROKEN: a sparse q whose repeated columns keep only their first entry (half their mass), as a conversion that
    overwrites instead of adding would; unvalidated, since the rows no longer sum to 1."""
    q = None
    if draft_probs is not None:
        q = as_sparse(draft_probs)
        q.values[..., draft_probs.shape[-1] :] = 0.0
    out = rejection_sample_logits(draft_tokens, num_draft_tokens, q, target_probs.log(), 1.0, generator, validate=False)
    out.lossless, out.mode = False, "dropped_repeated_column_bug"
    return out


def _lossy_sampler(mode) -> Sampler:
    def sampler(draft_tokens, num_draft_tokens, draft_probs, target_probs, generator) -> VerifierOutput:
        return mode.verify(draft_tokens, num_draft_tokens, draft_probs, target_probs, generator)

    return sampler


def negative_controls() -> dict[str, Sampler]:
    """Samplers the suite must reject: three real-world bugs and every lossy mode."""
    return {
        "shared_uniform_accept_and_residual": shared_uniform_sampler,
        "unnormalised_residual": unnormalised_residual_sampler,
        "p_q_swapped": swapped_sampler,
        "sparse_q_repeated_column_dropped": dropped_repeat_sampler,
        "typical_acceptance_lossy": _lossy_sampler(TypicalAcceptanceLossy()),
        "synthetic_acceptance_lossy": _lossy_sampler(SyntheticAcceptanceLossy(rates=(0.7,))),
        "entropy_gated_lossy": _lossy_sampler(EntropyGatedLossy(entropy_threshold=0.5, top_k=3)),
    }


# ---------------------------------------------------------------------------------------------------------
# the suite


def _run_all(runs, cases, num_samples, seed, progress_bar, results) -> None:
    task = progress_bar.add_task("lossless suite", total=len(runs) * len(cases))
    for run_index, (run_name, sampler) in enumerate(runs):
        results[run_name] = []
        for case_index, case in enumerate(cases):
            progress_bar.update(task, description=f"{run_name}: {case.name}")
            generator = torch.Generator().manual_seed(seed * 1_000_003 + run_index * 1_000 + case_index)
            tokens = generate_sequences(case, sampler, num_samples, generator)
            results[run_name].extend(case_tests(case, tokens))
            progress_bar.advance(task)


def run_synthetic_suite(
    num_samples: int = 100_000, significance: float = 0.01, seed: int = 0, progress: bool = True
) -> dict:
    """Run every case on the exact sampler and on each negative control; return the verdicts.

    Keys: verdict ("pass"/"fail"), significance, num_tests, per_test_alpha, num_samples, seed, runtime_s,
    cases (one entry per test: name, case, test, vocab, gamma, statistic, dof, p_value, verdict),
    negative_controls (name, verdict ("fail" = caught), tests_rejected, num_tests, min_p_value, caught_by),
    controls_caught (bool).
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1_000:
        raise ValueError(f"num_samples={num_samples!r} is out of range: use an integer >= 1000 (default 100000)")
    if not (0.0 < significance < 1.0):
        raise ValueError(f"significance={significance} is out of range: use a level in (0, 1), e.g. 0.01")
    started = time.perf_counter()
    cases = build_cases(seed)
    controls = negative_controls()
    exact = exact_samplers()
    num_tests = len(exact) * sum(case.gamma + 2 for case in cases)
    per_test_alpha = significance / num_tests
    runs = list(exact.items()) + list(controls.items())

    progress_bar = Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=Console(stderr=True), disable=not progress, transient=True,
    )
    results: dict[str, list[dict]] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tensors here are small (V <= 50): intra-op threads only add contention
    try:
        with progress_bar:
            _run_all(runs, cases, num_samples, seed, progress_bar, results)
    finally:
        torch.set_num_threads(threads)

    for tests in results.values():
        for r in tests:
            r["verdict"] = "fail" if r["p_value"] < per_test_alpha else "pass"
    case_results = []
    for name in exact:
        for r in results.pop(name):
            case_results.append({**r, "name": f"{name} | {r['name']}", "sampler": name})
    control_results = []
    for name, tests in results.items():
        rejected = [r["name"] for r in tests if r["verdict"] == "fail"]
        control_results.append({
            "name": name,
            "verdict": "fail" if rejected else "pass",
            "tests_rejected": len(rejected),
            "num_tests": len(tests),
            "min_p_value": min(r["p_value"] for r in tests),
            "caught_by": rejected[:3],
        })
    exact_passes = all(r["verdict"] == "pass" for r in case_results)
    controls_caught = all(c["verdict"] == "fail" for c in control_results)
    return {
        "verdict": "pass" if exact_passes and controls_caught else "fail",
        "significance": significance,
        "num_tests": num_tests,
        "per_test_alpha": per_test_alpha,
        "num_samples": num_samples,
        "seed": seed,
        "runtime_s": time.perf_counter() - started,
        "cases": case_results,
        "negative_controls": control_results,
        "controls_caught": controls_caught,
    }
