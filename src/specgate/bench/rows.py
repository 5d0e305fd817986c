"""Wide verification forwards (bench/bench_rows.py): the C path's bf16 row limit, old against new, per shape.

A serving step at concurrency B verifying gamma drafts per request scores B x (gamma + 1) tokens in one forward.
For each shape: a target forward of B rows x T tokens (positions after a 100-token prefill, logits into a kept
buffer, as the scheduler does) with the C path's bf16 row limit at `old` and at the runtime's
(native.BF16_LAYER_MAX_ROWS / BF16_HEAD_MAX_ROWS), alternating repeat by repeat in one process: the median ms of
each and new / old. The 64-row shapes (16x4, 8x8), which both limits run the same way, give the noise floor.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from specgate.bench.timing import median, timed_s, turn_order
from specgate.models import native
from specgate.models.transformer import LogitsBuffer

Shape = tuple[int, int]  # (batch, tokens)


def parse_shapes(text: str) -> list[Shape]:
    """'16x4,8x9' -> [(16, 4), (8, 9)]."""
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise ValueError(f"shapes {text!r}: use a comma list of BATCHxTOKENS, each >= 1, e.g. 16x4,8x9")
    return shapes  # type: ignore[return-value]


@contextlib.contextmanager
def row_limits(layers: int, head: int) -> Iterator[None]:
    """Within: the C path's bf16 row limits set to (layers, head); restored after."""
    saved = native.BF16_LAYER_MAX_ROWS, native.BF16_HEAD_MAX_ROWS
    native.BF16_LAYER_MAX_ROWS, native.BF16_HEAD_MAX_ROWS = layers, head
    try:
        yield
    finally:
        native.BF16_LAYER_MAX_ROWS, native.BF16_HEAD_MAX_ROWS = saved


def forward_ms(model: Any, batch: int, tokens: int, context: int = 100) -> float:
    """ms of one forward of batch x tokens after a `context`-token prefill (one untimed warm-up forward first)."""
    cache = model.new_cache(batch, context + tokens + 1)
    buffer = LogitsBuffer(model.vocab_size)
    generator = torch.Generator().manual_seed(batch * 100 + tokens)
    high = min(1000, model.vocab_size)
    with torch.inference_mode():
        prompt = torch.randint(4, high, (batch, context), generator=generator)  # [B, L]
        model.forward(prompt, torch.arange(context)[None].expand(batch, -1), cache, torch.arange(batch), logits=False)
        ids = torch.randint(4, high, (batch, tokens), generator=generator)  # [B, T]
        positions = torch.arange(context, context + tokens)[None].expand(batch, -1)  # [B, T]
        step = lambda: model.forward(ids, positions, cache, torch.arange(batch), out=buffer.view(batch, tokens))  # noqa: E731
        step()  # warm-up
        return 1e3 * timed_s(step)[1]


def old_new_ms(model: Any, shapes: list[Shape], repeats: int, old: int,
               advance: Callable[[], None] = lambda: None) -> dict[Shape, dict[str, list[float]]]:
    """shape -> {"old": [ms per repeat], "new": [...]}: per repeat every shape under both limits, the two in
    alternating order (old first in even repeats)."""
    new = (native.BF16_LAYER_MAX_ROWS, native.BF16_HEAD_MAX_ROWS)
    limits = {"old": (old, old), "new": new}
    times: dict[Shape, dict[str, list[float]]] = {shape: {"old": [], "new": []} for shape in shapes}
    for repeat in range(repeats):
        for shape in shapes:
            for lane in turn_order(["old", "new"], repeat, alternate=True):
                with row_limits(*limits[lane]):
                    times[shape][lane].append(forward_ms(model, *shape))
                advance()
    return times


def rows_table(times: dict[Shape, dict[str, list[float]]], old: int, repeats: int) -> list[str]:
    """The header line and the markdown table: per shape its rows, median ms under each limit, new / old."""
    lines = [f"bf16 weights, row limit old {old} / new {native.BF16_LAYER_MAX_ROWS} (layers), {native.BF16_HEAD_MAX_ROWS} (head); "
             f"median of {repeats}, interleaved",
             "| batch x tokens | rows | old limit ms | new limit ms | new / old |", "|---|---|---|---|---|"]
    for (batch, tokens), lanes in times.items():
        old_ms, new_ms = median(lanes["old"]), median(lanes["new"])
        lines.append(f"| {batch} x {tokens} | {batch * tokens} | {old_ms:.0f} | {new_ms:.0f} | {new_ms / old_ms:.2f} |")
    return lines
