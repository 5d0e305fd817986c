"""The console script is installed and answers --help."""

import subprocess
import sys


def test_help_runs():
    out = subprocess.run([sys.executable, "-m", "specgate", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "specgate" in out.stdout.lower()


def _run(*args):
    return subprocess.run([sys.executable, "-m", "specgate", *args], capture_output=True, text=True)


def test_usage_errors_are_one_line_with_exit_2():
    for args in (["model", "--alpha", "0.7", "--gamma", "2.5", "--c", "0.1"], ["no-such-command"]):
        out = _run(*args)
        assert out.returncode == 2, (args, out)
        assert "Traceback" not in out.stderr
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), out.stderr


def test_no_arguments_prints_help():
    out = _run()
    assert out.returncode == 0
    assert "Usage" in out.stdout


def test_every_command_offers_json():
    import typer.main

    from specgate.cli.main import app

    def leaves(group, prefix):
        for name, command in group.commands.items():
            if hasattr(command, "commands"):  # a command family (`specgate engines ...`): each of its commands
                yield from leaves(command, f"{prefix}{name} ")
            else:
                yield f"{prefix}{name}", command

    found = dict(leaves(typer.main.get_command(app), ""))
    assert {"gate", "engines install", "engines path", "engines list"} <= set(found)
    for name, command in found.items():
        options = {opt for param in command.params for opt in getattr(param, "opts", [])}
        assert "--json" in options, f"specgate {name} has no --json option"


def test_version_json():
    import json

    out = _run("version", "--json")
    assert out.returncode == 0
    assert json.loads(out.stdout)["version"]
