"""One small gate run on the real Gemma-3-270M through the CLI (slow: two server start-ups, ~1 minute)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gate_helpers import check_verdicts_follow_the_rule, criterion

pytestmark = pytest.mark.slow


def test_gate_cli_on_gemma_with_ngram_drafts(tmp_path):
    out = tmp_path / "gate"
    args = [sys.executable, "-m", "specgate", "gate", "--draft", "ngram", "--concurrency", "1", "--target-concurrency", "1",
            "--per-category", "1", "--max-tokens", "12", "--math-items", "2", "--sample-prompts", "2", "--max-num-seqs", "2",
            "--round-s", "1", "--rounds", "2", "--budget-s", "8", "--no-adaptive", "--no-score", "--out", str(out), "--json"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert not summary["failures"]
    report = json.loads((out / "report.json").read_text())
    assert set(report["configs"]) == {"ngram"} and report["configs"]["ngram"]["stage"] == "screen"  # one configuration: decided at once
    config = report["configs"]["ngram"]
    greedy = config["quality"]["greedy"]
    assert greedy["rate"] == 1.0, greedy["mismatches"]  # specgate's greedy output is token-identical under speculation
    assert criterion(config, "lossless")["state"] == "PASS"
    # unscored (--no-score): the log-likelihood test is not measured, so the verdict cannot be GO
    assert criterion(config, "sampled_loglik_equivalence")["state"] == "UNDECIDED" and summary["verdict"] in ("INCONCLUSIVE", "NO-GO")
    check_verdicts_follow_the_rule(report, summary)
    spec = report["measurements"]["ngram"]
    assert spec["spec_total"]["num_draft_tokens"] > 0 and spec["per_category"]["grounded"]["acceptance_rate"] > 0
    c1 = config["loads"][0]
    assert c1["load"] == "c1" and c1["acceptance"]["c"] is not None and c1["rounds"] >= 2
    assert any("target scoring skipped" in note for note in report["notes"])
    assert (out / "report.html").stat().st_size > 20_000
