"""Entry point of the `specgate` console script.

Every command module exposes `register(app)`; adding a command family means adding a module here.
Bad arguments exit with status 2 and one line naming the argument, never a traceback.
"""

from __future__ import annotations

import sys

import typer

try:  # typer >= 0.2x vendors its own copy of click; older releases use click itself
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import exceptions as click_exceptions

from specgate.cli import common, engine_cmds, engines_cmds, gate_cmds, serve_cmds, theory_cmds, verify_cmds

app = typer.Typer(
    name="specgate",
    help="Speculative decoding: run it exactly, predict it, measure it, decide whether it should be on.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)



@app.command()
def version(json_output: bool = typer.Option(False, "--json", help="Print one JSON object {version}.")) -> None:
    """Print specgate's version."""
    from specgate import __version__

    if json_output:
        common.print_json({"version": __version__})
    else:
        common.console.print(__version__)


for module in (theory_cmds, verify_cmds, engine_cmds, serve_cmds, gate_cmds, engines_cmds):
    module.register(app)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; usage and input errors become one `error: ...` line and exit status 2, never a traceback."""
    if argv is None and sys.argv[1:2] == ["serve"]:  # the real command line only: never an in-process caller
        from specgate.cli.hugepages import reexec_with_huge_pages

        reexec_with_huge_pages(sys.argv[1:])
    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name="specgate", standalone_mode=False)
    except click_exceptions.NoArgsIsHelpError as exc:
        common.console.print(exc.ctx.get_help() if exc.ctx else str(exc), highlight=False)
        sys.exit(0)
    except click_exceptions.UsageError as exc:
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx else ""
        common.fail(exc.format_message().replace("\n", " ") + hint)
    except (common.UserError, ValueError, FileNotFoundError) as exc:
        common.fail(str(exc).replace("\n", " "))
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(result if isinstance(result, int) else 0)


if __name__ == "__main__":
    main()
