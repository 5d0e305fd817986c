"""specgate.models.native: the C kernels of decode and verification steps (products, norms, attention).

Checks: it is built and used on this machine (x86-64 with AVX2/FMA and a C compiler, as CI is); its product
equals float64 x @ W^T within float32 summation error; every row's output is bit-identical whether the row is
multiplied alone or among others (batch invariance, the property that makes a verification pass give a
position the same head output as a 1-token step); odd N (a tail block of 1-3 rows) and a split over threads
cover every column once; bad input is refused with the reason.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from specgate.models import native, transformer
from specgate.models.dtypes import cpu_flags

HAS_TOOLCHAIN = shutil.which("cc") is not None or shutil.which("gcc") is not None
CAN_BUILD = HAS_TOOLCHAIN and {"avx2", "fma", "f16c"} <= cpu_flags()


def test_kernel_is_available_where_it_can_be_built():
    assert native.available() == CAN_BUILD


needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="no C compiler or no AVX2/FMA on this CPU")


HAS_AVX512 = {"avx512f", "avx512bw"} <= cpu_flags()
VARIANTS = [pytest.param(False, id="avx2"), pytest.param(True, id="avx512", marks=pytest.mark.skipif(not HAS_AVX512, reason="no AVX-512 on this CPU"))]


@pytest.fixture(params=VARIANTS)
def wide(request, monkeypatch):
    """Each test of the products runs with the AVX2 kernel and, where the CPU has AVX-512, with the AVX-512 one."""
    monkeypatch.setattr(native, "wide_vectors", lambda: request.param)
    return request.param


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 13, 16])
def test_product_is_exact_up_to_float32_rounding(rows, dtype, wide):
    """Against float64 on the same (bf16-rounded) weights: a bf16 weight is widened exactly, products and sums are
    float32 (K eps sum |x w| bounds the summation error)."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(4099, 64, generator=generator).to(dtype)  # N = 4 * 1024 + 3: a 3-row tail block
    x = torch.randn(rows, 64, generator=generator)
    out = native.skinny_linear(x, weight)
    exact = x.double() @ weight.double().t()  # [R, N]
    bound = 64 * 2**-23 * (x.double().abs() @ weight.double().abs().t())  # K eps sum |x w|
    assert out.shape == (rows, 4099) and out.dtype == torch.float32 and ((out.double() - exact).abs() <= bound).all()


@needs_kernel
def test_exactness_bound_catches_a_wrong_product():
    """Negative control: the bound of the test above fails for a product with the weight's last column dropped."""
    generator = torch.Generator().manual_seed(1)
    weight, x = torch.randn(64, 64, generator=generator), torch.randn(3, 64, generator=generator)
    truncated = weight.clone()
    truncated[:, -8:] = 0
    out = native.skinny_linear(x, truncated)
    exact = x.double() @ weight.double().t()
    bound = 64 * 2**-23 * (x.double().abs() @ weight.double().abs().t())
    assert not ((out.double() - exact).abs() <= bound).all()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_bit_identical_alone_and_in_a_batch(dtype, wide):
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(2050, 640, generator=generator).to(dtype)
    x = torch.randn(16, 640, generator=generator)
    together = native.skinny_linear(x, weight)  # [16, N]
    for count in (1, 2, 5, 6, 7, 9, 12):
        part = native.skinny_linear(x[:count], weight)
        assert torch.equal(part, together[:count])
    for row in range(16):
        assert torch.equal(native.skinny_linear(x[row : row + 1], weight)[0], together[row])


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_thread_split_covers_every_column_once(threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(threads)
        weight = torch.randn(1001, 16, generator=generator)
        x = torch.randn(3, 16, generator=generator)
        out = native.skinny_linear(x, weight)
    finally:
        torch.set_num_threads(previous)
    assert torch.allclose(out, x @ weight.t(), atol=1e-4)


@needs_kernel
def test_linear_routes_few_rows_to_the_kernel(monkeypatch):
    """linear() picks the kernel for float32 activations times 1..20 rows of a float32 LM head (>= HEAD_ELEMENTS),
    1..160 of a bf16 head, 1..64 of a float32 layer weight, 1..160 of a bf16 one; oneDNN, the bf16 upcast or
    F.linear otherwise (a prefill, a wide batch)."""
    calls = []
    real = native.skinny_product
    monkeypatch.setattr(native, "skinny_product", lambda x, w: calls.append((tuple(x.shape), w.shape[0])) or real(x, w))
    monkeypatch.setattr(native, "HEAD_ELEMENTS", 4096 * 64)
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(4096, 64, generator=generator)  # a "head" under the patched threshold
    bias = torch.randn(4096, generator=generator)
    x = torch.randn(2, 3, 64, generator=generator)
    with torch.inference_mode():
        out = transformer.linear(x, weight, bias)
        transformer.linear(torch.randn(21, 64), weight)  # 21 rows of a head: oneDNN
        transformer.linear(torch.randn(64, 64), weight[:1024])  # 64 rows of a layer's weight: the kernel
        transformer.linear(torch.randn(65, 64), weight[:1024])  # 65 rows: oneDNN
        transformer.linear(torch.randn(2, 64).double(), weight[:1024].double())  # float64: not the kernel
        half = weight.bfloat16()
        wide = transformer.linear(torch.randn(160, 64, generator=generator), half)  # 160 rows of a bf16 head: the kernel
        transformer.linear(torch.randn(160, 64), half[:1024])  # 160 rows of a bf16 layer weight: the kernel
        upcast = transformer.linear(x65 := torch.randn(161, 64, generator=generator), half)  # 161 rows: the chunked upcast
        transformer.linear(torch.randn(161, 64), half[:1024])  # and for a layer weight
    assert calls == [((6, 64), 4096), ((64, 64), 1024), ((160, 64), 4096), ((160, 64), 1024)]
    assert out.shape == (2, 3, 4096) and torch.allclose(out, torch.nn.functional.linear(x, weight, bias), atol=1e-4)
    assert wide.dtype == upcast.dtype == torch.float32
    assert torch.allclose(upcast, x65 @ half.float().t(), atol=1e-4)


@needs_kernel
def test_bad_input_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"must be \[R, K\] and \[N, K\]"):
        native.skinny_linear(torch.randn(2, 16), torch.randn(8, 24))
    with pytest.raises(ValueError, match=r"K % 8 == 0"):
        native.skinny_linear(torch.randn(2, 12), torch.randn(8, 12))
    with pytest.raises(ValueError, match=r"float32"):
        native.skinny_linear(torch.randn(2, 16).double(), torch.randn(8, 16).double())
    with pytest.raises(ValueError, match=r"float32 x, a float32 or bfloat16"):
        native.skinny_linear(torch.randn(2, 16).bfloat16(), torch.randn(8, 16).bfloat16())


def test_switch_off_by_environment(monkeypatch):
    monkeypatch.setenv("SPECGATE_NATIVE", "0")
    native._library.cache_clear()
    try:
        assert not native.available()
        with pytest.raises(ValueError, match="SPECGATE_NATIVE=0"):
            native.skinny_linear(torch.randn(1, 8), torch.randn(4, 8))
    finally:
        monkeypatch.delenv("SPECGATE_NATIVE")
        native._library.cache_clear()
    assert native.available() == CAN_BUILD


@needs_kernel
def test_the_kernel_shares_torchs_openmp_runtime():
    """One libgomp in the process: the kernel's OpenMP loop runs on torch's thread pool, not a second one that
    would fight torch's spinning threads for the cores."""
    native.skinny_linear(torch.randn(1, 8), torch.randn(8, 8))
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line and "sentencepiece" not in line}
    assert len(runtimes) == 1, runtimes


# --- norms and attention (the decode / verification path of specgate.models.transformer) ---------------------


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 20])
def test_norms_equal_torchs(rows):
    generator = torch.Generator().manual_seed(rows)
    x, a = torch.randn(rows, 640, generator=generator), torch.randn(rows, 640, generator=generator)
    scale, nxt = torch.rand(640, generator=generator) + 0.5, torch.rand(640, generator=generator) + 0.5
    norm = lambda v, s: torch.nn.functional.rms_norm(v, (640,), s, 1e-6)  # noqa: E731
    assert torch.allclose(native.rms_norm(x, scale, 1e-6), norm(x, scale), atol=1e-6, rtol=1e-5)
    inout = x.clone()
    out = native.residual_norm(inout, a, scale, nxt, 1e-6)
    assert torch.allclose(inout, x + norm(a, scale), atol=1e-6, rtol=1e-5)
    assert torch.allclose(out, norm(x + norm(a, scale), nxt), atol=1e-6, rtol=1e-5)
    assert native.residual_norm(x.clone(), a, scale, None, 1e-6) is None


def _ragged_logits(model, history_len: dict[int, int], new_len: dict[int, int], seed: int = 5):
    """Slots filled with histories (one call each), then one ragged call (rows in slot order 2, 0, 1, -1 padding):
    its logits [B, T, V] and the positions [B, T]."""
    generator = torch.Generator().manual_seed(seed)
    cache = model.new_cache(3, 64)
    for slot, n in history_len.items():
        if n:
            model(torch.randint(4, 500, (1, n), generator=generator), torch.arange(n)[None], cache, torch.tensor([slot]))
    order, width = [2, 0, 1], max(new_len.values())
    ids, positions = torch.full((3, width), -1), torch.full((3, width), -1)  # [B, T]
    for row, slot in enumerate(order):
        n, start = new_len[slot], history_len[slot]
        ids[row, :n] = torch.randint(4, 500, (n,), generator=generator)
        positions[row, :n] = torch.arange(start, start + n)
    return model(ids, positions, cache, torch.tensor(order)), positions


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["gemma3", "llama", "mistral", "qwen2"])
def test_native_paths_equal_the_torch_path(tiny_model_dir, monkeypatch, family, dtype):
    """A ragged batch (GQA, rows past the sliding window, different starts and lengths, padding, slots out of order)
    scored through the whole-stack C call (native.DecodeStack) and through the per-layer C path (norms, RoPE,
    cache write, attention as C calls between the products) equals torch's path (F.rms_norm, apply_rope, index_put,
    SDPA) to float32 rounding, for float32 and bf16 weights (both compute in float32). Negative controls for both C
    paths: the sliding window switched off, and a 1% error in the attention scale, must fail the comparison."""
    from specgate.models import load_model

    model = load_model(str(tiny_model_dir(family)), dtype=dtype).model
    history, new = {0: 13, 1: 17, 2: 0}, {0: 5, 1: 3, 2: 1}
    stack_calls, layer_calls = [], []
    real_run, real_attention = native.DecodeStack.run, native.attention
    with torch.inference_mode():
        with monkeypatch.context() as patch:
            patch.setattr(native.DecodeStack, "run", lambda self, x, *args: stack_calls.append(x.shape[0]) or real_run(self, x, *args))
            stacked, positions = _ragged_logits(model, history, new)
        # two histories + the ragged call, each one C call for all layers, on the real tokens only (no padding)
        assert stack_calls == [13, 17, sum(new.values())]
        assert (stacked[positions < 0] == 0).all()  # padding positions: zero logits, not garbage
        with monkeypatch.context() as patch:
            patch.setattr(model, "native_stack", lambda: None)
            patch.setattr(native, "attention", lambda *args: layer_calls.append(1) or real_attention(*args))
            per_layer, _ = _ragged_logits(model, history, new)
        assert len(layer_calls) == 3 * len(model.layers)
        with monkeypatch.context() as patch:
            patch.setattr(native, "attention_applies", lambda *args: False)
            patch.setattr(native, "norm_applies", lambda *args: False)
            slow, _ = _ragged_logits(model, history, new)

        wrongs = []  # (path, logits) of deliberately broken models
        windowed = [block.self_attn for block in model.layers if block.self_attn.window is not None]
        assert bool(windowed) == (family in ("gemma3", "mistral"))
        breaks = [("scale", [block.self_attn for block in model.layers], lambda attn: setattr(attn, "scale", attn.scale * 1.01))]
        if windowed:
            breaks.append(("window", windowed, lambda attn: setattr(attn, "window", None)))
        for _, modules, breaking in breaks:
            kept = [(attn.scale, attn.window) for attn in modules]
            for attn in modules:
                breaking(attn)
            wrongs.append(_ragged_logits(model, history, new)[0])  # the stack (rebuilt: its fingerprint changed)
            with monkeypatch.context() as patch:
                patch.setattr(model, "native_stack", lambda: None)
                wrongs.append(_ragged_logits(model, history, new)[0])  # the per-layer C path
            for attn, (scale, window) in zip(modules, kept):
                attn.scale, attn.window = scale, window
    valid = positions >= 0  # [B, T]
    tolerance = 1e-5 * slow[valid].abs().max().item()
    assert (stacked[valid] - slow[valid]).abs().max().item() <= tolerance
    assert (per_layer[valid] - slow[valid]).abs().max().item() <= tolerance
    for wrong in wrongs:
        assert (wrong[valid] - slow[valid]).abs().max().item() > 100 * tolerance


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stack", [True, False], ids=["stack", "per-layer"])
def test_a_verification_pass_is_bit_identical_to_single_steps(tiny_model_dir, monkeypatch, dtype, stack):
    """Batch invariance of the C paths: the logits of 5 tokens scored in one call (a verification pass), with another
    request's rows beside them, are bit-identical to scoring the 5 tokens one call at a time alone."""
    from specgate.models import load_model

    model = load_model(str(tiny_model_dir("gemma3")), dtype=dtype).model
    if not stack:
        monkeypatch.setattr(model, "native_stack", lambda: None)
    generator = torch.Generator().manual_seed(3)
    prompt, drafts, other = (torch.randint(4, 500, (1, n), generator=generator) for n in (12, 5, 9))
    with torch.inference_mode():
        cache = model.new_cache(2, 64)
        model(prompt, torch.arange(12)[None], cache, torch.tensor([0]))
        model(other, torch.arange(9)[None], cache, torch.tensor([1]))
        ids = torch.stack([drafts[0], torch.cat([other[0, :3], torch.full((2,), -1)])])  # [2, 5]
        positions = torch.stack([torch.arange(12, 17), torch.cat([torch.arange(9, 12), torch.full((2,), -1)])])
        together = model(ids, positions, cache, torch.tensor([0, 1]))[0]  # [5, V]
        alone = model.new_cache(1, 64)
        model(prompt, torch.arange(12)[None], alone, torch.tensor([0]))
        single = torch.cat([model(drafts[:, i : i + 1], torch.tensor([[12 + i]]), alone, torch.tensor([0]))[0] for i in range(5)])
    assert torch.equal(together, single)


@needs_kernel
def test_a_wide_bf16_verification_pass_is_bit_identical_to_single_steps(tiny_model_dir, monkeypatch):
    """bf16 weights: a verification forward of 16 requests x 5 tokens (80 rows, past the float32 limit of 64) still
    runs on the C path, so each request's logits are bit-identical to scoring its tokens one call at a time alone.
    Negative control: with the bf16 limit put back at 64, the same forward takes the torch path and differs."""
    from specgate.models import load_model

    model = load_model(str(tiny_model_dir("gemma3")), dtype=torch.bfloat16).model
    batch, width, context = 16, 5, 7
    generator = torch.Generator().manual_seed(5)
    prompts = torch.randint(4, 500, (batch, context), generator=generator)  # [B, L]
    drafts = torch.randint(4, 500, (batch, width), generator=generator)  # [B, T]
    positions = torch.arange(context, context + width)[None].expand(batch, -1)  # [B, T]

    def together() -> torch.Tensor:
        with torch.inference_mode():
            cache = model.new_cache(batch, 32)
            for row in range(batch):  # each prompt alone, as the single steps below see it
                model(prompts[row : row + 1], torch.arange(context)[None], cache, torch.tensor([row]))
            return model(drafts, positions, cache, torch.arange(batch))  # [B, T, V]

    with torch.inference_mode():
        single = []
        for row in range(batch):
            alone = model.new_cache(1, 32)
            model(prompts[row : row + 1], torch.arange(context)[None], alone, torch.tensor([0]))
            single.append(torch.cat([model(drafts[row : row + 1, i : i + 1], positions[:1, i : i + 1], alone, torch.tensor([0]))[0] for i in range(width)]))
    single = torch.stack(single)  # [B, T, V]
    assert native.layer_max_rows(torch.bfloat16) >= batch * width > native.layer_max_rows(torch.float32)
    assert torch.equal(together(), single)
    monkeypatch.setattr(native, "BF16_LAYER_MAX_ROWS", 64)
    monkeypatch.setattr(native, "BF16_HEAD_MAX_ROWS", 64)
    assert not torch.equal(together(), single)


def attention_case(head_dim: int, window: int | None, seed: int) -> dict:
    """Random q/k/v rows over a random cache: 4 query heads on 2 KV heads, rows at positions with 4k + 1 and 8k + 3
    keys (the kernels' 4- and 8-key tails), a long one past a 256-float chunk of keys, and a padding row."""
    generator = torch.Generator().manual_seed(seed)
    heads, kv_heads, slots, length = 4, 2, 4, 701
    keys = torch.randn(slots, kv_heads, length, head_dim, generator=generator)
    values = torch.randn(slots, kv_heads, length, head_dim, generator=generator)
    qkv = torch.randn(4, (heads + 2 * kv_heads) * head_dim, generator=generator)
    positions, row_slots = torch.tensor([4, 298, 699, -1]), torch.tensor([0, 1, 2, 3])
    return dict(qkv=qkv, positions=positions, slots=row_slots, inv_freq=torch.rand(head_dim // 2, generator=generator),
                q_scale=None, k_scale=None, eps=1e-6, num_heads=heads, num_kv_heads=kv_heads, keys=keys, values=values,
                window=window, scale=head_dim ** -0.5, kv_length=length)


def reference_attention(case: dict, qkv: torch.Tensor, window: int | None) -> torch.Tensor:
    """float64 softmax(q k^T scale) v per row and head, from the rotated q (qkv after the call) and the cache the
    call wrote; zeros for padding rows."""
    heads, kv_heads, D = case["num_heads"], case["num_kv_heads"], case["keys"].shape[-1]
    out = torch.zeros(qkv.shape[0], heads * D, dtype=torch.float64)
    for row, (p, slot) in enumerate(zip(case["positions"].tolist(), case["slots"].tolist())):
        if p < 0:
            continue
        lo = max(0, p - window + 1) if window else 0
        for h in range(heads):
            q = qkv[row, h * D : (h + 1) * D].double()
            k = case["keys"][slot, h // (heads // kv_heads), lo : p + 1].double()  # [n, D]
            v = case["values"][slot, h // (heads // kv_heads), lo : p + 1].double()
            out[row, h * D : (h + 1) * D] = torch.softmax(k @ q * case["scale"], 0) @ v
    return out


@needs_kernel
@pytest.mark.parametrize("head_dim", [16, 48, 256, 512])
@pytest.mark.parametrize("window", [None, 37])
def test_attention_equals_float64_softmax_and_each_row_is_the_same_alone(head_dim, window, wide):
    """Both variants (AVX2; AVX-512: keys four at a time, o held in registers) against float64 attention on the
    cache they wrote, within 1e-5, at up to 700 keys and head_dim up to 512; each row alone (its own call, its own
    fresh cache, maybe another thread count) bit-identical to its place in the batch. Negative control: the same
    bound fails against the reference without the window."""
    case = attention_case(head_dim, window, seed=head_dim)
    out = native.attention(**case)
    qkv = case["qkv"]  # rotated in place by the call
    exact = reference_attention(case, qkv, window)
    assert out[3].abs().max() == 0 and (out.double() - exact).abs().max() < 1e-5
    if window:
        assert (out.double() - reference_attention(case, qkv, None)).abs().max() > 1e-3
    for row in range(3):
        alone = attention_case(head_dim, window, seed=head_dim)
        keep = [row]
        alone.update(qkv=alone["qkv"][keep].contiguous(), positions=alone["positions"][keep], slots=alone["slots"][keep])
        assert torch.equal(native.attention(**alone)[0], out[row])


@needs_kernel
def test_attention_refuses_bad_shapes():
    keys = torch.zeros(1, 1, 9, 16)
    with pytest.raises(ValueError, match=r"qkv \(2, 40\) must be contiguous float32"):
        native.attention(torch.zeros(2, 40), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                         torch.ones(8), None, None, 1e-6, 2, 1, keys, keys.clone(), None, 1.0, 2)
    with pytest.raises(ValueError, match=r"must be int64 \[R\] = \[2\]"):
        native.attention(torch.zeros(2, 64), torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                         torch.ones(8), None, None, 1e-6, 2, 1, keys, keys.clone(), None, 1.0, 2)


@needs_kernel
def test_residual_norm_refuses_rows_it_would_overrun():
    """The C loop works on 8-float lanes: D % 8 != 0 must be refused, not read past the row."""
    x, a = torch.randn(2, 12), torch.randn(2, 12)
    with pytest.raises(ValueError, match=r"D % 8 == 0 \(got \(12,\), D=12\)"):
        native.residual_norm(x, a, torch.ones(12), None, 1e-6)
    with pytest.raises(ValueError, match=r"scales \[D\]"):
        native.residual_norm(torch.randn(2, 16), torch.randn(2, 16), torch.ones(8), None, 1e-6)


@needs_kernel
def test_the_stack_follows_weight_changes(tiny_model_dir):
    """The C stack points at the weights and at Gemma's (1 + w) norm scales: an in-place update of a projection is
    seen at once (same storage), a changed norm weight rebuilds the stack (its scale is recomputed), and a model
    moved to new storage drops it (the fused projections no longer alias their layers: per-layer path)."""
    from specgate.models import load_model

    model = load_model(str(tiny_model_dir("gemma3")), dtype=torch.float32).model
    ids = torch.randint(4, 500, (1, 6), generator=torch.Generator().manual_seed(2))

    def logits(use_stack: bool = True) -> torch.Tensor:
        saved = model.native_stack
        if not use_stack:
            model.native_stack = lambda: None
        try:
            with torch.inference_mode():
                return model(ids, torch.arange(6)[None], model.new_cache(1, 16), torch.tensor([0]))
        finally:
            model.native_stack = saved

    first = model.native_stack()
    assert first is not None and model.native_stack() is first  # built once, then reused
    with torch.no_grad():
        model.layers[0].self_attn.k_proj.weight.mul_(1.5)  # in place: the fused tensor changes, same storage
        model.layers[1].pre_feedforward_layernorm.weight.add_(0.25)  # a norm: (1 + w) must be recomputed
    rebuilt = model.native_stack()
    assert rebuilt is not None and rebuilt is not first
    assert torch.allclose(logits(), logits(use_stack=False), atol=1e-5, rtol=1e-5)
    model.to(torch.float64).to(torch.float32)  # new storage everywhere: the fused views are stale
    assert model.native_stack() is None


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 262144), (5, 4099), (3, 7), (2, 8), (1, 1), (17, 1000), (2, 3, 515), (0, 9), (2, 0, 9)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_argmax_and_amax_equal_torchs(shape, threads):
    """The verifier's argmax and the scheduler's finiteness pass: the same indices as torch.argmax (the first of
    tied maxima, the first NaN) and the same values as torch.amax (NaN, +inf), whatever the thread split."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(sum(shape))
        cases = [torch.randn(*shape, generator=generator), torch.randint(0, 3, shape, generator=generator).float()]  # ties
        for special in (float("nan"), float("inf"), -float("inf")) if 0 not in shape else ():
            x = torch.randn(*shape, generator=generator)
            flat = x.view(-1)
            flat[flat.numel() // 2] = special
            flat[-1] = special
            cases.append(x)
        cases.append(torch.full(shape, -float("inf")))
        for x in cases:
            assert torch.equal(native.argmax(x), x.argmax(-1)), x
            torch.testing.assert_close(native.amax(x), x.amax(-1), rtol=0, atol=0, equal_nan=True)
            peak, index = native.max_argmax(x)  # the scheduler's one pass: both results from one read
            assert torch.equal(index, x.argmax(-1)), x
            torch.testing.assert_close(peak, x.amax(-1), rtol=0, atol=0, equal_nan=True)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("prompt_len", [13, 70])  # the C stack (<= 64 real tokens) and the per-layer torch path
def test_a_cache_only_forward_writes_the_same_cache(tiny_model_dir, prompt_len):
    """logits=False (a prefill chunk nobody samples from) returns None and skips the head, but fills the KV cache
    exactly as a scored forward does: the next step's logits are bit-identical either way."""
    from specgate.models import load_model

    model = load_model(str(tiny_model_dir("gemma3")), dtype=torch.float32).model
    prompt = torch.randint(4, 500, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    step = []
    with torch.inference_mode():
        for logits in (True, False):
            cache = model.new_cache(1, 128)
            out = model(prompt, torch.arange(prompt_len)[None], cache, torch.tensor([0]), last_only=True, logits=logits)
            assert (out is None) == (not logits)
            step.append(model(torch.tensor([[7]]), torch.tensor([[prompt_len]]), cache, torch.tensor([0])))
    assert torch.equal(step[0], step[1])


def test_forward_writes_logits_into_a_given_buffer(tiny_model_dir):
    """out=: the logits land in the caller's buffer (returned), equal to a fresh forward's, padding zeroed, on the
    stack path and the per-layer path; a buffer of the wrong shape is refused with the shape it needs."""
    from specgate.models import load_model

    model = load_model(str(tiny_model_dir("gemma3")), dtype=torch.float32).model
    ids = torch.randint(4, 500, (2, 4), generator=torch.Generator().manual_seed(9))
    positions = torch.tensor([[10, 11, 12, 13], [20, -1, -1, -1]])
    with torch.inference_mode():
        for use_stack in (True, False):
            saved = model.native_stack
            if not use_stack:
                model.native_stack = lambda: None
            try:
                cache = model.new_cache(2, 32)
                model(torch.ones(2, 20, dtype=torch.int64), torch.arange(20)[None].expand(2, -1), cache, torch.tensor([0, 1]), logits=False)
                fresh = model(ids, positions, cache, torch.tensor([0, 1]))
                buffer = torch.full((2, 4, model.vocab_size), float("nan"))
                written = model(ids, positions, cache, torch.tensor([0, 1]), out=buffer)
            finally:
                model.native_stack = saved
            assert written.data_ptr() == buffer.data_ptr()
            valid = positions >= 0
            assert torch.equal(written[valid], fresh[valid])
            if use_stack:
                assert (written[~valid] == 0).all()
        with pytest.raises(ValueError, match=r"out \(2, 3, 512\) .* logits' shape \(2, 4, 512\)"):
            model(ids, positions, model.new_cache(2, 32), torch.tensor([0, 1]), out=torch.empty(2, 3, 512))
