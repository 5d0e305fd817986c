"""The specgate-vs-llama.cpp method (specgate.bench.llamacpp): the closed loop sends each request once in order and
counts every token; the served summary picks each engine's best lane per level and divides, and the decode line divides
the EAGLE head lane by llama.cpp's best (hand-computed values);
and a served lane runs against a real `specgate serve` of a tiny quantized model."""

import threading
import time

import pytest

from specgate.bench import llamacpp as method


def test_closed_loop_sends_every_request_once_with_at_most_c_in_flight():
    seen, in_flight, peak = [], [0], [0]
    lock = threading.Lock()

    def send(prompt, max_tokens):
        with lock:
            seen.append(prompt)
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        time.sleep(0.01)
        with lock:
            in_flight[0] -= 1
        return {"text": prompt.upper(), "tokens": max_tokens}

    result = method.closed_loop(send, ["a", "b", "c"], concurrency=3, requests=7, max_tokens=5)
    assert sorted(seen) == sorted(["a", "b", "c", "a", "b", "c", "a"]) and peak[0] == 3
    assert result.tokens == 35 and result.texts == ["A", "B", "C", "A", "B", "C", "A"]
    assert result.tokens_per_s == pytest.approx(35 / result.wall_s)
    with pytest.raises(ValueError, match="must be >= 1"):
        method.closed_loop(send, ["a"], concurrency=0, requests=1, max_tokens=1)


def test_closed_loop_raises_a_failed_request():
    def send(prompt, max_tokens):
        raise ConnectionError("refused")

    with pytest.raises(ConnectionError, match="refused"):
        method.closed_loop(send, ["a"], concurrency=2, requests=4, max_tokens=1)


def test_pooled_rates_weigh_each_request_by_its_time():
    # 2 requests of equal length at 100 and 50 tok/s: 2 x T tokens in T/100 + T/50 seconds = 66.67 tok/s
    assert method.pooled_tps([100.0, 50.0]) == pytest.approx(200 / 3)
    ratio, low, high = method.pooled_ratio([100.0, 50.0, 80.0], [50.0, 50.0, 40.0], draws=500)
    assert ratio == pytest.approx(method.pooled_tps([100.0, 50.0, 80.0]) / method.pooled_tps([50.0, 50.0, 40.0]))
    assert 1.0 <= low <= ratio <= high <= 2.0  # per-request ratios 2, 1, 2: every resample lies in [1, 2]
    assert method.pooled_ratio([60.0] * 4, [30.0] * 4, draws=100) == (2.0, 2.0, 2.0)


def _decode_result(rates: dict[str, float]) -> dict:
    raw = {lane: {"decode_tps": [rate] * 3, "e2e_tps": [rate] * 3, "same_as_target_only": []} for lane, rate in rates.items()}
    summary = {lane: {"decode_tps": rate, "e2e_tps": rate, "pooled_tps": rate, "same_as_target_only": "-"} for lane, rate in rates.items()}
    return {"summary": summary, "raw": raw, "forward_ms": {1: 10.0, 5: 12.5, 9: 18.0}}


@pytest.mark.parametrize("llama_ngram, best, head_ratio", [(60.0, "llama.cpp ngram", "1.50x"), (30.0, "llama.cpp", "2.25x")])
def test_the_eagle_head_lane_is_divided_by_llamacpps_best_lane(llama_ngram, best, head_ratio):
    """llama.cpp cannot run the head, so its decode line compares the head with llama.cpp's faster lane."""
    lines = method.decode_lines(_decode_result({"llama.cpp": 40.0, "specgate": 70.0, "llama.cpp ngram": llama_ngram,
                                                "specgate ngram": 120.0, "specgate default": 120.0, "specgate EAGLE head": 90.0}))
    ratios = next(line for line in lines if line.startswith("specgate / llama.cpp pooled decode"))
    assert f"EAGLE head / {best} {head_ratio} [{head_ratio[:-1]}-{head_ratio[:-1]}]" in ratios
    default_ratio = f"{120.0 / (llama_ngram if best == 'llama.cpp ngram' else 40.0):.2f}"
    assert f"default / {best} {default_ratio}x [{default_ratio}-{default_ratio}]" in ratios
    assert "target-only 1.75x" in ratios and "(5 / 1 = 1.25x, 9 / 1 = 1.80x)" in lines[-1]
    no_head = method.decode_lines(_decode_result({"llama.cpp": 40.0, "specgate": 70.0, "llama.cpp ngram": 60.0, "specgate ngram": 120.0}))
    assert not any("EAGLE" in line or "default /" in line for line in no_head)


def test_served_summary_takes_the_best_lane_of_each_engine_per_level():
    runs = {
        "llama.cpp": {1: [50.0, 60.0, 55.0], 4: [100.0]},
        "llama.cpp ngram-mod": {1: [70.0, 80.0, 90.0], 4: [90.0]},
        "specgate adaptive": {1: [100.0, 120.0, 110.0], 4: [80.0, 84.0]},
        "specgate fixed": {1: [40.0], 4: [150.0]},
    }
    summary = method.served_summary(runs)
    assert summary[1]["best_llamacpp"] == "llama.cpp ngram-mod" and summary[1]["best_specgate"] == "specgate adaptive"
    assert summary[1]["ratio"] == pytest.approx(110 / 80)
    assert summary[4]["medians"]["specgate adaptive"] == pytest.approx(82.0)
    assert summary[4]["ratio"] == pytest.approx(150 / 100)
    table = method.served_table(summary)
    assert table[2].endswith("| 1.38x |") and table[3].endswith("| 1.50x |") and len(table) == 4


def test_served_lane_against_a_real_specgate_server_of_a_tiny_int8_model(tiny_model_dir):
    from specgate.serving.server import ServerConfig, start_server

    handle = start_server(ServerConfig(target=str(tiny_model_dir("llama")), draft="ngram", port=0, policy="fixed", gamma=3,
                                       max_num_seqs=4, max_seq_len=256, dtype="int8"))
    try:
        port = int(handle.url.rsplit(":", 1)[1])
        result = method.closed_loop(lambda p, n: method.specgate_served(port, p, n), method.SERVED_PROMPTS[:2], 2, 4, 6)
    finally:
        handle.stop()
    assert result.tokens == 24 and result.texts[0] == result.texts[2] and result.tokens_per_s > 0
