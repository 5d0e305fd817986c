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
from specgate.models import native, transformer
from specgate.models.dtypes import DTYPE_CHOICES

BF16_RTOL = 0.05
VOCAB = 512


def test_default_dtype_follows_the_cpu_flags():
    assert default_dtype(frozenset({"avx2", "avx512f", "avx512_bf16"})) == torch.bfloat16
    assert default_dtype(frozenset({"avx2", "amx_bf16", "amx_tile"})) == torch.bfloat16
    assert default_dtype(frozenset({"avx", "avx2", "fma"})) == torch.bfloat16  # the native kernel widens bf16 weights
    assert default_dtype(frozenset({"avx", "avx2"})) == torch.float32  # no FMA: no kernel, no native bf16
    assert default_dtype(frozenset()) == torch.float32
    assert resolve_dtype("float32") == torch.float32 and resolve_dtype("bfloat16") == torch.bfloat16
    assert DTYPE_CHOICES == ("auto", "float32", "bfloat16")


@pytest.mark.parametrize(
    "flags, kernel_built, expected",
    [
        ({"avx2", "avx512f", "avx512_bf16"}, False, torch.bfloat16),  # native bf16 dot products need no kernel
        ({"avx2", "amx_bf16", "amx_tile"}, False, torch.bfloat16),
        ({"avx", "avx2", "fma"}, True, torch.bfloat16),  # the kernel widens bf16 weights
        ({"avx", "avx2", "fma"}, False, torch.float32),  # AVX2 + FMA but no compiler (or SPECGATE_NATIVE=0): no kernel
        ({"avx", "avx2"}, False, torch.float32),
        (set(), False, torch.float32),
    ],
)
def test_default_dtype_of_this_machine_follows_its_flags_and_kernel(monkeypatch, flags, kernel_built, expected):
    """default_dtype() with no flags reads the machine: /proc/cpuinfo's flags and whether the native kernel loaded.
    Both facts are fixed here, and the expected dtype is written out, not recomputed by the rule under test."""
    from specgate.models import dtypes

    monkeypatch.setattr(dtypes, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(native, "available", lambda: kernel_built)
    assert native_bf16() == bool({"avx512_bf16", "amx_bf16"} & flags)
    assert default_dtype() == expected and resolve_dtype("auto") == expected
    with pytest.raises(ValueError, match=f"auto = {str(expected).removeprefix('torch.')} on this CPU"):
        resolve_dtype("float16")


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
    window_start = model._mask(positions, int(positions.max()) + 1, 8)[1]
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


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_onednn_float32_linear_matches_f_linear(rows):
    """The float32 CPU path (oneDNN's inner product) equals F.linear up to summation order, any leading shape."""
    assert transformer.ONEDNN_LINEAR, "torch's CPU build ships oneDNN (mkldnn): the float32 fast path must be on"
    generator = torch.Generator().manual_seed(10 + rows)
    for n, k in ((4096, 64), (96, 640)):
        weight = torch.randn(n, k, generator=generator)  # [N, K]
        bias = torch.randn(n, generator=generator)  # [N]
        x = torch.randn(2, rows, k, generator=generator)  # [B, T, K]
        with torch.inference_mode():
            out = transformer.linear(x, weight, bias)
            plain = transformer.linear(x[0, 0], weight)  # [K] -> [N]
        reference = F.linear(x, weight, bias)
        tolerance = 4 * k**0.5 * 2**-23 * reference.abs().max().item()  # float32 summation-order differences
        assert out.shape == (2, rows, n)
        assert (out - reference).abs().max().item() <= tolerance
        assert plain.shape == (n,) and (plain - F.linear(x[0, 0], weight)).abs().max().item() <= tolerance


def test_linear_keeps_autograd_where_gradients_are_needed():
    """Training (the draft distillation) needs gradients: the fast path, which records no graph, is skipped."""
    weight = torch.randn(32, 16, requires_grad=True)
    x = torch.randn(4, 16)
    transformer.linear(x, weight).sum().backward()
    assert weight.grad is not None and torch.allclose(weight.grad, x.sum(0).expand(32, 16))


@pytest.fixture()
def fresh_gemma(tiny_model_dir):
    return load_model(str(tiny_model_dir("gemma3")), dtype=torch.float32).model


def test_loader_fuses_qkv_and_gate_up_into_views_of_one_tensor(fresh_gemma):
    attn, mlp = fresh_gemma.layers[0].self_attn, fresh_gemma.layers[0].mlp
    assert attn.fused is not None and mlp.fused is not None
    fused_qkv = attn.fused.get()[0]
    assert fused_qkv.shape[0] == attn.q_proj.weight.shape[0] + 2 * attn.k_proj.weight.shape[0]
    assert attn.q_proj.weight.data_ptr() == fused_qkv.data_ptr()
    assert torch.equal(fused_qkv[-attn.v_proj.weight.shape[0] :], attn.v_proj.weight)
    names = set(fresh_gemma.state_dict())
    assert "layers.0.self_attn.q_proj.weight" in names and "layers.0.mlp.up_proj.weight" in names
    assert not any("fused" in name for name in names)


def test_fused_and_separate_projections_give_the_same_logits(fresh_gemma):
    ids = torch.randint(0, fresh_gemma.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        fused = _prefix_logits(fresh_gemma, ids)
    for block in fresh_gemma.layers:  # force the separate products
        block.self_attn.fused = block.mlp.fused = None
    with torch.inference_mode():
        separate = _prefix_logits(fresh_gemma, ids)
    assert (fused - separate).abs().max().item() <= 1e-4 * max(1.0, separate.abs().max().item())


def test_fused_projections_follow_in_place_updates_and_notice_new_storage(fresh_gemma):
    """load_state_dict copies in place (into the fused tensor); `.to()` gives new storage (fusion off, still right)."""
    ids = torch.randint(0, fresh_gemma.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    attn = fresh_gemma.layers[0].self_attn
    state = {name: tensor.clone() for name, tensor in fresh_gemma.state_dict().items()}
    state["layers.0.self_attn.k_proj.weight"] = torch.randn_like(state["layers.0.self_attn.k_proj.weight"])
    fresh_gemma.load_state_dict(state)
    assert attn.fused.get() is not None  # still aliased: the copy went into the fused tensor
    with torch.inference_mode():
        after_update = _prefix_logits(fresh_gemma, ids)
    fresh_gemma.layers[0].self_attn.fused = None
    with torch.inference_mode():
        reference = _prefix_logits(fresh_gemma, ids)
    assert (after_update - reference).abs().max().item() <= 1e-4 * max(1.0, reference.abs().max().item())

    fresh_gemma.fuse_projections()
    fresh_gemma.to(torch.float64)  # new storage for every parameter: the fused tensors are stale now
    assert fresh_gemma.layers[1].self_attn.fused.get() is None and fresh_gemma.layers[1].mlp.fused.get() is None
    with torch.inference_mode():
        widened = _prefix_logits(fresh_gemma, ids)
    assert (widened.float() - reference).abs().max().item() <= 1e-3 * max(1.0, reference.abs().max().item())


def test_gemma_norm_scale_is_recomputed_after_the_weight_changes():
    norm = transformer.RMSNorm(8, 1e-6, gemma=True).requires_grad_(False)
    x = torch.randn(2, 8)
    before = norm(x)
    with torch.no_grad():
        norm.weight.add_(1.0)  # (1 + w) doubles where w was 0
    assert torch.allclose(norm(x), 2 * before, atol=1e-6)
    norm.weight.data = torch.full((8,), 2.0)  # new storage
    assert torch.allclose(norm(x), 3 * before, atol=1e-6)
