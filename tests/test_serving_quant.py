"""Serving in a quantized dtype (issue 31): `serve --dtype int8|gguf|auto` loads the target as `generate` does, and
the batched scheduler over QuantLinear weights keeps greedy speculation token-identical to target-only decoding.

A tiny random Llama quantized to Q8_0 on load (--dtype int8) stands in for a GGUF: it runs the same quantized
kernels (models/csrc/quant.c) and the same QuantLinear / QuantFusedLinears paths.
"""


import httpx
import pytest
import torch

from specgate.drafting import NoDrafter
from specgate.engine import generate
from specgate.sampling import SamplingParams
from specgate.serving import FixedPolicy, Request, Scheduler
from specgate.serving.server import ServerConfig, build_engine, start_server

GREEDY = SamplingParams(temperature=0.0)
PROMPT = "def generate(prompt, max_new_tokens=16):\n    tokens = tokenize(prompt)\n    for step in range(max_new_tokens):"

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def tiny_path(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def quantized(tiny_path):
    from specgate.models import load_model

    model = load_model(tiny_path, dtype="int8")
    if not model.model.quantized:
        pytest.skip("the quantized kernels did not build here")
    return model


def test_served_int8_request_equals_generate_target_only(tiny_path, quantized):
    handle = start_server(ServerConfig(target=tiny_path, draft="ngram", port=0, policy="fixed", gamma=4, max_num_seqs=2,
                                       max_seq_len=256, dtype="int8"))
    try:
        assert handle.engine.scheduler.target.model.quantized, "the served target must hold QuantLinear weights"
        body = {"model": handle.engine.model_name, "prompt": PROMPT, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
        reply = httpx.post(handle.url + "/v1/completions", json=body, timeout=120).json()
    finally:
        handle.stop()
    alone = generate(PROMPT, quantized, NoDrafter(), 0, GREEDY, max_new_tokens=24, eos_ids=set())
    assert reply["choices"][0]["text"] == alone.text and reply["usage"]["completion_tokens"] == 24


def test_batched_speculation_in_int8_equals_target_only_for_concurrent_requests(quantized):
    """3 requests decoded together with n-gram drafts (fixed gamma 4) over QuantLinear weights: each request's
    tokens equal its own target-only decoding, token for token (batch invariance end to end)."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.cat([torch.tensor([1]), torch.randint(4, 512, (3 + i,), generator=generator).repeat(3)]) for i in range(3)]
    budgets = [20, 14, 26]
    scheduler = Scheduler(quantized, "ngram", FixedPolicy(4), num_slots=3, max_seq_len=128)
    requests = [scheduler.submit(Request(p, GREEDY, max_tokens=m, ignore_eos=True, seed=i)) for i, (p, m) in enumerate(zip(prompts, budgets))]
    scheduler.run_until_idle()
    for request, prompt, budget in zip(requests, prompts, budgets):
        assert request.tokens == generate(prompt, quantized, NoDrafter(), 0, GREEDY, max_new_tokens=budget, eos_ids=set()).tokens
    assert max(len(r.stats.gammas) for r in requests) > 0 and sum(r.stats.drafted_tokens for r in requests) > 0


def test_serve_dtype_resolves_like_generate(tiny_path):
    from specgate.models.dtypes import resolve_weights, weights_name

    config = ServerConfig(target=tiny_path, draft="none", policy="off", dtype="int8")
    config.validate()
    assert build_engine(config).scheduler.target.model.quantized
    assert weights_name(resolve_weights("auto", tiny_path)) in ("float32", "bfloat16")  # an HF directory: not quantized
    for bad in ("float16", "q4"):
        with pytest.raises(ValueError, match="use one of auto, float32, bfloat16, gguf, int8"):
            ServerConfig(target=tiny_path, dtype=bad).validate()


def test_gate_resolves_auto_to_the_served_weights(tiny_path):
    from specgate.gate.runner import resolve_dtype

    assert resolve_dtype("int8", tiny_path) == "int8" and resolve_dtype("auto", tiny_path) in ("float32", "bfloat16")
    from specgate.models import native

    if native.available():
        assert resolve_dtype("auto", "/models/x.gguf") == "gguf"
