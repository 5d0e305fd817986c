"""Commands of the analytical model: `model`, `simulate`, `sweep` and the theory `demo`.

Each command builds its numbers as one dict (what --json prints) and renders the same dict as rich tables.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from specgate import theory
from specgate.cli.common import UserError, console, print_json
from specgate.simulate import simulate as run_simulation

JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
_PROGRESS_MIN_ITERATIONS = 20_000_000  # below this a run takes well under a second: no bar


def _fmt(value: float | None, digits: int = 3) -> str:
    return "none" if value is None else f"{value:.{digits}f}"


def _resolve_c(c: float | None, draft_ms: float | None, target_ms: float | None) -> float:
    """c from --c, or from --draft-ms / --target-ms; exactly one of the two ways."""
    timed = draft_ms is not None or target_ms is not None
    if (c is None) == (not timed):
        raise UserError("pass exactly one of --c C or the pair --draft-ms D --target-ms T (draft / target cost)")
    if c is not None:
        return theory.check_cost(c, "c")
    if draft_ms is None or target_ms is None:
        missing = "--draft-ms" if draft_ms is None else "--target-ms"
        raise UserError(f"{missing} is missing; --draft-ms and --target-ms go together (c = draft_ms / target_ms)")
    return theory.c_from_times(draft_ms, target_ms)


def _parse_profile(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(
            f"--profile={text!r} is not a comma-separated list of numbers; pass conditional rates like 0.9,0.8,0.7"
        ) from None
    return theory.check_profile(rates, "profile")


# ------------------------------------------------------------------------------------------------- model


def model_report(alpha: float, gamma: int, c: float, gamma_max: int = 16, c_hat: float | None = None) -> dict:
    """Every closed-form quantity of the model at (alpha, gamma, c); c_hat defaults to c."""
    c_hat = c if c_hat is None else c_hat
    g_star, s_star = theory.best_gamma(alpha, c, gamma_max)
    return {
        "alpha": theory.check_alpha(alpha),
        "gamma": theory.check_gamma(gamma),
        "c": c,
        "expected_tokens": theory.expected_tokens(alpha, gamma),
        "iteration_cost": theory.iteration_cost(gamma, c),
        "speedup": theory.speedup(alpha, gamma, c),
        "c_break": theory.c_break(alpha, gamma),
        "alpha_min": theory.alpha_min(gamma, c),
        "best_gamma": g_star,
        "best_speedup": s_star,
        "gamma_max": gamma_max,
        "c_hat": c_hat,
        "compute_overhead": theory.compute_overhead(alpha, gamma, c_hat),
        "speedup_lower_bound": theory.speedup_lower_bound(alpha, c),
    }


def _render_model(report: dict) -> None:
    verdict = "helps" if report["speedup"] > 1 else "does not help"
    table = Table(title=f"alpha={report['alpha']:g}, gamma={report['gamma']}, c={report['c']:.4g}: speculation {verdict}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("meaning")
    rows = [
        ("expected_tokens", _fmt(report["expected_tokens"]), "E[T] = (1 - a^(g+1)) / (1 - a), tokens per iteration"),
        ("iteration_cost", _fmt(report["iteration_cost"]), "g c + 1, in target forward passes"),
        ("speedup", _fmt(report["speedup"]), "S = E[T] / (g c + 1)"),
        ("c_break", _fmt(report["c_break"]), "largest c with S >= 1 at this gamma: (E[T] - 1) / g"),
        ("alpha_min", _fmt(report["alpha_min"]), "smallest alpha with S >= 1 at this gamma and c"),
        ("best_gamma", str(report["best_gamma"]), f"gamma in 1..{report['gamma_max']} maximising S"),
        ("best_speedup", _fmt(report["best_speedup"]), "S at best_gamma"),
        ("compute_overhead", _fmt(report["compute_overhead"]), f"ops vs plain decoding, c_hat={report['c_hat']:.4g} (Thm 3.11)"),
        ("speedup_lower_bound", _fmt(report["speedup_lower_bound"]), "(1 + a) / (1 + c) when a > c (Cor. 3.9)"),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)


def model(
    alpha: Annotated[float, typer.Option("--alpha", help="Per-token acceptance probability, in [0, 1].")],
    gamma: Annotated[int, typer.Option("--gamma", help="Draft tokens per iteration, >= 1.")],
    c: Annotated[float | None, typer.Option("--c", help="Draft / target cost per forward pass, >= 0.")] = None,
    draft_ms: Annotated[float | None, typer.Option("--draft-ms", help="Draft forward pass, ms (with --target-ms).")] = None,
    target_ms: Annotated[float | None, typer.Option("--target-ms", help="Target forward pass, ms (with --draft-ms).")] = None,
    gamma_max: Annotated[int, typer.Option("--gamma-max", help="Largest gamma searched for best_gamma.")] = 16,
    c_hat: Annotated[float | None, typer.Option("--c-hat", help="Draft / target ops per token for compute_overhead (default: c).")] = None,
    json_out: JsonFlag = False,
) -> None:
    """Closed-form speedup, break-even and best gamma of speculative decoding (Leviathan et al.)."""
    cost = _resolve_c(c, draft_ms, target_ms)
    report = model_report(alpha, gamma, cost, gamma_max, None if c_hat is None else theory.check_cost(c_hat, "c_hat"))
    if json_out:
        print_json(report)
    else:
        _render_model(report)


# ---------------------------------------------------------------------------------------------- simulate


def simulation_report(
    alpha: float | None, gamma: int | None, c: float, iterations: int, seed: int, profile: list[float] | None,
    progress: bool = False,
) -> dict:
    """Run the Monte Carlo and put it beside the closed form it should reproduce."""
    if progress and iterations >= _PROGRESS_MIN_ITERATIONS:
        columns = (TextColumn("simulating"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,}"), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("simulate", total=iterations)
            result = run_simulation(
                alpha, gamma, c, iterations, seed, profile=profile, on_progress=lambda n: bar.update(task, completed=n)
            )
    else:
        result = run_simulation(alpha, gamma, c, iterations, seed, profile=profile)
    rates = list(result.conditional_rates)
    closed_form = theory.expected_tokens_profile(rates)
    lo, hi = result.acceptance_length_ci95
    return {
        "acceptance_length": result.acceptance_length,
        "acceptance_length_ci95": [lo, hi],
        "speedup": result.speedup,
        "iterations": result.iterations,
        "closed_form_expected_tokens": closed_form,
        "closed_form_speedup": theory.speedup_profile(rates, result.c),
        "closed_form_within_ci95": lo <= closed_form <= hi,
        "histogram": list(result.histogram),
        "gamma": result.gamma,
        "c": result.c,
        "seed": result.seed,
        "conditional_rates": rates,
    }


def _render_simulation(report: dict) -> None:
    lo, hi = report["acceptance_length_ci95"]
    table = Table(title=f"Monte Carlo: {report['iterations']:,} iterations, gamma={report['gamma']}, c={report['c']:.4g}, seed={report['seed']}")
    table.add_column("quantity")
    table.add_column("simulated", justify="right")
    table.add_column("closed form", justify="right")
    table.add_row("acceptance length", f"{report['acceptance_length']:.4f}", f"{report['closed_form_expected_tokens']:.4f}")
    table.add_row("95% CI", f"[{lo:.4f}, {hi:.4f}]", "inside" if report["closed_form_within_ci95"] else "OUTSIDE")
    table.add_row("speedup", f"{report['speedup']:.4f}", f"{report['closed_form_speedup']:.4f}")
    console.print(table)
    hist = Table(title="tokens emitted per iteration")
    hist.add_column("tokens", justify="right")
    hist.add_column("iterations", justify="right")
    hist.add_column("share", justify="right")
    for tokens, count in enumerate(report["histogram"], start=1):
        hist.add_row(str(tokens), f"{count:,}", f"{count / report['iterations']:.4f}")
    console.print(hist)


def simulate(
    c: Annotated[float, typer.Option("--c", help="Draft / target cost per forward pass, >= 0.")],
    alpha: Annotated[float | None, typer.Option("--alpha", help="Per-token acceptance probability, in [0, 1].")] = None,
    gamma: Annotated[int | None, typer.Option("--gamma", help="Draft tokens per iteration (default with --profile: its length).")] = None,
    iterations: Annotated[int, typer.Option("--iterations", help="Simulated draft-verify iterations, >= 2.")] = 1_000_000,
    seed: Annotated[int, typer.Option("--seed", help="Random seed, >= 0.")] = 0,
    profile: Annotated[str | None, typer.Option("--profile", help="Conditional per-position rates a1,a2,... instead of --alpha.")] = None,
    json_out: JsonFlag = False,
) -> None:
    """Monte Carlo of the draft-verify loop: acceptance length with a 95% CI, beside the closed form."""
    rates = None if profile is None else _parse_profile(profile)
    if (alpha is None) == (rates is None):
        raise UserError("pass exactly one of --alpha A (with --gamma G) or --profile a1,a2,...")
    if rates is None and gamma is None:
        raise UserError("--gamma is missing; --alpha needs --gamma G (draft tokens per iteration, >= 1)")
    report = simulation_report(alpha, gamma, c, iterations, seed, rates, progress=not json_out)
    if json_out:
        print_json(report)
    else:
        _render_simulation(report)


# ------------------------------------------------------------------------------------------------- sweep


def sweep(
    out: Annotated[Path, typer.Option("--out", help="PNG file to write.")],
    c: Annotated[float, typer.Option("--c", help="Draft / target cost for the speedup-vs-gamma panel.")] = 0.1,
    gamma_max: Annotated[int, typer.Option("--gamma-max", help="Largest gamma plotted and searched.")] = 16,
    json_out: JsonFlag = False,
) -> None:
    """Plot speedup vs gamma for several alpha, and the break-even map over (alpha, c)."""
    from specgate.plots import sweep_figure  # matplotlib only when a plot is asked for

    with console.status("drawing the sweep", spinner="dots") if not json_out else nullcontext():
        data = sweep_figure(out, c=c, gamma_max=gamma_max)
    if json_out:
        print_json(data)
    else:
        console.print(f"wrote {data['out']}")


# -------------------------------------------------------------------------------------------------- demo

LESSON_CASES = (  # (label, alpha, gamma, c): the worked examples of the lesson
    ("baseline", 0.7, 4, 0.10),
    ("slower draft", 0.7, 4, 0.20),
    ("weak draft", 0.5, 4, 0.20),
    ("good draft", 0.85, 4, 0.15),
)
LEVIATHAN_TABLE_1 = ((0.8, 5), (0.9, 10))  # (alpha, gamma) at c = c_hat = 0
DEMO_ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)
DEMO_GAMMAS = (1, 2, 3, 4, 5, 6, 8)
DEMO_COSTS = (0.05, 0.1, 0.2, 0.3, 0.5)
DEMO_MONTE_CARLO = (  # (label, conditional rates)
    ("a=0.7, g=4", [0.7] * 4),
    ("a=0.85, g=4", [0.85] * 4),
    ("profile .9,.8,.7,.6", [0.9, 0.8, 0.7, 0.6]),
)


def demo_report(out_dir: Path, c: float = 0.1, iterations: int = 1_000_000, seed: int = 0) -> dict:
    """All numbers of the theory demo, and the sweep plot written to out_dir/theory_sweep.png."""
    from specgate.plots import sweep_figure

    lesson = [{"case": label, **model_report(a, g, cost)} for label, a, g, cost in LESSON_CASES]
    exercise = {"case": "exercise 8/40 ms", "draft_ms": 8.0, "target_ms": 40.0,
                **model_report(0.75, 4, theory.c_from_times(8.0, 40.0))}
    table_1 = [
        {"alpha": a, "gamma": g, "speedup": theory.speedup(a, g, 0.0), "compute_overhead": theory.compute_overhead(a, g, 0.0)}
        for a, g in LEVIATHAN_TABLE_1
    ]
    speedups = {f"{a:g}": {str(g): theory.speedup(a, g, c) for g in DEMO_GAMMAS} for a in DEMO_ALPHAS}
    best = {f"{a:g}": dict(zip(("gamma", "speedup"), theory.best_gamma(a, c))) for a in DEMO_ALPHAS}
    alpha_mins = {str(g): {f"{cost:g}": theory.alpha_min(g, cost) for cost in DEMO_COSTS} for g in DEMO_GAMMAS}
    c_breaks = {f"{a:g}": {str(g): theory.c_break(a, g) for g in DEMO_GAMMAS} for a in DEMO_ALPHAS}
    monte_carlo = [
        {"case": label, **simulation_report(None, None, c, iterations, seed, rates)} for label, rates in DEMO_MONTE_CARLO
    ]
    plot = sweep_figure(Path(out_dir) / "theory_sweep.png", c=c)
    return {
        "out": plot["out"],
        "c": c,
        "lesson": lesson + [exercise],
        "leviathan_table_1": table_1,
        "speedup_table": speedups,
        "best_gamma": best,
        "alpha_min": alpha_mins,
        "c_break": c_breaks,
        "monte_carlo": monte_carlo,
    }


def _render_demo(report: dict) -> None:
    c = report["c"]
    lesson = Table(title="Lesson examples: E[T] = (1 - a^(g+1)) / (1 - a), S = E[T] / (g c + 1)")
    for name in ("case", "alpha", "g", "c", "E[T]", "S", "best g", "S*"):
        lesson.add_column(name, justify="left" if name == "case" else "right", no_wrap=True)
    for row in report["lesson"]:
        lesson.add_row(
            row["case"], f"{row['alpha']:g}", str(row["gamma"]), f"{row['c']:.3f}", _fmt(row["expected_tokens"]),
            _fmt(row["speedup"]), str(row["best_gamma"]), _fmt(row["best_speedup"]),
        )
    baseline = report["lesson"][0]
    lesson.caption = (
        f"c_break(alpha={baseline['alpha']:g}, gamma={baseline['gamma']}) = {baseline['c_break']:.3f}: "
        "the draft may cost up to that fraction of a target pass"
    )
    console.print(lesson)

    table_1 = Table(title="Leviathan et al. Table 1 (c = c_hat = 0)")
    for name in ("alpha", "gamma", "speedup", "compute overhead"):
        table_1.add_column(name, justify="right")
    for row in report["leviathan_table_1"]:
        table_1.add_row(f"{row['alpha']:g}", str(row["gamma"]), f"{row['speedup']:.2f}x", f"{row['compute_overhead']:.2f}x")
    console.print(table_1)

    speedups = Table(title=f"Speedup S over alpha x gamma at c = {c:g} (bold = best gamma in the row; red = slower)")
    speedups.add_column("alpha", justify="right")
    gammas = list(next(iter(report["speedup_table"].values())))
    for g in gammas:
        speedups.add_column(f"g={g}", justify="right")
    for a, row in report["speedup_table"].items():
        best = max(row.values())
        cells = [f"[bold]{s:.3f}[/]" if s == best else (f"[red]{s:.3f}[/]" if s < 1 else f"{s:.3f}") for s in row.values()]
        speedups.add_row(a, *cells)
    console.print(speedups)

    alpha_mins = Table(title="alpha_min: the acceptance needed to break even (S = 1)")
    alpha_mins.add_column("gamma", justify="right")
    costs = list(next(iter(report["alpha_min"].values())))
    for cost in costs:
        alpha_mins.add_column(f"c={cost}", justify="right")
    for g, row in report["alpha_min"].items():
        alpha_mins.add_row(g, *(_fmt(v) for v in row.values()))
    console.print(alpha_mins)

    c_breaks = Table(title="c_break: the largest draft cost ratio that still breaks even")
    c_breaks.add_column("alpha", justify="right")
    for g in gammas:
        c_breaks.add_column(f"g={g}", justify="right")
    for a, row in report["c_break"].items():
        c_breaks.add_row(a, *(_fmt(v) for v in row.values()))
    console.print(c_breaks)

    iterations = report["monte_carlo"][0]["iterations"]
    monte_carlo = Table(title=f"Monte Carlo ({iterations:,} iterations each) vs closed form: acceptance length")
    for name in ("case", "simulated", "95% CI", "closed form", "inside CI"):
        monte_carlo.add_column(name, justify="left" if name == "case" else "right", no_wrap=True)
    for row in report["monte_carlo"]:
        lo, hi = row["acceptance_length_ci95"]
        monte_carlo.add_row(
            row["case"], f"{row['acceptance_length']:.4f}", f"[{lo:.4f}, {hi:.4f}]",
            f"{row['closed_form_expected_tokens']:.4f}", "yes" if row["closed_form_within_ci95"] else "[red]NO[/]",
        )
    console.print(monte_carlo)
    console.print(f"plot: {report['out']}")


def demo(
    out: Annotated[Path, typer.Option("--out", help="Directory for the demo's files.")] = Path("out/demo"),
    json_out: JsonFlag = False,
) -> None:
    """The theory demo: the lesson's numbers, Leviathan's Table 1, break-even tables, Monte Carlo, the sweep plot."""
    report = demo_report(out)
    if json_out:
        print_json(report)
    else:
        _render_demo(report)


def register(app: typer.Typer) -> None:
    """Add model, simulate, sweep and demo to `app`."""
    app.command()(model)
    app.command()(simulate)
    app.command()(sweep)
    app.command()(demo)
