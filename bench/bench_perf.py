"""Runtime performance against the memory-bandwidth floor and against transformers, per dtype (one process).

Sections (all but demo_rss run by default; pick with --sections):
- bandwidth: a memory-bandwidth probe: sum (read) and copy (read + write) of a tensor far larger than the caches,
  GB/s = bytes moved / median wall time.
- floor: bytes of weights a batch-1 decode step reads per model and dtype (every layer weight, the full LM head
  (Gemma-3-270M's tied 262k-row head is read in full each step), the KV cache up to the step's position; one
  embedding row), the floor = bytes / read bandwidth, and the measured batch-1 step of specgate's runtime as a
  multiple of it (median of --steps decode steps at position --position).
- decode: own target-only decode (specgate.engine.generate, --draft none) vs transformers greedy
  `generate(do_sample=False)` on the same weights, same dtype, same prompt, tokens/s and the ratio.
- ngram: the own n-gram lane (prompt lookup) vs transformers `generate(prompt_lookup_num_tokens=gamma)` on the
  same input-grounded prompt (examples/prompts/rewrite_code.txt), same dtype; the measured speedup of the n-gram
  lane over the own baseline against Leviathan's prediction S = (1 - a^(g+1)) / ((1 - a)(g c + 1)) from the
  measured alpha and c (c = draft ms per drafted token / the baseline's target ms per step); whether the
  speculative output equals target-only greedy token for token (in bf16 a multi-token verify pass and a 1-token
  pass may round differently, so this is measured, not assumed).
- head: the LM-head product alone (a float32 262,144 x 640 weight, Gemma-3-270M's shape) times R = 1..20 rows, by
  each formulation the runtime could use: F.linear (MKL), oneDNN's inner product, specgate's native kernel
  (specgate.models.native); median ms of --steps calls per R, the three interleaved (not with --dtypes: float32).
- layers: Gemma-3-270M's 18 layers' products (fused q/k/v 1536 x 640, o 640 x 1024, fused gate/up 4096 x 640, down
  640 x 2048, float32, 18 distinct copies of each so that every product reads its weight from memory as a decode
  step does) times R = 1..64 rows, oneDNN's inner product vs the native kernel: median ms of --steps sweeps of all
  72 products (not with --dtypes: float32).
- demo_rss: peak resident memory of each command of `make demo` (read from the Makefile; /usr/bin/time -v,
  else getrusage).

Every ratio comes from one run in one process. Run heavy: `flock /tmp/specgate-heavy.lock .venv/bin/python
bench/bench_perf.py [--dtypes float32,bfloat16] [--max-new-tokens 64] [--gamma 8] [--json-out FILE]`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress

from specgate.drafting import NgramDrafter, NoDrafter
from specgate.engine import generate
from specgate.models import default_dtype, load_model, native_bf16
from specgate.sampling import SamplingParams
from specgate.theory import speedup

ROOT = Path(__file__).resolve().parent.parent
PROMPT_FILE = ROOT / "examples" / "prompts" / "rewrite_code.txt"
DEMO_TIMEOUT_S = 1200


def demo_commands() -> list[str]:
    """The recipe lines of the Makefile's `demo` target, with $(VENV) = .venv, run from the repository root."""
    commands, in_demo = [], False
    for line in (ROOT / "Makefile").read_text().replace("\\\n", " ").splitlines():
        if not line.startswith("\t"):
            in_demo = line.startswith("demo:")
            continue
        if in_demo:
            commands.append(line.strip().replace("$(VENV)", ".venv"))
    return commands

SECTIONS = ("bandwidth", "floor", "decode", "ngram", "head", "layers", "demo_rss")
HEAD_ROWS = (1, 2, 3, 5, 9, 12, 16, 20)
LAYER_ROWS = (1, 2, 5, 9, 16, 32, 64)
LAYER_SHAPES = {"qkv": (1536, 640), "o": (640, 1024), "gate_up": (4096, 640), "down": (640, 2048)}  # [N, K]
console = Console(stderr=True)


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def head_products(steps: int) -> list[dict[str, Any]]:
    """Median ms of the head product per row count and formulation (interleaved call by call)."""
    from specgate.models import native

    weight = torch.randn(262_144, 640, generator=torch.Generator().manual_seed(0))  # [V, H] float32, 671 MB
    lanes = {
        "f_linear_ms": lambda x: torch.nn.functional.linear(x, weight),
        "onednn_ms": lambda x: torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], ""),
    }
    if native.available():
        lanes["native_ms"] = lambda x: native.skinny_linear(x, weight)
    rows_out = []
    with torch.inference_mode(), Progress(console=console, transient=True) as progress:
        task = progress.add_task("head products", total=len(HEAD_ROWS))
        for rows in HEAD_ROWS:
            x = torch.randn(rows, 640)  # [R, H]
            times: dict[str, list[float]] = {name: [] for name in lanes}
            for name, fn in lanes.items():
                fn(x)  # warm-up
            for _ in range(steps):
                for name, fn in lanes.items():
                    start = time.perf_counter()
                    fn(x)
                    times[name].append(time.perf_counter() - start)
            rows_out.append({"rows": rows, **{name: 1e3 * sorted(t)[len(t) // 2] for name, t in times.items()}})
            progress.advance(task)
    return rows_out


def layer_products(steps: int, num_layers: int = 18) -> list[dict[str, Any]]:
    """Median ms of one step's layer products (num_layers copies of each shape) per row count and formulation."""
    from specgate.models import native

    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=generator) for _ in range(num_layers) for n, k in LAYER_SHAPES.values()]
    lanes = {"onednn_ms": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")}
    if native.available():
        lanes["native_ms"] = native.skinny_linear
    rows_out = []
    with torch.inference_mode(), Progress(console=console, transient=True) as progress:
        task = progress.add_task("layer products", total=len(LAYER_ROWS))
        for rows in LAYER_ROWS:
            inputs = {k: torch.randn(rows, k, generator=generator) for k in {k for _, k in LAYER_SHAPES.values()}}  # [R, K]
            sweep = {name: (lambda fn=fn: [fn(inputs[w.shape[1]], w) for w in weights]) for name, fn in lanes.items()}
            times: dict[str, list[float]] = {name: [] for name in lanes}
            for fn in sweep.values():
                fn()  # warm-up
            for _ in range(steps):
                for name, fn in sweep.items():
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            rows_out.append({"rows": rows, **{name: 1e3 * sorted(t)[len(t) // 2] for name, t in times.items()}})
            progress.advance(task)
    return rows_out


# --- bandwidth and the floor ------------------------------------------------------------------------------------


def bandwidth_probe(megabytes: int = 512, repeats: int = 7) -> dict[str, float]:
    """Read GB/s and copy GB/s (bytes read + written) over `megabytes` MB. Read: the faster of torch's sum and a
    plain AVX2 streaming sum on torch's threads (specgate.models.native.read_sum); torch's sum alone reads
    ~20-30% below what the machine delivers here, which would put the floor too high (too easy to meet)."""
    from specgate.models import native

    source = torch.ones(megabytes * (1 << 20) // 4)  # [N] float32
    target = torch.empty_like(source)
    source.sum(), target.copy_(source)  # touch every page before timing
    nbytes = source.numel() * 4
    torch_read_gb_s = nbytes / median_s(lambda: source.sum(), repeats) / 1e9
    out = {"megabytes": megabytes, "torch_sum_read_gb_s": torch_read_gb_s, "read_gb_s": torch_read_gb_s}
    if native.available():
        native.read_sum(source)
        out["native_read_gb_s"] = nbytes / median_s(lambda: native.read_sum(source), repeats) / 1e9
        out["read_gb_s"] = max(torch_read_gb_s, out["native_read_gb_s"])
    out["copy_gb_s"] = 2 * nbytes / median_s(lambda: target.copy_(source), repeats) / 1e9
    return out


def step_bytes(model: Any, position: int) -> dict[str, int]:
    """Bytes a batch-1 decode step at `position` reads: weights (tied head counted once, in full), KV, one embedding row."""
    seen, weights = set(), 0
    for param in model.parameters():  # parameters() yields a tied weight once
        if param.data_ptr() in seen:
            continue
        seen.add(param.data_ptr())
        weights += param.numel() * param.element_size()
    args = model.args
    embed = model.embed_tokens.weight
    tied = model.lm_head.weight.data_ptr() == embed.data_ptr()
    if not tied:  # an untied embedding table is not read in full: only the token's row
        weights -= embed.numel() * embed.element_size()
    row = embed.shape[1] * embed.element_size()
    kv = 2 * args.num_layers * args.num_kv_heads * args.head_dim * (position + 1) * embed.element_size()
    return {"weights": weights, "kv_cache": kv, "embedding_row": row, "total": weights + kv + row}


@contextlib.contextmanager
def torch_attention_path():
    """Within: the runtime's norms, RoPE, cache writes and attention go through torch ops (F.rms_norm, index_put,
    SDPA) instead of specgate.models.native's C path; the products stay as they are."""
    from specgate.models import native

    saved = native.attention_applies, native.norm_applies
    native.attention_applies = native.norm_applies = lambda *args: False
    try:
        yield
    finally:
        native.attention_applies, native.norm_applies = saved


def step_forward(model: Any, position: int, num_tokens: int = 1):
    """A callable running one batch-1 forward of num_tokens tokens at `position` (the cache holds `position`
    earlier tokens); num_tokens = gamma + 1 is a verification step."""
    cache, slots = model.new_cache(1, position + num_tokens + 1), torch.zeros(1, dtype=torch.int64)
    ids = torch.randint(0, 1000, (1, position), generator=torch.Generator().manual_seed(0))  # [1, P]
    tokens = torch.full((1, num_tokens), 7)  # [1, T]
    where = torch.arange(position, position + num_tokens)[None]  # [1, T]
    with torch.inference_mode():
        model(ids, torch.arange(position)[None], cache, slots, last_only=True)
        model(tokens, where, cache, slots)

    def forward() -> None:
        with torch.inference_mode():
            model(tokens, where, cache, slots)

    return forward


def floor_rounds(model: Any, args: argparse.Namespace, probe: bool) -> dict[str, Any]:
    """--rounds rounds, each: the read-bandwidth probe, then the median of --steps 1-token steps and of --steps
    (gamma+1)-token steps, through the C attention path and through torch's; medians over rounds of each figure
    and of the per-round ratios (a round's step and its floor are measured back to back, so a slow phase of this
    shared machine moves both)."""
    verify_tokens = args.gamma + 1
    nbytes = step_bytes(model, args.position)
    forwards = {"step_ms": step_forward(model, args.position), "verify_ms": step_forward(model, args.position, verify_tokens)}
    rounds = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("floor rounds", total=args.rounds)
        for _ in range(args.rounds):
            row: dict[str, float] = {}
            if probe:
                bandwidth = bandwidth_probe(repeats=3)
                row["read_gb_s"] = bandwidth["read_gb_s"]
                row["floor_ms"] = nbytes["total"] / (bandwidth["read_gb_s"] * 1e9) * 1e3
            for key, forward in forwards.items():
                row[key] = 1e3 * median_s(forward, args.steps)
            with torch_attention_path():
                for key, forward in forwards.items():
                    row[f"torch_path_{key}"] = 1e3 * median_s(forward, args.steps)
            row["verify_over_step"] = row["verify_ms"] / row["step_ms"]
            row["torch_path_verify_over_step"] = row["torch_path_verify_ms"] / row["torch_path_step_ms"]
            row["torch_path_over_c_path"] = row["torch_path_step_ms"] / row["step_ms"]
            if probe:
                row["step_over_floor"] = row["step_ms"] / row["floor_ms"]
                row["achieved_gb_s"] = nbytes["total"] / (row["step_ms"] / 1e3) / 1e9
            rounds.append(row)
            progress.advance(task)
    median = {key: sorted(r[key] for r in rounds)[len(rounds) // 2] for key in rounds[0]}
    return {"bytes_per_step": nbytes, "verify_tokens": verify_tokens, "rounds": rounds, **median,
            "glue_step_ms": glue_step_ms(model, forwards["step_ms"], args.steps)}


def glue_step_ms(model: Any, forward, steps: int) -> float | None:
    """Median ms of the same 1-token step with every native product replaced by its own output, computed once
    beforehand: what the step costs besides reading the weights (norms, RoPE, attention, Python, small ops).
    A measurement device only: the logits of such a step are stale."""
    from specgate.models import native

    if not native.available():
        return None
    real, outputs = native.skinny_product, {}

    def cached(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        key = (tuple(x.shape), weight.data_ptr())
        if key not in outputs:
            outputs[key] = real(x, weight)
        return outputs[key]

    native.skinny_product = cached
    try:
        forward()  # fill the cache
        return 1e3 * median_s(forward, steps)
    finally:
        native.skinny_product = real


# --- lanes ------------------------------------------------------------------------------------------------------


def own_lane(target: Any, drafter: Any, gamma: int, prompt: str, max_new_tokens: int) -> dict[str, Any]:
    cpu_start = time.process_time()
    result = generate(prompt, target, drafter, gamma, SamplingParams(temperature=0.0), seed=0, max_new_tokens=max_new_tokens)
    stats = result.stats
    return {"tokens": result.tokens, "wall_s": stats.wall_s, "cpu_s": time.process_time() - cpu_start, "stats": stats}


def hf_lane(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int, lookup: int | None) -> dict[str, Any]:
    inputs = tokenizer(prompt, return_tensors="pt")
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, top_p=None, top_k=None, temperature=None)
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = lookup
    start, cpu_start = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = model.generate(**inputs, **kwargs)
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    return {"tokens": out[0, inputs["input_ids"].shape[1] :].tolist(), "wall_s": wall_s, "cpu_s": cpu_s, "stats": None}


def tokens_per_s(lane: dict[str, Any]) -> float:
    return len(lane["tokens"]) / lane["wall_s"]


def run_dtype(dtype: torch.dtype, args: argparse.Namespace, bandwidth: dict[str, float] | None, sections: set[str]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    name = str(dtype).removeprefix("torch.")
    out: dict[str, Any] = {}
    console.print(f"[bold]{name}[/]: loading gemma-3-270m (specgate runtime)")
    target = load_model("gemma-3-270m", dtype=dtype)
    if "floor" in sections:
        console.print(f"{name}: batch-1 decode steps at position {args.position}, {args.rounds} rounds")
        out["floor"] = floor_rounds(target.model, args, bandwidth is not None)
    if not sections & {"decode", "ngram"}:
        return out

    console.print(f"{name}: loading transformers' Gemma3ForCausalLM from {target.path}")
    hf_model = AutoModelForCausalLM.from_pretrained(str(target.path), dtype=dtype).eval()
    tokenizer = target.tokenizer
    prompt = PROMPT_FILE.read_text(encoding="utf-8")
    lanes = {"own baseline": lambda n: own_lane(target, NoDrafter(), 0, prompt, n),
             "transformers greedy": lambda n: hf_lane(hf_model, tokenizer, prompt, n, None)}
    if "ngram" in sections:
        lanes["own n-gram"] = lambda n: own_lane(target, NgramDrafter(), args.gamma, prompt, n)
        lanes["transformers prompt lookup"] = lambda n: hf_lane(hf_model, tokenizer, prompt, n, args.gamma)
    for lane_name, lane in lanes.items():  # warm-up: first-call allocations and kernels out of the timed runs
        console.print(f"{name}: warm-up {lane_name}")
        lane(4)
    results = {}
    for lane_name, lane in lanes.items():
        console.print(f"{name}: {lane_name}, {args.max_new_tokens} new tokens")
        results[lane_name] = lane(args.max_new_tokens)
    speed = {lane_name: tokens_per_s(r) for lane_name, r in results.items()}
    baseline = results["own baseline"]
    cpu_speed = {lane_name: len(r["tokens"]) / r["cpu_s"] for lane_name, r in results.items()}
    out["lanes"] = {
        lane_name: {"tokens_per_s": speed[lane_name], "tokens_per_cpu_s": cpu_speed[lane_name], "new_tokens": len(r["tokens"]),
                    "wall_s": r["wall_s"], "cpu_s": r["cpu_s"],
                    "same_tokens_as_own_baseline": r["tokens"] == baseline["tokens"]}
        for lane_name, r in results.items()
    }
    out["ratios"] = {"own baseline / transformers greedy": speed["own baseline"] / speed["transformers greedy"]}
    out["cpu_time_ratios"] = {"own baseline / transformers greedy": cpu_speed["own baseline"] / cpu_speed["transformers greedy"]}
    base_stats = baseline["stats"]
    out["own_baseline_ms_per_step"] = base_stats.verify_ms_total / base_stats.iterations
    if "ngram" in sections:
        stats = results["own n-gram"]["stats"]
        alpha = stats.measured_alpha
        c = (stats.draft_ms_total / stats.drafted_tokens) / out["own_baseline_ms_per_step"] if stats.drafted_tokens else None
        predicted = float(speedup(alpha, args.gamma, c)) if alpha is not None and c is not None else None
        measured = speed["own n-gram"] / speed["own baseline"]
        # Leviathan's model prices a verification step like a 1-token step. On a CPU a (gamma+1)-token step costs
        # more; folding that growth into c (per drafted token) gives the prediction the engine can be held to.
        verify_growth = stats.verify_ms_total / stats.iterations / out["own_baseline_ms_per_step"] - 1.0
        c_effective = (c or 0.0) + verify_growth / args.gamma
        predicted_effective = float(speedup(alpha, args.gamma, c_effective)) if alpha is not None else None
        out["cpu_time_ratios"].update({
            "own n-gram / transformers prompt lookup": cpu_speed["own n-gram"] / cpu_speed["transformers prompt lookup"],
            "own n-gram / own baseline": cpu_speed["own n-gram"] / cpu_speed["own baseline"],
        })
        out["ratios"].update({
            "own n-gram / transformers prompt lookup": speed["own n-gram"] / speed["transformers prompt lookup"],
            "own n-gram / own baseline (measured speedup)": measured,
            "transformers prompt lookup / transformers greedy": speed["transformers prompt lookup"] / speed["transformers greedy"],
        })
        # the decode phase alone (prefill excluded from both lanes), against what the measured tokens per step and
        # the measured step costs account for: what is left between them is the engine's own per-step work
        ngram = results["own n-gram"]
        decode_s_per_token = {name: (r["wall_s"] - r["stats"].prefill_ms / 1e3) / len(r["tokens"])  # prefill emits none
                              for name, r in (("baseline", baseline), ("ngram", ngram))}
        decode_speedup = decode_s_per_token["baseline"] / decode_s_per_token["ngram"]
        accounted = stats.acceptance_length * out["own_baseline_ms_per_step"] / (stats.verify_ms_total / stats.iterations)
        out["theory"] = {
            "decode_phase_speedup": decode_speedup, "accounted_speedup": accounted,
            "decode_phase_over_accounted": decode_speedup / accounted,
            "gamma": args.gamma, "measured_alpha": alpha, "c": c, "predicted_speedup": predicted,
            "measured_speedup": measured, "measured_over_predicted": measured / predicted if predicted else None,
            "c_effective": c_effective, "predicted_speedup_effective_c": predicted_effective,
            "measured_over_predicted_effective_c": measured / predicted_effective if predicted_effective else None,
            "acceptance_length": stats.acceptance_length, "drafted_tokens": stats.drafted_tokens,
            "iterations": stats.iterations, "verify_ms_per_step": stats.verify_ms_total / stats.iterations,
            "baseline_verify_ms_per_step": out["own_baseline_ms_per_step"],
        }
    del hf_model
    return out


# --- make demo ---------------------------------------------------------------------------------------------------


def demo_peak_rss() -> list[dict[str, Any]]:
    """Peak resident set size of each `make demo` command, measured around a subprocess run."""
    rows = []
    for command in demo_commands():
        console.print(f"demo: {command}")
        argv = shlex.split(command)
        if Path("/usr/bin/time").exists():
            proc = subprocess.run(["/usr/bin/time", "-v", *argv], cwd=ROOT, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S)
            match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
            peak_kb = int(match.group(1)) if match else None
            wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", proc.stderr)
            rows.append({"command": command, "exit_status": proc.returncode, "peak_rss_mib": peak_kb / 1024 if peak_kb else None,
                         "wall": wall.group(1) if wall else None, "tool": "/usr/bin/time -v"})
        else:  # ru_maxrss of children: the largest child so far, in KiB on Linux
            proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S)
            peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            rows.append({"command": command, "exit_status": proc.returncode, "peak_rss_mib": peak_kb / 1024, "tool": "getrusage"})
    return rows


# --- report ------------------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = next((line.partition(":")[2].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": native_bf16(),
            "default_dtype": str(default_dtype()).removeprefix("torch."), "load_average_start": os.getloadavg()}


def print_markdown(report: dict[str, Any]) -> None:
    m = report["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['cpu_capability']}), {m['threads']} threads, "
          f"native bf16: {m['native_bf16']}, default_dtype: {m['default_dtype']}, load {m['load_average_start']} -> {report['load_average_end']}")
    if "bandwidth" in report:
        b = report["bandwidth"]
        print(f"bandwidth probe ({b['megabytes']} MB): read {b['read_gb_s']:.1f} GB/s (torch sum {b['torch_sum_read_gb_s']:.1f}, "
              f"AVX2 sum {b.get('native_read_gb_s', float('nan')):.1f}), copy {b['copy_gb_s']:.1f} GB/s\n")
    rows = [(d, r) for d, r in report["dtypes"].items()]
    if any("floor" in r for _, r in rows):
        print("Medians over rounds (each round: probe, then the steps, back to back):")
        print("| dtype | MB read per step | read GB/s | floor ms | step ms | step / floor | achieved GB/s | verify / step | "
              "torch-path step ms | torch path / C path | torch-path verify / step |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for d, r in rows:
            f = r.get("floor")
            if f and "floor_ms" in f:
                print(f"| {d} | {f['bytes_per_step']['total'] / 1e6:.0f} | {f['read_gb_s']:.1f} | {f['floor_ms']:.1f} | {f['step_ms']:.1f} | "
                      f"{f['step_over_floor']:.2f}x | {f['achieved_gb_s']:.1f} | {f['verify_over_step']:.2f}x | "
                      f"{f['torch_path_step_ms']:.1f} | {f['torch_path_over_c_path']:.2f}x | {f['torch_path_verify_over_step']:.2f}x |")
        for d, r in rows:
            f = r.get("floor")
            if f and "floor_ms" in f:
                print(f"{d}: step / floor per round: " + ", ".join(f"{row['step_over_floor']:.2f}x" for row in f["rounds"]) +
                      "; verify / step per round: " + ", ".join(f"{row['verify_over_step']:.2f}x" for row in f["rounds"]))
                if f.get("glue_step_ms") is not None:
                    print(f"{d}: the step without its products (each replaced by its precomputed output): {f['glue_step_ms']:.1f} ms "
                          f"of {f['step_ms']:.1f}")
        print()
    if any("lanes" in r for _, r in rows):
        names = list(next(r for _, r in rows if "lanes" in r)["lanes"])
        print("| dtype | " + " | ".join(f"{n} tok/s" for n in names) + " |")
        print("|---|" + "---|" * len(names))
        for d, r in rows:
            if "lanes" in r:
                print(f"| {d} | " + " | ".join(f"{r['lanes'][n]['tokens_per_s']:.1f}" for n in names) + " |")
        print()
        for d, r in rows:
            if "lanes" in r:
                print(f"{d}: " + "; ".join(f"{k} {v:.2f}x" for k, v in r["ratios"].items()))
                print(f"{d}: by CPU seconds: " + "; ".join(f"{k} {v:.2f}x" for k, v in r["cpu_time_ratios"].items()))
                print(f"{d}: same tokens as own baseline: " + ", ".join(f"{n} {r['lanes'][n]['same_tokens_as_own_baseline']}" for n in names))
                if "theory" in r:
                    t = r["theory"]
                    print(f"{d}: theory: alpha {t['measured_alpha']:.3f}, c {t['c']:.4f}, gamma {t['gamma']}, predicted {t['predicted_speedup']:.2f}x, "
                          f"measured {t['measured_speedup']:.2f}x ({t['measured_over_predicted']:.2f} of predicted); with the verify step's growth in c: "
                          f"c_eff {t['c_effective']:.3f}, predicted {t['predicted_speedup_effective_c']:.2f}x, measured/predicted {t['measured_over_predicted_effective_c']:.2f}; AL {t['acceptance_length']:.2f}, "
                          f"verify ms/step {t['verify_ms_per_step']:.1f} vs baseline {t['baseline_verify_ms_per_step']:.1f}")
                    print(f"{d}: decode phase (prefill excluded): measured {t['decode_phase_speedup']:.2f}x; AL x baseline step / verify step "
                          f"= {t['accounted_speedup']:.2f}x; measured / that {t['decode_phase_over_accounted']:.2f} (the rest is the engine's own work)")
        print()
    for section in ("head", "layers"):
        if report.get(section):
            names = [name for name in ("f_linear_ms", "onednn_ms", "native_ms") if name in report[section][0]]
            print(f"{section}:\n| rows | " + " | ".join(names) + " |")
            print("|" + "---|" * (len(names) + 1))
            for row in report[section]:
                print(f"| {row['rows']} | " + " | ".join(f"{row[name]:.1f}" for name in names) + " |")
            print()
    for row in report.get("demo_rss", []):
        print(f"demo peak RSS {row['peak_rss_mib']:.0f} MiB (exit {row['exit_status']}, {row.get('wall')}): {row['command']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="bandwidth,floor,decode,ngram",
                        help=f"comma-separated subset of {','.join(SECTIONS)} (demo_rss runs `make demo`'s commands: minutes)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=8, help="n-gram draft length and transformers' prompt_lookup_num_tokens")
    parser.add_argument("--position", type=int, default=128, help="KV position of the timed batch-1 decode steps")
    parser.add_argument("--steps", type=int, default=15, help="timed decode steps (median)")
    parser.add_argument("--rounds", type=int, default=5, help="floor section: rounds of probe + steps (medians over rounds)")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the report as JSON here")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, = cores); 1 avoids thread stalls on a shared VM")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sections = set(args.sections.split(","))
    unknown = sections - set(SECTIONS)
    if unknown:
        parser.error(f"--sections {sorted(unknown)} unknown: use a subset of {','.join(SECTIONS)}")

    report: dict[str, Any] = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(), "dtypes": {}}
    if sections & {"bandwidth", "floor"}:
        console.print("bandwidth probe")
        report["bandwidth"] = bandwidth_probe()
    for name in args.dtypes.split(","):
        if sections & {"floor", "decode", "ngram"}:
            report["dtypes"][name] = run_dtype(getattr(torch, name), args, report.get("bandwidth"), sections)
    if "head" in sections:
        console.print("LM-head products by row count")
        report["head"] = head_products(args.steps)
    if "layers" in sections:
        console.print("layer products by row count")
        report["layers"] = layer_products(args.steps)
    if "demo_rss" in sections:
        report["demo_rss"] = demo_peak_rss()
    report["load_average_end"] = os.getloadavg()
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))
    print_markdown(report)


if __name__ == "__main__":
    main()
