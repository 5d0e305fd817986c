"""Fuzzing the HTTP API with hypothesis against the real server on loopback (tiny random Llama, real HTTP).

Request bodies are drawn from random JSON: the known fields with values of every JSON type (including huge
integers, NaN / Infinity, which Python's JSON parser accepts, lone surrogates, nested objects), unknown
fields, and raw bytes that are not JSON or not UTF-8. Whatever comes in, the server must answer with no 5xx:
either a valid result (a completion / chat completion, or an SSE stream ending in [DONE]) or a 4xx carrying an
OpenAI-style error object {"error": {"message", "type", "param", "code"}}. The server's context is small
(max_seq_len 48), so every request that is valid finishes in a few milliseconds.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from specgate.models import load_model
from specgate.serving.server import ServerConfig, start_server

# SPECGATE_FUZZ_EXAMPLES=2000 runs a longer, randomised hunt; the default is a fixed, quick set of examples.
LONG_RUN = os.environ.get("SPECGATE_FUZZ_EXAMPLES")
FUZZ = settings(
    max_examples=int(LONG_RUN or 80), deadline=None, derandomize=not LONG_RUN,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
ERROR_KEYS = {"message", "type", "param", "code"}

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 2), st.text(max_size=12), st.just("\ud800"),
)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
SAMPLING_FIELDS = {
    "model": st.one_of(st.just("tiny"), json_values),
    "max_tokens": st.one_of(st.integers(-2, 60), json_values),
    "temperature": st.one_of(st.floats(0, 2), st.just(1e-30), json_values),
    "top_p": st.one_of(st.floats(0, 1), json_values),
    "top_k": st.one_of(st.integers(-3, 600), st.integers(2**40, 2**80), json_values),
    "seed": st.one_of(st.integers(-(2**80), 2**80), json_values),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=3), max_size=20), json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "n": st.one_of(st.integers(0, 3), json_values),
    "ignore_eos": st.one_of(st.booleans(), json_values),
    "logprobs": json_values, "echo": json_values, "best_of": json_values,
    "logit_bias": json_values, "presence_penalty": json_values, "draft": json_values, "user": json_values,
}
PROMPTS = st.one_of(st.text(max_size=40), st.lists(st.integers(-3, 600), max_size=30), st.lists(st.text(max_size=10), max_size=3), json_values)
MESSAGES = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool"]) | json_values,
                                    "content": st.text(max_size=30) | st.lists(st.fixed_dictionaries({"type": st.just("text") | json_values, "text": st.text(max_size=8) | json_values}), max_size=2) | json_values}), max_size=3),
    json_values,
)


def body(core: dict) -> st.SearchStrategy:
    optional = {name: strategy for name, strategy in SAMPLING_FIELDS.items()}
    return st.fixed_dictionaries(core, optional=optional)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    target = load_model(str(tiny_model_dir("llama")))
    target.tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    handle = start_server(ServerConfig(target=target, draft="ngram", port=0, policy="fixed", gamma=2, max_num_seqs=4, max_seq_len=48, served_model_name="tiny"))
    with httpx.Client(base_url=handle.url, timeout=60) as client:
        yield client
    handle.stop()


def check_response(response: httpx.Response, chat: bool) -> None:
    event(f"HTTP {response.status_code}")  # pytest --hypothesis-show-statistics shows the mix of outcomes
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code != 200:
        assert response.status_code in (400, 404, 413, 422, 429), response.status_code
        error = response.json()["error"]
        assert set(error) == ERROR_KEYS and isinstance(error["message"], str) and error["message"]
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in response.text.splitlines() if line]
        assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
        for line in lines[:-1]:
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
        return
    result = response.json()
    assert result["object"] == ("chat.completion" if chat else "text_completion")
    choice = result["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    assert isinstance(text, str) and choice["finish_reason"] in ("stop", "length")
    usage = result["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] and usage["prompt_tokens"] >= 1


def send(client: httpx.Client, path: str, payload) -> httpx.Response:
    raw = json.dumps(payload, allow_nan=True).encode()  # NaN / Infinity literals and \\ud800 escapes included
    return client.post(path, content=raw, headers={"content-type": "application/json"})


@FUZZ
@given(body({"prompt": PROMPTS}))
def test_completions_never_5xx(server, payload):
    check_response(send(server, "/v1/completions", payload), chat=False)


@FUZZ
@given(body({"messages": MESSAGES}))
def test_chat_completions_never_5xx(server, payload):
    check_response(send(server, "/v1/chat/completions", payload), chat=True)


@FUZZ
@given(json_values | st.dictionaries(st.text(max_size=8), json_values, max_size=5))
def test_arbitrary_json_never_5xx(server, payload):
    for path in ("/v1/completions", "/v1/chat/completions"):
        check_response(send(server, path, payload), chat=path.endswith("chat/completions"))


@FUZZ
@given(st.binary(max_size=64), st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]))
def test_raw_bytes_never_5xx(server, raw, content_type):
    headers = {"content-type": content_type} if content_type else {}
    response = server.post("/v1/completions", content=raw, headers=headers)
    event(f"HTTP {response.status_code}")
    assert 400 <= response.status_code < 500 and set(response.json()["error"]) == ERROR_KEYS, (response.status_code, response.text)
