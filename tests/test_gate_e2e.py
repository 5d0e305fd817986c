"""The whole gate against the real specgate server on loopback, with tiny models.

- embedded mode (`specgate serve` subprocesses): a peaked tiny target, n-gram drafts, a copy of the target as
  its own draft model (every greedy draft accepted: it pays), another tiny draft model whose server is SIGKILLed
  mid-run, a LOSSY twin of the n-gram configuration (synthetic acceptance 1.0, which accepts every
  draft whatever p says) that the log-likelihood equivalence test must fail, the adaptive policy on the n-gram drafts,
  screening in paired rounds, and the recommendation measured again in its own paired rounds;
- the launch-template mechanism (`--server-cmd` / `--baseline-cmd`) with `specgate serve`;
- external mode through the CLI (`--endpoint` / `--baseline-endpoint`) against in-process servers;
- the HTML report in headless Chromium: it renders, shows the verdict, and every plot image decodes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gate_helpers import check_verdicts_follow_the_rule, criterion

SMALL = dict(concurrency=[1, 2], target_concurrency=2, per_category=3, max_tokens=16, greedy_tokens=32, math_items=160, sample_prompts=24,
             sample_tokens=16, max_num_seqs=4, max_seq_len=256, round_s=1.0, rounds=4, budget_s=24.0)  # longer rounds: tiny-model rounds swing with the host


def peaked_copy(src: Path, dst: Path, scale: float = 3.0) -> Path:
    """The tiny model with its LM head scaled up: next-token entropy ~2.3 nats instead of ~5.5 (near uniform)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * scale
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def embedded_run(tiny_model_dir, tmp_path_factory):
    from specgate.gate.options import GateOptions
    from specgate.gate.runner import run_gate

    root = tmp_path_factory.mktemp("gate")
    target = peaked_copy(tiny_model_dir("llama"), root / "target")
    draft = tiny_model_dir("llama", seed=1)
    itself = Path(shutil.copytree(target, root / "self-draft"))
    options = GateOptions(out=root / "out", target=str(target), drafts=["ngram", str(itself), str(draft)], gammas=[3], lossy="synthetic:1.0", **SMALL)
    killed = {}

    def after_phase(config: str, phase: str, endpoint) -> None:
        if config == draft.name and phase == "greedy:code":  # SIGKILL the server between two phases, and wait until it is gone
            killed["pid"] = endpoint.process.pid
            os.kill(endpoint.process.pid, signal.SIGKILL)
            endpoint.process.wait()

    report = run_gate(options, after_phase=after_phase)
    return report, options, killed, draft.name


def test_embedded_report_structure_and_files(embedded_run):
    report, options, _, draft_name = embedded_run
    out = Path(options.out)
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["verdict"] == report["verdict"] == report["recommendation"]["verdict"] and report["engine"] == "specgate"
    assert report["verdict"] in ("GO", "NO-GO", "INCONCLUSIVE")
    keys = {"name", "state", "pass", "binding", "load", "estimate", "interval", "threshold", "reason", "needed"}
    assert on_disk["criteria"] and all(set(c) == keys for c in on_disk["criteria"])
    measured = {draft_name, "ngram", "self-draft", "ngram-lossy-synthetic", "ngram-adaptive"}
    assert measured <= set(report["configs"]) <= measured | {"recommended"}
    for name, config in report["configs"].items():
        assert config["engine"] == "specgate" and config["command"].startswith("python -m specgate serve")
        assert {c["name"] for c in config["criteria"] if not c["binding"]} >= {"ttft_p95_at_target_concurrency", "itl_p95_at_target_concurrency", "memory_headroom"}
    check_verdicts_follow_the_rule(report)
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert {r["config"] for r in rows} == {"baseline"} | set(report["measurements"])
    assert {"c1", "c2"} <= {r["phase"] for r in rows} and any(r["block"] is not None for r in rows)  # the paired rounds' requests
    assert all({"ttft_s", "itl_s", "tpot_s", "e2e_s", "phase", "category", "chunk_times_s"} <= set(r) for r in rows)
    assert "# specgate gate" in (out / "report.md").read_text()
    spec = report["measurements"]["ngram"]
    screened = [w for w in spec["windows"] if w["stage"] == "screen"]
    assert {w["load"] for w in screened} == {"c1", "c2"} and len({w["block"] for w in screened}) == options.rounds
    assert all(w["tokens_per_s"] > 0 and w["window_s"] >= options.round_s for w in screened)
    assert spec["spec_total"]["flavour"] == "specgate" and spec["spec_total"]["num_draft_tokens"] > 0
    acceptance = report["configs"]["ngram"]["acceptance"]
    assert acceptance["source"] == "counters" and acceptance["ar"] == spec["spec_total"]["acceptance_rate"]
    check = acceptance["fixed_work_check"]  # specgate's per-response `timings` summed == its counters, same requests
    assert check["timings_ar"] is not None and check["counters_ar"] == pytest.approx(check["timings_ar"])
    assert len(acceptance["per_position"]) == 3 and all(0 <= r <= 1 for r in acceptance["per_position"])
    assert set(spec["per_category"]) == {"code", "prose", "grounded", "math"}
    assert report["measurements"]["baseline"]["spec_total"]["num_draft_tokens"] == 0
    assert spec["memory"]["peak_rss_mib"] > 0 and spec["memory"]["kv_slots_total"] == 4 and spec["memory"]["preemptions"] == 0
    assert report["perplexity"]["perplexity"] > 1
    c1 = next(a for a in report["configs"]["ngram"]["loads"] if a["load"] == "c1")
    assert c1["throughput_ratio"]["n"] == options.rounds and c1["acceptance"]["c"] is not None and c1["acceptance"]["alpha"] is not None
    assert "num_speculative_tokens_per_batch_size" in report["configs"]["ngram"]["schedule"]["vllm_speculative_config"]


def test_the_recommendation_is_measured_again_in_its_own_paired_rounds(embedded_run):
    """The recommendation is chosen on the screening's intervals (the self-draft, accepted at every position, pays)
    and confirmed in fresh rounds, Poisson included; the headline verdict is the confirmation's."""
    report, options, _, _ = embedded_run
    rec = report["recommendation"]
    self_draft = next(a for a in report["configs"]["self-draft"]["loads"] if a["load"] == "c1")
    assert self_draft["acceptance"]["ar"]["estimate"] == 1.0 and self_draft["throughput_ratio"]["estimate"] > 1.0
    assert rec["kind"] != "off", rec["reason"]
    confirmed = report["configs"]["recommended"]
    assert rec["config"] == "recommended" and confirmed["stage"] == "confirm" and rec["based_on"] in report["configs"]
    assert {a["load"] for a in confirmed["loads"]} == {"c1", "c2", "poisson"}
    stage = report["stages"]["confirm"]
    assert 2 <= stage["blocks"] <= stage["planned_blocks"][-1] and stage["level"] >= 0.95
    windows = [w for w in report["measurements"]["recommended"]["windows"]]
    assert windows and all(w["stage"] == "confirm" for w in windows)  # fresh rounds, not the screening's
    assert rec["throughput_ratio"]["c2"] == next(a["throughput_ratio"] for a in confirmed["loads"] if a["load"] == "c2")
    assert report["criteria"] == confirmed["criteria"] and report["verdict"] == confirmed["verdict"]
    adaptive = report["measurements"][[n for n in report["measurements"] if n.endswith("-adaptive")][0]]
    assert adaptive["policy"] == "adaptive" and "--policy adaptive" in adaptive["command"] and not adaptive.get("failure")


def test_lossless_draft_reproduces_greedy_and_the_lossy_twin_fails_quality(embedded_run):
    report, options, _, draft_name = embedded_run
    greedy = report["configs"]["ngram"]["quality"]["greedy"]
    assert greedy["pairs"] == 12 and greedy["rate"] == 1.0, greedy["mismatches"]
    assert criterion(report["configs"]["ngram"], "lossless")["state"] == "PASS"
    lossy = report["configs"]["ngram-lossy-synthetic"]
    assert lossy["verdict"] == "NO-GO" and criterion(lossy, "lossless")["state"] == "FAIL"
    loglik = criterion(lossy, "sampled_loglik_equivalence")
    assert loglik["state"] == "FAIL" and abs(loglik["interval"]["estimate"]) > options.loglik_margin
    assert report["measurements"]["ngram-lossy-synthetic"]["spec_total"]["lossy"]
    assert report["recommendation"]["based_on"] != "ngram-lossy-synthetic"


def test_a_server_killed_mid_run_is_reported_and_the_gate_goes_on(embedded_run):
    report, _, killed, draft_name = embedded_run
    dead = report["measurements"][draft_name]
    assert killed["pid"] and "killed by signal 9" in dead["failure"] and str(killed["pid"]) in dead["failure"]
    assert [p["name"] for p in dead["phases"]] == ["warmup", "greedy:code"]  # measured before the kill: kept
    assert dead["samples"] == {} and dead["windows"] == []  # the rest: skipped
    completed = criterion(report["configs"][draft_name], "completed")
    assert completed["state"] == "FAIL" and "signal 9" in completed["reason"] and report["configs"][draft_name]["verdict"] == "NO-GO"
    assert report["measurements"]["ngram-lossy-synthetic"].get("failure") is None  # measured after the kill


def test_html_report_renders_verdict_and_plots_in_headless_chromium(embedded_run, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("headless Chromium not installed (Debian: apt-get install chromium; `make test` installs it when apt is available)")
    report, options, _, _ = embedded_run
    page = (Path(options.out) / "report.html").read_text()
    assert "http://" not in page and "https://" not in page  # self-contained
    probe = ("<script>window.addEventListener('load', function () {"
             " var imgs = [].slice.call(document.querySelectorAll('img.plot'));"
             " var d = document.createElement('pre'); d.id = 'probe';"
             " d.textContent = JSON.stringify({verdict: document.getElementById('verdict').textContent,"
             " widths: imgs.map(function (i) { return i.complete ? i.naturalWidth : -1; }), rows: document.querySelectorAll('#criteria tr').length});"
             " document.body.appendChild(d); });</script>")
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("</body>", probe + "</body>"))
    args = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*args, "--dump-dom", probed.as_uri()], capture_output=True, text=True, timeout=120).stdout
    start = dom.index('<pre id="probe">') + len('<pre id="probe">')
    seen = json.loads(dom[start : dom.index("</pre>", start)].replace("&quot;", '"'))
    assert seen["verdict"] == report["verdict"]
    assert len(seen["widths"]) == 3 and all(w > 100 for w in seen["widths"])  # throughput ratio, throughput and acceptance, the traffic
    assert seen["rows"] == len(report["criteria"]) + 1
    subprocess.run([*args, f"--screenshot={tmp_path / 'shot.png'}", "--window-size=1200,900", probed.as_uri()], capture_output=True, timeout=120)
    assert (tmp_path / "shot.png").stat().st_size > 10_000  # a rendered page, not a blank one


def test_external_mode_cli_against_in_process_servers(tiny_model_dir, tmp_path):
    from specgate.cli.main import app
    from specgate.models import load_model
    from specgate.serving.server import ServerConfig, start_server

    target = tiny_model_dir("llama")
    loaded = load_model(str(target))
    servers = [start_server(ServerConfig(target=loaded, draft="none", policy="off", port=0, max_num_seqs=2)),
               start_server(ServerConfig(target=loaded, draft="ngram", policy="fixed", gamma=3, port=0, max_num_seqs=2))]
    try:
        args = ["gate", "--baseline-endpoint", servers[0].url, "--endpoint", servers[1].url, "--target", str(target),
                "--concurrency", "1,2", "--target-concurrency", "2", "--per-category", "1", "--max-tokens", "8", "--math-items", "20",
                "--sample-prompts", "4", "--sample-tokens", "8", "--round-s", "0.5", "--rounds", "2", "--budget-s", "8",
                "--out", str(tmp_path / "ext"), "--json", "--fail-on-no-go"]
        result = CliRunner().invoke(app, args, standalone_mode=False)
    finally:
        for server in servers:
            server.stop()
    summary = json.loads(result.stdout)
    assert set(summary) >= {"verdict", "config", "criteria", "configs", "report", "notes"}
    assert (result.return_value or 0) == {"GO": 0, "NO-GO": 1, "INCONCLUSIVE": 3}[summary["verdict"]]
    report = json.loads(Path(summary["report"]["json"]).read_text())
    check_verdicts_follow_the_rule(report, summary)
    assert set(report["configs"]) == {"speculative"} and report["configs"]["speculative"]["stage"] == "confirm"
    assert report["configs"]["speculative"]["engine"] == "specgate"  # read from the server's /v1/models
    spec = report["measurements"]["speculative"]
    assert spec["spec_total"]["flavour"] == "specgate" and spec["spec_total"]["num_drafts"] > 0
    assert spec["memory"]["peak_rss_mib"] is None and spec["memory"]["kv_slots_total"] == 2
    assert report["configs"]["speculative"]["quality"]["greedy"]["rate"] == 1.0


def test_launch_templates_start_specgate_serve_per_gamma(tiny_model_dir, tmp_path):
    """--server-cmd / --baseline-cmd: any engine that starts from a command line; {gamma} runs once per draft length."""
    from specgate.gate.options import GateOptions
    from specgate.gate.runner import run_gate

    target = tiny_model_dir("llama")
    serve = f"{sys.executable} -m specgate serve --target {target} --host 127.0.0.1 --port {{port}} --max-num-seqs 2 --max-seq-len 256"
    options = GateOptions(out=tmp_path / "tpl", target=str(target), server_cmd=serve + " --draft ngram --policy fixed --gamma {gamma}",
                          baseline_cmd=serve + " --draft none --policy off", gammas=[2, 3], recommend=False,
                          **{**SMALL, "per_category": 1, "math_items": 8, "sample_prompts": 2, "rounds": 2})
    report = run_gate(options)
    assert set(report["configs"]) == {"server-cmd-g2", "server-cmd-g3"}
    for name, gamma in (("server-cmd-g2", 2), ("server-cmd-g3", 3)):
        m = report["measurements"][name]
        assert m["engine"] == "specgate" and f"--gamma {gamma}" in m["command"] and not m.get("failure")
        assert m["spec_total"]["mean_draft_len"] <= gamma and m["spec_total"]["num_draft_tokens"] > 0
        assert report["configs"][name]["quality"]["greedy"]["rate"] == 1.0
    assert report["measurements"]["baseline"]["spec_total"]["num_draft_tokens"] == 0
