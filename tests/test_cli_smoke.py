"""The console script is installed and answers --help."""

import subprocess
import sys


def test_help_runs():
    out = subprocess.run([sys.executable, "-m", "specgate", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "specgate" in out.stdout.lower()
