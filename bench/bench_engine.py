"""Engine benchmark: Gemma-3-270M, greedy, batch 1, one dtype for every lane, the same input-grounded prompts.

Lanes: own baseline (--draft none, gamma 0), own n-gram, transformers greedy, transformers prompt lookup, each
prompt once per lane after one short warm-up of every lane (the method: specgate.bench.engine; the prompts:
specgate.bench.workloads.ENGINE_PROMPTS). Ratios are from one run in one process; every lane must produce the
same tokens (greedy is exact) and the script says whether they do.

Run: .venv/bin/python bench/bench_engine.py [--max-new-tokens 96] [--gamma 8] [--dtype float32|bfloat16|auto]
(bench/bench_perf.py runs the same lanes per dtype next to the bandwidth floor.)
"""

from __future__ import annotations

import argparse
import json

import torch

from specgate.bench.engine import engine_lanes, engine_tables, run_engine
from specgate.bench.workloads import ENGINE_PROMPTS
from specgate.models import load_model, resolve_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="gemma-3-270m", help="model of every lane (a local HF dir for a quick check)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--gamma", type=int, default=8, help="n-gram draft length (and transformers' prompt_lookup_num_tokens)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the markdown table")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or auto (specgate.models.default_dtype())")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    dtype = resolve_dtype(args.dtype)
    target = load_model(args.target, dtype=dtype)
    hf_model = AutoModelForCausalLM.from_pretrained(str(target.path), dtype=dtype).eval()
    rows = run_engine(engine_lanes(target, hf_model, args.gamma), ENGINE_PROMPTS, args.max_new_tokens, ENGINE_PROMPTS["quote text"])
    if args.json:
        print(json.dumps(dict(max_new_tokens=args.max_new_tokens, gamma=args.gamma, dtype=str(dtype), prompts=rows), indent=2))
        return
    print(f"max_new_tokens={args.max_new_tokens}, gamma={args.gamma}, dtype={dtype}, threads={torch.get_num_threads()}\n")
    print("\n".join(engine_tables(rows)))


if __name__ == "__main__":
    main()
