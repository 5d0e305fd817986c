"""The runtime on the real Gemma-3-270M (the embedded default): logits and greedy decoding equal transformers'
Gemma3ForCausalLM loaded from the same safetensors cache; the tokenizer; the race-safe one-time conversion.

Tolerance (float32): max |logit diff| <= 1e-5 x the largest |logit| of the reference (GEMMA_RTOL); measured
here: 4.7e-5 on logits up to 33.6 (1.4e-6). The difference is float32 summation order: 18 layers, a 262k-wide
head and a different attention kernel (SDPA vs eager matmul-softmax).
"""

from __future__ import annotations

import threading

import pytest
import torch

from specgate.models import cache_root, load_model
from specgate.models import loading

GEMMA_RTOL = 1e-5
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(gemma):
    from transformers import Gemma3ForCausalLM

    return Gemma3ForCausalLM.from_pretrained(gemma.path, attn_implementation="eager", dtype=torch.float32).eval()


def test_gemma_is_cached_as_safetensors(gemma):
    assert gemma.name == "gemma-3-270m" and gemma.path == cache_root() / "gemma-3-270m"
    assert (gemma.path / "config.json").is_file() and (gemma.path / "model.safetensors").is_file()
    model = gemma.model
    assert model.vocab_size == 262144 and model.args.num_layers == 18 and model.args.model_type == "gemma3_text"
    assert model.lm_head.weight is model.embed_tokens.weight  # tied head, one copy in memory
    assert model.args.layer_windows.count(None) == 3 and set(model.args.layer_windows) == {None, 512}


def test_gemma_tokenizer_prepends_bos_and_round_trips(gemma):
    tokenizer = gemma.tokenizer
    ids = tokenizer(PROMPT).input_ids
    assert ids[0] == tokenizer.bos_token_id == 2 and tokenizer.eos_token_id not in ids
    assert tokenizer(PROMPT, add_special_tokens=False).input_ids == ids[1:]
    assert tokenizer.decode(ids, skip_special_tokens=True) == PROMPT


def test_gemma_logits_match_transformers(gemma, reference):
    ids = torch.tensor([gemma.tokenizer(PROMPT).input_ids])  # [1, T]
    with torch.no_grad():
        expected = reference(ids).logits.float()  # [1, T, V]
    positions = torch.arange(ids.shape[1])[None]  # [1, T]
    logits = gemma.model(ids, positions, gemma.model.new_cache(1, 64), torch.tensor([0]))
    diff = (logits - expected).abs().max().item()
    assert diff <= GEMMA_RTOL * expected.abs().max().item(), f"max |diff| {diff:.3g}"
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_gemma_greedy_decoding_matches_transformers(gemma, reference):
    ids = torch.tensor([gemma.tokenizer(PROMPT).input_ids])  # [1, T]
    steps = 16
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=steps, do_sample=False)[0, ids.shape[1] :].tolist()
    model, length = gemma.model, ids.shape[1]
    cache, slots = model.new_cache(1, length + steps), torch.tensor([0])
    logits = model(ids, torch.arange(length)[None], cache, slots, last_only=True)  # [1, V]
    generated = []
    for position in range(length, length + steps):
        generated.append(int(logits.argmax(-1)))
        logits = model(torch.tensor([[generated[-1]]]), torch.tensor([[position]]), cache, slots, last_only=True)
    assert generated == expected


def test_conversion_runs_once_when_processes_race(tmp_path, monkeypatch):
    """Two concurrent first uses: one converts (into a temp dir, renamed into place), the other waits and reuses."""
    monkeypatch.setenv("SPECGATE_CACHE", str(tmp_path))
    conversions = []

    def convert(work_dir):  # the real lock, temp dir and rename; a stand-in for the minute of de-quantisation
        conversions.append(work_dir)
        threading.Event().wait(0.3)
        (work_dir / "config.json").write_text("{}")

    monkeypatch.setattr(loading, "_write_default_model", convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(loading.ensure_default_model())) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    target = tmp_path / "models" / "gemma-3-270m"
    assert len(conversions) == 1 and results == [target] * 2 and (target / "config.json").is_file()
    assert [p.name for p in (tmp_path / "models").iterdir() if ".tmp-" in p.name] == []  # the temp dir was renamed
