"""Does the gate's verdict reproduce? The same `specgate gate` command run several times in a row, each run's
verdict, recommendation and target-concurrency throughput-ratio interval read from its report.json, and whether
the runs agree: the same verdict every time, and every pair of the recommendation's intervals overlapping."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def run_once(args: list[str], out: Path) -> dict[str, Any]:
    """One `python -m specgate gate ARGS --out OUT`; the facts of its report (exit status and stderr tail on failure)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "specgate", "gate", *args, "--out", str(out), "--json"], capture_output=True, text=True)
    row: dict[str, Any] = {"exit": done.returncode, "wall_s": time.perf_counter() - started}
    if done.returncode != 0:
        return {**row, "error": done.stderr[-500:]}
    report = json.loads((out / "report.json").read_text())
    target = f"c{report['options']['target_concurrency'] or (4 if 4 in report['options']['concurrency'] else max(report['options']['concurrency']))}"
    rec = report["recommendation"]
    failing = [f"{c['name']} {c['state']}" for c in report["criteria"] if c["binding"] and c["state"] in ("FAIL", "UNDECIDED")]
    screened = {name: next((a["throughput_ratio"] for a in c["loads"] if a["load"] == target), None)
                for name, c in report["configs"].items() if c["stage"] == "screen"}
    return {**row, "verdict": report["verdict"], "config": report["config"], "kind": rec["kind"], "based_on": rec["based_on"],
            "target": target, "ratio": rec["throughput_ratio"].get(target), "poisson": rec["throughput_ratio"].get("poisson"),
            "screened": screened, "not_passed": failing, "gate_wall_s": report["wall_s"]}


def agreement(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether every run gave the same verdict and every two of the recommendation's target intervals overlap (None when
    no run recommended speculation: there is no interval to compare)."""
    verdicts = {r.get("verdict") for r in rows}
    intervals = [r["ratio"] for r in rows if r.get("ratio")]
    overlap = all(a["low"] <= b["high"] and b["low"] <= a["high"] for i, a in enumerate(intervals) for b in intervals[i + 1 :])
    off = all(r.get("kind") == "off" for r in rows)
    return {"same_verdict": len(verdicts) == 1 and None not in verdicts, "intervals_overlap": None if off else overlap and len(intervals) == len(rows),
            "verdicts": sorted(v for v in verdicts if v)}


def table(label: str, rows: list[dict[str, Any]]) -> list[str]:
    def iv(d: dict | None) -> str:
        return f"{d['estimate']:.3f} [{d['low']:.3f}, {d['high']:.3f}]" if d else "n/a"

    out = [f"| {label} run | verdict | recommendation | its target ratio | its Poisson ratio | screened at the target | gate time |",
           "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        screened = "; ".join(f"{name} {iv(ratio)}" for name, ratio in (r.get("screened") or {}).items()) or "-"
        out.append(f"| {i} | {r.get('verdict', 'error')} | {r.get('config') or 'off'} ({r.get('kind', '')}) | {iv(r.get('ratio'))} | "
                   f"{iv(r.get('poisson'))} | {screened} | {r.get('gate_wall_s', r['wall_s']):.0f} s |")
    return out
