"""Entry point of the `specgate` console script.

Every command module exposes `register(app)`; adding a command family means adding a module here.
Bad arguments exit with status 2 and one line naming the argument, never a traceback.
"""

from __future__ import annotations

import sys

import typer

from specgate.cli import common, engine_cmds, theory_cmds, verify_cmds

app = typer.Typer(
    name="specgate",
    help="Speculative decoding: run it exactly, predict it, measure it, decide whether it should be on.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)



@app.command()
def version() -> None:
    """Print specgate's version."""
    from specgate import __version__

    common.console.print(__version__)


for module in (theory_cmds, verify_cmds, engine_cmds):
    module.register(app)


def main() -> None:
    """Run the CLI; turn user errors (ValueError, FileNotFoundError) into one clean line and exit 2."""
    try:
        app(standalone_mode=True)
    except common.UserError as exc:
        common.fail(str(exc))
    except (ValueError, FileNotFoundError) as exc:
        common.fail(str(exc))
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
