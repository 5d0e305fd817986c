"""Gemma-3-270M's drafts against its own gamma = 0 baseline, batch 1 (bench/bench_draft.py).

Prompts are held out of the draft's training text (workloads.held_out_prompts). Each prompt runs once per lane,
lanes interleaved prompt by prompt (background load hits every lane alike), after one warm-up of every lane.
Lanes (DRAFT_LANES; temperature 0 unless named): own baseline; the small draft model (registry.DRAFT_MODEL_DIRS)
at gamma 1, 2, 3; prompt lookup alone (`--draft ngram`) at gamma 6; the EAGLE drafter (`--draft default`: the head
shipped, or --eagle DIR; lookups where the context repeats, the head's chain elsewhere) at gamma 3, 4, 6, 8 (head
chains stop where the head is unsure: gamma is the longest), with every head chain gamma long ("fixed", gamma 4)
and without lookups ("head", gamma 6); the self-speculative candidate (the target's first 6 layers + final norm +
the same reduced head, untrained) at gamma 2 (only when named: its alpha is near 0); at temperature 1 the
baseline, the draft model at gamma 3, lookup at gamma 6, the EAGLE drafter at gamma 6 and fixed 4 and the head
alone at gamma 6 (the same seeds); transformers' greedy generate() on the same weights.

Speedup = baseline wall time / lane wall time summed over a category's prompts (tokens per second), prefill
included; decode_speedup leaves the (identical) prefill out of both. alpha, c, AL come from the engine's counters;
theory_speedup is Leviathan's S(alpha, gamma, c) from the measured alpha and c (it takes every chain gamma long).
Speedup and AL carry 95% bootstrap CIs over a category's prompt runs; with seeds > 1 the sampled lanes run each
prompt under that many seeds, so their CIs cover the sample paths as well as the prompts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from specgate.bench.generation import hf_run, own_run, prompt_ids
from specgate.drafting import NoDrafter, distill, make_drafter
from specgate.drafting.build_default import PACKAGE_DRAFT_DIR
from specgate.gate.quality import BOOTSTRAP_RESAMPLES
from specgate.theory import speedup as theory_speedup

# lane -> (drafter spec: "none", "default" or "self-spec:L", gamma, temperature)
DRAFT_LANES = {
    "baseline": ("none", 0, 0.0),
    "draft-model g2": ("draft-model", 2, 0.0),  # the small draft model (registry.DRAFT_MODEL_DIRS)
    "draft-model g3": ("draft-model", 3, 0.0),
    "draft-model g1": ("draft-model", 1, 0.0),
    "self-spec 6L g2": ("self-spec:6", 2, 0.0),
    "baseline T=1": ("none", 0, 1.0),
    "draft-model g3 T=1": ("draft-model", 3, 1.0),
    "ngram g6": ("ngram", 6, 0.0),  # prompt lookup alone (`--draft ngram`)
    "eagle g3": ("eagle", 3, 0.0),  # the EAGLE drafter: --eagle DIR, else the one shipped (`--draft default`):
    "eagle g4": ("eagle", 4, 0.0),  # lookups where the context repeats, else the head's chain, which stops early
    "eagle g6": ("eagle", 6, 0.0),  # where the head is unsure (eagle_drafter.LOOKUP_MIN_N, STOP_BELOW)
    "eagle g8": ("eagle", 8, 0.0),
    "eagle g4 fixed": ("eagle-fixed", 4, 0.0),  # every head chain gamma long (stop_below 0)
    "head g6": ("eagle-head", 6, 0.0),  # the head alone, no lookup (lookup_min_n 0)
    "ngram g6 T=1": ("ngram", 6, 1.0),
    "eagle g3 T=1": ("eagle", 3, 1.0),
    "eagle g4 T=1": ("eagle", 4, 1.0),
    "eagle g6 T=1": ("eagle", 6, 1.0),
    "eagle g4 fixed T=1": ("eagle-fixed", 4, 1.0),
    "head g3 T=1": ("eagle-head", 3, 1.0),
    "head g6 T=1": ("eagle-head", 6, 1.0),
}
DEFAULT_LANES = [lane for lane in DRAFT_LANES if not lane.startswith("self-spec")]
SEED_STRIDE = 1000  # a prompt's seed in repeat s (--seeds): 1000 + index + SEED_STRIDE s


def self_speculative_dir(target: Any, layers: int, out_dir: Path) -> Path:
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
def teacher_forced_agreement(target: Any, texts: list[str], drafter: Any = None) -> dict:
    """How often the draft's argmax (default: the default draft) equals the target's (full-vocabulary) argmax at each
    prompt position: the greedy acceptance probability of a first draft token on held-out text (no generation)."""
    drafter = drafter or make_drafter(str(PACKAGE_DRAFT_DIR), target)
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


def make_lane_drafter(spec: str, target: Any, tmp: Path, eagle_dir: Path | None = None) -> Any:
    """'none' | 'draft-model' (the small draft model) | 'self-spec:L' (written under tmp) | 'eagle' (the EAGLE
    drafter with the head in eagle_dir, else the one shipped for the target; 'eagle-fixed': chains gamma long;
    'eagle-head': no lookups) | anything make_drafter takes ('ngram') -> the drafter."""
    if spec == "none":
        return NoDrafter()
    if spec == "draft-model":
        return make_drafter(str(PACKAGE_DRAFT_DIR), target)
    if spec in ("eagle", "eagle-fixed", "eagle-head"):
        drafter = make_drafter("eagle" if eagle_dir is None else f"eagle:{eagle_dir}", target)
        if spec == "eagle-fixed":
            drafter.stop_below = 0.0
        if spec == "eagle-head":
            drafter.lookup_min_n = 0
        return drafter
    if spec.startswith("self-spec:"):
        layers = int(spec.partition(":")[2])
        return make_drafter(str(self_speculative_dir(target, layers, tmp / f"self-spec-{layers}")), target)
    return make_drafter(spec, target)


def choose_lanes(text: str) -> list[str]:
    """--lanes 'a,b' -> the lanes (default: DEFAULT_LANES); ValueError naming the unknown ones."""
    chosen = [lane.strip() for lane in text.split(",") if lane.strip()] or DEFAULT_LANES
    unknown = sorted(set(chosen) - set(DRAFT_LANES))
    if unknown:
        raise ValueError(f"unknown lane(s) {unknown}; choose from {list(DRAFT_LANES)}")
    return chosen


def run_lane(target: Any, built: tuple[Any, int, float], prompt: str, seed: int, max_new_tokens: int) -> dict:
    drafter, gamma, temperature = built
    run = own_run(target, drafter, gamma, prompt, max_new_tokens, temperature=temperature, seed=seed)
    return {"tokens": run["tokens"], "stats": run["stats"].to_dict()}


def hf_greedy_record(hf_model: Any, tokenizer: Any, prompt: str, max_new_tokens: int) -> dict:
    """transformers' greedy run of exactly max_new_tokens tokens, as a record shaped like run_lane's."""
    run = hf_run(hf_model, prompt_ids(tokenizer, prompt), max_new_tokens, exact_length=True)
    return {"tokens": run["tokens"], "stats": {"wall_s": run["wall_s"], "new_tokens": len(run["tokens"])}}


def run_draft_bench(target: Any, built: dict[str, tuple[Any, int, float]], hf_model: Any, prompts: dict[str, list[str]],
                    max_new_tokens: int, on_record: Callable[[list[dict]], None] = lambda records: None,
                    seeds: int = 1) -> list[dict]:
    """Warm-up of every lane on a short prompt, then every prompt through every lane in turn (seed 1000 + index):
    one record per prompt {category, prompt, seed, lane: {tokens, stats}}; on_record(records so far) after each.
    seeds > 1: the sampled lanes (temperature > 0) run every prompt again under seed 1000 + index + SEED_STRIDE s,
    s = 1 .. seeds - 1, one record per prompt and seed without the greedy lanes: one sample path per prompt is a
    noisy estimate of a sampled lane's acceptance, while greedy lanes repeat their tokens."""
    if seeds < 1:
        raise ValueError(f"seeds={seeds}: run every prompt under at least 1 seed")
    for lane in built.values():
        run_lane(target, lane, "import os\n", 0, 8)
    if hf_model is not None:
        hf_greedy_record(hf_model, target.tokenizer, "import os\n", 8)
    sampled = {lane: spec for lane, spec in built.items() if spec[2] > 0}
    records: list[dict] = []
    for repeat in range(seeds):
        lanes = built if repeat == 0 else sampled
        if not lanes:
            break
        for category, texts in prompts.items():
            for index, prompt in enumerate(texts):
                seed = 1000 + index + SEED_STRIDE * repeat
                row: dict = {"category": category, "prompt": index, "seed": seed}
                for lane, built_lane in lanes.items():
                    row[lane] = run_lane(target, built_lane, prompt, seed, max_new_tokens)
                if hf_model is not None and repeat == 0:
                    row["transformers greedy"] = hf_greedy_record(hf_model, target.tokenizer, prompt, max_new_tokens)
                records.append(row)
                on_record(records)
    return records


def row_bootstrap_ci(columns: np.ndarray, value: Callable[[np.ndarray], np.ndarray], seed: int = 0) -> list[float] | None:
    """95% percentile-bootstrap CI of value(column sums) with the rows resampled together: columns [N, K] (one row
    per prompt run, e.g. wall s and tokens of a lane and its baseline), value maps sums [R, K] -> [R]. None for
    fewer than 2 rows."""
    rows = columns.shape[0]
    if rows < 2:
        return None
    index = np.random.default_rng(seed).integers(0, rows, size=(BOOTSTRAP_RESAMPLES, rows))  # [R, N]
    values = value(columns[index].sum(axis=1))  # [R]
    return [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))]


def speedups(rows: list[dict], lane: str, base_lane: str, with_decode: bool) -> dict[str, Any]:
    """tokens/s summed over rows, against base_lane (prefill included; with_decode: and without it in both), with
    the speedup's 95% bootstrap CI over the rows (prompt runs) for a lane other than the baseline."""
    def totals(name: str) -> tuple[float, int]:
        return sum(r[name]["stats"]["wall_s"] for r in rows), sum(r[name]["stats"]["new_tokens"] for r in rows)

    (wall, tokens), (base_wall, base_tokens) = totals(lane), totals(base_lane)
    out: dict[str, Any] = {"speedup": (tokens / wall) / (base_tokens / base_wall)}
    if lane != base_lane:
        columns = np.array([[r[name]["stats"][key] for name in (lane, base_lane) for key in ("new_tokens", "wall_s")] for r in rows], dtype=float)
        out["speedup_ci95"] = row_bootstrap_ci(columns, lambda s: (s[:, 0] / s[:, 1]) / (s[:, 2] / s[:, 3]))
    if with_decode:
        decode_s = wall - sum(r[lane]["stats"]["prefill_ms"] for r in rows) / 1e3
        base_decode_s = base_wall - sum(r[base_lane]["stats"]["prefill_ms"] for r in rows) / 1e3
        out["decode_speedup"] = (tokens / decode_s) / (base_tokens / base_decode_s)
    return out


def acceptance(stats: list[dict], gamma: int) -> dict[str, float | None]:
    """alpha, AR, AL (with its 95% bootstrap CI over the runs), c, draft ms per token, verify ms per step over pooled
    engine counters, and Leviathan's S."""
    accepted, rejections = sum(s["accepted_tokens"] for s in stats), sum(s["rejections"] for s in stats)
    iterations, drafted = sum(s["iterations"] for s in stats), sum(s["drafted_tokens"] for s in stats)
    alpha = accepted / (accepted + rejections) if accepted + rejections else None
    draft_ms_per_token = sum(s["draft_ms_total"] for s in stats) / drafted
    verify_ms_per_step = sum(s["verify_ms_total"] for s in stats) / iterations
    c = draft_ms_per_token / verify_ms_per_step
    columns = np.array([[s["accepted_tokens"], s["iterations"]] for s in stats], dtype=float)
    return dict(alpha=alpha, acceptance_rate=accepted / drafted, acceptance_length=(accepted + iterations) / iterations, c=c,
                acceptance_length_ci95=row_bootstrap_ci(columns, lambda s: (s[:, 0] + s[:, 1]) / s[:, 1]),
                draft_ms_per_token=draft_ms_per_token, verify_ms_per_step=verify_ms_per_step,
                theory_speedup=theory_speedup(min(alpha, 0.999999), gamma, c) if alpha is not None else None)


def lane_entry(rows: list[dict], lane: str, built: dict[str, tuple[Any, int, float]]) -> dict:
    """One lane over one category's rows: tokens/s, speedups over its temperature's baseline, identity with the
    greedy baseline, and acceptance (speculative lanes) or ms per step (baselines)."""
    gamma, temperature = built[lane][1:] if lane in built else (0, 0.0)
    base_lane = "baseline T=1" if temperature > 0 else "baseline"
    rows = [r for r in rows if lane in r]  # the extra seeds' records hold the sampled lanes only
    entry: dict = {"tokens_per_s": sum(r[lane]["stats"]["new_tokens"] for r in rows) / sum(r[lane]["stats"]["wall_s"] for r in rows)}
    if base_lane in built:
        entry.update(speedups(rows, lane, base_lane, with_decode=lane in built))
    if temperature == 0 and lane != "baseline" and "baseline" in built:
        entry["identical_to_baseline"] = all(r[lane]["tokens"] == r["baseline"]["tokens"] for r in rows)
    stats = [r[lane]["stats"] for r in rows]
    if gamma > 0:
        entry.update(acceptance(stats, gamma))
    elif lane in built:
        entry["ms_per_step"] = sum(s["verify_ms_total"] for s in stats) / sum(s["iterations"] for s in stats)
    return entry


def summarise(records: list[dict], lanes: list[str], built: dict[str, tuple[Any, int, float]]) -> dict:
    """category -> lane -> lane_entry, plus "all" (every category's runs pooled) where there are several."""
    categories = sorted({r["category"] for r in records})
    summary = {category: {lane: lane_entry([r for r in records if r["category"] == category], lane, built) for lane in lanes}
               for category in categories}
    if len(categories) > 1:
        summary["all"] = {lane: lane_entry(records, lane, built) for lane in lanes}
    return summary
