"""Is speculative sampling with a real target and drafter lossless? A chi-square check at fixed prefixes.

For each prefix, N independent engine runs are simulated as one batch of N identical rows: one draft ->
score -> verify step (the same drafters and the real verifier the engine uses), and a second step for the
rows whose first step emitted only one token. That gives N samples of the next emitted token x1 and of the
next two tokens (x1, x2). Tests, each at significance / (number of tests) (Bonferroni):
- goodness of fit of x1 against the target's processed softmax p(x1 | prefix), and of (x1, x2) against
  p(x1 | prefix) p(x2 | prefix, x1) (chi-square; cells with expected count < 5 pooled into one "rest" cell;
  the second token is kept apart only for the most likely first tokens);
- two-sample chi-square of the same cells against target-only sampling (the verifier with 0 drafts);
- any outcome the target gives probability exactly 0 (e.g. outside top-k) fails outright.
Negative controls go through the same tests and must fail: the verifier given a q that is not the one the
drafts were sampled from (uniform q: the bug HF had several times), and the lossy modes available in
specgate.sampling.lossy. The target logits are scored once per distinct row and processed once (the verifier
sees exactly what verify() would pass it), which keeps Gemma's 262k vocabulary affordable.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from scipy import stats as scipy_stats
from torch import Tensor

from specgate.models.native import QUANT_MAX_ROWS

DEFAULT_PREFIXES: tuple[str, ...] = (
    "The cat sat on the mat. The cat sat on the",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return",
    "Once upon a time, there was a",
)
MIN_EXPECTED = 10.0  # chi-square cells with fewer expected draws are pooled (5 gave false alarms at N = 4000)
MAX_FIRST_TOKENS = 8  # first tokens whose second-token distribution is tested apart
MEMORY_FLOATS = 1 << 24  # rows per verifier call are chosen to keep [C, G+1, V] under ~64 MB


@dataclass
class Sampler:
    """One way of producing the next tokens: a drafter kind plus the verifier's mode."""

    name: str
    gamma: int
    lossy: Any = None  # a specgate.sampling.lossy mode (negative control) or None (exact)
    wrong_q: bool = False  # negative control: tell the verifier q is uniform instead of the drafts' real q


class _Pair:
    """Target + drafter with batched helpers: target probabilities, drafts for many rows, one verify step."""

    def __init__(self, target: Any, drafter: Any, params: Any, generator: torch.Generator) -> None:
        self.target, self.drafter, self.params, self.generator = target, drafter, params, generator
        self.vocab_size = int(target.model.vocab_size)

    def target_logits(self, rows: Tensor, last: int) -> Tensor:
        """Logits of the last `last` positions of rows [U, T] -> [U, last, V]. The tokens every row starts with
        (before the last `last`) are prefilled once and their K/V copied into each chunk's cache, as the engine
        prefills a prompt once and then verifies; only the remaining positions run per row."""
        model, (num_rows, length) = self.target.model, rows.shape
        same = (rows == rows[:1]).all(0).long()  # [T] 1 where every row has the first row's token
        shared = min(int(same.cumprod(0).sum()), length - last)
        prefix = None
        if shared > 0:
            prefix = model.new_cache(1, length)
            model.forward(rows[:1, :shared], torch.arange(shared)[None], prefix, torch.tensor([0]), logits=False)
        width = length - shared
        # rows x width within the C kernels' row limit: past it a forward de-quantises the weights chunk by chunk
        chunk = max(1, min(num_rows, 4 * MEMORY_FLOATS // max(1, width * self.vocab_size), QUANT_MAX_ROWS // max(1, width)))
        out = []
        for begin in range(0, num_rows, chunk):
            ids = rows[begin : begin + chunk, shared:]  # [C, T - shared]
            cache = model.new_cache(ids.shape[0], length)
            if prefix is not None:
                for mine, theirs in zip(cache.keys + cache.values, prefix.keys + prefix.values):
                    mine[:, :, :shared] = theirs[:1, :, :shared]
            positions = torch.arange(shared, length, dtype=torch.int64)[None].expand(ids.shape[0], width)  # [C, T - shared]
            slots = torch.arange(ids.shape[0], dtype=torch.int64)  # [C]
            out.append(model.forward(ids, positions, cache, slots)[:, width - last :].float())
        return torch.cat(out)

    def next_probs(self, rows: Tensor) -> Tensor:
        """Processed target distribution after each row [U, T] -> [U, V]."""
        from specgate.sampling import logits_to_probs

        return logits_to_probs(self.target_logits(rows, 1)[:, 0], self.params)

    def drafts(self, contexts: Tensor, gamma: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """Drafts for contexts [B, T]: tokens [B, G], counts [B], q [B, G, V] or None (one-hot). A drafter that samples
        (a draft model, the EAGLE head) drafts every row through its sample_batch; a lookup drafter once per context."""
        batch = contexts.shape[0]
        if gamma == 0 or self.drafter.name == "none":
            return torch.zeros(batch, 0, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64), None
        if hasattr(self.drafter, "sample_batch"):  # tokens -1 past a row's drafts (the EAGLE drafter's short lookups)
            tokens, draft_probs = self.drafter.sample_batch(contexts, gamma, self.params, self.generator)
            return tokens.clamp(min=0), (tokens >= 0).sum(1), draft_probs
        # a lookup drafter is a deterministic function of the context: draft once per distinct context
        unique, inverse = torch.unique(contexts, dim=0, return_inverse=True)
        tokens = torch.zeros(unique.shape[0], gamma, dtype=torch.int64)  # [U, G]
        counts = torch.zeros(unique.shape[0], dtype=torch.int64)  # [U]
        for row in range(unique.shape[0]):
            self.drafter.begin(unique[row], self.params, self.generator, unique.shape[1] + gamma + 1)
            proposal = self.drafter.propose(unique[row], gamma)
            tokens[row, : proposal.num_tokens], counts[row] = proposal.tokens, proposal.num_tokens
        return tokens[inverse], counts[inverse], None

    def step(self, contexts: Tensor, sampler: Sampler) -> tuple[Tensor, Tensor]:
        """One engine step for every row of contexts [B, T]: emitted tokens [B, G+1] (-1 pad), accepted [B].

        The target is scored once per distinct (context, drafts) row and its logits processed once, exactly as
        verify() would; the rows then go through the real sampler (rejection_sample, or the lossy mode's
        verify) in chunks. Columns where p, q and the drafts are all zero cannot be emitted or change any
        decision, so they are dropped when that shrinks the vocabulary (top-k / top-p): an exact shortcut.
        """
        from specgate.sampling import logits_to_probs, rejection_sample

        rows_per_call = max(1, 8 * MEMORY_FLOATS // ((sampler.gamma + 1) * self.vocab_size))
        if contexts.shape[0] > rows_per_call:  # q and p are [B, G(+1), V]: a real vocabulary needs them in slices
            parts = [self.step(contexts[begin : begin + rows_per_call], sampler) for begin in range(0, contexts.shape[0], rows_per_call)]
            width = max(out.shape[1] for out, _ in parts)
            out = torch.cat([F.pad(out, (0, width - out.shape[1]), value=-1) for out, _ in parts])
            return out, torch.cat([accepted for _, accepted in parts])
        tokens, counts, draft_probs = self.drafts(contexts, sampler.gamma)  # [B, G], [B], [B, G, V] | None
        gamma = tokens.shape[1]
        rows, inverse = torch.unique(torch.cat([contexts, tokens], 1), dim=0, return_inverse=True)
        target_probs = logits_to_probs(self.target_logits(rows, gamma + 1), self.params)  # [U, G+1, V]
        columns = self._support(target_probs, draft_probs, tokens, counts)  # [K] kept vocabulary ids
        if sampler.wrong_q and gamma > 0:  # q uniform over the kept columns: not what the drafts came from
            support = self.vocab_size if columns is None else columns.numel()
            draft_probs = torch.zeros(1, gamma, self.vocab_size)
            draft_probs[..., slice(None) if columns is None else columns] = 1.0 / support
            draft_probs = draft_probs.expand(len(tokens), -1, -1)
        if columns is not None:
            lookup = torch.full((self.vocab_size,), -1, dtype=torch.int64)
            lookup[columns] = torch.arange(columns.numel())
            target_probs = target_probs[..., columns]
            draft_probs = None if draft_probs is None else draft_probs[..., columns]
            tokens = lookup[tokens]  # unused padding may become -1, which the verifier allows
        vocab = target_probs.shape[-1]
        chunk = max(1, MEMORY_FLOATS // ((gamma + 1) * vocab))
        outputs, accepted = [], []
        for begin in range(0, contexts.shape[0], chunk):
            part = slice(begin, begin + chunk)
            row_probs = target_probs[inverse[part]]  # [C, G+1, V]
            row_q = None if draft_probs is None else draft_probs[part]
            validate = begin == 0  # inputs are built the same way for every chunk: check the first
            if sampler.lossy is None:
                result = rejection_sample(tokens[part], counts[part], row_q, row_probs, self.generator, validate=validate)
            else:  # what verify(..., lossy=mode) does after processing the logits
                result = sampler.lossy.verify(tokens[part], counts[part], row_q, row_probs, self.generator, validate=validate)
            outputs.append(result.output_tokens)
            accepted.append(result.num_accepted)
        out = torch.cat(outputs)
        if columns is not None:
            out = torch.where(out >= 0, columns[out.clamp(min=0)], out)
        return out, torch.cat(accepted)

    def _support(self, target_probs: Tensor, draft_probs: Tensor | None, tokens: Tensor, counts: Tensor) -> Tensor | None:
        """Vocabulary ids where any p or q is non-zero or a draft sits, if that is under half the vocabulary."""
        used = (target_probs > 0).flatten(0, 1).any(0)  # [V]
        if draft_probs is not None:
            used |= (draft_probs > 0).flatten(0, 1).any(0)
        valid = torch.arange(tokens.shape[1])[None, :] < counts[:, None]  # [B, G]
        used[tokens[valid]] = True
        columns = used.nonzero()[:, 0]
        return columns if columns.numel() * 2 <= self.vocab_size else None

    def two_tokens(self, prefix: Tensor, num_samples: int, sampler: Sampler, follow: Tensor) -> tuple[Tensor, Tensor]:
        """x1 [N] and x2 [N] (x2 = -1 where x1 is not in `follow`: those rows are pooled, x2 not needed)."""
        contexts = prefix[None].expand(num_samples, -1)  # [N, T]
        out, accepted = self.step(contexts, sampler)
        first = out[:, 0]
        second = torch.full_like(first, -1)
        if out.shape[1] > 1:  # rows that accepted a draft emitted their second token in the same step
            second = torch.where(accepted >= 1, out[:, 1], second)
        needed = (accepted == 0) & torch.isin(first, follow)  # rows that need a second engine step
        if bool(needed.any()):
            more = torch.cat([contexts[needed], first[needed, None]], 1)  # [B2, T+1]
            second[needed] = self.step(more, sampler)[0][:, 0]
        second[~torch.isin(first, follow)] = -1
        return first, second


def _cells(expected_probs: dict[int, float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Cell keys with expected count >= MIN_EXPECTED and their probabilities (the rest is pooled)."""
    keys = np.array([k for k, v in expected_probs.items() if v * num_samples >= MIN_EXPECTED], dtype=np.int64)
    probs = np.array([expected_probs[int(k)] for k in keys], dtype=np.float64)
    return keys, probs


def _counts(codes: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Observed counts of each key and of the rest (last entry)."""
    counts = np.array([np.count_nonzero(codes == k) for k in keys], dtype=np.float64) if len(keys) < 64 else (
        np.bincount(np.searchsorted(keys, codes[np.isin(codes, keys)]), minlength=len(keys)).astype(np.float64)
    )
    return np.append(counts, len(codes) - counts.sum())


def _goodness_of_fit(codes: np.ndarray, expected_probs: dict[int, float], impossible: int) -> tuple[float, float, int]:
    """Chi-square of codes [N] against expected_probs; `impossible` draws had probability 0 -> p = 0."""
    num_samples = len(codes)
    keys, probs = _cells(expected_probs, num_samples)
    order = np.argsort(keys)
    keys, probs = keys[order], probs[order]
    observed = _counts(codes, keys)
    expected = np.append(probs, max(0.0, 1.0 - probs.sum())) * num_samples
    if expected[-1] < MIN_EXPECTED and len(keys):  # pool a thin rest cell into the smallest kept cell
        smallest = int(np.argmin(expected[:-1]))
        observed[smallest] += observed[-1]
        expected[smallest] += expected[-1]
        observed, expected = observed[:-1], expected[:-1]
    if impossible:
        return float("inf"), 0.0, len(observed) - 1
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    return statistic, float(scipy_stats.chi2.sf(statistic, dof)) if dof > 0 else 1.0, dof


def _two_sample(codes_a: np.ndarray, codes_b: np.ndarray, expected_probs: dict[int, float]) -> tuple[float, float, int]:
    """Chi-square test of homogeneity of two samples over the same cells (target-expected >= 5, rest pooled)."""
    keys, _ = _cells(expected_probs, len(codes_a))
    keys = np.sort(keys)
    table = np.stack([_counts(codes_a, keys), _counts(codes_b, keys)])  # [2, K+1]
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 0.0, 1.0, 0
    statistic, p_value, dof, _ = scipy_stats.chi2_contingency(table, correction=False)
    return float(statistic), float(p_value), int(dof)


def _encode(prefix: str | list[int], tokenizer: Any) -> Tensor:
    from specgate.engine.generate import encode_prompt

    return encode_prompt(prefix, tokenizer)


def _lossy_controls() -> list[tuple[str, Any]]:
    """Labelled lossy modes of specgate.sampling.lossy that bias any drafter that proposes (each must be caught)."""
    from specgate.sampling.lossy import SyntheticAcceptanceLossy, TypicalAcceptanceLossy

    return [
        ("lossy: typical acceptance (Medusa, eps 0.09, delta 0.3)", TypicalAcceptanceLossy()),
        ("lossy: synthetic acceptance (rate 0.9)", SyntheticAcceptanceLossy(rates=(0.9,))),
    ]


def run_model_check(
    target: str | Any,
    draft: str,
    *,
    gamma: int = 4,
    num_samples: int = 20_000,
    seed: int = 0,
    significance: float = 0.01,
    progress: bool = False,
    temperature: float = 1.0,
    top_k: int = 50,
    top_p: float = 1.0,
    prefixes: list[str | list[int]] | None = None,
) -> dict[str, Any]:
    """Chi-square check that speculative sampling with (target, draft) follows the target's distribution.

    target: a model name/path or a LoadedModel; draft: a drafter spec ("ngram", a draft model path, "default").
    Sampling defaults to temperature 1 with top-k 50 (transformers' sampling default); the guarantee, and the
    test, are for the processed distributions. Top-k also lets the check drop the vocabulary columns nothing can
    reach, which is what makes 20,000 draws on Gemma's 262k vocabulary take seconds; with top_k=0 every
    verifier call handles the full vocabulary (minutes on a 2-core CPU).
    Returns {verdict, cases [{name, statistic, dof, p_value, verdict}], negative_controls [{name, verdict, ...}],
    ...}. verdict is "pass" iff every case passes at significance / len(cases) and every negative control is
    caught ("fail": at least one of its tests rejects at that same per-test level).
    """
    from specgate.drafting import make_drafter
    from specgate.models import load_model
    from specgate.sampling import SamplingParams

    _check_settings(gamma, num_samples, significance)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    if params.greedy:
        raise ValueError("temperature=0 is greedy: the lossless check needs sampling (temperature > 0); greedy exactness is tested token for token")
    target_model = load_model(target) if isinstance(target, str) else target
    drafter = make_drafter(draft, target_model)
    if drafter.name == "none":
        raise ValueError("--draft none proposes nothing, so there is nothing to check: use --draft ngram or a draft model")
    generator = torch.Generator().manual_seed(seed)
    pair = _Pair(target_model, drafter, params, generator)
    prefix_ids = [_encode(p, target_model.tokenizer) for p in (prefixes or list(DEFAULT_PREFIXES))]

    samplers = [Sampler("speculative", gamma), Sampler("target-only", 0)]
    controls = [Sampler("wrong q: verifier told q is uniform over p's support, not the draft's distribution", gamma, wrong_q=True)]
    controls += [Sampler(name, gamma, lossy=mode) for name, mode in _lossy_controls()]

    cases, control_cases = [], {c.name: [] for c in controls}
    with _progress_bar(progress) as bar, torch.inference_mode():
        task = bar.add_task("lossless check", total=len(prefix_ids) * (len(samplers) + len(controls))) if progress else None
        for index, prefix in enumerate(prefix_ids):
            cells = _PrefixCells.of(pair, prefix, num_samples)
            samples = {}
            for sampler in samplers + controls:
                samples[sampler.name] = cells.codes(*pair.two_tokens(prefix, num_samples, sampler, cells.follow))
                if task is not None:
                    bar.advance(task)
            _add_tests(f"prefix {index}", cells, samples, controls, cases, control_cases)

    per_test = significance / (4 * len(prefix_ids))  # 4 tests per prefix: 2 kinds x (softmax, target-only sampling)
    negative_controls = _verdicts(cases, control_cases, per_test)
    ok = all(c["verdict"] == "pass" for c in cases) and all(c["verdict"] == "fail" for c in negative_controls)
    return dict(
        verdict="pass" if ok else "fail",
        target=getattr(target_model, "name", str(target)),
        draft=drafter.name,
        gamma=gamma,
        num_samples=num_samples,
        seed=seed,
        sampling=dict(temperature=temperature, top_k=top_k, top_p=top_p),
        significance=significance,
        per_test_significance=per_test,
        prefixes=[p.tolist() for p in prefix_ids],
        cases=cases,
        negative_controls=negative_controls,
    )


def _progress_bar(show: bool) -> Any:
    """A transient rich progress bar if show, else a context that yields None."""
    if not show:
        return contextlib.nullcontext()
    from rich.progress import Progress

    return Progress(transient=True)


def _check_settings(gamma: int, num_samples: int, significance: float) -> None:
    if gamma < 1:
        raise ValueError(f"gamma={gamma} is invalid for the lossless check: use gamma >= 1 (drafts must be verified)")
    if num_samples < 100:
        raise ValueError(f"num_samples={num_samples} is too small: use >= 100 (e.g. 20000) for a meaningful test")
    if not 0.0 < significance < 1.0:
        raise ValueError(f"significance={significance} is outside (0, 1): use e.g. 0.01")


@dataclass
class _PrefixCells:
    """One prefix's target distributions and the cells its tests count: the next token (p1), the next two tokens
    after each frequent first token (follow, p2), each cell with its expected probability (>= MIN_EXPECTED draws)."""

    p1: Tensor  # [V] target probabilities of the next token
    follow: Tensor  # [F] the first tokens whose second token is tested jointly
    p2: Tensor  # [F, V] target probabilities of the second token after each of follow
    vocab: int
    next_expected: dict[int, float]  # next token -> probability
    joint_expected: dict[int, float]  # first * vocab + second -> probability

    @staticmethod
    def of(pair: _Pair, prefix: Tensor, num_samples: int) -> "_PrefixCells":
        p1 = pair.next_probs(prefix[None])[0].double()  # [V]
        follow = torch.argsort(p1, descending=True)[:MAX_FIRST_TOKENS]
        follow = follow[p1[follow] * num_samples >= 4 * MIN_EXPECTED]
        p2 = pair.next_probs(torch.cat([prefix[None].expand(len(follow), -1), follow[:, None]], 1)).double()  # [F, V]
        vocab = pair.vocab_size
        next_expected = {int(t): float(p1[t]) for t in torch.nonzero(p1 * num_samples >= MIN_EXPECTED)[:, 0]}
        joint_expected: dict[int, float] = {}
        for f, first in enumerate(follow.tolist()):
            for second in torch.nonzero(p1[first] * p2[f] * num_samples >= MIN_EXPECTED)[:, 0].tolist():
                joint_expected[first * vocab + second] = float(p1[first] * p2[f, second])
        return _PrefixCells(p1, follow, p2, vocab, next_expected, joint_expected)

    def codes(self, first: Tensor, second: Tensor) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Next-token codes, joint codes (-1 = pooled first token) and counts of impossible draws."""
        impossible_first = int((self.p1[first] == 0).sum())
        joint = torch.full_like(first, -1)
        impossible_joint = impossible_first
        for f, token in enumerate(self.follow.tolist()):
            rows = first == token
            joint[rows] = token * self.vocab + second[rows]
            impossible_joint += int((self.p2[f][second[rows]] == 0).sum())
        return first.numpy(), joint.numpy(), impossible_first, impossible_joint


def _add_tests(label: str, cells: _PrefixCells, samples: dict, controls: list[Sampler], cases: list[dict], control_cases: dict[str, list]) -> None:
    """One prefix's tests: per kind (next token, next two tokens), the speculative sample against the target's
    softmax and against target-only sampling (into cases), and each control against the softmax (control_cases)."""
    spec, base = samples["speculative"], samples["target-only"]
    for kind, column, expected in (("next token", 0, cells.next_expected), ("next two tokens", 1, cells.joint_expected)):
        impossible = spec[2 + column]
        statistic, p_value, dof = _goodness_of_fit(spec[column], expected, impossible)
        cases.append(dict(name=f"{label} / {kind} / speculative vs target softmax", statistic=statistic, dof=dof, p_value=p_value))
        statistic, p_value, dof = _two_sample(spec[column], base[column], expected)
        cases.append(dict(name=f"{label} / {kind} / speculative vs target-only sampling", statistic=statistic, dof=dof, p_value=p_value))
        for control in controls:
            sample = samples[control.name]
            statistic, p_value, dof = _goodness_of_fit(sample[column], expected, sample[2 + column])
            control_cases[control.name].append(dict(name=f"{label} / {kind}", statistic=statistic, dof=dof, p_value=p_value))


def _verdicts(cases: list[dict], control_cases: dict[str, list], per_test: float) -> list[dict]:
    """Mark each case pass / fail at per_test; the negative controls, each "fail" (caught) if any of its tests
    rejects at that same per-test level."""
    for case in cases:
        case["verdict"] = "pass" if case["p_value"] >= per_test else "fail"
    negative_controls = []
    for name, results in control_cases.items():
        caught = any(r["p_value"] < per_test for r in results)  # the same per-test level as the real cases
        negative_controls.append(
            dict(name=name, verdict="fail" if caught else "pass", min_p_value=min(r["p_value"] for r in results), cases=results)
        )
    return negative_controls
