"""The runtime against the memory-bandwidth floor: a read-bandwidth probe, the bytes a batch-1 decode step reads,
the measured step and verification passes, the step's products alone, and the products by row count.

bfloat16 here means bf16 weights computed in float32 (CausalLM.compute_dtype); both read the same weight bytes as
transformers' bf16. Every figure is a median of timed calls (specgate.bench.timing); comparisons take turns call by
call in one process.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from specgate.bench.timing import interleaved_median_ms, median, median_call_s

HEAD_ROWS = (1, 2, 3, 5, 9, 12, 16, 20)
LAYER_ROWS = (1, 2, 5, 9, 16, 32, 64)
LAYER_SHAPES = {"qkv": (1536, 640), "o": (640, 1024), "gate_up": (4096, 640), "down": (640, 2048)}  # [N, K]
PROBE_PREFETCH_FLOATS = 1024  # the prefetching read asks 4 KB ahead (faster than 256 B or 16 KB on the Ice Lake VM)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's inner product (the op torch's mkldnn fusion pass emits for a linear)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def bandwidth_probe(megabytes: int = 512, repeats: int = 7) -> dict[str, float]:
    """Read GB/s and copy GB/s (bytes read + written) over `megabytes` MB. Read: the fastest of torch's sum, a
    plain AVX2 streaming sum on torch's threads and the same sum with software prefetch 4 KB ahead
    (specgate.models.native.read_sum); each alone can read below what the machine delivers (torch's sum by 20-30%
    on the AMD VM, the plain sum by ~10% on the Ice Lake VM, where the runtime's prefetching kernel read faster
    than it), which would put the floor too high (too easy to meet)."""
    from specgate.models import native

    source = torch.ones(megabytes * (1 << 20) // 4)  # [N] float32
    target = torch.empty_like(source)
    source.sum(), target.copy_(source)  # touch every page before timing
    nbytes = source.numel() * 4
    torch_read_gb_s = nbytes / median_call_s(lambda: source.sum(), repeats) / 1e9
    out = {"megabytes": megabytes, "torch_sum_read_gb_s": torch_read_gb_s, "read_gb_s": torch_read_gb_s}
    if native.available():
        reads = {"native_read_gb_s": 0, "native_prefetch_read_gb_s": PROBE_PREFETCH_FLOATS}
        for key, prefetch in reads.items():
            native.read_sum(source, prefetch)
            out[key] = nbytes / median_call_s(lambda: native.read_sum(source, prefetch), repeats) / 1e9
        out["read_gb_s"] = max(torch_read_gb_s, *(out[key] for key in reads))
    out["copy_gb_s"] = 2 * nbytes / median_call_s(lambda: target.copy_(source), repeats) / 1e9
    return out


def step_bytes(model: Any, position: int) -> dict[str, int]:
    """Bytes a batch-1 decode step at `position` reads: weights (tied head counted once, in full), KV, one embedding row."""
    seen, weights = set(), 0
    for param in model.parameters():  # parameters() yields a tied weight once
        if param.data_ptr() in seen:
            continue
        seen.add(param.data_ptr())
        weights += param.numel() * param.element_size()
    args = model.args
    embed = model.embed_tokens.weight
    tied = model.lm_head.weight.data_ptr() == embed.data_ptr()
    if not tied:  # an untied embedding table is not read in full: only the token's row
        weights -= embed.numel() * embed.element_size()
    row = embed.shape[1] * embed.element_size()
    kv = 2 * args.num_layers * args.num_kv_heads * args.head_dim * (position + 1) * embed.element_size()
    return {"weights": weights, "kv_cache": kv, "embedding_row": row, "total": weights + kv + row}


@contextlib.contextmanager
def torch_attention_path():
    """Within: the runtime's norms, RoPE, cache writes and attention go through torch ops (F.rms_norm, index_put,
    SDPA) instead of specgate.models.native's C path; the products stay as they are."""
    from specgate.models import native

    saved = native.attention_applies, native.norm_applies
    native.attention_applies = native.norm_applies = lambda *args: False
    try:
        yield
    finally:
        native.attention_applies, native.norm_applies = saved


def step_forward(model: Any, position: int, num_tokens: int = 1) -> Callable[[], None]:
    """A callable running one batch-1 forward of num_tokens tokens at `position` (the cache holds `position`
    earlier tokens); num_tokens = gamma + 1 is a verification step."""
    cache, slots = model.new_cache(1, position + num_tokens + 1), torch.zeros(1, dtype=torch.int64)
    ids = torch.randint(0, min(1000, model.vocab_size), (1, position), generator=torch.Generator().manual_seed(0))  # [1, P]
    tokens = torch.full((1, num_tokens), 7)  # [1, T]
    where = torch.arange(position, position + num_tokens)[None]  # [1, T]
    with torch.inference_mode():
        model(ids, torch.arange(position)[None], cache, slots, last_only=True)
        model(tokens, where, cache, slots)

    def forward() -> None:
        with torch.inference_mode():
            model(tokens, where, cache, slots)

    return forward


def floor_round(forwards: dict[str, Callable[[], None]], total_bytes: int, steps: int, probe: bool) -> dict[str, float]:
    """One round: the read-bandwidth probe (probe=True), then the median ms of `steps` calls of each forward through
    the C attention path and through torch's, and the round's ratios."""
    row: dict[str, float] = {}
    if probe:
        row["read_gb_s"] = bandwidth_probe(repeats=3)["read_gb_s"]
        row["floor_ms"] = total_bytes / (row["read_gb_s"] * 1e9) * 1e3
    for key, forward in forwards.items():
        row[key] = 1e3 * median_call_s(forward, steps)
    with torch_attention_path():
        for key, forward in forwards.items():
            row[f"torch_path_{key}"] = 1e3 * median_call_s(forward, steps)
    row["verify_over_step"] = row["verify_ms"] / row["step_ms"]
    row["torch_path_verify_over_step"] = row["torch_path_verify_ms"] / row["torch_path_step_ms"]
    row["torch_path_over_c_path"] = row["torch_path_step_ms"] / row["step_ms"]
    if probe:
        row["step_over_floor"] = row["step_ms"] / row["floor_ms"]
        row["achieved_gb_s"] = total_bytes / (row["step_ms"] / 1e3) / 1e9
    return row


def floor_rounds(model: Any, gamma: int, position: int, steps: int, rounds: int, probe: bool,
                 advance: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """`rounds` rounds (floor_round) of 1-token steps and (gamma+1)-token verification steps at `position`; the
    median over rounds of each figure and of the per-round ratios (a round's step and its floor are measured back
    to back, so a slow phase of a shared machine moves both)."""
    nbytes = step_bytes(model, position)
    forwards = {"step_ms": step_forward(model, position), "verify_ms": step_forward(model, position, gamma + 1)}
    measured = []
    for _ in range(rounds):
        measured.append(floor_round(forwards, nbytes["total"], steps, probe))
        advance()
    medians = {key: median([r[key] for r in measured]) for key in measured[0]}
    return {"bytes_per_step": nbytes, "verify_tokens": gamma + 1, "rounds": measured, **medians,
            "products_ms": products_ms(model, steps)}


def products_ms(model: Any, steps: int) -> float | None:
    """Median ms of one batch-1 step's matrix products alone, called one by one on the model's own weights (every
    layer's fused q/k/v, o, fused gate/up and down, then the head) through the native kernel, each weight read
    from memory as in a step: step - this is what a step spends besides streaming its weights (norms, RoPE,
    attention, the embedding row, dispatch). None without the kernel."""
    from specgate.models import native

    if not native.available():
        return None
    weights = []
    for block in model.layers:
        attn, mlp = block.self_attn, block.mlp
        weights += [attn.fused.get()[0], attn.o_proj.weight, mlp.fused.get()[0], mlp.down_proj.weight]
    weights.append(model.lm_head.weight)
    inputs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}  # [1, K]

    def products() -> None:
        for weight in weights:
            native.skinny_linear(inputs[weight.shape[1]], weight)

    products()
    return 1e3 * median_call_s(products, steps)


def verification_cost(model: Any, position: int, widest: int, steps: int, rounds: int) -> tuple[list[float], list[float]]:
    """V(t), t = 1..widest: what a batch-1 target pass of t tokens at `position` costs in 1-token passes. The
    runtime alone, no engine: what the hardware charges for verifying t - 1 drafts. In `rounds` rounds, each the
    median ms of `steps` passes per t, the t interleaved; V is the median over rounds of each round's ratios, so a
    slow phase of a shared machine (which moves a round's passes together) does not skew it. Returns (V, ms)."""
    forwards = {t: step_forward(model, position, t) for t in range(1, widest + 1)}
    round_ms = [interleaved_median_ms(forwards, steps, warmup=1 if k == 0 else 0) for k in range(rounds)]
    ratios = [median([ms[t] / ms[1] for ms in round_ms]) for t in forwards]
    return ratios, [median([ms[t] for ms in round_ms]) for t in forwards]


def product_rows(lanes: dict[str, Callable[[torch.Tensor], Any]], inputs: Callable[[int], torch.Tensor], row_counts: tuple[int, ...],
                 steps: int, advance: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
    """Per row count R: the median ms of `steps` calls of each lane on inputs(R), interleaved call by call."""
    out = []
    with torch.inference_mode():
        for rows in row_counts:
            x = inputs(rows)
            calls = {name: (lambda fn=fn: fn(x)) for name, fn in lanes.items()}
            out.append({"rows": rows, **interleaved_median_ms(calls, steps)})
            advance()
    return out


def head_products(steps: int, vocab: int = 262_144, hidden: int = 640, advance: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
    """The LM-head product alone (a vocab x hidden weight, Gemma-3-270M's shape by default) per row count, by each
    formulation: F.linear (MKL), oneDNN, the native kernel with float32 and bf16 weights (where it is built)."""
    from specgate.models import native

    weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0))  # [V, H] float32, 671 MB at Gemma's shape
    lanes: dict[str, Callable[[torch.Tensor], Any]] = {
        "f_linear_ms": lambda x: torch.nn.functional.linear(x, weight),
        "onednn_ms": lambda x: onednn_linear(x, weight),
    }
    if native.available():
        weight_bf16 = weight.bfloat16()  # [V, H] bf16: the same product reading half the bytes
        lanes["native_ms"] = lambda x: native.skinny_linear(x, weight)
        lanes["native_bf16_ms"] = lambda x: native.skinny_linear(x, weight_bf16)
    return product_rows(lanes, lambda rows: torch.randn(rows, hidden), HEAD_ROWS, steps, advance)  # x: [R, H]


def layer_products(steps: int, num_layers: int = 18, advance: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
    """Median ms of one step's layer products (num_layers distinct copies of each of LAYER_SHAPES, so that every
    product reads its weight from memory as a decode step does) per row count: oneDNN vs the native kernel."""
    from specgate.models import native

    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=generator) for _ in range(num_layers) for n, k in LAYER_SHAPES.values()]
    products: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {"onednn_ms": onednn_linear}
    if native.available():
        halves = {w.data_ptr(): w.bfloat16() for w in weights}  # the same weights in bf16
        products["native_ms"] = native.skinny_linear
        products["native_bf16_ms"] = lambda x, w: native.skinny_linear(x, halves[w.data_ptr()])
    widths = sorted({k for _, k in LAYER_SHAPES.values()})

    def inputs(rows: int) -> dict[int, torch.Tensor]:
        return {k: torch.randn(rows, k, generator=generator) for k in widths}  # [R, K] per input width

    lanes = {name: (lambda x, fn=fn: [fn(x[w.shape[1]], w) for w in weights]) for name, fn in products.items()}
    return product_rows(lanes, inputs, LAYER_ROWS, steps, advance)
