"""llama.cpp for real: the llama-server specgate built (`specgate engines install llama.cpp`, run by `make test`)
on the Gemma-3-270M GGUF the package ships. Nothing here is mocked.

- its `llamacpp:spec_decode_*` counter deltas equal the per-response `timings` summed over the same requests;
- `specgate gate --engine llama.cpp` launches the baseline, a spec type and the recommendation, one at a time,
  and reports the engine, acceptance from counters, greedy mismatches with positions and `lossless` as unknown;
- the `--server-cmd` template mechanism drives llama-server and reads which engine it is from its answers.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from specgate.engines import gemma_gguf_path, llamacpp
from specgate.gate import client as gate_client
from specgate.gate import launch, prom

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama_server() -> str:
    try:
        return str(llamacpp.binary_path())
    except llamacpp.EngineNotInstalled as exc:
        pytest.skip(f"llama.cpp not installed: {exc}")


BLOCKS = {  # text that repeats, so llama.cpp's n-gram lookup (12-token keys by default) finds drafts in every category
    "code": "def area(width, height):\n    return width * height\n\n",
    "prose": "The river ran past the mill and the mill wheel turned slowly in the evening light. ",
    "grounded": "Item: 3 apples, 2 pears, 5 plums. Total: 10 pieces of fruit in the basket.\n",
    "math": "Q: What is 12 + 30? A: 42\n",
}


def repetitive_prompts() -> list[tuple[str, str]]:
    return [(category, block * 4) for category, block in BLOCKS.items()]


def _scrape(url: str) -> prom.SpecSnapshot:
    return prom.read_spec(prom.parse_exposition(httpx.get(f"{url}/metrics", timeout=10).text))


def test_counter_deltas_equal_the_summed_response_timings(llama_server, tmp_path):
    o = launch.LaunchOptions(engine="llama.cpp", target="gemma-3-270m", specs=["ngram-simple:8"], gamma=8, max_num_seqs=1,
                             max_seq_len=1024, threads=2)
    profile = launch.build_profiles(o)[1]
    assert profile.argv(1)[0] == llama_server and "--spec-type" in profile.argv(1)
    endpoint = launch.start(profile, tmp_path)
    try:
        assert launch.detect_engine(endpoint.url) == "llama.cpp"
        specs = [gate_client.RequestSpec(category, category, prompt, 48) for category, prompt in repetitive_prompts()]
        before = _scrape(endpoint.url)
        client = gate_client.Client(endpoint.url)
        outcome = asyncio.run(gate_client.closed_loop(client, specs, 1, config="ngram-simple", phase="c1"))
        asyncio.run(client.close())
        window = prom.spec_window(before, _scrape(endpoint.url))
    finally:
        endpoint.stop()
    assert all(r.ok for r in outcome.records), [r.error for r in outcome.records]
    timed = gate_client.sum_timings(outcome.records)
    assert window.flavour == "llamacpp" and timed is not None
    assert window.num_draft_tokens > 0 and window.num_draft_tokens == timed["draft_tokens"]
    assert window.num_accepted_tokens == timed["accepted_tokens"]
    assert 0.0 < window.acceptance_rate <= 1.0
    assert 1.0 <= window.mean_draft_len <= 8.0  # --spec-ngram-simple-size-m 8 bounds the drafts (--spec-draft-n-max would not)
    assert not any(window.accepted_per_pos[8:]) and all(0.0 <= r <= 1.0 for r in window.per_position_rate)
    assert sum(window.accepted_per_pos) == window.num_accepted_tokens  # marginal counts add up to the accepted tokens


def _gate(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "specgate", "gate", *args, "--json"], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


SMALL = ["--concurrency", "1,2", "--target-concurrency", "2", "--per-category", "1", "--max-tokens", "16", "--round-s", "1", "--rounds", "2",
         "--budget-s", "10", "--math-items", "2", "--sample-prompts", "2", "--max-num-seqs", "2", "--threads", "2", "--no-score"]


@pytest.fixture()
def workload(tmp_path) -> str:
    path = tmp_path / "workload.jsonl"
    path.write_text("".join(json.dumps({"id": category, "category": category, "prompt": prompt}) + "\n" for category, prompt in repetitive_prompts()))
    return str(path)


def test_gate_launches_llamacpp_profiles_and_reports_what_it_measured(llama_server, workload, tmp_path):
    out = tmp_path / "gate"
    summary = _gate("--engine", "llama.cpp", "--spec", "ngram-simple:8", "--workload", workload, *SMALL, "--out", str(out))
    report = json.loads((out / "report.json").read_text())
    name = "ngram-simple-g8"
    config, measured = report["configs"][name], report["measurements"][name]
    assert report["engine"] == "llama.cpp"
    assert config["engine"] == "llama.cpp" and "--spec-type ngram-simple --spec-ngram-simple-size-m 8" in config["command"]
    assert not measured.get("failure") and [p["name"] for p in measured["phases"]][-1] == "sample" and measured["windows"]
    acceptance = config["acceptance"]
    assert acceptance["source"] == "counters" and acceptance["flavour"] == "llamacpp" and len(acceptance["per_position"]) == 8
    check = acceptance["fixed_work_check"]  # over the same requests, counters == the responses' timings
    assert check["counters_ar"] == pytest.approx(check["timings_ar"]) and 0 < check["timings_ar"] <= 1
    greedy = config["quality"]["greedy"]
    assert greedy["pairs"] == 4  # one prompt per category, 128 tokens each (the default greedy length)
    assert report["options"]["greedy_tokens"] == 128 and all(report["measurements"]["baseline"]["greedy"].values())
    for m in greedy["mismatches"]:  # llama.cpp's batched verification is not batch-invariant: divergences are shown
        assert m["first_diff_char"] >= 0 and m["baseline"] != m["speculative"] and isinstance(m["context"], str)
    lossless = {c["name"]: c for c in config["criteria"]}["lossless"]
    assert lossless["state"] != "PASS" and "llama.cpp is not assumed lossless" in lossless["reason"]  # unscored: not proven
    rec = report["recommendation"]
    assert rec["verdict"] == summary["verdict"] == report["verdict"] != "GO"  # unproven losslessness is never GO
    if rec["kind"] != "off":
        assert rec["engine"] == "llama.cpp" and rec["config"] == name and rec["kind"] == "config"  # no batch-size table: as it ran
    assert report["measurements"]["baseline"]["memory"]["peak_rss_mib"] > 100  # llama-server's own VmHWM


def test_a_server_cmd_template_drives_llama_server(llama_server, workload, tmp_path):
    gguf = gemma_gguf_path()
    base = f"{llama_server} -m {gguf} --host 127.0.0.1 --port {{port}} --metrics -np 1 -t 2 -c 2048"
    _gate("--server-cmd", base + " --spec-type ngram-simple --spec-ngram-simple-size-m {gamma} --spec-ngram-simple-size-n {gamma}", "--baseline-cmd", base, "--gamma", "6",
          "--workload", workload, "--concurrency", "1", "--target-concurrency", "1", "--per-category", "1", "--greedy-tokens", "64", "--max-tokens", "8",
          "--round-s", "1", "--rounds", "2", "--budget-s", "6", "--math-items", "1", "--sample-prompts", "1", "--no-score", "--no-recommend",
          "--out", str(tmp_path / "gate"))
    report = json.loads((tmp_path / "gate" / "report.json").read_text())
    measured = report["measurements"]["server-cmd-g6"]
    assert measured["engine"] == "llama.cpp" and "--spec-ngram-simple-size-m 6" in measured["command"] and not measured.get("failure")
    assert report["configs"]["server-cmd-g6"]["acceptance"]["source"] == "counters"
    assert report["measurements"]["baseline"]["engine"] == "llama.cpp"
