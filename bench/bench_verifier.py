"""Verifier benchmark: time per call for B=16, G=4, V=262,144 (Gemma's vocabulary) next to one target step.

The verifier lanes (median wall ms per call over --repeats calls, after warm-up): rejection_sample with and
without validation, token-only (q None), greedy_verify on logits, and verify() from logits (what the engine calls
per step). The baseline: one forward step of Gemma-3-270M (fp32, own runtime) for the same batch, 16 rows x 5
tokens after a 64-token prefill, in the same process; when specgate.models is not usable, transformers'
Gemma3ForCausalLM on the same GGUF weights, and the output says which. Goal: verifier <= 10% of the target step.
The method and its inputs: specgate.bench.verifier.

Run: .venv/bin/python bench/bench_verifier.py [--repeats 30] [--no-model]
"""

from __future__ import annotations

import argparse
import json

import torch

from specgate.bench.verifier import BATCH, GAMMA, VOCAB, baseline_step_ms, verifier_lanes, verifier_lines


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
        step_ms, baseline, fallback = baseline_step_ms(args.model_repeats)
        if fallback:
            print(f"specgate.models is not usable here ({fallback}); fell back to transformers' Gemma3ForCausalLM for the target step")
    print("\n".join(verifier_lines(lanes, step_ms, baseline)))
    print(json.dumps({"baseline": baseline, "target_step_ms": step_ms, "verifier_ms": lanes,
                      "ratios": {k: (v / step_ms if step_ms else None) for k, v in lanes.items()}}))


if __name__ == "__main__":
    main()
