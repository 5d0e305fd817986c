"""specgate against llama.cpp on the same GGUF, threads and prompts, in one run, lanes taking turns (the method:
specgate.bench.llamacpp). Decode lanes (one request at a time) and served lanes (closed-loop clients at each
--concurrency: `specgate serve --dtype gguf` adaptive / fixed n-gram against `llama-server -np C` none / ngram-simple /
ngram-mod), greedy, output tokens per second, the ratio of the best lanes per level.

    PYTHONPATH=src python bench/bench_llamacpp.py --threads 2 --tokens 96 --rounds 2 --served-tokens 64 --concurrency 1,4,16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    from specgate.bench import llamacpp as method

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="the .gguf (default: the packaged Gemma-3-270M Q4_K_M)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96, help="new tokens per decode-lane request")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gamma", type=int, default=8, help="n-gram draft length for both engines (specgate adaptive: its largest)")
    parser.add_argument("--head-gamma", type=int, default=0, help="> 0: add decode lanes with specgate's --draft default (lookups, then its EAGLE head) and its head alone at this draft length")
    parser.add_argument("--served-tokens", type=int, default=64, help="max_tokens per served request")
    parser.add_argument("--concurrency", default="1,4,16", help="served levels (comma-separated); empty: no served lanes")
    parser.add_argument("--requests-per-client", type=int, default=2, help="served requests per level = C x this (at least 4)")
    parser.add_argument("--no-decode", action="store_true", help="skip the decode lanes")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    from specgate.models.loading import default_gguf_path

    gguf = Path(args.gguf) if args.gguf else default_gguf_path()
    results: dict = {}
    if not args.no_decode:
        results["decode"] = method.run_decode(gguf, args.threads, args.tokens, args.rounds, args.gamma, head_gamma=args.head_gamma)
        print(f"GGUF {gguf.name}, {args.threads} threads, greedy, {args.tokens} new tokens, "
              f"{len(method.DECODE_PROMPTS)} prompts x {args.rounds} rounds (medians)")
        print("\n".join(method.decode_lines(results["decode"])))
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if levels:
        results["served"] = method.run_served(gguf, args.threads, args.served_tokens, args.rounds, args.gamma, levels, args.requests_per_client)
        print(f"served: closed-loop clients, greedy, {args.served_tokens} tokens per request, output tok/s (median of {args.rounds} rounds)")
        print("\n".join(method.served_table(results["served"]["summary"])))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
