"""One request on the engine (bench/bench_engine.py): greedy, batch 1, four lanes on the same prompts.

Lanes (each prompt runs once per lane after one short warm-up of every lane; tokens/s = new tokens / wall s):
- own baseline: specgate.engine.generate with no draft, gamma 0 (target-only decoding through the same loop);
- own n-gram: the same loop with the prompt-lookup drafter;
- transformers greedy: model.generate(do_sample=False) on the same weights, with its own KV cache;
- transformers prompt lookup: model.generate(prompt_lookup_num_tokens=gamma).
Every lane must produce the same tokens (greedy is exact); the record says whether they do.
"""

from __future__ import annotations

from typing import Any, Callable

from specgate.bench.generation import hf_run, own_run, prompt_ids, tokens_per_s
from specgate.drafting import NgramDrafter, NoDrafter

Lane = Callable[[str, int], dict[str, Any]]


def engine_lanes(target: Any, hf_model: Any, gamma: int) -> dict[str, Lane]:
    """lane name -> run(prompt, max_new_tokens), in the tables' column order."""
    tokenizer = target.tokenizer
    return {
        "own baseline": lambda p, n: own_run(target, NoDrafter(), 0, p, n),
        "own n-gram": lambda p, n: own_run(target, NgramDrafter(), gamma, p, n),
        "transformers greedy": lambda p, n: hf_run(hf_model, prompt_ids(tokenizer, p), n),
        "transformers prompt lookup": lambda p, n: hf_run(hf_model, prompt_ids(tokenizer, p), n, lookup=gamma),
    }


def prompt_row(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One prompt's record from its runs per lane: new tokens, tokens/s, same tokens as the baseline, the n-gram
    lane's acceptance length, and the ratios the goals are set on."""
    tokens = {lane: r["tokens"] for lane, r in results.items()}
    speed = {lane: tokens_per_s(r) for lane, r in results.items()}
    return dict(
        new_tokens={lane: len(t) for lane, t in tokens.items()},
        tokens_per_s=speed,
        same_tokens_as_own_baseline={lane: t == tokens["own baseline"] for lane, t in tokens.items()},
        ngram_acceptance_length=results["own n-gram"]["stats"].acceptance_length,
        ratios={
            "own n-gram / own baseline (goal >= 2)": speed["own n-gram"] / speed["own baseline"],
            "own n-gram / transformers prompt lookup (goal > 1)": speed["own n-gram"] / speed["transformers prompt lookup"],
            "own baseline / transformers greedy (goal >= 1)": speed["own baseline"] / speed["transformers greedy"],
            "transformers prompt lookup / transformers greedy": speed["transformers prompt lookup"] / speed["transformers greedy"],
        },
    )


def run_engine(lanes: dict[str, Lane], prompts: dict[str, str], max_new_tokens: int, warmup_prompt: str) -> dict[str, dict[str, Any]]:
    """Every lane once on warmup_prompt (8 tokens), then every prompt once per lane: prompt name -> prompt_row."""
    for lane in lanes.values():  # warm-up: first-call allocations and kernels out of the timed runs
        lane(warmup_prompt, 8)
    return {name: prompt_row({lane: run(prompt, max_new_tokens) for lane, run in lanes.items()}) for name, prompt in prompts.items()}


def engine_tables(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown: tokens/s per prompt and lane with the n-gram AL; the ratios per prompt; the same-token checks."""
    lane_names = list(next(iter(rows.values()))["tokens_per_s"])
    lines = ["| prompt | " + " | ".join(f"{lane} tok/s" for lane in lane_names) + " | n-gram AL |", "|---|" + "---|" * (len(lane_names) + 1)]
    for name, row in rows.items():
        cells = " | ".join(f"{row['tokens_per_s'][lane]:.1f}" for lane in lane_names)
        lines.append(f"| {name} | {cells} | {row['ngram_acceptance_length']:.2f} |")
    ratio_names = list(next(iter(rows.values()))["ratios"])
    lines += ["", "| prompt | " + " | ".join(ratio_names) + " |", "|---|" + "---|" * len(ratio_names)]
    lines += [f"| {name} | " + " | ".join(f"{row['ratios'][r]:.2f}x" for r in ratio_names) + " |" for name, row in rows.items()]
    lines.append("")
    return lines + [f"{name}: new tokens {row['new_tokens']}; identical to own baseline: {row['same_tokens_as_own_baseline']}" for name, row in rows.items()]
