"""Quantized weights (specgate.models.quant, csrc/quant.c): GGUF blocks read as shipped.

Two kernel families, chosen by the CPU alone: float32 activations (AVX2 / AVX-512; `SPECGATE_VNNI=0` forces them)
and int8 activations (AVX-512 VNNI, llama.cpp's method). Oracles: gguf.quants' own numpy dequantization
(independent of our C), the float32 kernel on that dequantized matrix, and a torch rounding of x to int8 per
32-block. Checks: the C dequantization equals gguf's bit for bit for every served kind; a float32-activation
product equals the float32 kernel's product of the dequantized matrix bit for bit; an int8-activation product
equals float64 (rounded x) @ (dequantized W) within float32 error and is measurably not the product of the
unrounded x (negative control); the rounding equals the torch reference bit for bit and keeps inf / NaN
non-finite; Q8_0_R4 is an exact rearrangement of Q8_0; a row's output is bit-identical alone, among 5 or 9 rows,
or in a 16 x 9 batch (batch invariance), a property a row-count-dependent summation fails (negative control);
a fused weight of parts of different kinds equals its parts; a model quantized on load (int8) decodes greedily
to the same tokens with and without speculation; and, on the real Gemma-3-270M GGUF (slow), the quantized
model's logits equal the float32 model de-quantised by transformers bit for bit with float32 activations and
agree on the top token at >= 90% of decode positions with int8 activations, a position's logits are the same
alone, in a 5-token verification and beside other requests, and greedy n-gram speculation returns target-only
greedy's tokens.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from specgate.models import native
from specgate.models.dtypes import cpu_flags
from specgate.models.quant import BLOCKS, GGUF_KINDS, KIND_NAMES, QuantPart, QuantWeight, quantize_q8_0

CAN_BUILD = (shutil.which("cc") or shutil.which("gcc")) is not None and {"avx2", "fma", "f16c"} <= cpu_flags()
pytestmark = pytest.mark.skipif(not CAN_BUILD, reason="no C compiler or no AVX2/FMA/F16C on this CPU")
SCALE_OFFSETS = {8: (0,), 6: (0,), 12: (0, 2), 14: (208,)}  # where each kind's fp16 scales sit in its block
INT8 = CAN_BUILD and native.available() and native.int8_activations()
needs_int8 = pytest.mark.skipif(not INT8, reason="int8 activations need AVX-512 VNNI")


@pytest.fixture
def float_activations(monkeypatch):
    """The float32-activation kernels for one test (SPECGATE_VNNI=0; the flag is re-read around the test)."""
    monkeypatch.setenv("SPECGATE_VNNI", "0")
    native.int8_activations.cache_clear()
    yield
    native.int8_activations.cache_clear()


def rounded(x: torch.Tensor) -> torch.Tensor:
    """The torch reference of the int8 kernels' activations: per 32-block q = round_half_even(x * (127 / amax)),
    dx = amax / 127 (float32 arithmetic; 0 for an all-zero block), returned as q * dx."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / 127.0)).reshape(x.shape)


def random_blocks(kind: int, rows: int, k: int, seed: int = 0) -> QuantWeight:
    """Random but valid blocks: random bytes, with every fp16 scale set to a finite value of either sign."""
    per_block, block_bytes = BLOCKS[kind]
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (rows, k // per_block, block_bytes), dtype=torch.uint8, generator=g)
    for offset in SCALE_OFFSETS[kind]:
        scale = ((torch.rand(rows, k // per_block, generator=g) - 0.5) * 0.02).half()
        data[..., offset : offset + 2] = scale.view(torch.uint8).reshape(rows, k // per_block, 2)
    return QuantWeight((QuantPart(kind, data.reshape(rows, -1).contiguous()),), k)


@pytest.mark.parametrize("kind", GGUF_KINDS, ids=lambda kind: KIND_NAMES[kind])
def test_c_dequantization_equals_gguf(kind):
    weight = random_blocks(kind, 12, 512, seed=kind)
    assert torch.equal(native.dequantize_rows(weight), weight.dequantize())
    rows = torch.tensor([7, 0, 7, 11])
    assert torch.equal(native.dequantize_rows(weight, rows), weight.dequantize()[rows])


@pytest.mark.parametrize("kind", GGUF_KINDS, ids=lambda kind: KIND_NAMES[kind])
@pytest.mark.parametrize("rows", [1, 2, 5, 9])
def test_float_activation_product_equals_the_float_kernel_on_the_dequantized_matrix(kind, rows, float_activations):
    weight = random_blocks(kind, 38, 512, seed=kind)  # 38 rows: a tail block of 2
    dense = weight.dequantize()
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    out = native.skinny_product(x, weight)
    assert torch.equal(out, native.skinny_product(x, dense))  # same FMA order: bit for bit
    torch.testing.assert_close(out.double(), x.double() @ dense.double().t(), rtol=1e-4, atol=1e-4)


@needs_int8
@pytest.mark.parametrize("kind", GGUF_KINDS, ids=lambda kind: KIND_NAMES[kind])
@pytest.mark.parametrize("rows", [1, 2, 5, 9])
def test_int8_activation_product_is_the_product_of_the_rounded_rows(kind, rows):
    k = 512 if kind in (12, 14) else 544  # Q8_0 / Q5_0: an odd number of 32-blocks (a lone last group)
    weight = random_blocks(kind, 38, k, seed=kind)
    dense = weight.dequantize().double()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    out = native.skinny_product(x, weight).double()
    exact = rounded(x).double() @ dense.t()
    scale = exact.abs().max()
    assert (out - exact).abs().max() <= 1e-5 * scale  # integer dots, float32 sums: float32 error only
    assert (out - x.double() @ dense.t()).abs().max() > 1e-4 * scale  # negative control: x was rounded


@needs_int8
def test_int8_rounding_matches_the_reference_and_keeps_non_finite_rows():
    x = torch.randn(3, 96) * torch.tensor([1e-3, 1.0, 50.0])[:, None]
    x[1, 32:64] = 0.0  # an all-zero block: q = 0, dx = 0
    assert torch.equal(native.round_activations(x), rounded(x))
    weight = random_blocks(8, 8, 96, seed=1)
    for bad in (float("inf"), float("nan")):
        poisoned = x.clone()
        poisoned[2, 70] = bad
        out = native.skinny_product(poisoned, weight)
        assert torch.isfinite(out[:2]).all() and not torch.isfinite(out[2]).any()


@needs_int8
@pytest.mark.parametrize("kind", GGUF_KINDS, ids=lambda kind: KIND_NAMES[kind])
def test_repacking_is_an_exact_rearrangement(kind):
    from specgate.models.quant import REPACKED_KIND, unpack_q8_0_r4

    plain = random_blocks(kind, 36, 768, seed=5)
    packed = native.for_kernels(plain)
    assert packed.parts[0].kind == REPACKED_KIND[kind] and packed.shape == plain.shape
    if kind == 8:
        assert torch.equal(unpack_q8_0_r4(packed.parts[0].data, 768), plain.parts[0].data)
    assert torch.equal(native.dequantize_rows(packed), plain.dequantize())  # the C unpacking of the layout: gguf's values
    ids = torch.tensor([35, 0, 6, 6, 17])
    assert torch.equal(native.dequantize_rows(packed, ids), plain.dequantize()[ids])
    x = torch.randn(7, 768)
    ours, theirs = native.skinny_product(x, packed), native.skinny_product(x, plain)
    if kind == 14:  # Q6K_R4 keeps the GGUF-layout kernel's sums, re-laid out
        assert torch.equal(ours, theirs)
    else:  # block-transposed: each 32-group's integer sum whole, then scaled: the same value up to float32 rounding
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5 * float(theirs.abs().max()))
        assert not torch.allclose(ours, native.skinny_product(x * 1.01, plain), rtol=1e-5, atol=1e-5 * float(theirs.abs().max()))
    odd = random_blocks(kind, 6, 768, seed=6)  # rows % 4 != 0: left as shipped
    assert native.for_kernels(odd).parts[0].kind == kind


def rows_invariant(product, x: torch.Tensor) -> bool:
    """True where every row of product(x) is bit-identical to the row computed alone and inside every prefix."""
    together = product(x)
    for count in range(1, x.shape[0] + 1):
        if not torch.equal(product(x[:count]), together[:count]):
            return False
    return all(torch.equal(product(x[r : r + 1])[0], together[r]) for r in range(x.shape[0]))


def test_batch_invariance_holds_and_the_check_can_fail():
    shipped = QuantWeight.concat([random_blocks(6, 64, 640, 1), random_blocks(8, 32, 640, 2)])
    weight = native.for_kernels(shipped)
    x = torch.randn(16, 640, generator=torch.Generator().manual_seed(3))
    assert rows_invariant(lambda rows: native.skinny_product(rows.contiguous(), weight), x)
    wide = torch.randn(144, 640, generator=torch.Generator().manual_seed(4))  # a 16 x 9 verification batch
    together = native.skinny_product(wide, weight)
    assert all(torch.equal(native.skinny_product(wide[r : r + 1], weight)[0], together[r]) for r in (0, 5, 77, 143))

    dense = shipped.dequantize()

    def row_count_dependent(rows: torch.Tensor) -> torch.Tensor:  # sums K in R-sized chunks: order depends on R
        chunks = rows.shape[0] + 1
        return sum(rows[:, c::chunks] @ dense[:, c::chunks].t() for c in range(chunks))

    assert not rows_invariant(row_count_dependent, x)  # negative control: the check sees a difference


def test_fused_parts_equal_their_products():
    parts = [random_blocks(6, 64, 256, 1), random_blocks(12, 32, 256, 2), random_blocks(14, 16, 256, 3), random_blocks(8, 8, 256, 4)]
    fused = QuantWeight.concat(parts)
    x = torch.randn(5, 256)
    expected = torch.cat([native.skinny_product(x, part) for part in parts], dim=1)
    assert torch.equal(native.skinny_product(x, fused), expected)
    scattered = torch.zeros(8, fused.shape[0])
    native.skinny_product(x, fused, out=scattered, out_rows=torch.tensor([7, 1, 3, 0, 5]))
    assert torch.equal(scattered[[7, 1, 3, 0, 5]], expected)


def test_q8_0_quantization_matches_ggml():
    from gguf import GGMLQuantizationType, quantize

    weight = torch.randn(16, 256)
    ours = quantize_q8_0(weight)
    theirs = quantize(weight.numpy(), GGMLQuantizationType.Q8_0)
    assert np.array_equal(ours.parts[0].data.numpy(), theirs.reshape(16, -1))


def test_bad_blocks_are_refused():
    with pytest.raises(ValueError, match="Q5_0 rows of K=100"):
        QuantWeight((QuantPart(6, torch.zeros(4, 66, dtype=torch.uint8)),), 100)
    with pytest.raises(ValueError, match="not served"):
        QuantWeight((QuantPart(2, torch.zeros(4, 18, dtype=torch.uint8)),), 32)


@pytest.mark.parametrize("family", ["gemma3", "llama", "qwen2"])
def test_int8_on_load_decodes_the_same_with_and_without_speculation(tiny_model_dir, family, capsys):
    from specgate.drafting import NgramDrafter, NoDrafter
    from specgate.engine import generate
    from specgate.models import load_model
    from specgate.sampling import SamplingParams

    path = tiny_model_dir(family)
    quantized = load_model(str(path), dtype="int8")
    assert "changes the target model" in capsys.readouterr().err
    assert quantized.model.quantized and quantized.model.native_stack() is not None
    reference = load_model(str(path), dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 13, 5, 9, 13, 5, 9]])
    positions = torch.arange(ids.shape[1])[None]
    with torch.inference_mode():
        a = quantized.model(ids, positions, quantized.model.new_cache(1, 64), torch.tensor([0]))
        b = reference.model(ids, positions, reference.model.new_cache(1, 64), torch.tensor([0]))
    assert (a - b).abs().max() < 0.05 * b.abs().max()  # Q8_0 is close, not equal: it changed the model
    greedy = SamplingParams(temperature=0.0)
    prompt = [1, 5, 9, 13, 5, 9, 13, 5, 9, 13, 5]
    baseline = generate(prompt, quantized, NoDrafter(), 0, greedy, max_new_tokens=24).tokens
    for gamma in (2, 5):
        assert generate(prompt, quantized, NgramDrafter(), gamma, greedy, max_new_tokens=24).tokens == baseline


# --- the real Gemma-3-270M Q4_K_M GGUF ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_gguf():
    from specgate.models import load_model

    return load_model("gemma-3-270m", dtype="gguf")


def decode_logits(loaded, ids: torch.Tensor) -> torch.Tensor:
    """Logits of every position of ids [1, T], scored 8 tokens at a time (decode / verification rows)."""
    cache, positions = loaded.model.new_cache(1, ids.shape[1]), torch.arange(ids.shape[1])[None]
    with torch.inference_mode():
        return torch.cat([loaded.model(ids[:, i : i + 8], positions[:, i : i + 8], cache, torch.tensor([0]))[0]
                          for i in range(0, ids.shape[1], 8)])


@pytest.fixture(scope="module")
def gemma_float32():
    from specgate.models import load_model
    from specgate.models.loading import default_gguf_path

    return load_model(str(default_gguf_path()), dtype=torch.float32)  # transformers' de-quantisation


PASSAGE = ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\n"
           "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer the slings and arrows")


@pytest.mark.slow
def test_gguf_logits_equal_the_float32_dequantized_model(gemma_float32, float_activations):
    from specgate.models import load_model

    shipped = load_model("gemma-3-270m", dtype="gguf")  # float32 activations: no Q8_0_R4, the float32 kernels
    ids = torch.tensor([shipped.tokenizer(PASSAGE)["input_ids"]])
    assert torch.equal(decode_logits(shipped, ids), decode_logits(gemma_float32, ids))


@pytest.mark.slow
@needs_int8
def test_gguf_int8_activations_stay_close_to_the_float32_model(gemma_gguf, gemma_float32):
    ids = torch.tensor([gemma_gguf.tokenizer(PASSAGE)["input_ids"]])
    a, b = decode_logits(gemma_gguf, ids), decode_logits(gemma_float32, ids)
    assert not torch.equal(a, b)  # the activations were rounded
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    kl = (b.log_softmax(-1).exp() * (b.log_softmax(-1) - a.log_softmax(-1))).sum(-1).mean()
    assert kl < 0.02


@pytest.mark.slow
def test_gguf_position_logits_do_not_depend_on_the_batch(gemma_gguf):
    model = gemma_gguf.model
    tokens = gemma_gguf.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"]
    prefix, verify = tokens[:-5], tokens[-5:]
    cache = model.new_cache(4, 128)
    with torch.inference_mode():
        for slot in range(4):
            model(torch.tensor([prefix]), torch.arange(len(prefix))[None], cache, torch.tensor([slot]), logits=False)
        start = len(prefix)
        alone = [model(torch.tensor([[t]]), torch.tensor([[start + i]]), cache, torch.tensor([0]))[0, 0].clone()
                 for i, t in enumerate(verify)]
        verified = model(torch.tensor([verify]), torch.arange(start, start + 5)[None], cache, torch.tensor([1]))[0]
        others = torch.tensor([verify, verify[::-1], [5, 6, 7, 8, 9]])
        batched = model(others, torch.arange(start, start + 5)[None].expand(3, 5), cache, torch.tensor([2, 3, 1]))[0]
    for i in range(5):
        assert torch.equal(alone[i], verified[i]) and torch.equal(alone[i], batched[i])


@pytest.mark.slow
@pytest.mark.parametrize("gamma", [2, 5, 8])
def test_gguf_ngram_greedy_equals_target_only(gemma_gguf, gamma):
    from specgate.drafting import NgramDrafter, NoDrafter
    from specgate.engine import generate
    from specgate.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    prompt = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
              "Rewrite both functions with type hints:\n")
    baseline = generate(prompt, gemma_gguf, NoDrafter(), 0, greedy, max_new_tokens=48).tokens
    result = generate(prompt, gemma_gguf, NgramDrafter(), gamma, greedy, max_new_tokens=48)
    assert result.tokens == baseline
    assert result.stats.accepted_tokens > 0


def test_auto_picks_the_gguf_blocks_for_a_gguf_target_only():
    from specgate.models.dtypes import default_dtype, draft_dtype, resolve_weights

    assert resolve_weights("auto", "gemma-3-270m") == "gguf"
    assert resolve_weights("auto", "/models/x.gguf") == "gguf"
    assert resolve_weights("auto", "/models/hf_dir") == default_dtype()
    assert resolve_weights("int8", "/models/hf_dir") == "int8" and resolve_weights("float32", "x.gguf") == torch.float32
    assert draft_dtype("gguf") == default_dtype()
    with pytest.raises(ValueError, match="use one of auto, float32, bfloat16, gguf, int8"):
        resolve_weights("int4", "x.gguf")


def test_a_forward_longer_than_the_c_paths_runs_in_chunks_equal_to_decode_steps(tiny_model_dir, monkeypatch):
    """A prefill past QUANT_MAX_ROWS runs as column chunks through the C stack (CausalLM._chunked_forward): every
    state, K/V entry and logit equals what one-token decode steps give, bit for bit, in a ragged batch, whether the
    call asks for the cache only, the hidden states, every position's logits or the last token's."""
    from specgate.models import load_model
    from specgate.models.native import DecodeStack

    loaded = load_model(str(tiny_model_dir("gemma3")), dtype="int8")
    model = loaded.model
    assert model.quantized and model.native_stack() is not None
    monkeypatch.setattr(native, "QUANT_MAX_ROWS", 8)  # a 2 x 21 forward is now past the C paths' limit
    seen: list[int] = []
    run = DecodeStack.run
    monkeypatch.setattr(DecodeStack, "run", lambda self, x, *a: (seen.append(x.shape[0]), run(self, x, *a))[1])
    lengths = (21, 13)
    ids = torch.randint(0, 512, (2, 21), generator=torch.Generator().manual_seed(3))
    positions = torch.stack([torch.where(torch.arange(21) < n, torch.arange(21), -1) for n in lengths])  # [2, 21]
    valid = positions >= 0
    slots = torch.tensor([0, 1])
    with torch.inference_mode():
        step_cache = model.new_cache(2, 32)
        step_logits, step_hidden = torch.zeros(2, 21, 512), torch.zeros(2, 21, model.args.hidden_size)
        for row, n in enumerate(lengths):
            for t in range(n):
                scores, hidden = model(ids[row : row + 1, t : t + 1], torch.tensor([[t]]), step_cache,
                                       slots[row : row + 1], return_hidden=True)
                step_logits[row, t], step_hidden[row, t] = scores[0, 0], hidden[0, 0]
        seen.clear()
        cache = model.new_cache(2, 32)
        hidden = model(ids, positions, cache, slots, logits=False, return_hidden=True)
        assert seen and max(seen) <= 8 and sum(seen) == sum(lengths)  # chunks of <= 8 real tokens, each token once
        assert torch.equal(hidden[valid], step_hidden[valid])
        for layer in range(len(cache.keys)):
            for row, n in enumerate(lengths):
                assert torch.equal(cache.keys[layer][row, :, :n], step_cache.keys[layer][row, :, :n])
                assert torch.equal(cache.values[layer][row, :, :n], step_cache.values[layer][row, :, :n])
        logits, hidden = model(ids, positions, model.new_cache(2, 32), slots, return_hidden=True)
        assert torch.equal(logits[valid], step_logits[valid]) and torch.equal(hidden[valid], step_hidden[valid])
        last = model(ids, positions, model.new_cache(2, 32), slots, last_only=True)
        assert torch.equal(last, torch.stack([step_logits[row, n - 1] for row, n in enumerate(lengths)]))
