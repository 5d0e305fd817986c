"""`specgate check-lossless`: the statistical proof that the verifier is lossless, on synthetic or real models."""

from __future__ import annotations

from typing import Any, Optional

import typer
from rich.table import Table

from specgate.cli import common

SYNTHETIC_SAMPLES = 100_000
MODEL_SAMPLES = 20_000


def _format_p(p_value: float) -> str:
    return f"{p_value:.3g}" if p_value >= 1e-4 or p_value == 0 else f"{p_value:.2e}"


def _print_result(result: dict[str, Any]) -> None:
    """Rich tables: every test of the exact sampler, then the negative controls, then the verdict."""
    cases = Table(title="Goodness-of-fit tests of the exact sampler", show_lines=False)
    for column in ("test", "statistic", "dof", "p-value", "verdict"):
        cases.add_column(column, justify="left" if column == "test" else "right")
    for case in result["cases"]:
        style = "green" if case["verdict"] == "pass" else "bold red"
        dof = case.get("dof")
        cases.add_row(
            case["name"], f"{case['statistic']:.2f}", "" if dof is None else str(dof),
            _format_p(case["p_value"]), f"[{style}]{case['verdict']}[/]",
        )
    common.console.print(cases)
    controls = Table(title="Negative controls (each must read fail: the tests caught it)")
    for column in ("control", "min p-value", "verdict"):
        controls.add_column(column, justify="left" if column == "control" else "right")
    for control in result["negative_controls"]:
        style = "green" if control["verdict"] == "fail" else "bold red"
        min_p = control.get("min_p_value")
        min_p_text = "" if min_p is None else _format_p(min_p)
        controls.add_row(control["name"], min_p_text, f"[{style}]{control['verdict']}[/]")
    common.console.print(controls)
    level = result.get("significance")
    per_test = result.get("per_test_alpha", result.get("per_test_significance"))
    if level is not None and per_test is not None:
        common.console.print(
            f"family-wise significance {level:g}, Bonferroni over {len(result['cases'])} tests: "
            f"each test rejects below p = {per_test:.3g}"
        )
    style = "bold green" if result["verdict"] == "pass" else "bold red"
    common.console.print(f"verdict: [{style}]{result['verdict']}[/]")


def check_lossless(
    target: Optional[str] = typer.Option(
        None, "--target", help="Target model (name or path). Omit to run the synthetic suite."
    ),
    draft: Optional[str] = typer.Option(None, "--draft", help="Drafter for --target (a draft model path, 'ngram', 'default' or eagle:DIR)."),
    gamma: Optional[int] = typer.Option(None, "--gamma", help="Drafts per step for --target checks (default 4)."),
    samples: Optional[int] = typer.Option(
        None, "--samples",
        help=f"Outcomes per case (default {SYNTHETIC_SAMPLES:,} synthetic, {MODEL_SAMPLES:,} with --target).",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of every random draw."),
    dtype: str = typer.Option(
        "auto", "--dtype", help="Weights of --target: auto (a .gguf target, the embedded gemma-3-270m included: its own quantized blocks where the native kernels run; else bfloat16 weights with float32 arithmetic where the kernels run or the CPU has bf16 instructions, else float32), gguf, int8 (Q8_0 on load: changes the target), float32 or bfloat16."
    ),
    significance: float = typer.Option(0.01, "--significance", help="Family-wise level, Bonferroni-corrected."),
    json_output: bool = typer.Option(
        False, "--json", help="Print one JSON object (verdict, cases, negative_controls)."
    ),
) -> None:
    """Prove statistically that speculative sampling is lossless (chi-square tests + negative controls).

    Without --target: synthetic (p, q) cases; every emitted position and the joint of the first two tokens
    are tested against the target distribution, and broken samplers and every lossy mode must be rejected.

    With --target/--draft: the same kind of check on a real model pair.

    Exit status: 0 when the verdict is pass, 1 when it is fail, 2 on bad arguments.
    """
    if not (0.0 < significance < 1.0):
        raise common.UserError(f"--significance {significance} is out of range: use a level in (0, 1), e.g. 0.01")
    if samples is not None and samples < 1:
        raise common.UserError(f"--samples {samples} is out of range: use a positive count (e.g. 100000)")
    if target is None:
        if samples is not None and samples < 1_000:
            raise common.UserError(
                f"--samples {samples} is too small for the synthetic suite: use >= 1000 (default 100000)"
            )
        if draft is not None or gamma is not None:
            raise common.UserError(
                "--draft and --gamma apply to real-model checks: pass --target too, or drop them to run the "
                "synthetic suite (which covers gamma 1, 3 and 5)"
            )
        from specgate.sampling.lossless_check import run_synthetic_suite

        result = run_synthetic_suite(
            num_samples=SYNTHETIC_SAMPLES if samples is None else samples,
            significance=significance, seed=seed, progress=not json_output,
        )
    else:
        if draft is None:
            raise common.UserError("--target needs --draft (a draft model path or 'ngram') to check a model pair")
        gamma = 4 if gamma is None else gamma
        if gamma < 1:
            raise common.UserError(f"--gamma {gamma} is out of range: use an integer >= 1")
        from specgate.engine.lossless_real import run_model_check
        from specgate.models import load_model
        from specgate.models.dtypes import resolve_weights

        torch_dtype = resolve_weights(dtype, target)  # ValueError (exit 2) for an unknown --dtype, before the slow load
        result = run_model_check(
            load_model(target, dtype=torch_dtype), draft, gamma=gamma, num_samples=MODEL_SAMPLES if samples is None else samples,
            seed=seed, significance=significance, progress=not json_output,
        )
    if json_output:
        common.print_json(result)
    else:
        _print_result(result)
    if result["verdict"] != "pass":
        raise typer.Exit(code=1)


def register(app: typer.Typer) -> None:
    """Add `check-lossless` to `app`."""
    app.command("check-lossless")(check_lossless)
