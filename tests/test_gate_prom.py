"""The gate's Prometheus parsing and spec-decode adapters, on exposition text in each engine's documented format."""

from __future__ import annotations

import math

import pytest

from specgate.gate import prom

MODEL = 'model_name="meta-llama/Llama-3.1-8B-Instruct",engine="0"'


def vllm_text(drafts: float, draft_tokens: float, accepted: float, per_pos: list[float], preemptions: float = 0.0) -> str:
    """vLLM V1's /metrics: counters exported with _total, labels model_name and engine, per-position counters."""
    lines = [
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        f"vllm:spec_decode_num_drafts_total{{{MODEL}}} {drafts}",
        "# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.",
        "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
        f"vllm:spec_decode_num_draft_tokens_total{{{MODEL}}} {draft_tokens}",
        "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
        f"vllm:spec_decode_num_accepted_tokens_total{{{MODEL}}} {accepted}",
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter",
        *[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{MODEL},position="{i}"}} {v}' for i, v in enumerate(per_pos)],
        "# TYPE vllm:num_preemptions_total counter",
        f"vllm:num_preemptions_total{{{MODEL}}} {preemptions}",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{{{MODEL}}} {drafts + accepted}",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        f'vllm:time_to_first_token_seconds_bucket{{{MODEL},le="+Inf"}} 12.0',
        f"vllm:time_to_first_token_seconds_sum{{{MODEL}}} 1.5e-01",
    ]
    return "\n".join(lines) + "\n"


def test_vllm_counter_deltas_give_ar_al_and_marginal_per_position_rates():
    before = prom.read_spec(prom.parse_exposition(vllm_text(100, 300, 150, [70, 50, 30])))
    after = prom.read_spec(prom.parse_exposition(vllm_text(140, 420, 246, [104, 82, 60], preemptions=2)))
    window = prom.spec_window(before, after)
    assert window.flavour == "vllm"
    assert (window.num_drafts, window.num_draft_tokens, window.num_accepted_tokens) == (40, 120, 96)
    assert window.acceptance_rate == pytest.approx(96 / 120)
    assert window.acceptance_length == pytest.approx(1 + 96 / 40)
    assert window.per_position_rate == pytest.approx([34 / 40, 32 / 40, 30 / 40])
    assert window.mean_draft_len == pytest.approx(3.0)
    assert window.preemptions == 2
    assert not window.lossy


def test_llamacpp_counters_read_with_vllms_meanings():
    """llama-server --metrics: the same spec-decode counters under `llamacpp:`, unlabelled (real exposition is
    exercised against a built llama-server in test_engines_llamacpp.py)."""
    def text(drafts, tokens, accepted, per_pos):
        return "\n".join([
            "# TYPE llamacpp:spec_decode_num_drafts_total counter", f"llamacpp:spec_decode_num_drafts_total {drafts}",
            "# TYPE llamacpp:spec_decode_num_draft_tokens_total counter", f"llamacpp:spec_decode_num_draft_tokens_total {tokens}",
            "# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter", f"llamacpp:spec_decode_num_accepted_tokens_total {accepted}",
            *[f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {v}' for i, v in enumerate(per_pos)],
            "llamacpp:n_decode_total 99",
        ])
    window = prom.spec_window(prom.read_spec(prom.parse_exposition(text(2, 16, 3, [2, 1]))),
                              prom.read_spec(prom.parse_exposition(text(7, 56, 13, [6, 4]))))
    assert window.flavour == "llamacpp"
    assert (window.num_drafts, window.num_draft_tokens, window.num_accepted_tokens) == (5, 40, 10)
    assert window.acceptance_rate == pytest.approx(10 / 40) and window.acceptance_length == pytest.approx(1 + 10 / 5)
    assert window.per_position_rate == pytest.approx([4 / 5, 3 / 5])


def test_labels_with_escapes_infinities_and_timestamps_parse():
    text = 'x_total{path="a\\"b\\\\c",le="+Inf"} +Inf 1700000000000\ny NaN\nz{a="1"} -3.5e2\n'
    samples = prom.parse_exposition(text)
    assert samples[0].label("path") == 'a"b\\c' and samples[0].value == math.inf
    assert math.isnan(samples[1].value) and samples[2].value == -350.0


def test_a_malformed_line_is_named():
    with pytest.raises(ValueError, match="line 2"):
        prom.parse_exposition("ok_total 1\nthis is not a sample line\n")


def test_sglang_gauges_are_read_as_the_latest_batch_not_deltas():
    text = (
        "# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.\n"
        "# TYPE sglang:spec_accept_length gauge\n"
        'sglang:spec_accept_length{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.85\n'
        "# TYPE sglang:spec_accept_rate gauge\n"
        'sglang:spec_accept_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.62\n'
        "# TYPE sglang:generation_tokens_total counter\n"
        'sglang:generation_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 5000\n'
    )
    before = prom.read_spec(prom.parse_exposition(text.replace("2.85", "1.5").replace(" 5000", " 1000")))
    window = prom.spec_window(before, prom.read_spec(prom.parse_exposition(text)))
    assert window.flavour == "sglang"
    assert window.acceptance_length == 2.85 and window.acceptance_rate == 0.62
    assert window.generation_tokens == 4000


def test_specgate_server_metrics_round_trip_and_lossy_label():
    from specgate.serving.metrics import ServingMetrics
    from specgate.serving.scheduler import StepStats

    metrics = ServingMetrics("tiny", num_slots=4)
    before = prom.read_spec(prom.parse_exposition(metrics.render().decode()))
    metrics.on_step(StepStats(num_drafts=2, draft_tokens=8, accepted=5, accepted_per_position=[2, 2, 1, 0]), lossless=True)
    metrics.on_step(StepStats(num_drafts=1, draft_tokens=4, accepted=1, accepted_per_position=[1, 0, 0, 0]), lossless=True)
    after = prom.read_spec(prom.parse_exposition(metrics.render().decode()))
    window = prom.spec_window(before, after)
    assert window.flavour == "specgate" and after.kv_slots_total == 4 and after.preemptions == 0
    assert (window.num_drafts, window.num_draft_tokens, window.num_accepted_tokens) == (3, 12, 6)
    assert window.per_position_rate == pytest.approx([1.0, 2 / 3, 1 / 3])
    assert not window.lossy
    metrics.on_step(StepStats(num_drafts=1, draft_tokens=2, accepted=2, accepted_per_position=[1, 1]), lossless=False)
    lossy = prom.spec_window(after, prom.read_spec(prom.parse_exposition(metrics.render().decode())))
    assert lossy.lossy and lossy.num_accepted_tokens == 2


def test_no_spec_metrics_and_merging_windows():
    assert prom.read_spec(prom.parse_exposition("process_cpu_seconds_total 3\n")).flavour is None
    a = prom.spec_window(prom.read_spec(prom.parse_exposition(vllm_text(0, 0, 0, [0, 0]))),
                         prom.read_spec(prom.parse_exposition(vllm_text(10, 20, 10, [6, 4]))))
    b = prom.spec_window(prom.read_spec(prom.parse_exposition(vllm_text(0, 0, 0, [0, 0]))),
                         prom.read_spec(prom.parse_exposition(vllm_text(30, 60, 20, [14, 6]))))
    merged = prom.merge_windows([a, b])
    assert merged.acceptance_rate == pytest.approx(30 / 80) and merged.per_position_rate == pytest.approx([0.5, 0.25])


def test_gpu_memory_parses_nvidia_smi_csv(tmp_path, monkeypatch):
    """nvidia-smi's documented CSV (--format=csv,noheader,nounits), from a stand-in executable on PATH."""
    from specgate.gate.runner import gpu_memory_mib

    script = tmp_path / "nvidia-smi"
    script.write_text('#!/bin/sh\ncase "$1" in\n  --query-gpu=*) printf "1024, 81559\\n2048, 81559\\n";;\n'
                      '  --query-compute-apps=*) printf "4242, 3000\\n999, 7\\n";;\nesac\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert gpu_memory_mib() == {"used": 3072.0, "total": 163118.0}
    assert gpu_memory_mib(pid=4242) == {"used": 3000.0, "total": 163118.0}
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert gpu_memory_mib() is None
