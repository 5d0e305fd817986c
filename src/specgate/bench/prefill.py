"""Prefill of a long prompt on quantized weights (bench/bench_prefill.py): chunks through the C stack against the
dequantize-and-multiply path, per prompt length.

A prompt past the C paths' row limit (native.QUANT_MAX_ROWS) used to leave the C stack for torch ops, where every
product dequantizes its whole weight to float32 and multiplies in float32; now it runs as chunks of at most that
many tokens through the stack (CausalLM._chunked_forward). For each length: one prefill (the K/V only, as the
engine and the scheduler prefill) each way, alternating repeat by repeat in one process; the median ms of each and
chunked / upcast. A length within the limit runs the same way both times: the noise floor. The same for the
stack's attention, AVX2 against AVX-512 (compare="attention"): a chunk's rows attend to keys already in cache,
where the AVX-512 variant's fewer instructions show.
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


@contextlib.contextmanager
def attention_variant(model: Any, wide: bool) -> Iterator[None]:
    """Within: the model's C stack attends with its AVX-512 variant (wide) or the AVX2 one; as built after. Needs a
    CPU where native.attention_wide() holds (ValueError otherwise) and the C stack (the embedded GGUF target)."""
    from specgate.models import native

    stack = model.native_stack()
    if stack is None or not native.attention_wide():
        raise ValueError("the attention comparison needs the C stack and AVX-512 (native.attention_wide(); "
                         "SPECGATE_AVX512 / SPECGATE_ATTN_AVX512 unset)")
    built = stack.config.wide
    stack.config.wide = built | native.WIDE_ATTN if wide else built & ~native.WIDE_ATTN
    try:
        yield
    finally:
        stack.config.wide = built


COMPARISONS = {  # --compare -> (lane A, lane B, the context that runs a lane: (model, lane == B))
    "chunking": ("upcast", "chunked", chunking),
    "attention": ("avx2", "avx512", attention_variant),
}


def lanes_ms(model: Any, lengths: list[int], repeats: int, compare: str = "chunking",
             advance: Callable[[], None] = lambda: None) -> dict[int, dict[str, list[float]]]:
    """length -> {lane A: [ms per repeat], lane B: [...]} for one of COMPARISONS, after one untimed prefill of each;
    the two lanes in alternating order (A first in even repeats)."""
    first, second, context = COMPARISONS[compare]
    for length in lengths:
        prefill_ms(model, length)
    times: dict[int, dict[str, list[float]]] = {length: {first: [], second: []} for length in lengths}
    for repeat in range(repeats):
        for length in lengths:
            for lane in turn_order([first, second], repeat, alternate=True):
                with context(model, lane == second):
                    times[length][lane].append(prefill_ms(model, length))
                advance()
    return times


def prefill_table(times: dict[int, dict[str, list[float]]], limit: int, repeats: int) -> list[str]:
    """The header line and the markdown table: per length the median ms of each lane, ms a token of the second and
    second / first."""
    first, second = next(iter(times.values()))
    lines = [f"quantized weights, C path limit {limit} tokens; median of {repeats}, interleaved",
             f"| prompt tokens | {first} ms | {second} ms | {second} ms / token | {second} / {first} |", "|---|---|---|---|---|"]
    for length, lanes in times.items():
        a, b = median(lanes[first]), median(lanes[second])
        lines.append(f"| {length} | {a:.0f} | {b:.0f} | {b / length:.2f} | {b / a:.2f} |")
    return lines
