"""Runtime performance against the memory-bandwidth floor and against transformers, per dtype (one process).

Sections: bandwidth, floor, decode, ngram (the default), head, layers, demo_rss; what each measures is in
specgate/bench/perf.py (the method: specgate.bench.perf and specgate.bench.floor; the markdown:
specgate.bench.tables.perf_report). Every ratio comes from one run in one process. Run heavy:
`flock /tmp/specgate-heavy.lock .venv/bin/python bench/bench_perf.py [--dtypes bfloat16,float32] [--max-new-tokens 64] [--gamma 4] [--json-out FILE]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
from rich.console import Console

from specgate.bench.floor import bandwidth_probe, head_products, layer_products
from specgate.bench.perf import SECTIONS, PerfSettings, demo_commands, machine, peak_rss, run_dtype
from specgate.bench.tables import perf_report

ROOT = Path(__file__).resolve().parent.parent
PROMPT_FILE = ROOT / "examples" / "prompts" / "rewrite_code.txt"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="bandwidth,floor,decode,ngram",
                        help=f"comma-separated subset of {','.join(SECTIONS)} (demo_rss runs `make demo`'s commands: minutes)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--target", default="gemma-3-270m", help="model of the floor and lane sections (a local HF dir for a quick check)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=8, help="n-gram draft length and transformers' prompt_lookup_num_tokens")
    parser.add_argument("--verify-steps", type=int, default=7, help="theory: passes per token count per round of the verification cost")
    parser.add_argument("--lane-repeats", type=int, default=3, help="runs of each lane, interleaved; each lane's median run is reported")
    parser.add_argument("--theory-draft", default="default", help="draft model of the theory section's second lane ('none': n-gram only)")
    parser.add_argument("--theory-draft-gamma", type=int, default=3, help="that lane's gamma")
    parser.add_argument("--position", type=int, default=128, help="KV position of the timed batch-1 decode steps")
    parser.add_argument("--steps", type=int, default=15, help="timed decode steps (median)")
    parser.add_argument("--rounds", type=int, default=5, help="floor section: rounds of probe + steps (medians over rounds)")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the report as JSON here")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, = cores); 1 avoids thread stalls on a shared VM")
    args = parser.parse_args()
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"--sections {sorted(unknown)} unknown: use a subset of {','.join(SECTIONS)}")
    return args


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sections, console = set(args.sections.split(",")), Console(stderr=True)
    settings = PerfSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PerfSettings)})
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(), "dtypes": {}}
    if sections & {"bandwidth", "floor"}:
        report["bandwidth"] = bandwidth_probe()
    for name in args.dtypes.split(","):
        if sections & {"floor", "decode", "ngram"}:
            prompt = PROMPT_FILE.read_text(encoding="utf-8")
            report["dtypes"][name] = run_dtype(getattr(torch, name), settings, prompt, "bandwidth" in report, sections, console)
    if "head" in sections:
        report["head"] = head_products(args.steps)
    if "layers" in sections:
        report["layers"] = layer_products(args.steps)
    if "demo_rss" in sections:
        report["demo_rss"] = [peak_rss(command, ROOT) for command in demo_commands((ROOT / "Makefile").read_text())]
    report["load_average_end"] = os.getloadavg()
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))
    print("\n".join(perf_report(report)))


if __name__ == "__main__":
    main()
