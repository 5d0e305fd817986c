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
CAN_BUILD = HAS_TOOLCHAIN and {"avx2", "fma"} <= cpu_flags()


def test_kernel_is_available_where_it_can_be_built():
    assert native.available() == CAN_BUILD


needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="no C compiler or no AVX2/FMA on this CPU")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 16])
def test_product_is_exact_up_to_float32_rounding(rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(4099, 64, generator=generator)  # N = 4 * 1024 + 3: a 3-row tail block
    x = torch.randn(rows, 64, generator=generator)
    out = native.skinny_linear(x, weight)
    exact = x.double() @ weight.double().t()  # [R, N]
    bound = 64 * 2**-23 * (x.double().abs() @ weight.double().abs().t())  # K eps sum |x w|
    assert out.shape == (rows, 4099) and ((out.double() - exact).abs() <= bound).all()


@needs_kernel
def test_each_row_is_bit_identical_alone_and_in_a_batch():
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(2050, 640, generator=generator)
    x = torch.randn(16, 640, generator=generator)
    together = native.skinny_linear(x, weight)  # [16, N]
    for count in (1, 2, 5, 9):
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
    """linear() picks the kernel for float32 products of 1..20 rows with an LM head (>= HEAD_ELEMENTS) and 1..64
    rows with a layer's weight; oneDNN / F.linear otherwise (a prefill, a wide batch)."""
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
    assert calls == [((6, 64), 4096), ((64, 64), 1024)]
    assert out.shape == (2, 3, 4096) and torch.allclose(out, torch.nn.functional.linear(x, weight, bias), atol=1e-4)


@needs_kernel
def test_bad_input_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"must be \[R, K\] and \[N, K\]"):
        native.skinny_linear(torch.randn(2, 16), torch.randn(8, 24))
    with pytest.raises(ValueError, match=r"K % 8 == 0"):
        native.skinny_linear(torch.randn(2, 12), torch.randn(8, 12))
    with pytest.raises(ValueError, match=r"float32"):
        native.skinny_linear(torch.randn(2, 16).double(), torch.randn(8, 16).double())


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
@pytest.mark.parametrize("family", ["gemma3", "llama", "mistral"])
def test_native_attention_path_equals_the_torch_path(tiny_model_dir, monkeypatch, family):
    """A ragged batch (GQA, rows past the sliding window, different starts and lengths, padding, slots out of order)
    scored through the C path (norms, RoPE, cache write, attention) equals torch's path (F.rms_norm, apply_rope,
    index_put, SDPA) to float32 rounding; a copy with the sliding window switched off in the C path must not
    (negative control: the comparison sees a window error), nor one with a 1% error in the attention scale."""
    from specgate.models import load_model

    model = load_model(str(tiny_model_dir(family)), dtype=torch.float32).model
    history, new = {0: 13, 1: 17, 2: 0}, {0: 5, 1: 3, 2: 1}
    calls = []
    real = native.attention
    with torch.inference_mode():
        with monkeypatch.context() as patch:
            patch.setattr(native, "attention", lambda *args: calls.append(args[0].shape) or real(*args))
            fast, positions = _ragged_logits(model, history, new)
        assert len(calls) == 3 * len(model.layers)  # two histories + the ragged call, every layer through the C path
        with monkeypatch.context() as patch:
            patch.setattr(native, "attention_applies", lambda *args: False)
            patch.setattr(native, "norm_applies", lambda *args: False)
            slow, _ = _ragged_logits(model, history, new)
        wrongs = []
        windowed = [block.self_attn for block in model.layers if block.self_attn.window is not None]
        assert bool(windowed) == (family != "llama")
        for attn in windowed:
            attn.window, kept = None, attn.window
        if windowed:
            wrongs.append(_ragged_logits(model, history, new)[0])
            for attn in windowed:
                attn.window = kept
        for block in model.layers:
            block.self_attn.scale *= 1.01
        wrongs.append(_ragged_logits(model, history, new)[0])
    valid = positions >= 0  # [B, T]
    tolerance = 1e-5 * slow[valid].abs().max().item()
    assert (fast[valid] - slow[valid]).abs().max().item() <= tolerance
    for wrong in wrongs:
        assert (wrong[valid] - slow[valid]).abs().max().item() > 100 * tolerance


@needs_kernel
def test_a_verification_pass_is_bit_identical_to_single_steps(tiny_model_dir):
    """Batch invariance of the C path: the logits of 5 tokens scored in one call (a verification pass), with another
    request's rows beside them, are bit-identical to scoring the 5 tokens one call at a time alone."""
    from specgate.models import load_model

    model = load_model(str(tiny_model_dir("gemma3")), dtype=torch.float32).model
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
