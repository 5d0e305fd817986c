"""specgate.models.native: the C kernel for the LM head of 1..20 rows.

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
def test_linear_routes_a_large_head_to_the_kernel(monkeypatch):
    """linear() picks the kernel for a >= 16M-element float32 weight and 1..20 rows, oneDNN/F.linear otherwise."""
    calls = []
    real = native.skinny_linear
    monkeypatch.setattr(native, "skinny_linear", lambda x, w: calls.append(tuple(x.shape)) or real(x, w))
    monkeypatch.setattr(native, "SKINNY_MIN_ELEMENTS", 4096 * 64)
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(4096, 64, generator=generator)
    bias = torch.randn(4096, generator=generator)
    x = torch.randn(2, 3, 64, generator=generator)
    with torch.inference_mode():
        out = transformer.linear(x, weight, bias)
        transformer.linear(torch.randn(21, 64), weight)  # 21 rows: not the kernel
        transformer.linear(torch.randn(2, 64), weight[:1024])  # a smaller weight: not the kernel
    assert calls == [(6, 64)]
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
