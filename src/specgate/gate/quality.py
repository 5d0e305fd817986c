"""Quality, paired on the same items: greedy exact match, math exact match (paired non-inferiority), the target's
perplexity, and an equivalence test of the target's log-likelihood of sampled continuations.

- Greedy exact match: a lossless configuration reproduces the baseline's greedy text on every prompt (up to
  floating-point ties); every mismatch is listed with the first differing character.
- Math: exact match of the first number of each answer, paired by item. The difference (configuration -
  baseline) gets Tango's score interval (stats.paired_proportion_difference) at the family-wise level over the
  configurations tested; it is non-inferior when the lower bound is >= -margin, a regression when the upper bound
  is < -margin, and undecided otherwise, with the smallest regression the sample could rule out stated ("40 items
  rule out regressions >= 8.8 points at best"): never a pass by absence of evidence. McNemar's exact p is reported beside.
- Perplexity: exp(mean token NLL) of a text under the target, with a block-bootstrap 95% CI.
- Sampled log-likelihood: the same prompts and seeds sampled at temperature 1 by the baseline and the
  configuration; the target scores each token x_t of a continuation by log p(x_t) + H(p_t), which has mean 0
  exactly when x_t is drawn from p_t (and less spread than log p alone, whose mean moves with the context's
  entropy). The paired per-prompt difference of the means gets a t interval at 1 - 2 alpha (alpha the
  family-wise 0.05 over the configurations); two one-sided tests call the shift equivalent to zero when the
  interval lies inside (-margin, margin), a shift when it lies wholly outside, undecided otherwise (with the
  smallest margin the sample could establish). Lossless speculation samples from the target's distribution;
  lossy modes shift it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specgate.gate import stats
from specgate.gate.records import SampleScore
from specgate.gate.workload import MathItem, first_number

WINDOW = 128  # tokens per perplexity window
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


def math_noninferiority(items: list[MathItem], baseline: dict[str, str], speculative: dict[str, str], margin: float,
                        level: float = stats.LEVEL) -> dict[str, Any]:
    """Exact-match rates, the paired difference's Tango interval at `level`, its state against -margin, McNemar's p."""
    from scipy.stats import binomtest

    base, spec = math_scores(items, baseline), math_scores(items, speculative)
    better, worse = int(((spec - base) > 0).sum()), int(((spec - base) < 0).sum())
    interval = stats.paired_proportion_difference(better, worse, len(items), level)
    state = stats.State.PASS if interval.low >= -margin else stats.State.FAIL if interval.high < -margin else stats.State.UNDECIDED
    return {
        "items": len(items), "baseline_em": float(base.mean()), "speculative_em": float(spec.mean()), "delta": interval.estimate,
        "interval": interval, "discordant": {"speculative_right": better, "baseline_right": worse}, "margin": margin,
        "mcnemar_p": float(binomtest(better, better + worse, 0.5).pvalue) if better + worse else 1.0, "state": state,
        "detectable": stats.paired_proportion_difference(0, 0, len(items), level).high,  # the least regression it can rule out
    }


def loglik_equivalence(baseline: dict[str, Any], speculative: dict[str, Any], margin: float, level: float = stats.LEVEL) -> dict[str, Any]:
    """TOST on the paired per-prompt difference of centered log-likelihoods (module docstring).

    baseline / speculative: sample id -> SampleScore. `level` is the family-wise confidence: the tests run at
    alpha = (1 - level), so the interval read is the (1 - 2 alpha) one."""
    common = [k for k in sorted(set(baseline) & set(speculative)) if baseline[k].tokens > 0 and speculative[k].tokens > 0]
    diffs = [speculative[k].centered_mean - baseline[k].centered_mean for k in common]
    raw = [speculative[k].logprob_sum / speculative[k].tokens - baseline[k].logprob_sum / baseline[k].tokens for k in common]
    tost_level = 1.0 - 2.0 * (1.0 - level)
    interval = stats.mean_interval(diffs, tost_level) if len(diffs) >= 2 else None
    return {
        "pairs": len(common), "interval": interval, "margin": margin, "state": stats.equivalent(interval, margin),
        "mean_logprob_delta": float(np.mean(raw)) if raw else None, "tokens": sum(speculative[k].tokens for k in common),
        "detectable": interval.half_width if interval is not None else None,  # the least margin this sample can establish
        "baseline_perplexity": _perplexity([baseline[k] for k in common]), "speculative_perplexity": _perplexity([speculative[k] for k in common]),
    }


def _perplexity(scores: list[Any]) -> float | None:
    tokens = sum(s.tokens for s in scores)
    return float(np.exp(-sum(s.logprob_sum for s in scores) / tokens)) if tokens else None


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

    def score_continuation(self, prompt: str, continuation: str) -> SampleScore:
        """The target's log-probabilities of `continuation` after `prompt` (re-tokenised together), with the entropy
        of each of its positions (SampleScore.centered_sum)."""
        import torch

        prompt_ids = self.tokenizer(prompt)["input_ids"]
        ids = self.tokenizer(prompt + continuation)["input_ids"]
        n = len(ids) - len(prompt_ids)
        if n <= 0:
            return SampleScore(0.0, 0, 0.0)
        cut = len(ids) - n - 1  # positions before it only write the K/V; the LM head runs on the continuation's
        cache = self.model.new_cache(1, len(ids))
        slot = torch.zeros(1, dtype=torch.int64)
        with torch.inference_mode():
            if cut > 0:
                self.model.forward(torch.tensor([ids[:cut]]), torch.arange(cut)[None], cache, slot, logits=False)
            logits = self.model.forward(torch.tensor([ids[cut:-1]]), torch.arange(cut, len(ids) - 1)[None], cache, slot)  # [1, n, V]
            logprobs = torch.log_softmax(logits[0].float(), dim=-1)  # [n, V]
            chosen = logprobs.gather(1, torch.tensor(ids[cut + 1 :])[:, None])[:, 0]  # [n]
            entropy = -(logprobs.exp() * logprobs).sum(-1)  # [n]
        return SampleScore(float(chosen.sum()), n, float((chosen + entropy).sum()))

    def perplexity(self, text: str, seed: int = 0, block_tokens: int = 32) -> dict[str, Any]:
        """exp(mean NLL) of `text`, with a 95% block-bootstrap CI over blocks of block_tokens tokens."""
        ids = self.tokenizer(text)["input_ids"]
        nll = -self.token_logprobs(ids)  # [N]
        blocks = [nll[i : i + block_tokens].mean() for i in range(0, nll.size, block_tokens)]
        lo, hi = bootstrap_ci(np.array(blocks), seed)
        return {"tokens": int(nll.size), "perplexity": float(np.exp(nll.mean())), "ci95": (float(np.exp(lo)), float(np.exp(hi)))}
