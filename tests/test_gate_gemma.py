"""One small gate run on the real Gemma-3-270M through the CLI (slow: two server start-ups, ~1 minute)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_gate_cli_on_gemma_with_ngram_drafts(tmp_path):
    out = tmp_path / "gate"
    args = [sys.executable, "-m", "specgate", "gate", "--draft", "ngram", "--concurrency", "1", "--target-concurrency", "1",
            "--per-category", "1", "--max-tokens", "12", "--poisson-requests", "2", "--qps", "5", "--math-items", "2",
            "--sample-prompts", "2", "--max-num-seqs", "2", "--no-score", "--out", str(out), "--json"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["verdict"] in ("GO", "NO-GO") and summary["config"] == "ngram" and not summary["failures"]
    report = json.loads((out / "report.json").read_text())
    assert report["quality"]["ngram"]["greedy"]["rate"] == 1.0, report["quality"]["ngram"]["greedy"]["mismatches"]
    spec = report["measurements"]["ngram"]
    assert spec["spec_total"]["num_draft_tokens"] > 0 and spec["per_category"]["grounded"]["acceptance_rate"] > 0
    assert report["configs"]["ngram"]["analysis"]["per_concurrency"][0]["c"] is not None
    assert any("target scoring skipped" in note for note in report["notes"])
    assert (out / "report.html").stat().st_size > 20_000
