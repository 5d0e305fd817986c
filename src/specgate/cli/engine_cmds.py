"""`specgate generate`: one request through the speculative engine, streamed or as one JSON object."""

from __future__ import annotations

from pathlib import Path

import typer

from specgate.cli import common

DTYPES = ("auto", "float32", "bfloat16", "gguf", "int8")  # specgate.models.dtypes.WEIGHT_CHOICES (not imported: torch)
WEIGHTS_HELP = (
    "Target weights: auto (a .gguf target, the embedded gemma-3-270m included, runs its own quantized blocks as "
    "shipped where the native kernels run; else bfloat16 weights with float32 arithmetic where the kernels run or "
    "the CPU has bf16 instructions, else float32), gguf, int8 (an HF model quantized to Q8_0 on load: this changes "
    "the target model), float32 or bfloat16. A draft model gets the torch dtype."
)


def _read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if (prompt is None) == (prompt_file is None):
        raise common.UserError("give exactly one of --prompt TEXT or --prompt-file FILE")
    if prompt_file is not None:
        if not prompt_file.is_file():
            raise common.UserError(f"--prompt-file {prompt_file}: no such file; pass a path to a UTF-8 text file")
        try:
            prompt = prompt_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise common.UserError(f"--prompt-file {prompt_file}: byte {exc.start} is not UTF-8; save the file as UTF-8 text") from None
        except OSError as exc:
            raise common.UserError(f"--prompt-file {prompt_file}: cannot read it ({exc.strerror}); check the path and its permissions") from None
    return prompt


def _stats_line(stats) -> str:
    """The live line under the streamed text: tokens, steps, AL, AR, tokens/s."""

    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    return (
        f"[dim]{stats.new_tokens} tokens | {stats.iterations} steps | AL {fmt(stats.acceptance_length, '.2f')} | "
        f"AR {fmt(stats.acceptance_rate, '.2f')} | {fmt(stats.tokens_per_s, '.1f')} tok/s[/]"
    )


def register(app: typer.Typer) -> None:
    """Add `generate` to `app`."""

    @app.command()
    def generate(
        target: str = typer.Option("gemma-3-270m", help="Target model: gemma-3-270m, an HF directory, or a .gguf file."),
        draft: str = typer.Option(
            "ngram",
            help="Drafter: none (target only), ngram (prompt lookup), default (the target's draft), eagle (the EAGLE head "
            "shipped for the target), eagle:DIR (one saved for it), a draft model PATH, "
            "or synthetic:AL=3 / synthetic:0.9,0.8 (LOSSY, cost studies only).",
        ),
        gamma: int = typer.Option(4, help="Draft tokens per step (>= 0; use 0 with --draft none for the baseline)."),
        temperature: float = typer.Option(
            0.0, help="Sampling temperature; 0 = greedy (transformers' default, do_sample=False), reproducible."
        ),
        top_k: int = typer.Option(0, help="Keep the k most likely tokens (0 = off)."),
        top_p: float = typer.Option(1.0, help="Nucleus sampling mass (1.0 = off)."),
        max_new_tokens: int = typer.Option(128, help="Most tokens to generate."),
        seed: int = typer.Option(0, help="Request seed: the same seed gives the same output."),
        prompt: str = typer.Option(None, help="Prompt text."),
        prompt_file: Path = typer.Option(None, help="Read the prompt from this UTF-8 file."),
        stop: list[str] = typer.Option(None, help="Stop string (repeatable); the output ends before it."),
        dtype: str = typer.Option("auto", help=WEIGHTS_HELP),
        json_output: bool = typer.Option(False, "--json", help="Print one JSON object {tokens, text, stats}."),
    ) -> None:
        """Generate text with speculative decoding (exact: the output follows the target's distribution)."""
        from specgate.drafting import make_drafter
        from specgate.engine import generate as run_generate
        from specgate.models import load_model
        from specgate.models.dtypes import draft_dtype, resolve_weights
        from specgate.sampling import SamplingParams

        text = _read_prompt(prompt, prompt_file)
        if dtype not in DTYPES:
            raise common.UserError(f"--dtype {dtype!r} is not supported: use one of {', '.join(DTYPES)}")
        if gamma < 0:
            raise common.UserError(f"--gamma {gamma} is invalid: use gamma >= 0 (0 = no drafting)")
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        weights = resolve_weights(dtype, target)
        target_model = load_model(target, dtype=weights)
        drafter = make_drafter(draft, target_model, dtype=draft_dtype(weights), gamma=gamma)
        if drafter.name == "none" and gamma > 0:
            gamma = 0  # nothing to draft: report the run as the baseline it is
        kwargs = dict(seed=seed, max_new_tokens=max_new_tokens, stop=stop or None)

        if json_output:
            result = run_generate(text, target_model, drafter, gamma, params, **kwargs)
            common.print_json(result.to_dict())
            return

        from rich.console import Group
        from rich.live import Live
        from rich.text import Text

        streamed = Text()
        status = Text.from_markup("[dim]prefill...[/]")
        with Live(Group(streamed, status), console=common.console, refresh_per_second=8, vertical_overflow="visible") as live:

            def on_text(delta: str) -> None:
                streamed.append(delta)

            def on_step(stats) -> None:
                status.truncate(0)
                status.append_text(Text.from_markup(_stats_line(stats)))
                live.refresh()

            result = run_generate(text, target_model, drafter, gamma, params, on_text=on_text, on_step=on_step, **kwargs)
            stats = result.stats
            speedup = f" | predicted speedup {stats.predicted_speedup:.2f}x" if stats.predicted_speedup is not None else ""
            on_step(stats)
            status.append_text(
                Text.from_markup(
                    f"\n[dim]finish: {stats.finish_reason} | drafter {stats.drafter}, gamma {stats.gamma} | "
                    f"lossless {stats.lossless} | wall {stats.wall_s:.2f} s{speedup}[/]"
                )
            )
            live.refresh()
        if not common.console.is_terminal:
            common.console.line()
