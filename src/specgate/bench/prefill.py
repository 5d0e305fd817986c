"""Prefill of a long prompt on quantized weights (bench/bench_prefill.py): chunks through the C stack against the
dequantize-and-multiply path, per prompt length.

A prompt past the C paths' row limit (native.QUANT_MAX_ROWS) used to leave the C stack for torch ops, where every
product dequantizes its whole weight to float32 and multiplies in float32; now it runs as chunks of at most that
many tokens through the stack (CausalLM._chunked_forward). For each length: one prefill (the K/V only, as the
engine and the scheduler prefill) each way, alternating repeat by repeat in one process; the median ms of each and
chunked / upcast. A length within the limit runs the same way both times: the noise floor.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from specgate.bench.timing import median, timed_s, turn_order


def parse_lengths(text: str) -> list[int]:
    """'64,222' -> [64, 222]."""
    try:
        lengths = [int(v) for v in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths {text!r}: use a comma list of prompt lengths, each >= 1, e.g. 64,222,480")
    return lengths


@contextlib.contextmanager
def chunking(model: Any, on: bool) -> Iterator[None]:
    """Within: long forwards chunked through the C stack (on) or not (the upcast path); the model's own rule after."""
    if not on:
        model._chunks_long_forwards = lambda: False  # an instance attribute shadows the method
    try:
        yield
    finally:
        model.__dict__.pop("_chunks_long_forwards", None)


def prefill_ms(model: Any, length: int) -> float:
    """ms of one prefill of `length` random tokens into a fresh cache row (the K/V only)."""
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(4, min(1000, model.vocab_size), (1, length), generator=generator)  # [1, T]
    cache = model.new_cache(1, length + 1)
    with torch.inference_mode():
        return 1e3 * timed_s(lambda: model.forward(ids, torch.arange(length)[None], cache, torch.tensor([0]), logits=False))[1]


def chunked_upcast_ms(model: Any, lengths: list[int], repeats: int,
                      advance: Callable[[], None] = lambda: None) -> dict[int, dict[str, list[float]]]:
    """length -> {"upcast": [ms per repeat], "chunked": [...]}, after one untimed prefill of each; the two ways in
    alternating order (upcast first in even repeats)."""
    for length in lengths:
        prefill_ms(model, length)
    times: dict[int, dict[str, list[float]]] = {length: {"upcast": [], "chunked": []} for length in lengths}
    for repeat in range(repeats):
        for length in lengths:
            for lane in turn_order(["upcast", "chunked"], repeat, alternate=True):
                with chunking(model, lane == "chunked"):
                    times[length][lane].append(prefill_ms(model, length))
                advance()
    return times


def prefill_table(times: dict[int, dict[str, list[float]]], limit: int, repeats: int) -> list[str]:
    """The header line and the markdown table: per length the median ms each way, ms a token and chunked / upcast."""
    lines = [f"quantized weights, C path limit {limit} tokens; median of {repeats}, interleaved",
             "| prompt tokens | upcast ms | chunked ms | chunked ms / token | chunked / upcast |", "|---|---|---|---|---|"]
    for length, lanes in times.items():
        upcast, chunked = median(lanes["upcast"]), median(lanes["chunked"])
        lines.append(f"| {length} | {upcast:.0f} | {chunked:.0f} | {chunked / length:.2f} | {chunked / upcast:.2f} |")
    return lines
