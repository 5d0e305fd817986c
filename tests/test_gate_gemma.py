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
    assert not summary["failures"]
    report = json.loads((out / "report.json").read_text())
    assert {"ngram", "ngram-adaptive"} <= set(report["configs"]) and summary["config"] in report["configs"]
    for name, config in report["configs"].items():  # specgate's greedy output is token-identical under speculation
        assert report["quality"][name]["greedy"]["rate"] == 1.0, (name, report["quality"][name]["greedy"]["mismatches"])
        binding = [c for c in config["criteria"] if c["binding"]]
        assert config["verdict"] == ("GO" if all(c["pass"] for c in binding) else "NO-GO")
        assert {c["name"]: c for c in config["criteria"]}["lossless"]["pass"]
    # unscored (--no-score): the log-likelihood test is not measured, so no configuration can be GO
    assert summary["verdict"] == report["recommendation"]["verdict"] == "NO-GO" and report["recommendation"]["measured"]
    spec = report["measurements"]["ngram"]
    assert spec["spec_total"]["num_draft_tokens"] > 0 and spec["per_category"]["grounded"]["acceptance_rate"] > 0
    assert report["configs"]["ngram"]["analysis"]["per_concurrency"][0]["c"] is not None
    assert any("target scoring skipped" in note for note in report["notes"])
    assert (out / "report.html").stat().st_size > 20_000
