"""Runtime performance per dtype (bench/bench_perf.py), in sections:

- bandwidth: a memory-bandwidth probe (floor.bandwidth_probe).
- floor: the bytes a batch-1 decode step reads (every layer weight, the full LM head: Gemma-3-270M's tied 262k-row
  head is read in full each step; the KV cache up to the step's position; one embedding row), the floor = bytes /
  read bandwidth, and the measured step as a multiple of it, in rounds of probe + steps; also the step through
  torch's ops instead of the C path, and the step's products alone (floor.floor_rounds).
- decode: own target-only decode (specgate.engine.generate, no draft) vs transformers' greedy generate() on the same
  weights, dtype and prompt.
- ngram: the own n-gram lane vs transformers' prompt lookup on the same input-grounded prompt, plus an own
  draft-model lane (theory_draft); each speculative lane against the analytical model (theory_comparison).
  Whether the speculative output equals target-only greedy token for token is measured, not assumed.
- head, layers: the LM-head product and the 18 layers' products by row count and formulation (floor.head_products,
  floor.layer_products).
- demo_rss: peak resident memory of each command of `make demo` (peak_rss).

Lanes run `lane_repeats` times, interleaved (a slow phase hits every lane alike); each lane's median run is
reported. The theory: each speculative lane's measured speedup over the own baseline (decode phase and end to end)
against the analytical model fed with what was measured: alpha, c, the draft lengths that ran, and the verification
cost V(t) of the runtime's own t-token passes (floor.verification_cost).
"""

from __future__ import annotations

import os
import platform
import re
import resource
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from rich.console import Console
from rich.progress import Progress

from specgate.bench.floor import floor_rounds, verification_cost
from specgate.bench.generation import hf_run, own_run, prompt_ids, tokens_per_s
from specgate.bench.timing import middle
from specgate.drafting import NgramDrafter, NoDrafter, make_drafter
from specgate.models import default_dtype, load_model, native_bf16
from specgate.theory import expected_tokens, speedup, speedup_over_lengths

SECTIONS = ("bandwidth", "floor", "decode", "ngram", "head", "layers", "demo_rss")
DEMO_TIMEOUT_S = 1200


@dataclass
class PerfSettings:
    """bench_perf.py's knobs (its --help says what each does)."""

    target: str = "gemma-3-270m"
    max_new_tokens: int = 64
    gamma: int = 8
    verify_steps: int = 7
    lane_repeats: int = 3
    theory_draft: str = "default"
    theory_draft_gamma: int = 3
    position: int = 128
    steps: int = 15
    rounds: int = 5


def speculative_lanes(target: Any, hf_model: Any, prompt: str, settings: PerfSettings, with_ngram: bool,
                      dtype: torch.dtype) -> dict[str, Callable[[int], dict[str, Any]]]:
    """lane name -> run(max_new_tokens): the own baseline and transformers' greedy; with_ngram: the own n-gram lane,
    transformers' prompt lookup and (theory_draft != 'none') the own draft-model lane."""
    ids = prompt_ids(target.tokenizer, prompt)
    lanes = {"own baseline": lambda n: own_run(target, NoDrafter(), 0, prompt, n),
             "transformers greedy": lambda n: hf_run(hf_model, ids, n)}
    if with_ngram:
        lanes["own n-gram"] = lambda n: own_run(target, NgramDrafter(), settings.gamma, prompt, n)
        lanes["transformers prompt lookup"] = lambda n: hf_run(hf_model, ids, n, lookup=settings.gamma)
    if with_ngram and settings.theory_draft != "none":
        drafter = make_drafter(settings.theory_draft, target, dtype=dtype)
        lanes["own draft model"] = lambda n: own_run(target, drafter, settings.theory_draft_gamma, prompt, n)
    return lanes


def median_runs(lanes: dict[str, Callable[[int], dict[str, Any]]], repeats: int, max_new_tokens: int,
                advance: Callable[[], None] = lambda: None) -> dict[str, dict[str, Any]]:
    """One warm-up of every lane (4 tokens: first-call allocations out of the timed runs), then `repeats` rounds of
    every lane in turn; lane -> its median run by wall time."""
    for lane in lanes.values():
        lane(4)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in lanes}
    for _ in range(repeats):
        for name, lane in lanes.items():
            runs[name].append(lane(max_new_tokens))
            advance()
    return {name: middle(r, key=lambda run: run["wall_s"]) for name, r in runs.items()}


def lane_figures(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per lane tokens/s (wall and CPU), the ratios between the lanes present, the baseline's ms per step."""
    speed = {name: tokens_per_s(r) for name, r in results.items()}
    cpu_speed = {name: len(r["tokens"]) / r["cpu_s"] for name, r in results.items()}
    baseline = results["own baseline"]
    out: dict[str, Any] = {"lanes": {
        name: {"tokens_per_s": speed[name], "tokens_per_cpu_s": cpu_speed[name], "new_tokens": len(r["tokens"]),
               "wall_s": r["wall_s"], "cpu_s": r["cpu_s"], "same_tokens_as_own_baseline": r["tokens"] == baseline["tokens"]}
        for name, r in results.items()}}
    out["ratios"] = {"own baseline / transformers greedy": speed["own baseline"] / speed["transformers greedy"]}
    out["cpu_time_ratios"] = {"own baseline / transformers greedy": cpu_speed["own baseline"] / cpu_speed["transformers greedy"]}
    out["own_baseline_ms_per_step"] = baseline["stats"].verify_ms_total / baseline["stats"].iterations
    if "own n-gram" in results:
        out["cpu_time_ratios"].update({
            "own n-gram / transformers prompt lookup": cpu_speed["own n-gram"] / cpu_speed["transformers prompt lookup"],
            "own n-gram / own baseline": cpu_speed["own n-gram"] / cpu_speed["own baseline"],
        })
        out["ratios"].update({
            "own n-gram / transformers prompt lookup": speed["own n-gram"] / speed["transformers prompt lookup"],
            "own n-gram / own baseline (measured speedup)": speed["own n-gram"] / speed["own baseline"],
            "transformers prompt lookup / transformers greedy": speed["transformers prompt lookup"] / speed["transformers greedy"],
        })
    return out


def theory_section(model: Any, results: dict[str, dict[str, Any]], settings: PerfSettings) -> dict[str, Any]:
    """The verification cost V(t) at the middle of the decode, and theory_comparison for each speculative lane."""
    baseline = results["own baseline"]
    spec_lanes = {"ngram": results["own n-gram"]}
    if "own draft model" in results:
        spec_lanes["draft model"] = results["own draft model"]
    widest = max(settings.gamma, settings.theory_draft_gamma) + 1
    position = baseline["stats"].prompt_tokens + settings.max_new_tokens // 2  # the middle of the decode
    verify_cost, pass_ms = verification_cost(model, position, widest, settings.verify_steps, settings.rounds)
    gammas = {"ngram": settings.gamma, "draft model": settings.theory_draft_gamma}
    return {"verification_cost": {"position": position, "tokens": list(range(1, widest + 1)), "ms": pass_ms, "over_one_token": verify_cost},
            "theory": {lane: theory_comparison(r, baseline, verify_cost, gammas[lane]) for lane, r in spec_lanes.items()}}


def theory_comparison(lane: dict[str, Any], baseline: dict[str, Any], verify_cost: list[float], gamma: int) -> dict[str, Any]:
    """The measured speedup of a speculative lane over the own baseline against the analytical model, fed only with
    what was measured: alpha (the MLE accepted / (accepted + rejections)), c (the drafter's ms per drafted token
    over the baseline's ms per target step), the draft lengths of the steps that ran, and V(t). Three predictions,
    each adding one measured fact to Leviathan's S:
    - leviathan: S = E[T](alpha, gamma) / (gamma c + 1): every step drafts gamma tokens and a verification pass
      costs one target pass;
    - lengths: the same model over the draft lengths that ran (theory.speedup_over_lengths);
    - lengths_and_verify_cost: and each pass of t tokens priced at V(t).
    Measured: the decode phase (prefill excluded from both lanes; the model is one of decoding) and, for context,
    end to end. What separates the last prediction from the decode-phase measurement is the engine's own work per
    step (drafting, sampling, bookkeeping) and how far acceptance is from i.i.d."""
    stats, base = lane["stats"], baseline["stats"]
    base_step_ms = base.verify_ms_total / base.iterations
    alpha = stats.measured_alpha
    c = (stats.draft_ms_total / stats.drafted_tokens) / base_step_ms if stats.drafted_tokens else 0.0
    decode_s_per_token = {name: (r["wall_s"] - r["stats"].prefill_ms / 1e3) / len(r["tokens"]) for name, r in (("base", baseline), ("lane", lane))}
    measured = {"decode_phase": decode_s_per_token["base"] / decode_s_per_token["lane"], "end_to_end": tokens_per_s(lane) / tokens_per_s(baseline)}
    predicted = {
        "leviathan": float(speedup(alpha, gamma, c)),
        "lengths": speedup_over_lengths(alpha, stats.steps_by_draft_length, c),
        "lengths_and_verify_cost": speedup_over_lengths(alpha, stats.steps_by_draft_length, c, verify_cost=verify_cost),
    }
    return {
        "gamma": gamma, "alpha": alpha, "acceptance_rate": stats.acceptance_rate, "c": c, "acceptance_length": stats.acceptance_length,
        "expected_tokens_at_gamma": float(expected_tokens(alpha, gamma)) if alpha is not None else None,
        "mean_draft_length": stats.drafted_tokens / stats.iterations, "steps_by_draft_length": stats.steps_by_draft_length,
        "iterations": stats.iterations, "baseline_ms_per_step": base_step_ms, "verify_ms_per_step": stats.verify_ms_total / stats.iterations,
        "measured": measured, "predicted": predicted,
        "decode_phase_over_predicted": {key: measured["decode_phase"] / value for key, value in predicted.items()},
        "end_to_end_over_predicted": {key: measured["end_to_end"] / value for key, value in predicted.items()},
        "same_tokens_as_baseline": lane["tokens"] == baseline["tokens"],
    }


def run_dtype(dtype: torch.dtype, settings: PerfSettings, prompt: str, probe: bool, sections: set[str], console: Console) -> dict[str, Any]:
    """One dtype's sections: the floor, then the lanes (decode; ngram adds the speculative lanes and the theory)."""
    from transformers import AutoModelForCausalLM

    name = str(dtype).removeprefix("torch.")
    out: dict[str, Any] = {}
    console.print(f"[bold]{name}[/]: loading {settings.target} (specgate runtime)")
    target = load_model(settings.target, dtype=dtype)
    with Progress(console=console, transient=True) as progress:
        if "floor" in sections:
            task = progress.add_task(f"{name}: floor rounds at position {settings.position}", total=settings.rounds)
            out["floor"] = floor_rounds(target.model, settings.gamma, settings.position, settings.steps, settings.rounds, probe,
                                        lambda: progress.advance(task))
        if not sections & {"decode", "ngram"}:
            return out
        hf_model = AutoModelForCausalLM.from_pretrained(str(target.path), dtype=dtype).eval()
        lanes = speculative_lanes(target, hf_model, prompt, settings, "ngram" in sections, dtype)
        task = progress.add_task(f"{name}: lanes x {settings.lane_repeats}, {settings.max_new_tokens} new tokens", total=settings.lane_repeats * len(lanes))
        results = median_runs(lanes, settings.lane_repeats, settings.max_new_tokens, lambda: progress.advance(task))
    out.update(lane_figures(results))
    if "ngram" in sections:
        console.print(f"{name}: target passes of 1..{max(settings.gamma, settings.theory_draft_gamma) + 1} tokens (the verification cost)")
        out.update(theory_section(target.model, results, settings))
    return out


# --- make demo and the machine ------------------------------------------------------------------------------------


def demo_commands(makefile_text: str) -> list[str]:
    """The recipe lines of a Makefile's `demo` target, with $(VENV) = .venv (continued lines joined)."""
    commands, in_demo = [], False
    for line in makefile_text.replace("\\\n", " ").splitlines():
        if not line.startswith("\t"):
            in_demo = line.startswith("demo:")
            continue
        if in_demo:
            commands.append(line.strip().replace("$(VENV)", ".venv"))
    return commands


def peak_rss(command: str, cwd: Path) -> dict[str, Any]:
    """Peak resident set size of one command run as a subprocess (/usr/bin/time -v, else getrusage of children)."""
    argv = shlex.split(command)
    if Path("/usr/bin/time").exists():
        proc = subprocess.run(["/usr/bin/time", "-v", *argv], cwd=cwd, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S)
        match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
        peak_kb = int(match.group(1)) if match else None
        wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", proc.stderr)
        return {"command": command, "exit_status": proc.returncode, "peak_rss_mib": peak_kb / 1024 if peak_kb else None,
                "wall": wall.group(1) if wall else None, "tool": "/usr/bin/time -v"}
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S)
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest child so far, in KiB on Linux
    return {"command": command, "exit_status": proc.returncode, "peak_rss_mib": peak_kb / 1024, "tool": "getrusage"}


def machine() -> dict[str, Any]:
    cpu = next((line.partition(":")[2].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": native_bf16(),
            "default_dtype": str(default_dtype()).removeprefix("torch."), "load_average_start": os.getloadavg()}
