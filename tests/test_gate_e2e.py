"""The whole gate against the real specgate server on loopback, with tiny models.

- embedded mode (`specgate serve` subprocesses): a peaked tiny target, a tiny draft model, n-gram drafts
  whose server is SIGKILLed mid-run, a LOSSY twin of the draft configuration (synthetic acceptance 1.0,
  which accepts every draft whatever p says) that the log-likelihood test must flag, the adaptive policy on the
  best fixed draft, and the recommendation measured as its own configuration;
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

SMALL = dict(concurrency=[1, 2], per_category=3, requests_per_level=4, poisson_requests=4, qps=20.0, max_tokens=16, greedy_tokens=32,
             math_items=6, sample_prompts=12, max_num_seqs=4, max_seq_len=256)


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
    from specgate.gate.decision import Thresholds
    from specgate.gate.runner import GateOptions, run_gate

    root = tmp_path_factory.mktemp("gate")
    target = peaked_copy(tiny_model_dir("llama"), root / "target")
    draft = tiny_model_dir("llama", seed=1)
    options = GateOptions(out=root / "out", target=str(target), drafts=[str(draft), "ngram"], gamma=3, lossy="synthetic:1.0",
                          thresholds=Thresholds(target_concurrency=2), **SMALL)
    killed = {}

    def after_phase(config: str, phase: str, endpoint) -> None:
        if config == "ngram" and phase == "c1:code":  # SIGKILL the server between two phases, and wait until it is gone
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
    assert on_disk["criteria"] and all(set(c) == {"name", "value", "threshold", "pass", "reason", "binding"} for c in on_disk["criteria"])
    measured = {draft_name, "ngram", f"{draft_name}-lossy-synthetic", f"{draft_name}-adaptive"}  # ngram died: adaptive on the draft
    assert measured <= set(report["configs"]) <= measured | {"recommended"}
    for name, config in report["configs"].items():  # each verdict is the rule applied to its own criteria
        binding = [c for c in config["criteria"] if c["binding"]]
        assert config["verdict"] == ("GO" if all(c["pass"] for c in binding) else "NO-GO"), name
        assert {c["name"] for c in config["criteria"] if not c["binding"]} == {"ttft_p95_at_target_concurrency", "itl_p95_at_target_concurrency", "memory_headroom"}
        assert config["engine"] == "specgate" and config["command"].startswith("python -m specgate serve")
    assert not report["measurements"][report["config"]].get("lossy") and not report["measurements"][report["config"]].get("failure")
    assert "unavailable" not in " ".join(report["notes"])
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert {r["config"] for r in rows} == {"baseline"} | set(report["configs"])
    assert all({"ttft_s", "itl_s", "tpot_s", "e2e_s", "phase", "category"} <= set(r) for r in rows)
    assert "# specgate gate" in (out / "report.md").read_text()
    baseline, spec = report["measurements"]["baseline"], report["measurements"][draft_name]
    assert [lv["concurrency"] for lv in spec["sweep"]] == [1, 2]
    assert spec["spec_total"]["flavour"] == "specgate" and spec["spec_total"]["num_draft_tokens"] > 0
    acceptance = report["configs"][draft_name]["acceptance"]
    assert acceptance["source"] == "counters" and acceptance["ar"] == spec["spec_total"]["acceptance_rate"]
    assert len(acceptance["per_position"]) == 3 and all(0 <= r <= 1 for r in acceptance["per_position"])
    assert set(spec["per_category"]) == {"code", "prose", "grounded", "math"}
    assert baseline["spec_total"]["num_draft_tokens"] == 0
    assert spec["memory"]["peak_rss_mib"] > 0 and spec["memory"]["kv_slots_total"] == 4 and spec["memory"]["preemptions"] == 0
    assert report["perplexity"]["perplexity"] > 1
    analysis = report["configs"][draft_name]["analysis"]
    assert analysis["per_concurrency"][0]["c"] is not None and analysis["alpha_min_c"] is not None
    assert "num_speculative_tokens_per_batch_size" in report["configs"][draft_name]["schedule"]["vllm_speculative_config"]


def test_the_recommendation_is_a_measured_configuration(embedded_run):
    """The recommendation is launched and measured with the same phases; GO only when its own throughput at the
    target concurrency is at least the baseline's; `off` is the measured baseline."""
    report, options, _, draft_name = embedded_run
    rec = report["recommendation"]
    assert rec["measured"] is True and rec["verdict"] == report["verdict"]
    target = str(options.thresholds.target_concurrency)
    if rec["kind"] == "off":
        assert rec["config"] == "off" and report["verdict"] == "NO-GO" and "--draft none" in rec["command"]
    else:
        assert rec["config"] == report["config"] and rec["based_on"] in report["configs"]
        measurement = report["measurements"]["recommended"]  # launched and measured either way
        assert [p["name"] for p in measurement["phases"]][-1] == "sample"
        if rec["config"] != "recommended":  # its run measured worse than the configuration it came from
            assert rec["config"] == rec["based_on"] and rec["kind"] == "config" and "recommended as it ran" in rec["reason"]
        assert rec["command"] == report["measurements"][rec["config"]]["command"]
        assert rec["throughput_ratio"][target] == report["configs"][rec["config"]]["analysis"]["per_concurrency"][-1]["measured_speedup"]
    if rec["verdict"] == "GO":
        assert rec["throughput_ratio"][target] >= 1.0
    adaptive = report["measurements"][f"{draft_name}-adaptive"]
    assert adaptive["policy"] == "adaptive" and "--policy adaptive" in adaptive["command"] and not adaptive.get("failure")


def test_lossless_draft_reproduces_greedy_and_lossy_twin_is_flagged(embedded_run):
    report, _, _, draft_name = embedded_run
    greedy = report["quality"][draft_name]["greedy"]
    assert greedy["pairs"] == 12 and greedy["rate"] == 1.0, greedy["mismatches"]
    assert not report["quality"][draft_name]["loglik"]["flagged"]
    lossy = report["configs"][f"{draft_name}-lossy-synthetic"]
    by_name = {c["name"]: c for c in lossy["criteria"]}
    assert lossy["verdict"] == "NO-GO" and not by_name["lossless"]["pass"]
    loglik = report["quality"][f"{draft_name}-lossy-synthetic"]["loglik"]
    assert loglik["flagged"] and loglik["p_value"] < 0.01 and not by_name["sampled_loglik_shift"]["pass"]
    assert report["measurements"][f"{draft_name}-lossy-synthetic"]["spec_total"]["lossy"]


def test_a_server_killed_mid_run_is_reported_and_the_gate_goes_on(embedded_run):
    report, _, killed, draft_name = embedded_run
    ngram = report["measurements"]["ngram"]
    assert killed["pid"] and "killed by signal 9" in ngram["failure"] and str(killed["pid"]) in ngram["failure"]
    assert [p["name"] for p in ngram["phases"]] == ["warmup", "c1:code"]  # measured before the kill: kept
    assert not any(p["name"] == "sample" for p in ngram["phases"]) and ngram["samples"] == {}  # the rest: skipped
    by_name = {c["name"]: c for c in report["configs"]["ngram"]["criteria"]}
    assert not by_name["completed"]["pass"] and "signal 9" in by_name["completed"]["reason"]
    assert report["measurements"][f"{draft_name}-lossy-synthetic"].get("failure") is None  # measured after the kill


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
    assert len(seen["widths"]) == 3 and all(w > 100 for w in seen["widths"])
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
                "--concurrency", "1,2", "--target-concurrency", "2", "--per-category", "1", "--requests-per-level", "2",
                "--poisson-requests", "2", "--qps", "20", "--max-tokens", "8", "--math-items", "3", "--sample-prompts", "4",
                "--out", str(tmp_path / "ext"), "--json", "--fail-on-no-go"]
        result = CliRunner().invoke(app, args, standalone_mode=False)
    finally:
        for server in servers:
            server.stop()
    summary = json.loads(result.stdout)
    assert set(summary) >= {"verdict", "config", "criteria", "configs", "report", "notes"}
    assert (result.return_value or 0) == (0 if summary["verdict"] == "GO" else 1)
    report = json.loads(Path(summary["report"]["json"]).read_text())
    for name, config in report["configs"].items():  # each verdict is the rule applied to its own criteria
        expected = "GO" if all(c["pass"] for c in config["criteria"] if c["binding"]) else "NO-GO"
        assert config["verdict"] == summary["configs"][name] == expected, name
    recommended = summary["recommendation"]
    if recommended["kind"] == "off":  # no speculation is recommended: NO-GO whatever the criteria of the rest
        assert summary["verdict"] == "NO-GO"
    else:  # the recommended config's own binding criteria decide, and they are the summary's criteria
        assert summary["criteria"] == report["configs"][recommended["config"]]["criteria"]
        assert summary["verdict"] == ("GO" if all(c["pass"] for c in summary["criteria"] if c["binding"]) else "NO-GO")
    assert report["configs"]["speculative"]["engine"] == "specgate"  # read from the server's /v1/models
    rec = report["recommendation"]
    assert rec["measured"] and (rec["config"], rec["kind"]) in {("speculative", "config"), ("off", "off")}
    spec = report["measurements"]["speculative"]
    assert spec["spec_total"]["flavour"] == "specgate" and spec["spec_total"]["num_drafts"] > 0
    assert spec["memory"]["peak_rss_mib"] is None and spec["memory"]["kv_slots_total"] == 2
    assert report["quality"]["speculative"]["greedy"]["rate"] == 1.0


def test_launch_templates_start_specgate_serve_per_gamma(tiny_model_dir, tmp_path):
    """--server-cmd / --baseline-cmd: any engine that starts from a command line; {gamma} runs once per draft length."""
    from specgate.gate.decision import Thresholds
    from specgate.gate.runner import GateOptions, run_gate

    target = tiny_model_dir("llama")
    serve = f"{sys.executable} -m specgate serve --target {target} --host 127.0.0.1 --port {{port}} --max-num-seqs 2 --max-seq-len 256"
    options = GateOptions(out=tmp_path / "tpl", target=str(target), server_cmd=serve + " --draft ngram --policy fixed --gamma {gamma}",
                          baseline_cmd=serve + " --draft none --policy off", gammas=[2, 3], recommend=False,
                          thresholds=Thresholds(target_concurrency=2),
                          **{**SMALL, "per_category": 1, "requests_per_level": 2, "poisson_requests": 2, "math_items": 2, "sample_prompts": 2})
    report = run_gate(options)
    assert set(report["configs"]) == {"server-cmd-g2", "server-cmd-g3"}
    for name, gamma in (("server-cmd-g2", 2), ("server-cmd-g3", 3)):
        m = report["measurements"][name]
        assert m["engine"] == "specgate" and f"--gamma {gamma}" in m["command"] and not m.get("failure")
        assert m["spec_total"]["mean_draft_len"] <= gamma and m["spec_total"]["num_draft_tokens"] > 0
        assert report["quality"][name]["greedy"]["rate"] == 1.0
    assert report["measurements"]["baseline"]["spec_total"]["num_draft_tokens"] == 0
