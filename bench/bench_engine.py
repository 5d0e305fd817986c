"""Engine benchmark: Gemma-3-270M, greedy, batch 1, one dtype for every lane, the same input-grounded prompts.

Lanes (each prompt runs once per lane after one short warm-up of every lane; tokens/s = new tokens / wall s):
- own baseline: specgate.engine.generate with --draft none, gamma 0 (target-only decoding through the same loop);
- own n-gram: the same loop with the prompt-lookup drafter;
- transformers greedy: model.generate(do_sample=False) on the same weights (the safetensors cache dir the
  runtime wrote), with its own KV cache;
- transformers prompt lookup: model.generate(prompt_lookup_num_tokens=gamma).
Ratios are from one run in one process. Every lane must produce the same tokens (greedy is exact); the script
says whether they do.

Run: .venv/bin/python bench/bench_engine.py [--max-new-tokens 96] [--gamma 8] [--dtype float32|bfloat16|auto]
(bench/bench_perf.py runs the same lanes per dtype next to the bandwidth floor.)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specgate.drafting import NgramDrafter, NoDrafter
from specgate.engine import generate
from specgate.models import load_model, resolve_dtype
from specgate.sampling import SamplingParams

CODE = '''def moving_average(values, window):
    """Return the moving averages of `values` over `window` items."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages
'''

PARAGRAPH = (
    "Speculative decoding lets a small draft model propose several tokens, which the large target model then "
    "checks in a single forward pass. Every proposed token the target agrees with is kept, and the first "
    "disagreement is replaced by a token sampled from a corrected distribution, so the output follows exactly "
    "the distribution the target alone would produce. The method pays off only when the draft is cheap and "
    "its guesses are often right."
)

PROMPTS = {
    "rewrite code (rename a variable)": (
        "Here is a Python function:\n\n```python\n" + CODE + "```\n\n"
        "Here is the same function with the variable `total` renamed to `running_sum`:\n\n```python\n"
    ),
    "quote text": (
        "Read the paragraph below and then copy it word for word.\n\nParagraph:\n" + PARAGRAPH + "\n\nCopy:\n"
    ),
}


def own_lane(target, drafter, gamma: int, prompt: str, max_new_tokens: int) -> tuple[list[int], float, dict | None]:
    result = generate(prompt, target, drafter, gamma, SamplingParams(temperature=0.0), seed=0, max_new_tokens=max_new_tokens)
    return result.tokens, result.stats.wall_s, result.stats.to_dict()


def hf_lane(model, tokenizer, prompt: str, max_new_tokens: int, lookup: int | None) -> tuple[list[int], float, dict | None]:
    inputs = tokenizer(prompt, return_tensors="pt")
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, top_p=None, top_k=None, temperature=None)
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = lookup
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, **kwargs)
    wall_s = time.perf_counter() - start
    return out[0, inputs["input_ids"].shape[1] :].tolist(), wall_s, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--gamma", type=int, default=8, help="n-gram draft length (and transformers' prompt_lookup_num_tokens)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the markdown table")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or auto (specgate.models.default_dtype())")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    dtype = resolve_dtype(args.dtype)
    target = load_model("gemma-3-270m", dtype=dtype)
    hf_model = AutoModelForCausalLM.from_pretrained(str(target.path), dtype=dtype).eval()
    tokenizer = target.tokenizer
    lanes = {
        "own baseline": lambda p, n: own_lane(target, NoDrafter(), 0, p, n),
        "own n-gram": lambda p, n: own_lane(target, NgramDrafter(), args.gamma, p, n),
        "transformers greedy": lambda p, n: hf_lane(hf_model, tokenizer, p, n, None),
        "transformers prompt lookup": lambda p, n: hf_lane(hf_model, tokenizer, p, n, args.gamma),
    }
    for lane in lanes.values():  # warm-up: first-call allocations and kernels out of the timed runs
        lane(PROMPTS["quote text"], 8)

    rows = {}
    for name, prompt in PROMPTS.items():
        results = {lane: run(prompt, args.max_new_tokens) for lane, run in lanes.items()}
        tokens = {lane: r[0] for lane, r in results.items()}
        speed = {lane: len(r[0]) / r[1] for lane, r in results.items()}
        rows[name] = dict(
            new_tokens={lane: len(t) for lane, t in tokens.items()},
            tokens_per_s=speed,
            same_tokens_as_own_baseline={lane: t == tokens["own baseline"] for lane, t in tokens.items()},
            ngram_acceptance_length=results["own n-gram"][2]["acceptance_length"],
            ratios={
                "own n-gram / own baseline (goal >= 2)": speed["own n-gram"] / speed["own baseline"],
                "own n-gram / transformers prompt lookup (goal > 1)": speed["own n-gram"] / speed["transformers prompt lookup"],
                "own baseline / transformers greedy (goal >= 1)": speed["own baseline"] / speed["transformers greedy"],
                "transformers prompt lookup / transformers greedy": speed["transformers prompt lookup"] / speed["transformers greedy"],
            },
        )
    if args.json:
        print(json.dumps(dict(max_new_tokens=args.max_new_tokens, gamma=args.gamma, dtype=str(dtype), prompts=rows), indent=2))
        return
    lane_names = list(lanes)
    print(f"max_new_tokens={args.max_new_tokens}, gamma={args.gamma}, dtype={dtype}, threads={torch.get_num_threads()}\n")
    print("| prompt | " + " | ".join(f"{lane} tok/s" for lane in lane_names) + " | n-gram AL |")
    print("|---|" + "---|" * (len(lane_names) + 1))
    for name, row in rows.items():
        cells = " | ".join(f"{row['tokens_per_s'][lane]:.1f}" for lane in lane_names)
        print(f"| {name} | {cells} | {row['ngram_acceptance_length']:.2f} |")
    ratio_names = list(next(iter(rows.values()))["ratios"])
    print("\n| prompt | " + " | ".join(ratio_names) + " |")
    print("|---|" + "---|" * len(ratio_names))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row['ratios'][r]:.2f}x" for r in ratio_names) + " |")
    print()
    for name, row in rows.items():
        print(f"{name}: new tokens {row['new_tokens']}; identical to own baseline: {row['same_tokens_as_own_baseline']}")


if __name__ == "__main__":
    main()
