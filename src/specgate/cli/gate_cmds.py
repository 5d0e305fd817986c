"""`specgate gate`: measure speculation against a baseline as an experiment and decide GO / NO-GO / INCONCLUSIVE
(docs/GATE.md). Its options are GateOptions' fields (specgate.gate.options): declared once, with their help and their
`--quick` values, and turned into the command's parameters here."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any, Optional

import typer

from specgate.cli import common

EXIT_NO_GO, EXIT_INCONCLUSIVE = 1, 3  # with --fail-on-no-go; 0 for GO (and for any verdict without it); 2 for bad input
CLI_ONLY = {
    "quick": (bool, typer.Option(False, "--quick", help="The --quick values of every option not given (about 6 minutes on Gemma-3-270M, 2 cores).")),
    "fail_on_no_go": (bool, typer.Option(False, "--fail-on-no-go", help=f"Exit {EXIT_NO_GO} on NO-GO and {EXIT_INCONCLUSIVE} on INCONCLUSIVE (default: exit 0 whenever the run completes).")),
    "json_output": (bool, typer.Option(False, "--json", help="Print one JSON object {verdict, config, recommendation, criteria, configs, report, notes}.")),
}


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values:
        raise common.UserError(f"{flag} {text!r} is not a comma-separated list of integers, e.g. 1,2,4,8")
    return values


def _parameters() -> list[inspect.Parameter]:
    """One typer option per GateOptions field (default None: the field's own, or its --quick value), then CLI_ONLY."""
    from specgate.gate.options import GateOptions, cli_name

    params = []
    for f in dataclasses.fields(GateOptions):
        flag = cli_name(f)
        if not flag:
            continue
        kind, help_text = f.metadata.get("kind"), _with_defaults(f)
        if kind == "list":
            annotation, option = list[str], typer.Option([], flag, help=help_text)
        elif kind == "bool":
            name = flag[2:]
            annotation, option = Optional[bool], typer.Option(None, f"--{name}/--no-{name}", help=help_text)
        elif kind in ("ints", "csv"):
            annotation, option = Optional[str], typer.Option(None, flag, help=help_text)
        else:
            base = {Path: Path, float: float, int: int}.get(_plain_type(f), str)
            annotation, option = Optional[base], typer.Option(None, flag, help=help_text)
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation))
    for name, (annotation, option) in CLI_ONLY.items():
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation))
    return params


def _with_defaults(f: dataclasses.Field) -> str:
    from specgate.gate.options import show_value

    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    quick = f.metadata.get("quick", dataclasses.MISSING)
    return f"{f.metadata['help']} [default: {show_value(default)}" + ("" if quick is dataclasses.MISSING else f"; --quick: {show_value(quick)}") + "]"


def _plain_type(f: dataclasses.Field) -> type:
    text = str(f.type)
    return Path if "Path" in text else float if "float" in text else int if "int" in text else str


def gate_options(args: dict[str, Any]):
    """GateOptions (quick or full defaults) with the given options over them, validated."""
    from specgate.gate.options import GateOptions

    out = args.get("out") or Path("out/gate")
    options = GateOptions.quick(out) if args.get("quick") else GateOptions(out=out)
    for f in dataclasses.fields(GateOptions):
        value = args.get(f.name)
        if value is None or (f.metadata.get("kind") == "list" and not value):
            continue
        kind = f.metadata.get("kind")
        if kind == "ints":
            value = _int_list(value, "--" + (f.metadata.get("cli") or f.name).replace("_", "-"))
        elif kind == "csv":
            value = [part.strip() for part in value.split(",") if part.strip()]
        elif kind == "list":
            value = list(value)
        setattr(options, f.name, value)
    options.validate()
    return options


def register(app: typer.Typer) -> None:
    """Add `gate` to `app`."""

    def gate(**args: Any) -> None:
        """Measure speculation against a baseline in paired, interleaved rounds and decide GO / NO-GO / INCONCLUSIVE, with a report."""
        from specgate.gate.runner import check_out_dir, make_plan, target_tokenizer

        options = gate_options(args)
        check_out_dir(options.out)
        plan = make_plan(options, target_tokenizer(options.target))  # a bad --workload is one line, before any progress
        report = _run_with_progress(options, plan)
        summary = _summary(report)
        if args["json_output"]:
            common.print_json(summary)
        else:
            _print_report(report, summary)
        if args["fail_on_no_go"] and report["verdict"] != "GO":
            raise typer.Exit(EXIT_NO_GO if report["verdict"] == "NO-GO" else EXIT_INCONCLUSIVE)

    gate.__signature__ = inspect.Signature(_parameters())  # type: ignore[attr-defined]
    app.command(name="gate")(gate)


def _run_with_progress(options: Any, plan: Any) -> dict:
    """run_gate with progress bars and log lines on stderr; the report."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specgate.gate.runner import run_gate

    console = common.err_console

    def log(message: str) -> None:
        console.print(f"[dim]gate:[/] {message}", highlight=False)

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        return run_gate(options, plan=plan, progress=progress, log=log)


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

    from specgate.gate.report import CRITERIA_HEADER, criteria_rows, recommendation_lines

    table = Table(title=f"gate criteria for {report['config'] or 'no speculation'}")
    for column in CRITERIA_HEADER:
        table.add_column(column)
    for row in criteria_rows(report["criteria"]):
        colour = {"PASS": "green", "FAIL": "red", "UNDECIDED": "yellow"}.get(row[4].split()[0], "dim")
        table.add_row(*row[:4], f"[{colour}]{row[4]}[/]", row[5])
    common.console.print(table)
    common.console.print("\n".join(line for line in recommendation_lines(report) if line != "```"), highlight=False, markup=False)
    for note in report["notes"]:
        common.console.print(f"note: {note}", highlight=False)
    for name, failure in summary["failures"].items():
        common.console.print(f"[red]failed:[/] {name}: {failure}", highlight=False)
    colour = {"GO": "green", "NO-GO": "red"}.get(report["verdict"], "yellow")
    common.console.print(f"verdict: [bold {colour}]{report['verdict']}[/] ({report['config'] or 'no speculation'})", highlight=False)
    common.console.print(f"report: {report['files']['html']}", highlight=False)
