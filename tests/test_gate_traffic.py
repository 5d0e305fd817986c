"""The gate's traffic end to end: a request log the test writes, replayed against a real specgate server with its
own lengths, sampling settings and arrival times; ShareGPT through make_plan; bad --workload input as one line."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from specgate.gate import client as gate_client
from specgate.gate import rounds
from specgate.gate import workload as wl
from specgate.gate.options import GateOptions
from specgate.gate.runner import make_plan, traffic_summary
from specgate.serving.server import ServerConfig, start_server

ARRIVALS_S = [0.0, 0.05, 0.3, 0.32, 0.7, 1.1]  # bursty: two pairs 20-50 ms apart, then gaps


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    handle = start_server(ServerConfig(target=str(tiny_model_dir("llama")), draft="none", port=0, policy="off", max_num_seqs=4, max_seq_len=512))
    yield handle
    handle.stop()


def write_log(path, start: float = 1_700_000_000.0) -> list[dict]:
    """A request log: completions and chat bodies with their own lengths and sampling, timestamps in seconds."""
    bodies = [
        {"prompt": "def add(a, b):", "max_tokens": 5, "temperature": 0.0},
        {"messages": [{"role": "user", "content": "Name a fruit."}], "max_completion_tokens": 7, "temperature": 0.8, "top_p": 0.9, "seed": 3},
        {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 1.0, "top_k": 20, "seed": 11},
        {"prompt": "The capital of France is", "max_tokens": 4, "stop": ["\n"]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "max_tokens": 6},
        {"prompt": "1, 2, 3,", "max_tokens": 8, "temperature": 0.0, "ignore_eos": False},
    ]
    lines = [{"timestamp": start + at, "category": "chat" if "messages" in body else "text", "body": body} for at, body in zip(ARRIVALS_S, bodies)]
    path.write_text("".join(json.dumps(line) + "\n" for line in reversed(lines)))  # out of order: replayed by time
    return bodies


def options_for(log, tmp_path, **kw) -> GateOptions:
    return GateOptions(workload=str(log), out=str(tmp_path / "out"), max_seq_len=512, max_tokens=16, **kw)


def test_a_replayed_log_keeps_its_lengths_sampling_and_arrival_times(served, tmp_path):
    """Every request reaches the server with the log's max_tokens and sampling fields, in the log's order, each sent
    within 10 ms of its recorded offset from the round's start; the server generates exactly max_tokens."""
    log = tmp_path / "requests.jsonl"
    bodies = write_log(log)
    plan = make_plan(options_for(log, tmp_path, arrivals="recorded"))
    assert plan.recorded and [s.arrival_s for s in plan.load] == pytest.approx(ARRIVALS_S, abs=1e-6)  # float seconds near 1.7e9 hold ~0.1 us
    client = gate_client.Client(served.url)
    for spec, body in zip(plan.load, bodies):
        sent = client._body(spec)
        assert sent["max_tokens"] == body.get("max_completion_tokens", body.get("max_tokens"))
        for name in ("temperature", "top_p", "top_k", "seed", "stop"):
            assert sent.get(name, {"temperature": 0.0}.get(name)) == body.get(name, {"temperature": 0.0}.get(name)), name
        assert sent["ignore_eos"] == body.get("ignore_eos", True)

    sent_at: list[tuple[str, float]] = []
    real_complete = client.complete

    async def complete(spec, record, on_first_token=None):
        sent_at.append((spec.prompt_id, time.perf_counter()))
        return await real_complete(spec, record, on_first_token)

    client.complete = complete  # the real client and server, timed where the request leaves

    async def scrape():
        return None

    async def healthy():
        return True

    async def replay():
        target = rounds.Target("log", client, scrape, healthy)
        started = time.perf_counter()
        done, _, _ = await rounds.open_round(target, rounds.Load(rounds.POISSON, qps=1.0), plan.load, 0, window_s=1.5, seed=0, recorded=True)
        await client.close()
        return started, done

    started, done = asyncio.run(replay())
    first = [(pid, at - started) for pid, at in sent_at][: len(ARRIVALS_S)]
    assert [pid for pid, _ in first] == [spec.prompt_id for spec in plan.load]
    assert all(abs(offset - want) <= 0.010 for (_, offset), want in zip(first, ARRIVALS_S)), first
    finished = {r.prompt_id: r for r in done.records if r.ok}
    for spec in plan.load:
        if spec.prompt_id in finished and spec.ignore_eos:
            assert finished[spec.prompt_id].completion_tokens == spec.max_tokens


def test_a_log_loops_with_its_own_rate():
    specs = [gate_client.RequestSpec(str(i), "log", "x", 4, arrival_s=at) for i, at in enumerate(ARRIVALS_S)]
    period = rounds.replay_period_s(specs)
    assert period == pytest.approx(1.1 + 1.1 / 5)
    schedule = rounds.recorded_arrivals(specs, 2 * period + 0.01)
    assert [at for at, _ in schedule][6:12] == pytest.approx([period + at for at in ARRIVALS_S])


def test_sharegpt_through_the_plan(tmp_path):
    """`--workload sharegpt`: the installed file, sampled with the seed, every request's output length its reply's
    (capped), the traffic summarised for the report; the same seed gives the same requests."""
    pytest.importorskip(wl.SHAREGPT_MODULE)
    options = GateOptions(workload="sharegpt", requests=12, max_tokens=24, max_seq_len=512, out=str(tmp_path))
    plan = make_plan(options)
    assert len(plan.load) == 12 and all(1 <= s.max_tokens <= 24 for s in plan.load)
    assert set(plan.categories.values()) == {"sharegpt"} and all(s.prompt.endswith("Assistant:") for s in plan.load)
    traffic = plan.traffic
    assert traffic["prompts"] == 12 and len(traffic["prompt_tokens"]) == 12 and traffic["categories"] == {"sharegpt": 12}
    assert traffic["quantiles"]["output_tokens"]["max"] <= 24 and "estimate" in traffic["token_counts"]
    assert [s.prompt for s in make_plan(options).load] == [s.prompt for s in plan.load]
    assert [s.prompt for s in make_plan(GateOptions(workload="sharegpt", requests=12, seed=1, out=str(tmp_path))).load] != [s.prompt for s in plan.load]


def test_the_builtin_plan_is_balanced_and_summarised(tmp_path):
    plan = make_plan(GateOptions(per_category=2, out=str(tmp_path)))
    assert [len(v) for v in plan.greedy_by_category.values()] == [2, 2, 2, 2]
    summary = traffic_summary(wl.load_traffic(wl.BUILTIN, max_context=1024, max_tokens=64), plan.load, None)
    assert summary["prompts"] > len(plan.load) and summary["quantiles"]["output_tokens"]["max"] == 64


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specgate", "gate", "--no-score", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("make_args, message", [
    (lambda log: ["--workload-category", "poetry"], "--workload-category poetry is not in the workload"),
    (lambda log: ["--arrivals", "burst"], "--arrivals 'burst' is not known"),
    (lambda log: ["--arrivals", "recorded"], "has none"),
    (lambda log: ["--workload", str(log)], "line 2"),
    (lambda log: ["--workload", f"sharegpt:{log}"], "is not a JSON list of conversations"),
])
def test_bad_traffic_input_is_one_line_exit_2(make_args, message, tmp_path):
    log = tmp_path / "bad.jsonl"
    log.write_text(json.dumps({"prompt": "ok", "max_tokens": 4}) + "\n" + json.dumps({"text": "not a request body"}) + "\n")
    done = _cli("--out", str(tmp_path / "out"), *make_args(log))
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], done.stderr
