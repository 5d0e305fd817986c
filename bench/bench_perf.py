"""Runtime performance against the memory-bandwidth floor and against transformers, per dtype (one process).

Sections (all but demo_rss run by default; pick with --sections):
- bandwidth: a memory-bandwidth probe: sum (read) and copy (read + write) of a tensor far larger than the caches,
  GB/s = bytes moved / median wall time; the read is the fastest of torch's sum and an AVX2 sum with and
  without software prefetch.
- floor: bytes of weights a batch-1 decode step reads per model and dtype (every layer weight, the full LM head
  (Gemma-3-270M's tied 262k-row head is read in full each step), the KV cache up to the step's position; one
  embedding row), the floor = bytes / read bandwidth, and the measured batch-1 step of specgate's runtime as a
  multiple of it (median of --steps decode steps at position --position, in --rounds rounds of probe + steps);
  also the step through torch's ops instead of the C path, and the step's products alone, one by one.
  bfloat16 here means bf16 weights computed in float32 (CausalLM.compute_dtype); transformers' bf16 computes in
  bf16: both read the same weight bytes.
- decode: own target-only decode (specgate.engine.generate, --draft none) vs transformers greedy
  `generate(do_sample=False)` on the same weights, same dtype, same prompt, tokens/s and the ratio.
- ngram: the own n-gram lane (prompt lookup) vs transformers `generate(prompt_lookup_num_tokens=gamma)` on the
  same input-grounded prompt (examples/prompts/rewrite_code.txt), same dtype, plus an own draft-model lane
  (--theory-draft, default: the target's default draft, gamma --theory-draft-gamma). Every lane runs
  --lane-repeats times, interleaved; each lane's median run is reported. The theory: each speculative lane's
  measured speedup over the own baseline (decode phase and end to end) against the analytical model fed with
  what was measured (alpha, c, the draft lengths that ran, the verification cost V(t) of the runtime's own
  t-token passes): Leviathan's S as written, over the lengths that ran, and with V(t) (theory_comparison).
  Whether the speculative output equals target-only greedy token for token is measured, not assumed.
- head: the LM-head product alone (a 262,144 x 640 weight, Gemma-3-270M's shape) times R = 1..20 rows, by each
  formulation the runtime could use: F.linear (MKL), oneDNN's inner product, specgate's native kernel with
  float32 and with bf16 weights (specgate.models.native); median ms of --steps calls per R, interleaved.
- layers: Gemma-3-270M's 18 layers' products (fused q/k/v 1536 x 640, o 640 x 1024, fused gate/up 4096 x 640, down
  640 x 2048, 18 distinct copies of each so that every product reads its weight from memory as a decode step
  does) times R = 1..64 rows, oneDNN's inner product (float32) vs the native kernel (float32, bf16): median ms
  of --steps sweeps of all 72 products.
- demo_rss: peak resident memory of each command of `make demo` (read from the Makefile; /usr/bin/time -v,
  else getrusage).

Every ratio comes from one run in one process. Run heavy: `flock /tmp/specgate-heavy.lock .venv/bin/python
bench/bench_perf.py [--dtypes bfloat16,float32] [--max-new-tokens 64] [--gamma 4] [--json-out FILE]`.
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

from specgate.drafting import NgramDrafter, NoDrafter, make_drafter
from specgate.engine import generate
from specgate.models import default_dtype, load_model, native_bf16
from specgate.sampling import SamplingParams
from specgate.theory import expected_tokens, speedup, speedup_over_lengths

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
        weight_bf16 = weight.bfloat16()  # [V, H] bf16, 335 MB: the same product reading half the bytes
        lanes["native_ms"] = lambda x: native.skinny_linear(x, weight)
        lanes["native_bf16_ms"] = lambda x: native.skinny_linear(x, weight_bf16)
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
        halves = {w.data_ptr(): w.bfloat16() for w in weights}  # the same weights in bf16
        lanes["native_ms"] = native.skinny_linear
        lanes["native_bf16_ms"] = lambda x, w: native.skinny_linear(x, halves[w.data_ptr()])
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


PROBE_PREFETCH_FLOATS = 1024  # the prefetching read asks 4 KB ahead (faster than 256 B or 16 KB on the Ice Lake VM)


def bandwidth_probe(megabytes: int = 512, repeats: int = 7) -> dict[str, float]:
    """Read GB/s and copy GB/s (bytes read + written) over `megabytes` MB. Read: the fastest of torch's sum, a
    plain AVX2 streaming sum on torch's threads and the same sum with software prefetch 4 KB ahead
    (specgate.models.native.read_sum); each alone can read below what the machine delivers (torch's sum by 20-30%
    on the AMD VM, the plain sum by ~10% on the Ice Lake VM, where the runtime's prefetching kernel read faster
    than it), which would put the floor too high (too easy to meet)."""
    from specgate.models import native

    source = torch.ones(megabytes * (1 << 20) // 4)  # [N] float32
    target = torch.empty_like(source)
    source.sum(), target.copy_(source)  # touch every page before timing
    nbytes = source.numel() * 4
    torch_read_gb_s = nbytes / median_s(lambda: source.sum(), repeats) / 1e9
    out = {"megabytes": megabytes, "torch_sum_read_gb_s": torch_read_gb_s, "read_gb_s": torch_read_gb_s}
    if native.available():
        reads = {"native_read_gb_s": 0, "native_prefetch_read_gb_s": PROBE_PREFETCH_FLOATS}
        for key, prefetch in reads.items():
            native.read_sum(source, prefetch)
            out[key] = nbytes / median_s(lambda: native.read_sum(source, prefetch), repeats) / 1e9
        out["read_gb_s"] = max(torch_read_gb_s, *(out[key] for key in reads))
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
            "products_ms": products_ms(model, args.steps)}


def products_ms(model: Any, steps: int) -> float | None:
    """Median ms of one batch-1 step's matrix products alone, called one by one on the model's own weights (every
    layer's fused q/k/v, o, fused gate/up and down, then the head) through the native kernel, each weight read
    from memory as in a step: step - this is what a step spends besides streaming its weights (norms, RoPE,
    attention, the embedding row, dispatch). None without the kernel."""
    from specgate.models import native

    if not native.available():
        return None
    weights = []
    for block in model.layers:
        attn, mlp = block.self_attn, block.mlp
        weights += [attn.fused.get()[0], attn.o_proj.weight, mlp.fused.get()[0], mlp.down_proj.weight]
    weights.append(model.lm_head.weight)
    inputs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}  # [1, K]

    def products() -> None:
        for weight in weights:
            native.skinny_linear(inputs[weight.shape[1]], weight)

    products()
    return 1e3 * median_s(products, steps)


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
    if "ngram" in sections and args.theory_draft != "none":  # the theory section's second drafter
        console.print(f"{name}: loading the draft model {args.theory_draft!r} (gamma {args.theory_draft_gamma})")
        drafter = make_drafter(args.theory_draft, target, dtype=dtype)
        lanes["own draft model"] = lambda n: own_lane(target, drafter, args.theory_draft_gamma, prompt, n)
    for lane_name, lane in lanes.items():  # warm-up: first-call allocations and kernels out of the timed runs
        console.print(f"{name}: warm-up {lane_name}")
        lane(4)
    runs: dict[str, list[dict[str, Any]]] = {lane_name: [] for lane_name in lanes}
    with Progress(console=console, transient=True) as progress:  # interleaved: a slow phase hits every lane alike
        task = progress.add_task(f"{name}: lanes x {args.lane_repeats}, {args.max_new_tokens} new tokens", total=args.lane_repeats * len(lanes))
        for _ in range(args.lane_repeats):
            for lane_name, lane in lanes.items():
                runs[lane_name].append(lane(args.max_new_tokens))
                progress.advance(task)
    results = {lane_name: sorted(r, key=lambda run: run["wall_s"])[len(r) // 2] for lane_name, r in runs.items()}  # the median run
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
        out["cpu_time_ratios"].update({
            "own n-gram / transformers prompt lookup": cpu_speed["own n-gram"] / cpu_speed["transformers prompt lookup"],
            "own n-gram / own baseline": cpu_speed["own n-gram"] / cpu_speed["own baseline"],
        })
        out["ratios"].update({
            "own n-gram / transformers prompt lookup": speed["own n-gram"] / speed["transformers prompt lookup"],
            "own n-gram / own baseline (measured speedup)": speed["own n-gram"] / speed["own baseline"],
            "transformers prompt lookup / transformers greedy": speed["transformers prompt lookup"] / speed["transformers greedy"],
        })
        spec_lanes = {"ngram": results["own n-gram"]}
        if "own draft model" in results:
            spec_lanes["draft model"] = results["own draft model"]
        widest = max(args.gamma, args.theory_draft_gamma) + 1
        position = base_stats.prompt_tokens + args.max_new_tokens // 2  # the middle of the decode
        console.print(f"{name}: target passes of 1..{widest} tokens at position {position} (the verification cost)")
        verify_cost, pass_ms = verification_cost(target.model, position, widest, args.verify_steps, args.rounds)
        out["verification_cost"] = {"position": position, "tokens": list(range(1, widest + 1)), "ms": pass_ms, "over_one_token": verify_cost}
        out["theory"] = {lane: theory_comparison(r, baseline, verify_cost, args.gamma if lane == "ngram" else args.theory_draft_gamma)
                         for lane, r in spec_lanes.items()}
    del hf_model
    return out


def verification_cost(model: Any, position: int, widest: int, steps: int, rounds: int) -> tuple[list[float], list[float]]:
    """V(t), t = 1..widest: what a batch-1 target pass of t tokens at `position` costs in 1-token passes. The
    runtime alone, no engine: what the hardware charges for verifying t - 1 drafts. In `rounds` rounds, each the
    median ms of `steps` passes per t, the t interleaved; V is the median over rounds of each round's ratios, so a
    slow phase of this shared machine (which moves a round's passes together) does not skew it. Returns (V, ms)."""
    forwards = [step_forward(model, position, t) for t in range(1, widest + 1)]
    for forward in forwards:
        forward()  # warm-up
    round_ms = []
    for _ in range(rounds):
        times: list[list[float]] = [[] for _ in forwards]
        for _ in range(steps):
            for t, forward in enumerate(forwards):
                start = time.perf_counter()
                forward()
                times[t].append(1e3 * (time.perf_counter() - start))
        round_ms.append([sorted(t)[len(t) // 2] for t in times])
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    ratios = [median([ms[t] / ms[0] for ms in round_ms]) for t in range(widest)]
    return ratios, [median([ms[t] for ms in round_ms]) for t in range(widest)]


def theory_comparison(lane: dict[str, Any], baseline: dict[str, Any], verify_cost: list[float], gamma: int) -> dict[str, Any]:
    """The measured speedup of a speculative lane over the own baseline against the analytical model, fed only with
    what was measured: alpha (the MLE accepted / (accepted + rejections)), c (the drafter's ms per drafted token
    over the baseline's ms per target step), the draft lengths of the steps that ran, and V(t) from the runtime's
    own passes (verification_cost). Three predictions, each adding one measured fact to Leviathan's S:
    - leviathan: S = E[T](alpha, gamma) / (gamma c + 1): every step drafts gamma tokens and a verification pass
      costs one target pass;
    - lengths: the same model over the draft lengths that ran (theory.speedup_over_lengths);
    - lengths_and_verify_cost: and each pass of t tokens priced at V(t).
    Measured: the decode phase (prefill excluded from both lanes; the model is one of decoding) and, for
    context, end to end. What separates the last prediction from the decode-phase measurement is the engine's
    own work per step (drafting, sampling, bookkeeping) and how far acceptance is from i.i.d."""
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
              f"AVX2 sum {b.get('native_read_gb_s', float('nan')):.1f}, with prefetch {b.get('native_prefetch_read_gb_s', float('nan')):.1f}), "
              f"copy {b['copy_gb_s']:.1f} GB/s\n")
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
                if f.get("products_ms") is not None:
                    print(f"{d}: the step's products alone, one by one: {f['products_ms']:.1f} ms of the {f['step_ms']:.1f} ms step "
                          f"(the rest, {f['step_ms'] - f['products_ms']:.1f} ms: norms, RoPE, attention, embedding, dispatch)")
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
                if "verification_cost" in r:
                    v = r["verification_cost"]
                    print(f"{d}: verification cost V(t) at position {v['position']}: " +
                          ", ".join(f"t={t} {ms:.1f} ms ({ratio:.2f}x)" for t, ms, ratio in zip(v["tokens"], v["ms"], v["over_one_token"])))
                for lane, t in r.get("theory", {}).items():
                    p, m = t["predicted"], t["measured"]
                    print(f"{d}: theory, {lane} (gamma {t['gamma']}): alpha {t['alpha']:.3f} (AR {t['acceptance_rate']:.3f}), c {t['c']:.4f}, "
                          f"AL {t['acceptance_length']:.2f} vs E[T] {t['expected_tokens_at_gamma']:.2f}, mean draft length {t['mean_draft_length']:.2f}, "
                          f"steps by draft length {t['steps_by_draft_length']}")
                    print(f"{d}:   measured speedup: decode phase {m['decode_phase']:.2f}x, end to end {m['end_to_end']:.2f}x; predicted: "
                          f"Leviathan {p['leviathan']:.2f}x, over the lengths that ran {p['lengths']:.2f}x, and with V(t) {p['lengths_and_verify_cost']:.2f}x")
                    print(f"{d}:   decode phase / predicted: " + ", ".join(f"{k} {v:.2f}" for k, v in t["decode_phase_over_predicted"].items()) +
                          "; end to end / predicted: " + ", ".join(f"{k} {v:.2f}" for k, v in t["end_to_end_over_predicted"].items()))
        print()
    for section in ("head", "layers"):
        if report.get(section):
            names = [name for name in ("f_linear_ms", "onednn_ms", "native_ms", "native_bf16_ms") if name in report[section][0]]
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
