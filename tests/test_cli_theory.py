"""The theory commands: model, simulate, sweep, demo; --json output and one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specgate.cli.main import app

SPECGATE = Path(sys.executable).parent / "specgate"
runner = CliRunner()


def run_json(*args: str) -> dict:
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def run_console_script(*args: str) -> subprocess.CompletedProcess:
    command = [str(SPECGATE)] if SPECGATE.exists() else [sys.executable, "-m", "specgate"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60)


def test_model_json_lesson_numbers():
    out = run_json("model", "--alpha", "0.7", "--gamma", "4", "--c", "0.1")
    assert out["expected_tokens"] == pytest.approx(2.773, abs=5e-4)
    assert out["speedup"] == pytest.approx(1.981, abs=5e-4)
    assert out["c_break"] == pytest.approx(0.443, abs=5e-4)
    assert out["iteration_cost"] == pytest.approx(1.4)
    assert out["c"] == pytest.approx(0.1)
    assert out["best_gamma"] == 4 and out["best_speedup"] == pytest.approx(1.981, abs=5e-4)
    assert 0 < out["alpha_min"] < 0.7
    assert {"compute_overhead", "speedup_lower_bound"} <= set(out)


def test_model_from_times_exercise():
    out = run_json("model", "--alpha", "0.75", "--gamma", "4", "--draft-ms", "8", "--target-ms", "40")
    assert out["c"] == pytest.approx(0.2)
    assert out["speedup"] == pytest.approx(1.695, abs=5e-4)


def test_model_alpha_min_and_null_when_unreachable():
    assert run_json("model", "--alpha", "0.5", "--gamma", "4", "--c", "0.2")["alpha_min"] == pytest.approx(0.455, abs=5e-4)
    out = run_json("model", "--alpha", "0.5", "--gamma", "4", "--c", "1.5")
    assert out["alpha_min"] is None and out["speedup_lower_bound"] is None


def test_model_table_output():
    result = runner.invoke(app, ["model", "--alpha", "0.7", "--gamma", "4", "--c", "0.1"])
    assert result.exit_code == 0
    assert "1.981" in result.stdout and "0.443" in result.stdout


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["model", "--alpha", "1.5", "--gamma", "4", "--c", "0.1"], "alpha=1.5"),
        (["model", "--alpha", "0.7", "--gamma", "4"], "--c"),
        (["model", "--alpha", "0.7", "--gamma", "4", "--c", "0.1", "--draft-ms", "8", "--target-ms", "40"], "--c"),
        (["simulate", "--alpha", "0.7", "--gamma", "0", "--c", "0.1"], "gamma=0"),
        (["simulate", "--profile", "0.9,abc", "--c", "0.1"], "--profile"),
    ],
)
def test_bad_arguments_one_line_no_traceback(args, names):
    result = run_console_script(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:") and names in lines[0]
    assert result.stdout == ""


def test_simulate_json():
    out = run_json("simulate", "--alpha", "0.7", "--gamma", "4", "--c", "0.1", "--iterations", "200000", "--seed", "3")
    lo, hi = out["acceptance_length_ci95"]
    assert lo <= out["acceptance_length"] <= hi
    assert lo <= out["closed_form_expected_tokens"] <= hi and out["closed_form_within_ci95"] is True
    assert out["iterations"] == 200_000 and sum(out["histogram"]) == 200_000
    assert out["speedup"] == pytest.approx(out["acceptance_length"] / 1.4)
    again = run_json("simulate", "--alpha", "0.7", "--gamma", "4", "--c", "0.1", "--iterations", "200000", "--seed", "3")
    assert again == out


def test_simulate_profile_json():
    out = run_json("simulate", "--profile", "0.9,0.8,0.6", "--c", "0.1", "--iterations", "200000", "--seed", "1")
    assert out["gamma"] == 3 and len(out["histogram"]) == 4
    assert out["closed_form_expected_tokens"] == pytest.approx(1 + 0.9 + 0.72 + 0.432)
    lo, hi = out["acceptance_length_ci95"]
    assert lo <= out["closed_form_expected_tokens"] <= hi


def test_sweep_writes_png(tmp_path):
    target = tmp_path / "plots" / "sweep.png"
    out = run_json("sweep", "--out", str(target), "--c", "0.2")
    assert out["out"] == str(target)
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and target.stat().st_size > 20_000
    assert out["best_gamma_by_alpha"]["0.7"]["gamma"] == 3


def test_demo_runs_and_writes_plot(tmp_path):
    result = runner.invoke(app, ["demo", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    plot = tmp_path / "theory_sweep.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(plot) in result.stdout.replace("\n", "")
    for number in ("2.773", "1.981", "1.541", "1.076", "2.318", "0.443", "1.695", "3.69x", "1.63x", "6.86x", "1.60x"):
        assert number in result.stdout, number


def test_demo_json(tmp_path):
    out = run_json("demo", "--out", str(tmp_path))
    assert out["out"] == str(tmp_path / "theory_sweep.png")
    assert all(row["closed_form_within_ci95"] for row in out["monte_carlo"])
    assert out["alpha_min"]["4"]["0.2"] == pytest.approx(0.455, abs=5e-4)
