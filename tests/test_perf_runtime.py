"""The fast paths of the runtime: default_dtype, the CPU linear formulations (tall-weight fp32, chunked bf16
upcast), bf16 logits against fp32, and ragged / sliding-window batches through the bf16 multi-row path.

Tolerances: linear() against F.linear in float32: max |diff| <= 1e-4 on outputs of magnitude ~30 (summation
order only); the bf16 upcast path against a float64 product of the same bf16 operands: within one bf16 rounding
of the output (|diff| <= 2^-8 |value| + 1e-3); bf16 model logits against float32 logits: max |diff| <= 5% of
the largest |logit| (BF16_RTOL; bf16 keeps 8 mantissa bits through 2 layers).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specgate.models import default_dtype, load_model, native_bf16, resolve_dtype
from specgate.models import transformer
from specgate.models.dtypes import DTYPE_CHOICES

BF16_RTOL = 0.05
VOCAB = 512


def test_default_dtype_follows_the_cpu_flags():
    assert default_dtype(frozenset({"avx2", "avx512f", "avx512_bf16"})) == torch.bfloat16
    assert default_dtype(frozenset({"avx2", "amx_bf16", "amx_tile"})) == torch.bfloat16
    assert default_dtype(frozenset({"avx", "avx2", "fma"})) == torch.float32
    assert default_dtype(frozenset()) == torch.float32
    assert default_dtype() == (torch.bfloat16 if native_bf16() else torch.float32)
    assert resolve_dtype("auto") == default_dtype()
    assert resolve_dtype("float32") == torch.float32 and resolve_dtype("bfloat16") == torch.bfloat16
    assert DTYPE_CHOICES == ("auto", "float32", "bfloat16")


def test_resolve_dtype_names_the_bad_value():
    with pytest.raises(ValueError, match=r"--dtype 'float16' is not supported: use one of auto, float32, bfloat16"):
        resolve_dtype("float16")


@pytest.mark.parametrize("rows", [1, 2, 5, 9, 33])
def test_tall_float32_weight_matches_f_linear(rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(4096, 64, generator=generator)  # [N, K]: tall (N >= 8 K), the LM-head path
    bias = torch.randn(4096, generator=generator)  # [N]
    x = torch.randn(3, rows, 64, generator=generator)  # [B, T, K]
    out = transformer.linear(x, weight, bias)
    assert out.shape == (3, rows, 4096) and out.is_contiguous()
    assert (out - F.linear(x, weight, bias)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("rows", [2, 7])
def test_bf16_upcast_path_is_one_rounding_of_the_exact_product(monkeypatch, rows):
    """The chunked upcast (forced on, with chunks smaller than the weight) covers every output row exactly once."""
    monkeypatch.setattr(transformer, "native_bf16", lambda: False)
    monkeypatch.setattr(transformer, "UPCAST_CHUNK_ELEMENTS", 64 * 100)  # 100-row chunks: 11 chunks, the last partial
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(1050, 64, generator=generator).bfloat16()  # [N, K]
    bias = torch.randn(1050, generator=generator).bfloat16()  # [N]
    x = torch.randn(2, rows, 64, generator=generator).bfloat16()  # [B, T, K]
    out = transformer.linear(x, weight, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (2, rows, 1050)
    exact = x.double() @ weight.double().t()  # [B, T, N]
    product = out.double() - bias.double()  # undo the bias (added in bf16) up to one more rounding
    assert ((product - exact).abs() <= exact.abs() * 2**-7 + bias.double().abs() * 2**-8 + 1e-2).all()


@pytest.fixture(scope="module")
def gemma_pair(tiny_model_dir):
    """The tiny Gemma-3 (sliding window 8 on layer 0) in float32 and in bfloat16."""
    path = str(tiny_model_dir("gemma3"))
    return load_model(path, dtype=torch.float32).model, load_model(path, dtype=torch.bfloat16).model


def _prefix_logits(model, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1])[None]  # [1, T]
    return model(ids, positions, model.new_cache(1, 64), torch.tensor([0]))  # [1, T, V]


def test_bf16_logits_are_close_to_float32(gemma_pair):
    fp32, bf16 = gemma_pair
    ids = torch.randint(4, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))  # [1, T], past the window
    expected, actual = _prefix_logits(fp32, ids), _prefix_logits(bf16, ids)
    assert actual.dtype == torch.float32
    diff = (actual - expected).abs().max().item()
    assert diff <= BF16_RTOL * expected.abs().max().item(), f"max |diff| {diff:.3g}"


def test_bf16_tolerance_rejects_wrong_logits(gemma_pair):
    """Negative control: logits of a different prefix must fail the bf16 tolerance (so the tolerance can fail)."""
    fp32, bf16 = gemma_pair
    ids = torch.randint(4, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))  # [1, T]
    other = torch.randint(4, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))  # [1, T]
    expected, wrong = _prefix_logits(fp32, ids), _prefix_logits(bf16, other)
    assert (wrong - expected).abs().max().item() > BF16_RTOL * expected.abs().max().item()


@pytest.mark.parametrize(
    "dtype_index, history_len, atol_fraction",
    [
        (1, {0: 13, 1: 0, 2: 9}, 0.02),  # bf16 (upcast path), one row starting at 0
        (0, {0: 13, 1: 17, 2: 10}, 1e-6),  # fp32, every row past the window: the local layer reads from position > 0
    ],
)
def test_ragged_batch_past_the_window_equals_each_row_alone(gemma_pair, monkeypatch, dtype_index, history_len, atol_fraction):
    """Rows with histories longer than the sliding window (8), different starts and lengths, -1 padding, through
    the multi-row paths (bf16 upcast forced on): each row equals the same row scored alone in the same dtype."""
    monkeypatch.setattr(transformer, "native_bf16", lambda: False)
    model = gemma_pair[dtype_index]
    generator = torch.Generator().manual_seed(5)
    new_len = {0: 5, 1: 3, 2: 1}  # slot -> tokens scored in this call
    history = {s: torch.randint(4, VOCAB, (1, n), generator=generator) for s, n in history_len.items()}
    new = {s: torch.randint(4, VOCAB, (1, n), generator=generator) for s, n in new_len.items()}
    order = [2, 0, 1]
    cache = model.new_cache(3, 32)
    for slot, ids in history.items():
        if ids.shape[1]:
            model(ids, torch.arange(ids.shape[1])[None], cache, torch.tensor([slot]))
    width = max(new_len.values())
    ids = torch.full((3, width), -1)  # [B, T]
    positions = torch.full((3, width), -1)  # [B, T]
    for row, slot in enumerate(order):
        n, start = new_len[slot], history_len[slot]
        ids[row, :n], positions[row, :n] = new[slot][0], torch.arange(start, start + n)
    logits = model(ids, positions, cache, torch.tensor(order))  # [B, T, V]
    window_start = model._masks(positions, int(positions.max()) + 1)[8][1]
    assert window_start == max(0, min(history_len.values()) - 8 + 1)  # keys before it are not read
    for row, slot in enumerate(order):
        full = torch.cat([history[slot], new[slot]], dim=1)  # [1, H + n]
        alone = _prefix_logits(model, full)[0, history_len[slot] :]  # [n, V]
        diff = (logits[row, : new_len[slot]] - alone).abs().max().item()
        # same dtype: only the row count of the batched products (summation order) differs
        assert diff <= atol_fraction * alone.abs().max().item() + 1e-5, f"slot {slot}: max |diff| {diff:.3g}"


def test_weights_are_aligned_so_logits_do_not_depend_on_the_file_layout(gemma_pair):
    fp32 = gemma_pair[0]
    assert all(p.data_ptr() % 64 == 0 for p in fp32.parameters())


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["check-lossless", "--target", "gemma-3-270m", "--draft", "ngram"]])
def test_cli_rejects_an_unknown_dtype_before_loading(command):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "specgate", *command, "--dtype", "float16"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--dtype 'float16' is not supported" in proc.stderr and "auto, float32, bfloat16" in proc.stderr
