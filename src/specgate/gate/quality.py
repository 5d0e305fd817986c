"""Quality, paired on the same prompts: greedy exact match, math exact match with 95% CIs, the target's
perplexity, and a two-sample test on the target's log-likelihood of sampled continuations.

- Greedy exact match: a lossless configuration must reproduce the baseline's greedy text on every prompt
  (up to floating-point ties); every mismatch is listed with the first differing character.
- Math: exact match of the first number of each answer; a 95% percentile-bootstrap CI per configuration and
  a paired bootstrap CI of the difference (same items, resampled together), plus McNemar's exact test.
- Perplexity: exp(mean token NLL) of a text under the target (teacher forcing, windows of WINDOW tokens),
  with a block-bootstrap 95% CI; per configuration, the target's perplexity of its own sampled continuations.
- Sampled log-likelihood test: the same prompts and seeds sampled at temperature 1 from the baseline and
  the speculative configuration; the target scores each continuation (mean log-prob per token). A lossless
  configuration samples from the target's distribution, so the paired differences are centred at 0; a lossy
  one (typical acceptance, synthetic acceptance) shifts them. Wilcoxon signed-rank (paired by prompt),
  two-sided, at significance LOGLIK_ALPHA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from specgate.gate.workload import MathItem, first_number

WINDOW = 128  # tokens per perplexity window
LOGLIK_ALPHA = 0.01
BOOTSTRAP_RESAMPLES = 2000
MATH_SHOTS = "Q: What is 7 + 5?\nA: 12\nQ: What is 20 - 8?\nA: 12\nQ: What is 6 * 4?\nA: 24\n"


MISMATCH_CHARS = 160  # of each continuation shown from the first difference


def math_prompt(item: MathItem) -> str:
    """A few-shot prompt whose answer is the first number the model writes."""
    return f"{MATH_SHOTS}Q: {item.question}\nA:"


def greedy_exact_match(baseline: dict[str, str], speculative: dict[str, str], categories: dict[str, str] | None = None) -> dict[str, Any]:
    """Compare greedy outputs paired by prompt id: the rate and every mismatch (where it starts, both continuations)."""
    common = sorted(set(baseline) & set(speculative))
    mismatches = []
    for pid in common:
        a, b = baseline[pid], speculative[pid]
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            mismatches.append({
                "prompt_id": pid, "category": (categories or {}).get(pid), "first_diff_char": at, "first_diff_token": None,
                "context": a[max(at - 40, 0) : at], "baseline": a[at : at + MISMATCH_CHARS], "speculative": b[at : at + MISMATCH_CHARS],
            })
    rate = (len(common) - len(mismatches)) / len(common) if common else None
    return {"pairs": len(common), "matches": len(common) - len(mismatches), "rate": rate, "mismatches": mismatches}


def add_token_positions(greedy: dict[str, Any], baseline: dict[str, str], speculative: dict[str, str], tokenizer: Any) -> None:
    """Each mismatch's first differing token, counted in the target tokenizer's encoding of both outputs."""
    for m in greedy["mismatches"]:
        a = tokenizer.encode(baseline[m["prompt_id"]], add_special_tokens=False)
        b = tokenizer.encode(speculative[m["prompt_id"]], add_special_tokens=False)
        m["first_diff_token"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def bootstrap_ci(values: np.ndarray, seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float]:
    """95% percentile-bootstrap CI of the mean of `values` [N] (vectorised: one [R, N] index draw)."""
    values = np.asarray(values, dtype=float)
    if values.size == 0:
        return (float("nan"), float("nan"))
    idx = np.random.default_rng(seed).integers(0, values.size, size=(resamples, values.size))  # [R, N]
    means = values[idx].mean(axis=1)  # [R]
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def math_scores(items: list[MathItem], outputs: dict[str, str]) -> np.ndarray:
    """1.0 where the first number of the output equals the answer, per item (missing output = 0)."""
    return np.array([float(first_number(outputs.get(item.id, "")) == item.answer) for item in items])


def paired_math(items: list[MathItem], baseline: dict[str, str], speculative: dict[str, str], seed: int = 0) -> dict[str, Any]:
    """Exact-match rates with 95% bootstrap CIs, the paired difference's CI, and McNemar's exact p-value."""
    from scipy.stats import binomtest

    base, spec = math_scores(items, baseline), math_scores(items, speculative)
    diff = spec - base
    better, worse = int((diff > 0).sum()), int((diff < 0).sum())
    mcnemar_p = float(binomtest(better, better + worse, 0.5).pvalue) if better + worse else 1.0
    lo, hi = bootstrap_ci(diff, seed)
    return {
        "items": len(items), "baseline_em": float(base.mean()), "baseline_ci95": bootstrap_ci(base, seed),
        "speculative_em": float(spec.mean()), "speculative_ci95": bootstrap_ci(spec, seed),
        "delta": float(diff.mean()), "delta_ci95": (lo, hi), "discordant": {"speculative_right": better, "baseline_right": worse},
        "mcnemar_p": mcnemar_p, "within_noise": bool(lo <= 0.0 <= hi) or float(diff.mean()) >= 0.0,
    }


class TargetScorer:
    """Teacher-forced token log-probs under the target (specgate runtime, one sequence at a time)."""

    def __init__(self, loaded: Any) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer

    def token_logprobs(self, ids: list[int]) -> np.ndarray:
        """log p(ids[t] | ids[:t]) for t = 1..len-1 [len-1], in windows that fit the model's context."""
        import torch

        out = []
        with torch.inference_mode():
            for start in range(0, len(ids) - 1, WINDOW):
                chunk = ids[start : start + WINDOW + 1]
                if len(chunk) < 2:
                    break
                # windows after the first restart the context: each one is scored on its own
                cache = self.model.new_cache(1, len(chunk))
                x = torch.tensor([chunk[:-1]], dtype=torch.int64)  # [1, T]
                positions = torch.arange(len(chunk) - 1)[None]  # [1, T]
                logits = self.model.forward(x, positions, cache, torch.zeros(1, dtype=torch.int64))  # [1, T, V]
                logprobs = torch.log_softmax(logits[0].float(), dim=-1)  # [T, V]
                targets = torch.tensor(chunk[1:], dtype=torch.int64)  # [T]
                out.append(logprobs.gather(1, targets[:, None])[:, 0].numpy())
        return np.concatenate(out) if out else np.zeros(0)

    def continuation_logprob(self, prompt: str, continuation: str) -> tuple[float, int]:
        """(sum of log-probs, tokens) of `continuation` after `prompt` (re-tokenised together)."""
        prompt_ids = self.tokenizer(prompt)["input_ids"]
        full_ids = self.tokenizer(prompt + continuation)["input_ids"]
        n_new = len(full_ids) - len(prompt_ids)
        if n_new <= 0:
            return 0.0, 0
        ids = full_ids[-(WINDOW + 1) :] if len(full_ids) > WINDOW + 1 else full_ids
        logprobs = self.token_logprobs(ids)
        return float(logprobs[-n_new:].sum()), int(min(n_new, logprobs.size))

    def perplexity(self, text: str, seed: int = 0, block_tokens: int = 32) -> dict[str, Any]:
        """exp(mean NLL) of `text`, with a 95% block-bootstrap CI over blocks of block_tokens tokens."""
        ids = self.tokenizer(text)["input_ids"]
        nll = -self.token_logprobs(ids)  # [N]
        blocks = [nll[i : i + block_tokens].mean() for i in range(0, nll.size, block_tokens)]
        lo, hi = bootstrap_ci(np.array(blocks), seed)
        return {"tokens": int(nll.size), "perplexity": float(np.exp(nll.mean())), "ci95": (float(np.exp(lo)), float(np.exp(hi)))}


@dataclass
class LoglikTest:
    pairs: int
    baseline_mean: float | None
    speculative_mean: float | None
    mean_delta: float | None
    p_value: float | None
    significance: float
    flagged: bool
    baseline_perplexity: float | None
    speculative_perplexity: float | None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def loglik_two_sample(baseline: dict[str, tuple[float, int]], speculative: dict[str, tuple[float, int]], significance: float = LOGLIK_ALPHA) -> LoglikTest:
    """Paired Wilcoxon signed-rank test on the per-token mean target log-likelihood of sampled continuations.

    baseline / speculative: prompt id -> (sum log-prob, tokens). flagged = p < significance: the speculative
    configuration does not sample from the target's distribution (a lossy mode).
    """
    from scipy.stats import wilcoxon

    common = [pid for pid in sorted(set(baseline) & set(speculative)) if baseline[pid][1] > 0 and speculative[pid][1] > 0]
    if len(common) < 2:
        return LoglikTest(len(common), None, None, None, None, significance, False, None, None)
    base = np.array([baseline[pid][0] / baseline[pid][1] for pid in common])
    spec = np.array([speculative[pid][0] / speculative[pid][1] for pid in common])
    diff = spec - base
    p_value = 1.0 if np.all(diff == 0) else float(wilcoxon(spec, base, zero_method="zsplit").pvalue)

    def perplexity(scores: dict[str, tuple[float, int]]) -> float:
        total = sum(scores[pid][0] for pid in common)
        tokens = sum(scores[pid][1] for pid in common)
        return float(np.exp(-total / tokens))

    return LoglikTest(
        len(common), float(base.mean()), float(spec.mean()), float(diff.mean()), p_value, significance,
        bool(p_value < significance), perplexity(baseline), perplexity(speculative),
    )
