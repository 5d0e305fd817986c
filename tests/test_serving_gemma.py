"""Smoke test: Gemma-3-270M behind the real server (n-gram drafts, fixed gamma), via the openai client.

Greedy output through the server equals target-only greedy decoding (engine.generate, no drafter), with n-gram
drafts and with `--draft default` (lookups and the EAGLE head in one batch).
"""

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from test_eagle_drafting import count_draft_kinds

from specgate.drafting import NoDrafter
from specgate.engine import generate
from specgate.sampling import SamplingParams
from specgate.serving.server import ServerConfig, start_server

pytestmark = pytest.mark.slow

PROMPT = "Copy the list exactly.\nList: apple, banana, cherry, damson, elderberry.\nCopy: apple, banana,"


def test_gemma_server_greedy_equals_target_only(gemma):
    handle = start_server(ServerConfig(target=gemma, draft="ngram", port=0, policy="fixed", gamma=4, max_num_seqs=2, max_seq_len=128))
    try:
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="x", max_retries=0, timeout=120)
        response = client.completions.create(model="gemma-3-270m", prompt=PROMPT, max_tokens=16, temperature=0.0)
        reference = generate(PROMPT, gemma, NoDrafter(), 0, SamplingParams(temperature=0.0), max_new_tokens=16)
        assert response.choices[0].text == reference.text
        assert response.usage.completion_tokens == len(reference.tokens)
        streamed = client.completions.create(model="gemma-3-270m", prompt=PROMPT, max_tokens=16, temperature=0.0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == reference.text
        metrics = handle.engine.metrics.render().decode()
        assert 'specgate:spec_decode_num_draft_tokens_total{lossless="true",model_name="gemma-3-270m"}' in metrics
    finally:
        handle.stop()


def test_gemma_server_with_the_default_draft_batches_lookups_and_the_head_exactly(gemma):
    """Two requests at once through `--draft default`: one copies its prompt (lookups), one is free prose (the head
    drafts); both equal target-only greedy, and the head's chains and the lookups both drafted."""
    handle = start_server(ServerConfig(target=gemma, draft="default", port=0, policy="fixed", gamma=4, max_num_seqs=2, max_seq_len=160))
    kinds = count_draft_kinds(handle.engine.scheduler.model_drafter)
    prompts = [PROMPT, "The old lighthouse keeper climbed the stairs every evening, and"]
    try:
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="x", max_retries=0, timeout=120)

        def complete(prompt: str) -> str:
            return client.completions.create(model="gemma-3-270m", prompt=prompt, max_tokens=24, temperature=0.0).choices[0].text

        with ThreadPoolExecutor(2) as pool:
            texts = list(pool.map(complete, prompts))
        for prompt, text in zip(prompts, texts):
            assert text == generate(prompt, gemma, NoDrafter(), 0, SamplingParams(temperature=0.0), max_new_tokens=24).text
        assert kinds["head"] > 0 and kinds["lookup"] > 0, kinds
    finally:
        handle.stop()
