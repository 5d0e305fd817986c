"""Default-draft benchmark: Gemma-3-270M with `--draft default` vs its own gamma = 0 baseline, batch 1.

Prompts are held out of the draft's training text (docs/DRAFT_MODEL.md): code = functions of held-out stdlib
modules (textwrap, statistics, heapq) cut in the middle plus one freshly written function; prose = passages of
held-out plays (Hamlet, Macbeth) plus one freshly written paragraph. Each prompt runs once per lane, lanes
interleaved prompt by prompt (so background load hits every lane alike), after one warm-up of every lane.

Lanes (temperature 0 unless named): own baseline (--draft none, gamma 0); --draft default at gamma 1, 2, 3;
the self-speculative candidate (Gemma's first 6 layers + final norm + the same reduced head, untrained) at
gamma 2 (only when named in --lanes: its alpha is near 0); temperature 1: baseline and --draft default at gamma 3 (the same seeds); transformers greedy
generate() on the same weights and dtype (its assisted generation cannot take the draft: see the model card).

Speedup = baseline wall time / lane wall time summed over a category's prompts (the same tokens at
temperature 0; at temperature 1, tokens per second), prefill included; decode_speedup leaves the (identical)
prefill out of both. alpha, c, AL come from the engine's counters; the theory
column is Leviathan's S(alpha, gamma, c) from the measured alpha and c.

Run: flock /tmp/specgate-heavy.lock .venv/bin/python bench/bench_draft.py [--max-new-tokens 64] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from specgate.bench.workloads import held_out_prompts
from specgate.drafting import NoDrafter, distill, make_drafter
from specgate.drafting.build_default import PACKAGE_DRAFT_DIR
from specgate.engine import generate
from specgate.models import load_model
from specgate.sampling import SamplingParams
from specgate.theory import speedup as theory_speedup

def self_speculative_dir(target, layers: int, out_dir: Path) -> Path:
    """Candidate B: the target's first `layers` layers + final norm + the default draft's reduced head, untrained."""
    from safetensors.torch import load_file

    from specgate.drafting.model_drafter import DRAFT_INFO_FILE, VOCAB_MAP_FILE, VOCAB_MAP_KEY

    d2t = load_file(str(PACKAGE_DRAFT_DIR / VOCAB_MAP_FILE))[VOCAB_MAP_KEY]
    ids = list(range(layers))
    config = distill.student_config(target.model.config, ids, d2t.numel())
    student = distill.build_student(config, distill.student_state_from_target(target.model, ids, d2t))
    info = json.loads((PACKAGE_DRAFT_DIR / DRAFT_INFO_FILE).read_text())
    distill.save_student(student, config, d2t, out_dir, info)
    return out_dir


@torch.inference_mode()
def teacher_forced_agreement(target, texts: list[str]) -> dict:
    """How often the default draft's argmax equals the target's (full-vocabulary) argmax at each prompt position:
    the greedy acceptance probability of a first draft token on held-out human text (no generation, no timing)."""
    drafter = make_drafter("default", target)
    equal = positions = 0
    for text in texts:
        ids = target.tokenizer(text, return_tensors="pt")["input_ids"]  # [1, L]
        length = ids.shape[1]
        where = torch.arange(length)[None]  # [1, L]
        slots = torch.zeros(1, dtype=torch.int64)
        target_next = target.model.forward(ids, where, target.model.new_cache(1, length), slots).argmax(-1)  # [1, L]
        draft_logits = drafter.draft.model.forward(drafter.t2d[ids], where, drafter.draft.model.new_cache(1, length), slots)  # [1, L, V_d]
        draft_next = drafter.d2t[draft_logits[..., : drafter.num_outputs].argmax(-1)]  # [1, L] target ids
        equal += int((draft_next == target_next).sum())
        positions += length
    return {"positions": positions, "agreement": equal / positions}


def hf_generate(hf_model, tokenizer, prompt: str, max_new_tokens: int) -> tuple[list[int], float]:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist(), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (target and draft alike)")
    parser.add_argument("--build-dir", type=Path, default=Path("build/draft"))
    parser.add_argument("--out", type=Path, default=Path("out/bench_draft.json"))
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers lane")
    parser.add_argument("--agreement-only", action="store_true", help="only the teacher-forced greedy agreement of the default draft with the target on the prompts (no timing)")
    parser.add_argument("--lanes", default="", help="comma-separated subset of the lanes (default: all); speedups need the baselines")
    args = parser.parse_args()
    from specgate.models.dtypes import resolve_dtype

    dtype = resolve_dtype(args.dtype)
    target = load_model("gemma-3-270m", dtype=dtype)
    if args.agreement_only:
        result = {category: teacher_forced_agreement(target, texts) for category, texts in held_out_prompts(args.build_dir).items()}
        print(json.dumps({"dtype": str(dtype).removeprefix("torch."), "teacher_forced_agreement": result}, indent=1))
        return
    tmp = Path(tempfile.mkdtemp(prefix="specgate-selfspec-"))
    drafters = {
        "baseline": (lambda: NoDrafter(), 0, 0.0),
        "default g2": (lambda: make_drafter("default", target), 2, 0.0),
        "default g3": (lambda: make_drafter("default", target), 3, 0.0),
        "default g1": (lambda: make_drafter("default", target), 1, 0.0),
        "self-spec 6L g2": (lambda: make_drafter(str(self_speculative_dir(target, 6, tmp / "self-spec-6")), target), 2, 0.0),
        "baseline T=1": (lambda: NoDrafter(), 0, 1.0),
        "default g3 T=1": (lambda: make_drafter("default", target), 3, 1.0),
    }
    default_lanes = [lane for lane in drafters if not lane.startswith("self-spec")]  # candidate B: --lanes
    chosen = [lane.strip() for lane in args.lanes.split(",") if lane.strip()] or default_lanes
    unknown = sorted(set(chosen) - set(drafters))
    if unknown:
        raise SystemExit(f"--lanes: unknown lane(s) {unknown}; choose from {list(drafters)}")
    built = {lane: (factory(), gamma, temperature) for lane, (factory, gamma, temperature) in drafters.items() if lane in chosen}
    hf_model = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(str(target.path), dtype=dtype, local_files_only=True).eval()

    def run_lane(lane: str, prompt: str, seed: int, max_new_tokens: int) -> dict:
        drafter, gamma, temperature = built[lane]
        result = generate(prompt, target, drafter, gamma, SamplingParams(temperature=temperature), seed=seed, max_new_tokens=max_new_tokens)
        return {"tokens": result.tokens, "stats": result.stats.to_dict()}

    # warm-up: every lane once on a short prompt
    for lane in built:
        run_lane(lane, "import os\n", 0, 8)
    if hf_model is not None:
        hf_generate(hf_model, target.tokenizer, "import os\n", 8)

    records = []
    for category, texts in held_out_prompts(args.build_dir).items():
        for index, prompt in enumerate(texts):
            row = {"category": category, "prompt": index}
            for lane in built:
                row[lane] = run_lane(lane, prompt, 1000 + index, args.max_new_tokens)
            if hf_model is not None:
                tokens, wall_s = hf_generate(hf_model, target.tokenizer, prompt, args.max_new_tokens)
                row["transformers greedy"] = {"tokens": tokens, "stats": {"wall_s": wall_s, "new_tokens": len(tokens)}}
            records.append(row)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.with_suffix(".partial.json").write_text(json.dumps(records))  # survives an interrupted run
            print(json.dumps({"category": category, "prompt": index, **{lane: round(row[lane]["stats"]["wall_s"], 2) for lane in built}}), flush=True)

    summary = summarise(records, list(built) + (["transformers greedy"] if hf_model is not None else []), built)
    report = {"dtype": str(dtype).removeprefix("torch."), "max_new_tokens": args.max_new_tokens, "torch_threads": torch.get_num_threads(), "summary": summary, "records": records}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({"dtype": report["dtype"], "summary": summary}, indent=1))


def summarise(records: list[dict], lanes: list[str], built: dict) -> dict:
    out: dict = {}
    for category in sorted({r["category"] for r in records}):
        rows = [r for r in records if r["category"] == category]
        cat: dict = {}
        for lane in lanes:
            temperature = built[lane][2] if lane in built else 0.0
            base_lane = "baseline T=1" if temperature > 0 else "baseline"
            wall = sum(r[lane]["stats"]["wall_s"] for r in rows)
            tokens = sum(r[lane]["stats"]["new_tokens"] for r in rows)
            entry = {"tokens_per_s": tokens / wall}
            if base_lane in built:  # decode only: the same prefill is subtracted from both lanes
                base_wall = sum(r[base_lane]["stats"]["wall_s"] for r in rows)
                base_tokens = sum(r[base_lane]["stats"]["new_tokens"] for r in rows)
                entry["speedup"] = (tokens / wall) / (base_tokens / base_wall)
            if lane in built and base_lane in built:
                decode_s = wall - sum(r[lane]["stats"]["prefill_ms"] for r in rows) / 1e3
                base_decode_s = base_wall - sum(r[base_lane]["stats"]["prefill_ms"] for r in rows) / 1e3
                entry["decode_speedup"] = (tokens / decode_s) / (base_tokens / base_decode_s)
            if temperature == 0 and lane != "baseline" and "baseline" in built:
                entry["identical_to_baseline"] = all(r[lane]["tokens"] == r["baseline"]["tokens"] for r in rows)
            gamma = built[lane][1] if lane in built else 0
            if gamma > 0:
                stats = [r[lane]["stats"] for r in rows]
                accepted = sum(s["accepted_tokens"] for s in stats)
                rejections = sum(s["rejections"] for s in stats)
                iterations = sum(s["iterations"] for s in stats)
                drafted = sum(s["drafted_tokens"] for s in stats)
                alpha = accepted / (accepted + rejections) if accepted + rejections else None
                c = (sum(s["draft_ms_total"] for s in stats) / drafted) / (sum(s["verify_ms_total"] for s in stats) / iterations)
                entry.update(
                    alpha=alpha,
                    acceptance_rate=accepted / drafted,
                    acceptance_length=(accepted + iterations) / iterations,
                    c=c,
                    draft_ms_per_token=sum(s["draft_ms_total"] for s in stats) / drafted,
                    verify_ms_per_step=sum(s["verify_ms_total"] for s in stats) / iterations,
                    theory_speedup=theory_speedup(min(alpha, 0.999999), gamma, c) if alpha is not None else None,
                )
            elif lane in built:
                stats = [r[lane]["stats"] for r in rows]
                entry["ms_per_step"] = sum(s["verify_ms_total"] for s in stats) / sum(s["iterations"] for s in stats)
            cat[lane] = entry
        out[category] = cat
    return out


if __name__ == "__main__":
    main()
