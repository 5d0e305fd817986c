"""Greedy speculative decoding on Gemma-3-270M equals target-only greedy, token for token.

Drafters: the n-gram drafter (high acceptance on prompts whose text is copied) and a model drafter that is a
tiny randomly initialised Gemma-3 (2 layers, hidden 64) carrying Gemma's own tokenizer and full 262k
vocabulary. Its drafts are rarely right, which is honest about what it is: it exercises the model-drafter path
(tokenizer check, its own KV cache, rejections and corrections) at almost no cost; acceptance is not the point.
"""

import pytest
import torch

from specgate.drafting import NgramDrafter, NoDrafter
from specgate.drafting.model_drafter import ModelDrafter
from specgate.engine import generate
from specgate.models import load_model
from specgate.sampling import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0)
NEW_TOKENS = 24
PROMPTS = {
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "prose": "The history of the printing press begins in",
    "copy": (
        "Copy the sentence exactly.\nSentence: The quick brown fox jumps over the lazy dog near the river bank.\n"
        "Copy: The quick brown fox"
    ),
}


@pytest.fixture(scope="module")
def random_gemma_draft(gemma, tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=gemma.model.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
        sliding_window=64, bos_token_id=gemma.tokenizer.bos_token_id, eos_token_id=gemma.tokenizer.eos_token_id,
        pad_token_id=gemma.tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("random_gemma_draft")
    Gemma3ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    gemma.tokenizer.save_pretrained(out)
    return load_model(str(out))


@pytest.fixture(scope="module")
def baselines(gemma):
    return {name: generate(p, gemma, NoDrafter(), 0, GREEDY, max_new_tokens=NEW_TOKENS).tokens for name, p in PROMPTS.items()}


@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_ngram_greedy_equals_target_only(gemma, baselines, prompt, gamma):
    result = generate(PROMPTS[prompt], gemma, NgramDrafter(), gamma, GREEDY, max_new_tokens=NEW_TOKENS)
    assert result.tokens == baselines[prompt]
    if prompt == "copy":
        assert result.stats.accepted_tokens > 0


@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
def test_model_drafter_greedy_equals_target_only(gemma, baselines, random_gemma_draft, gamma):
    result = generate(PROMPTS["code"], gemma, ModelDrafter(random_gemma_draft, gemma), gamma, GREEDY, max_new_tokens=NEW_TOKENS)
    assert result.tokens == baselines["code"]
    assert result.stats.draft_forward_passes == result.stats.drafted_tokens > 0
