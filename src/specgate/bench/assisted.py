"""The same draft in specgate and in transformers' assisted generation: a full-vocabulary copy of a reduced draft.

transformers' `generate(assistant_model=...)` reads an assistant's output ids as target ids, so a draft with a
reduced head and an id map (the default draft's `d2t`) cannot be an assistant as it ships. The copy written here
has the target's vocabulary: its tied embedding/head row of target id t is the draft's row of t2d[t] (the draft's
own row, or its fallback `<unk>` row for a token it lacks). Inputs: specgate's drafter feeds a token outside its
vocabulary as the fallback, and the copy's row of that token IS the fallback row, so both compute the same hidden
states. Outputs: every token the draft lacks gets exactly the fallback's logit; argmax returns the first maximal
index (torch and transformers' greedy alike), so while each such id is above the fallback's id a tie resolves to
the fallback, which is what the reduced draft proposes there. Greedy drafts are then identical.

The benchmark (bench/bench_assisted.py): per prompt, interleaved (the order rotates from prompt to prompt), after one
warm-up of every lane: own baseline (gamma 0) | transformers greedy | per gamma: own lane with the full-vocabulary
copy, transformers `assistant_model=` the same copy with num_assistant_tokens=gamma, schedule "constant" and the
confidence stop off (exactly gamma drafts a round, like the own lane) | transformers with its own assisted defaults
(20 tokens, stop below confidence 0.4) | own lane with the reduced draft per gamma | own lane with `--draft default`
(lookups where the context repeats, the EAGLE head elsewhere) per gamma, whose head transformers cannot load (a head on the target's hidden states is not an
assistant model), paired with transformers' assisted lanes and its greedy. Wall time around each call,
tokenisation outside it, prefill inside. alpha = accepted / (accepted + rejections), AL = (accepted + rounds) /
rounds, for transformers from its candidate generator's per-round (drafted, matched) counts. Ratios: median over
prompts of the per-prompt ratio.
"""

from __future__ import annotations

import json
import statistics
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from specgate.bench.generation import hf_run, own_run, tokens_per_s
from specgate.bench.lanes import lane_order
from specgate.drafting import NoDrafter

HF_DEFAULTS_LANE = "transformers assisted full-vocab copy, its defaults (20, conf 0.4)"


def expand_draft_vocabulary(drafter: Any, target: Any, out_dir: Path) -> Path:
    """Write a full-vocabulary copy of a reduced-vocabulary ModelDrafter (HF layout + the target's tokenizer) to
    out_dir and return it. Refuses a draft whose head is not tied, and one where a target id outside the draft
    vocabulary lies below the fallback's id (argmax ties would pick it: the copy would not draft alike)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    draft_dir = Path(drafter.draft.path)
    config = json.loads((draft_dir / "config.json").read_text())
    if not config.get("tie_word_embeddings", True):
        raise ValueError(f"draft '{draft_dir}': tie_word_embeddings={config['tie_word_embeddings']}; expand_draft_vocabulary handles a tied head only")
    target_vocab = int(target.model.vocab_size)
    unmapped = torch.ones(target_vocab, dtype=torch.bool)  # [V_t]
    unmapped[drafter.d2t] = False
    fallback_target_id = int(drafter.d2t[drafter.t2d[int(unmapped.nonzero()[0])]]) if bool(unmapped.any()) else -1
    if bool(unmapped.any()) and int(unmapped.nonzero()[0]) < fallback_target_id:
        raise ValueError(
            f"target id {int(unmapped.nonzero()[0])} is outside the draft vocabulary but below its fallback token "
            f"{fallback_target_id}: argmax ties would pick it, so the full-vocabulary copy would not draft alike"
        )
    with safe_open(str(draft_dir / "model.safetensors"), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    embedding_key = next(key for key in tensors if key.endswith("embed_tokens.weight"))
    tensors[embedding_key] = tensors[embedding_key][drafter.t2d].contiguous()  # [V_t, H]: row t = draft row t2d[t]
    tensors.pop("lm_head.weight", None)  # tied: the head is the embedding
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.update(vocab_size=target_vocab, tie_word_embeddings=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    target.tokenizer.save_pretrained(str(out_dir))  # same tokenizer: both libraries load the dir as it is
    return out_dir


# --- the benchmark: lanes ---------------------------------------------------------------------------------------------


def set_assistant_policy(assistant: Any, num_tokens: int, confidence_threshold: float) -> None:
    """transformers reads the draft length and the confidence stop from the ASSISTANT's generation_config."""
    config = assistant.generation_config
    config.num_assistant_tokens = num_tokens
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = confidence_threshold


@contextmanager
def hf_rounds() -> Iterator[list[tuple[int, int]]]:
    """Record transformers' per-round (drafted, matched) counts from its candidate generator's feedback call."""
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    rounds: list[tuple[int, int]] = []
    original = AssistedCandidateGenerator.update_candidate_strategy

    def recording(self, input_ids, scores, num_matches):  # scores [B, drafted + 1, V]
        rounds.append((int(scores.shape[1]) - 1, int(num_matches)))
        return original(self, input_ids, scores, num_matches)

    AssistedCandidateGenerator.update_candidate_strategy = recording
    try:
        yield rounds
    finally:
        AssistedCandidateGenerator.update_candidate_strategy = original


def own_lane(target: Any, drafter: Any, gamma: int, prompt_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    """specgate's run as an acceptance record (wall time around the call)."""
    run = own_run(target, drafter, gamma, prompt_ids, max_new_tokens)
    s = run["stats"]
    return {"tokens": run["tokens"], "wall_s": run["call_s"], "iterations": s.iterations, "drafted": s.drafted_tokens,
            "accepted": s.accepted_tokens, "rejections": s.rejections, "draft_ms": s.draft_ms_total, "verify_ms": s.verify_ms_total}


def hf_lane(model: Any, prompt_ids: list[int], max_new_tokens: int, assistant: Any = None) -> dict[str, Any]:
    """transformers' run as an acceptance record (its candidate generator's rounds; none without an assistant)."""
    with hf_rounds() as rounds:
        run = hf_run(model, torch.tensor([prompt_ids]), max_new_tokens, assistant=assistant)
    return {"tokens": run["tokens"], "wall_s": run["call_s"], "iterations": len(rounds),
            "drafted": sum(drafted for drafted, _ in rounds), "accepted": sum(matched for _, matched in rounds),
            "rejections": sum(matched < drafted for drafted, matched in rounds)}


def hf_assisted_lane(model: Any, assistant: Any, num_tokens: int, confidence_threshold: float, prompt_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    set_assistant_policy(assistant, num_tokens, confidence_threshold)
    return hf_lane(model, prompt_ids, max_new_tokens, assistant)


def assisted_lanes(target: Any, hf_target: Any, reduced: Any, full: Any, hf_assistant: Any, gammas: list[int],
                   hf_defaults: bool = True, head: Any = None) -> tuple[dict[str, Callable], list[tuple[str, str]], list[tuple[str, str]]]:
    """(lane -> run(prompt_ids, max_new_tokens), the (own, theirs) pairs whose speed ratio is reported, the pairs that
    must draft alike). head: the EAGLE drafter (`--draft default`), run by specgate only: transformers' assistant
    is a model over token ids and cannot read the target's hidden states, so its lanes are paired with the
    assisted draft-model lanes, the best transformers can run on this target."""
    lanes: dict[str, Callable] = {"own baseline": lambda p, n: own_lane(target, NoDrafter(), 0, p, n),
                                  "transformers greedy": lambda p, n: hf_lane(hf_target, p, n)}
    pairs, same_draft = [("own baseline", "transformers greedy")], []
    for g in gammas:
        lanes[f"own full-vocab copy g{g}"] = lambda p, n, g=g: own_lane(target, full, g, p, n)
        lanes[f"transformers assisted full-vocab copy g{g}"] = lambda p, n, g=g: hf_assisted_lane(hf_target, hf_assistant, g, 0.0, p, n)
        pairs.append((f"own full-vocab copy g{g}", f"transformers assisted full-vocab copy g{g}"))
    if hf_defaults:  # GenerationConfig's own defaults for an assistant (transformers 5.24)
        lanes[HF_DEFAULTS_LANE] = lambda p, n: hf_assisted_lane(hf_target, hf_assistant, 20, 0.4, p, n)
    for g in gammas:
        lanes[f"own reduced default draft g{g}"] = lambda p, n, g=g: own_lane(target, reduced, g, p, n)
        pairs.append((f"own reduced default draft g{g}", f"transformers assisted full-vocab copy g{g}"))
        same_draft += [(f"own reduced default draft g{g}", f"own full-vocab copy g{g}"), (f"own full-vocab copy g{g}", f"transformers assisted full-vocab copy g{g}")]
    if hf_defaults:
        for g in gammas:
            pairs += [(f"own full-vocab copy g{g}", HF_DEFAULTS_LANE), (f"own reduced default draft g{g}", HF_DEFAULTS_LANE)]
    if head is not None:
        for g in gammas:
            lanes[f"own --draft default g{g}"] = lambda p, n, g=g: own_lane(target, head, g, p, n)
            pairs += [(f"own --draft default g{g}", f"transformers assisted full-vocab copy g{g}"), (f"own --draft default g{g}", "transformers greedy")]
            if hf_defaults:
                pairs.append((f"own --draft default g{g}", HF_DEFAULTS_LANE))
    return lanes, pairs, same_draft


def load_assisted(target_name: str, dtype: torch.dtype, gammas: list[int], hf_defaults: bool = True, with_head: bool = True):
    """The target in both libraries, the small draft model and its full-vocabulary copy (written to a temporary
    directory, removed once loaded) in both, and (with_head, where the registry's default is one) the EAGLE head in
    specgate: (target, assisted_lanes(...))."""
    import shutil
    import tempfile

    from transformers import AutoModelForCausalLM

    from specgate.drafting import make_drafter
    from specgate.drafting.registry import DEFAULT_DRAFTS, DRAFT_MODEL_DIRS, EAGLE_PREFIX
    from specgate.models import load_model

    target = load_model(target_name, dtype=dtype)
    hf_target = AutoModelForCausalLM.from_pretrained(str(target.path), dtype=dtype, local_files_only=True).eval()
    reduced = make_drafter(str(DRAFT_MODEL_DIRS[target.name]), target, dtype=dtype)  # the small draft model
    tmp = Path(tempfile.mkdtemp(prefix="specgate-fullvocab-draft-"))
    try:
        full_dir = expand_draft_vocabulary(reduced, target, tmp / f"{Path(target_name).name}-default-full-vocab")
        full = make_drafter(str(full_dir), target, dtype=dtype)
        hf_assistant = AutoModelForCausalLM.from_pretrained(str(full_dir), dtype=dtype, local_files_only=True).eval()
    finally:
        shutil.rmtree(tmp)  # every model is in memory now
    head = None
    if with_head and DEFAULT_DRAFTS.get(target.name, "").startswith(EAGLE_PREFIX):
        head = make_drafter("default", target, dtype=dtype)
    return target, assisted_lanes(target, hf_target, reduced, full, hf_assistant, gammas, hf_defaults, head)


def progress_line(row: dict[str, Any]) -> str:
    """One prompt's wall seconds per lane, as a JSON line."""
    return json.dumps({"category": row["category"], "prompt": row["prompt"], **{n: round(r["wall_s"], 2) for n, r in row["lanes"].items()}})


def run_prompts(lanes: dict[str, Callable], jobs: list[tuple[str, int, list[int]]], max_new_tokens: int, warm_ids: list[int],
                advance: Callable[[dict], None] = lambda row: None) -> list[dict[str, Any]]:
    """One warm-up of every lane (8 tokens), then per job (category, index, prompt ids) every lane once, the order
    rotating job by job (no lane always first): one record per prompt; advance(record) after each."""
    names = list(lanes)
    for name in names:
        lanes[name](warm_ids, 8)
    records = []
    for position, (category, index, ids) in enumerate(jobs):
        row: dict[str, Any] = {"category": category, "prompt": index, "prompt_tokens": len(ids), "lanes": {}}
        for name in lane_order(names, position, "rotate"):
            row["lanes"][name] = lanes[name](ids, max_new_tokens)
        row["lanes"] = {name: row["lanes"][name] for name in names}
        records.append(row)
        advance(row)
    return records


# --- the benchmark: summary -------------------------------------------------------------------------------------------


def pooled_acceptance(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """alpha, acceptance rate and AL over the runs' pooled counts; with engine timings, draft ms per token and
    verify ms per step."""
    accepted, rejections = sum(r["accepted"] for r in runs), sum(r["rejections"] for r in runs)
    iterations, drafted = sum(r["iterations"] for r in runs), sum(r["drafted"] for r in runs)
    out = {"alpha": accepted / (accepted + rejections) if accepted + rejections else None,
           "acceptance_rate": accepted / drafted if drafted else None,
           "acceptance_length": (accepted + iterations) / iterations if iterations else None}
    if all("draft_ms" in r for r in runs) and drafted and iterations:
        out["draft_ms_per_token"] = sum(r["draft_ms"] for r in runs) / drafted
        out["verify_ms_per_step"] = sum(r["verify_ms"] for r in runs) / iterations
    return out


def same_counts(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same rounds, drafted, accepted and rejections: the two lanes drafted alike (greedy drafts are deterministic)."""
    return all(a[key] == b[key] for key in ("iterations", "drafted", "accepted", "rejections"))


def lane_summary(rows: list[dict[str, Any]], lane: str) -> dict[str, Any]:
    """One lane over rows: median tokens/s, median speedup over its library's greedy, same-token counts, acceptance."""
    runs = [r["lanes"][lane] for r in rows]
    reference = "own baseline" if lane.startswith("own") else "transformers greedy"
    return {
        "median_tokens_per_s": statistics.median(tokens_per_s(x) for x in runs),
        "median_speedup_over_" + reference.replace(" ", "_"): statistics.median(
            tokens_per_s(x) / tokens_per_s(r["lanes"][reference]) for x, r in zip(runs, rows)),
        "same_tokens_as_own_baseline": sum(x["tokens"] == r["lanes"]["own baseline"]["tokens"] for x, r in zip(runs, rows)),
        "same_tokens_as_transformers_greedy": sum(x["tokens"] == r["lanes"]["transformers greedy"]["tokens"] for x, r in zip(runs, rows)),
        **pooled_acceptance(runs),
    }


def summarise(records: list[dict[str, Any]], lanes: list[str], pairs: list[tuple[str, str]], same_draft: list[tuple[str, str]]) -> dict[str, Any]:
    """Per group ("all" and each category): every lane's summary, each pair's per-prompt ratio (median, min, max),
    and how many prompts each same-draft pair drafted alike on."""
    groups = {"all": records, **{c: [r for r in records if r["category"] == c] for c in sorted({r["category"] for r in records})}}
    out: dict[str, Any] = {}
    for group, rows in groups.items():
        entry: dict[str, Any] = {"prompts": len(rows), "lanes": {lane: lane_summary(rows, lane) for lane in lanes}, "ratios": {}, "same_acceptance_counts": {}}
        for own, theirs in pairs:
            per_prompt = [tokens_per_s(r["lanes"][own]) / tokens_per_s(r["lanes"][theirs]) for r in rows]
            entry["ratios"][f"{own} / {theirs}"] = {"median": statistics.median(per_prompt), "min": min(per_prompt), "max": max(per_prompt)}
        for a, b in same_draft:
            entry["same_acceptance_counts"][f"{a} = {b}"] = sum(same_counts(r["lanes"][a], r["lanes"][b]) for r in rows)
        out[group] = entry
    return out


def assisted_tables(report: dict[str, Any]) -> list[str]:
    """Markdown per group: one row per lane, then the ratios and the same-draft counts."""
    lines = [f"command: {report['command']}\nmachine: {report['machine']}\n"]
    for group, entry in report["summary"].items():
        lines += [f"### {group} ({entry['prompts']} prompts, {report['max_new_tokens']} new tokens, {report['dtype']})\n",
                  "| lane | median tok/s | median speedup over its library's greedy | alpha | AL | same tokens as own greedy / transformers greedy |",
                  "|---|---|---|---|---|---|"]
        for lane, s in entry["lanes"].items():
            speedup = next(v for k, v in s.items() if k.startswith("median_speedup"))
            alpha = f"{s['alpha']:.2f}" if s["alpha"] is not None else "-"
            length = f"{s['acceptance_length']:.2f}" if s["acceptance_length"] is not None else "-"
            lines.append(f"| {lane} | {s['median_tokens_per_s']:.1f} | {speedup:.2f}x | {alpha} | {length} | "
                         f"{s['same_tokens_as_own_baseline']}/{entry['prompts']} / {s['same_tokens_as_transformers_greedy']}/{entry['prompts']} |")
        lines.append("")
        lines += [f"- {name}: median {r['median']:.2f}x (per prompt {r['min']:.2f}-{r['max']:.2f}x)" for name, r in entry["ratios"].items()]
        lines += [f"- same rounds/drafted/accepted/rejections, {name}: {count}/{entry['prompts']} prompts" for name, count in entry["same_acceptance_counts"].items()]
        lines.append("")
    return lines
