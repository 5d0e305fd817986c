"""Smoke test: Gemma-3-270M behind the real server (n-gram drafts, fixed gamma), via the openai client.

Greedy output through the server equals target-only greedy decoding (engine.generate, no drafter).
"""

import openai
import pytest

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
