"""`specgate gate`: measure a draft/target pair on a workload and decide GO or NO-GO (see docs/GATE.md)."""

from __future__ import annotations

from pathlib import Path

import typer

from specgate.cli import common


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values:
        raise common.UserError(f"{name} {text!r} is not a comma-separated list of integers, e.g. 1,2,4,8")
    return values


def register(app: typer.Typer) -> None:
    """Add `gate` to `app`."""

    @app.command()
    def gate(
        out: Path = typer.Option(Path("out/gate"), help="Directory for report.json, report.md, report.html, requests.jsonl and server logs."),
        target: str = typer.Option("gemma-3-270m", help="Embedded mode: the target (gemma-3-270m, an HF directory or a .gguf file); also the weights used to score quality."),
        engine: str = typer.Option(None, help="The engine to launch: specgate (default), llama.cpp, vllm or sglang; with --endpoint, the engine behind it (default: read from its answers)."),
        spec: list[str] = typer.Option([], help="A speculative method of --engine, repeatable: llama.cpp ngram-simple, ngram-mod, ngram-cache, ngram-map-k, draft:PATH.gguf; vllm / sglang ngram, draft:PATH, eagle3:PATH; specgate as --draft, adaptive[:DRAFT]. ':N' sets its draft length."),
        draft: list[str] = typer.Option(["default", "ngram"], help="specgate: a speculative configuration per --draft (default, ngram, eagle:DIR, or a draft model PATH); repeatable."),
        gamma: str = typer.Option("4", help="Draft tokens per step of every speculative configuration, or a list (2,4,8): one configuration per length."),
        server_cmd: str = typer.Option(None, help="Launch template of the speculative server for any engine: {port} (required), {gamma}, {model}."),
        baseline_cmd: str = typer.Option(None, help="Launch template of the same server without speculation (with --server-cmd)."),
        threads: int = typer.Option(None, help="llama.cpp: threads (-t, -tb); default every core."),
        require: str = typer.Option(None, help="Targets that also bind the verdict: any of ttft,itl,memory (reported either way)."),
        greedy_tokens: int = typer.Option(None, help="Tokens per prompt of the greedy concurrency-1 phase, compared for exact match (default 128; quick 64)."),
        adaptive: bool = typer.Option(True, "--adaptive/--no-adaptive", help="specgate: also measure --policy adaptive on the best fixed draft."),
        recommend: bool = typer.Option(True, "--recommend/--no-recommend", help="Launch and measure the recommended configuration."),
        dtype: str = typer.Option("auto", help="Target weights of the embedded servers and the scorer: auto (as `specgate serve`: gguf for a .gguf target, the embedded default included, where the native kernels run), float32, bfloat16, gguf or int8."),
        lossy: str = typer.Option(None, help="Embedded mode: also measure a LOSSY twin of the first --draft configuration (--lossy typical or synthetic:R,...); it can never be GO."),
        endpoint: str = typer.Option(None, help="External mode: base URL of the speculative OpenAI-compatible server."),
        baseline_endpoint: str = typer.Option(None, help="External mode: base URL of the same model served without speculation."),
        metrics_url: list[str] = typer.Option([], help="External mode: Prometheus URL of the speculative server, then of the baseline (default URL/metrics)."),
        model: str = typer.Option(None, help="External mode: the `model` field sent with each request."),
        api_key: str = typer.Option(None, help="Bearer key for the endpoints."),
        workload: str = typer.Option("builtin", help="Prompt JSONL ({prompt, category} or Spec-Bench question.jsonl), or builtin."),
        math: str = typer.Option("builtin", help="GSM8K-style JSONL ({question, answer '... #### N'}), or builtin (arithmetic)."),
        text: str = typer.Option("builtin", help="Text file for the target's perplexity, or builtin."),
        concurrency: str = typer.Option(None, help="Closed-loop concurrency levels, e.g. 1,2,4,8 (quick: 1,4)."),
        target_concurrency: int = typer.Option(None, help="Concurrency at which throughput / TTFT / ITL are judged (default 4; must be measured)."),
        qps: float = typer.Option(None, help="Open-loop Poisson arrival rate, requests/s (default 1)."),
        max_tokens: int = typer.Option(None, help="Output tokens per request (default 64; quick 24)."),
        per_category: int = typer.Option(None, help="Prompts per category (default 6; quick 2)."),
        requests_per_level: int = typer.Option(None, help="Requests per concurrency level above 1 (default 16; quick 6)."),
        poisson_requests: int = typer.Option(None, help="Requests of the Poisson phase (default 16; quick 5)."),
        math_items: int = typer.Option(None, help="Math items (default 40; quick 8)."),
        sample_prompts: int = typer.Option(None, help="Prompts sampled at temperature 1 for the log-likelihood test (default 24; quick 8)."),
        max_num_seqs: int = typer.Option(None, help="Embedded servers' KV slots (default 8; quick 4)."),
        ttft_tolerance: float = typer.Option(0.10, help="TTFT p95 may be this fraction worse than the baseline's."),
        memory_headroom: float = typer.Option(0.20, help="Fraction of RAM (and GPU memory) the server must leave free."),
        greedy_match_min: float = typer.Option(1.0, help="Least greedy exact-match rate against the baseline."),
        seed: int = typer.Option(0, help="Seed of the Poisson arrivals, sampling and bootstraps."),
        score: bool = typer.Option(True, "--score/--no-score", help="Load the target here to score perplexity and sampled log-likelihoods."),
        quick: bool = typer.Option(False, "--quick", help="A small run (~5 minutes on Gemma-3-270M, 2 cores)."),
        fail_on_no_go: bool = typer.Option(False, "--fail-on-no-go", help="Exit 1 on NO-GO (default: exit 0 whenever the run completes)."),
        json_output: bool = typer.Option(False, "--json", help="Print one JSON object {verdict, config, criteria, configs, report, notes}."),
    ) -> None:
        """Measure speculation against a baseline on a workload and decide GO / NO-GO, with a report."""
        args = dict(locals())  # every option by name, before any other local
        from specgate.gate.runner import check_out_dir

        check_out_dir(out)
        report = _run_with_progress(_gate_options(args))
        summary = _summary(report)
        if json_output:
            common.print_json(summary)
        else:
            _print_report(report, summary)
        if fail_on_no_go and report["verdict"] != "GO":
            raise typer.Exit(1)


def _gate_options(args: dict):
    """GateOptions (quick or full defaults) with the command's options over them, validated."""
    from specgate.gate.decision import Thresholds
    from specgate.gate.runner import GateOptions

    options = GateOptions.quick(args["out"]) if args["quick"] else GateOptions(out=args["out"])
    overrides = ("max_tokens", "per_category", "requests_per_level", "qps", "poisson_requests", "math_items", "sample_prompts",
                 "max_num_seqs", "greedy_tokens", "threads")
    for key in overrides:
        if args[key] is not None:
            setattr(options, key, args[key])
    if args["concurrency"] is not None:
        options.concurrency = _int_list(args["concurrency"], "--concurrency")
    options.gammas = _int_list(args["gamma"], "--gamma")
    options.gamma, options.drafts, options.specs, options.metrics_urls = options.gammas[0], list(args["draft"]), list(args["spec"]), list(args["metrics_url"])
    for key in ("target", "dtype", "lossy", "engine", "server_cmd", "baseline_cmd", "adaptive", "recommend", "endpoint",
                "baseline_endpoint", "model", "api_key", "workload", "math", "text", "seed", "score"):
        setattr(options, key, args[key])
    default_target = 4 if 4 in options.concurrency else max(options.concurrency)
    options.thresholds = Thresholds(
        target_concurrency=default_target if args["target_concurrency"] is None else args["target_concurrency"],
        ttft_tolerance=args["ttft_tolerance"], memory_headroom=args["memory_headroom"], greedy_match_min=args["greedy_match_min"],
        require=tuple(part.strip() for part in (args["require"] or "").split(",") if part.strip()),
    )
    options.validate()
    return options


def _run_with_progress(options) -> dict:
    """run_gate with a progress bar and log lines on stderr; the report."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specgate.gate.runner import run_gate

    console = common.err_console

    def log(message: str) -> None:
        console.print(f"[dim]gate:[/] {message}", highlight=False)

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        return run_gate(options, progress=progress, log=log)


def _summary(report: dict) -> dict:
    """The --json object: verdict, chosen config, recommendation, criteria, per-config verdicts, files, notes."""
    return {
        "verdict": report["verdict"], "config": report["config"], "recommendation": report["recommendation"], "criteria": report["criteria"],
        "configs": {name: c["verdict"] for name, c in report["configs"].items()}, "report": report["files"],
        "notes": report["notes"], "wall_s": report["wall_s"],
        "failures": {name: r["failure"] for name, r in report["measurements"].items() if r.get("failure")},
    }


def _print_report(report: dict, summary: dict) -> None:
    """The criteria table, the recommendation, notes, failures and the verdict, on stdout."""
    from rich.table import Table

    from specgate.gate.report import _f, recommendation_lines

    table = Table(title=f"gate criteria for {report['config']}")
    for column in ("criterion", "value", "threshold", "result", "reason"):
        table.add_column(column)
    for c in report["criteria"]:
        result = ("[green]PASS[/]" if c["pass"] else "[red]FAIL[/]") + ("" if c.get("binding", True) else " (target)")
        table.add_row(c["name"], _f(c["value"]), _f(c["threshold"]), result, c["reason"])
    common.console.print(table)
    common.console.print("\n".join(line for line in recommendation_lines(report) if line != "```"), highlight=False, markup=False)
    for note in report["notes"]:
        common.console.print(f"note: {note}", highlight=False)
    for name, failure in summary["failures"].items():
        common.console.print(f"[red]failed:[/] {name}: {failure}", highlight=False)
    colour = "green" if report["verdict"] == "GO" else "red"
    common.console.print(f"verdict: [bold {colour}]{report['verdict']}[/] ({report['config']})", highlight=False)
    common.console.print(f"report: {report['files']['html']}", highlight=False)
