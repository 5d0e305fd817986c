"""Draft benchmark: Gemma-3-270M with its EAGLE head (`--draft default`) and its small draft model vs its own
gamma = 0 baseline, batch 1.

Prompts are held out of both drafts' training text (docs/DRAFT_MODEL.md); lanes interleaved prompt by prompt after
one warm-up of every lane: own baseline, the draft model at gamma 1, 2, 3, the head at gamma 2, 3, 4, at
temperature 1 the baseline and both at gamma 3, transformers greedy generate(); the self-speculative candidate only
when named in --lanes. Speedups, alpha, c, AL and Leviathan's S per category: the method is specgate.bench.draft.

Run: flock /tmp/specgate-heavy.lock .venv/bin/python bench/bench_draft.py [--max-new-tokens 64] [--dtype auto] [--seeds 1]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from specgate.bench.draft import DRAFT_LANES, choose_lanes, make_lane_drafter, run_draft_bench, summarise, teacher_forced_agreement
from specgate.bench.workloads import held_out_prompts
from specgate.models import load_model
from specgate.models.dtypes import draft_dtype, resolve_weights


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto", help="the target's weights: auto (the GGUF's blocks where the C kernels run) | gguf | float32 | bfloat16")
    parser.add_argument("--build-dir", type=Path, default=Path("build/draft"))
    parser.add_argument("--out", type=Path, default=Path("out/bench_draft.json"))
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers lane")
    parser.add_argument("--agreement-only", action="store_true", help="only the teacher-forced greedy agreement of the default draft with the target on the prompts (no timing)")
    parser.add_argument("--eagle", type=Path, default=None, help="the eagle lanes' head directory (eagle_train export; default: the head shipped for the target)")
    parser.add_argument("--seeds", type=int, default=1, help="sampled (T=1) lanes: run every prompt under this many seeds (one sample path per prompt is a noisy estimate)")
    parser.add_argument("--lanes", default="", help="comma-separated subset of the lanes (default: all); speedups need the baselines")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.seeds < 1:
        raise SystemExit(f"--seeds {args.seeds}: run every prompt under at least 1 seed")
    weights = resolve_weights(args.dtype, "gemma-3-270m")  # auto: the GGUF's own blocks where the C kernels run
    dtype = draft_dtype(weights)  # the draft model's and transformers' torch dtype
    target = load_model("gemma-3-270m", dtype=weights)
    prompts = held_out_prompts(args.build_dir)
    if args.agreement_only:
        result = {category: teacher_forced_agreement(target, texts) for category, texts in prompts.items()}
        print(json.dumps({"dtype": str(weights).removeprefix("torch."), "teacher_forced_agreement": result}, indent=1))
        return
    try:
        chosen = choose_lanes(args.lanes)
    except ValueError as error:
        raise SystemExit(f"--lanes: {error}") from None
    tmp = Path(tempfile.mkdtemp(prefix="specgate-selfspec-"))
    built = {lane: (make_lane_drafter(spec, target, tmp, args.eagle), gamma, temperature) for lane, (spec, gamma, temperature) in DRAFT_LANES.items() if lane in chosen}
    hf_model = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(str(target.path), dtype=dtype, local_files_only=True).eval()
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def on_record(records: list[dict]) -> None:
        args.out.with_suffix(".partial.json").write_text(json.dumps(records))  # survives an interrupted run
        row = records[-1]
        print(json.dumps({"category": row["category"], "prompt": row["prompt"], "seed": row["seed"],
                          **{lane: round(row[lane]["stats"]["wall_s"], 2) for lane in built if lane in row}}), flush=True)

    records = run_draft_bench(target, built, hf_model, prompts, args.max_new_tokens, on_record, seeds=args.seeds)
    summary = summarise(records, list(built) + (["transformers greedy"] if hf_model is not None else []), built)
    report = {"dtype": str(weights).removeprefix("torch."), "max_new_tokens": args.max_new_tokens, "seeds": args.seeds, "torch_threads": torch.get_num_threads(), "summary": summary, "records": records}
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({"dtype": report["dtype"], "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
