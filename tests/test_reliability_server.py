"""Faults and bad input against the real server on loopback (a tiny random Llama, real HTTP, no mocks).

Timing: nothing here races the host's speed. A request that must still be running when the test acts is held
mid-step by a StepGate (conftest) until the test has acted; timeouts run on a scheduler clock that advances
with the steps, not with the wall clock.

Covered here: OpenAI-style error objects for every refusal (400/401/404/413/422/429/503 with Retry-After where
it applies), a client that disconnects (streamed or not) frees its request and KV slot at the next step,
per-request timeouts (504, or an error event in a stream), NaN logits in one request fail it alone while a
concurrent request is served, and SIGTERM on `specgate serve` drains: the in-flight stream completes, new
requests are refused, the process exits 0. NaN logits are injected by wrapping the real model's forward for
one request's cache slot (fault injection around the real model; nothing under test is mocked).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from specgate.drafting import NoDrafter
from specgate.engine import generate
from specgate.models import load_model
from specgate.sampling import SamplingParams
from specgate.serving.server import ServerConfig, start_server

from conftest import StepGate, has_text, read_json_object

PROMPT = "def generate(prompt, max_new_tokens=16):\n    tokens = tokenize(prompt)\n    for step in range(max_new_tokens):"
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def tiny_path(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def server(tiny_path):
    target = load_model(tiny_path)
    target.tokenizer.chat_template = (  # this in-memory copy only; refuses a conversation that does not start with a user
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must come from the user') }}{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    handle = start_server(ServerConfig(
        target=target, draft="ngram", port=0, policy="fixed", gamma=3, max_num_seqs=2, max_waiting=4, max_seq_len=1024,
        max_body_bytes=16_384, api_key="k3y",
    ))
    yield handle
    handle.stop()


AUTH = {"Authorization": "Bearer k3y"}


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, headers={**AUTH, **kwargs.pop("headers", {})}, timeout=60, **kwargs)


def gauge(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f"specgate:{name}{{") or line.startswith(f"specgate:{name} "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def counter(url: str, reason: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("specgate:request_success_total{") and f'finished_reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["message"], error
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def test_every_refusal_is_an_openai_error_object(server):
    for body, status, param, code in [
        ({"prompt": "x", "n": 3}, 400, "n", None),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
        ({"prompt": "x", "max_tokens": 2000}, 400, "max_tokens", "context_length_exceeded"),
        ({"prompt": "x " * 1200}, 400, "prompt", "context_length_exceeded"),  # tokenized: 2401 tokens > 1023
        ({"prompt": "a" * 15000}, 400, "prompt", "context_length_exceeded"),  # refused by length before tokenizing
        ({"prompt": "x", "stop": ["a"] * 17}, 400, "stop", None),
        ({"prompt": "x", "stop": "s" * 300}, 400, "stop", None),
        ({"prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias", "unsupported_parameter"),
        ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty", "unsupported_parameter"),
        ({"prompt": "x", "draft": "/tmp/other-model"}, 400, "draft", "unsupported_parameter"),
        ({"prompt": "x", "trust_remote_code": True}, 400, "trust_remote_code", "unsupported_parameter"),
        ({"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
        ({"prompt": {"text": "x"}}, 400, None, None),
        ({"prompt": "x", "model": "/models/another"}, 404, "model", "model_not_found"),
    ]:
        assert_error(post(server, "/v1/completions", json=body), status, param, code)
    assert "characters" in assert_error(post(server, "/v1/completions", json={"prompt": "a" * 15000}), 400)["message"]
    # ignored: unknown fields that change nothing, and the no-op values of unsupported ones
    ok = post(server, "/v1/completions", json={"prompt": "x", "max_tokens": 2, "user": "me", "presence_penalty": 0, "logit_bias": {}})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2
    raw = {"content-type": "application/json"}
    assert_error(post(server, "/v1/completions", content=b"{\"prompt\": ", headers=raw), 400)
    assert_error(post(server, "/v1/completions", content=b"{\"prompt\": \"caf\xe9\"}", headers=raw), 400)  # Latin-1, not UTF-8
    assert_error(post(server, "/v1/completions", content=b"{\"prompt\": \"\\ud800x\"}", headers=raw), 400, "prompt")  # lone surrogate
    assert_error(post(server, "/v1/completions", content=b"", headers=raw), 400)
    for not_an_object in (b"[1, 2]", b"\"hello\"", b"42"):
        assert_error(post(server, "/v1/completions", content=not_an_object, headers=raw), 422)
    assert_error(post(server, "/v1/chat/completions", json={"messages": [{"role": "assistant", "content": "hi"}]}), 422, "messages")
    assert_error(post(server, "/v1/chat/completions", json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400, "messages")
    assert_error(post(server, "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}), 400, "max_tokens")
    chat = post(server, "/v1/chat/completions", json={"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    assert_error(httpx.post(server.url + "/v1/completions", json={"prompt": "x"}), 401, code="invalid_api_key")
    assert_error(httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer k3y-"}), 401)
    assert_error(httpx.get(server.url + "/v1/nothing", headers=AUTH), 404)


def test_body_size_limit_is_413(server):
    big = json.dumps({"prompt": "word " * 5000}).encode()  # 25 kB > max_body_bytes 16384
    assert_error(post(server, "/v1/completions", content=big, headers={"content-type": "application/json"}), 413, code="request_too_large")

    def chunked():  # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b" " * 1024

    assert_error(post(server, "/v1/completions", content=chunked(), headers={"content-type": "application/json"}), 413)
    assert post(server, "/v1/completions", json={"prompt": "small", "max_tokens": 1}).status_code == 200


def test_queue_full_is_429_and_draining_is_503_both_with_retry_after(tiny_path):
    handle = start_server(ServerConfig(target=tiny_path, draft="none", port=0, policy="off", max_num_seqs=1, max_waiting=0))
    try:
        body = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
        with StepGate(handle.engine.scheduler, has_text) as gate, httpx.stream("POST", handle.url + "/v1/completions", json=body, timeout=60) as first:
            lines = first.iter_lines()  # one iterator throughout: closing it would close the stream
            next(line for line in lines if line.startswith("data: {"))
            assert gate.held.wait(60)  # held mid-step: it keeps the only slot while the test fills the queue
            full = httpx.post(handle.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert_error(full, 429, code="queue_full")
            assert full.headers["retry-after"] == "1"
            handle.engine.scheduler.drain()
            draining = httpx.post(handle.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert_error(draining, 503, code="server_draining")
            assert int(draining.headers["retry-after"]) > 0
            assert httpx.get(handle.url + "/health").status_code == 503
            gate.open()
            lines = [line for line in lines if line]  # the running request still completes
        assert lines[-1] == "data: [DONE]" and '"finish_reason": "length"' in lines[-2]
    finally:
        handle.stop()


def test_disconnect_frees_the_request_and_its_slot_at_the_next_step(server):
    """The request is held mid-step (StepGate) from its first text until the API asks for the cancel, so the
    client leaves while it runs however fast the host decodes, and a non-streamed answer can never arrive first."""
    scheduler = server.engine.scheduler
    cancels: list[int] = []
    real_cancel = scheduler.cancel
    gates: list[StepGate] = []

    def recording_cancel(request_id: str) -> None:  # records the step at which the API asked for the cancel
        cancels.append(scheduler.steps)
        real_cancel(request_id)
        gates[-1].open()

    scheduler.cancel = recording_cancel
    try:
        for stream in (True, False):
            before, cancels[:] = counter(server.url, "cancelled"), []
            body = {"prompt": PROMPT, "max_tokens": 1000 - 40, "ignore_eos": True, "stream": stream}
            with StepGate(scheduler, has_text) as gate:
                gates.append(gate)
                if stream:
                    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as raw:
                        next(line for line in raw.iter_lines() if line.startswith("data: {"))
                else:  # the client gives up waiting for a long non-streamed answer (held: it cannot come first)
                    with pytest.raises(httpx.ReadTimeout):
                        httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(60, read=0.5))
                wait_for(lambda: counter(server.url, "cancelled") == before + 1)  # cancelled: it was still running
            assert len(cancels) == 1 and scheduler.steps - cancels[0] <= 1, (cancels, scheduler.steps)
            assert gauge(server.url, "kv_slots_in_use") == 0 and gauge(server.url, "num_requests_running") == 0
    finally:
        scheduler.cancel = real_cancel


class StepClock:
    """A scheduler clock on which every step takes step_s: a request's timeout falls after a set number of steps,
    whatever the host's speed (0.3 s at 0.125 s a step: it expires at the start of its 4th step; 3 steps pass)."""

    def __init__(self, scheduler, step_s: float) -> None:
        self.scheduler, self.step_s = scheduler, step_s

    def __call__(self) -> float:
        return self.scheduler.steps * self.step_s


def test_request_timeout_is_504_or_a_stream_error_and_frees_the_slot(tiny_path):
    handle = start_server(ServerConfig(target=tiny_path, draft="ngram", port=0, policy="fixed", gamma=2, request_timeout_s=0.3))
    handle.engine.scheduler.clock = StepClock(handle.engine.scheduler, 0.125)  # set before any request arrives
    try:
        body = {"prompt": PROMPT, "max_tokens": 950, "ignore_eos": True}
        error = assert_error(httpx.post(handle.url + "/v1/completions", json=body, timeout=60), 504, code="request_timeout")
        assert "0.3 s" in error["message"]
        tokens = int(error["message"].split(" after ")[1].split(" tokens")[0])
        assert 3 <= tokens <= 9  # 3 decode steps of 1..3 tokens (gamma 2), far short of 950
        with httpx.stream("POST", handle.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as raw:
            lines = [line for line in raw.iter_lines() if line]
        assert raw.status_code == 200 and lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "request_timeout"
        assert counter(handle.url, "timeout") == 2 and gauge(handle.url, "kv_slots_in_use") == 0
        short = httpx.post(handle.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert short.status_code == 200  # a request that fits in the time limit is served
    finally:
        handle.stop()


def test_nan_logits_fail_one_request_while_a_concurrent_one_is_served(tiny_path):
    target = load_model(tiny_path)
    handle = start_server(ServerConfig(target=target, draft="ngram", port=0, policy="fixed", gamma=2, max_num_seqs=2))
    scheduler, poisoned_prompt = handle.engine.scheduler, "poison " * 4
    poisoned_ids = target.tokenizer(poisoned_prompt)["input_ids"]
    real_forward = target.model.forward

    def forward(input_ids, positions, cache, slots, **kwargs):  # NaN in the rows of the request with the poisoned prompt
        logits = real_forward(input_ids, positions, cache, slots, **kwargs)
        if logits is None:  # a prefill chunk (logits=False): the other request joined after the poisoned one's 3rd token
            return logits
        for request in list(scheduler.running):
            if request.prompt_ids.tolist() == poisoned_ids and len(request.tokens) >= 3:
                logits[(slots == request.slot).nonzero().flatten()] = float("nan")
        return logits

    target.model.forward = forward
    try:
        results: dict[str, httpx.Response] = {}
        good_body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
        bad_body = {"prompt": poisoned_prompt, "max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
        threads = [threading.Thread(target=lambda k=k, b=b: results.__setitem__(k, httpx.post(handle.url + "/v1/completions", json=b, timeout=60)))
                   for k, b in (("good", good_body), ("bad", bad_body))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        error = assert_error(results["bad"], 500, code="engine_error")
        assert "finite" in error["message"].lower() or "nan" in error["message"].lower(), error
        target.model.forward = real_forward
        alone = generate(PROMPT, target, NoDrafter(), 0, SamplingParams(temperature=0.0), max_new_tokens=40, eos_ids=set())
        assert results["good"].status_code == 200 and results["good"].json()["choices"][0]["text"] == alone.text
        assert counter(handle.url, "error") == 1 and gauge(handle.url, "kv_slots_in_use") == 0
    finally:
        target.model.forward = real_forward
        handle.stop()


CLOSED = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)  # refused, or queued and reset as the socket closed


def refusing(url: str) -> bool:
    """The server has taken a SIGTERM: /health says it is draining, or its socket is closed (a connection the
    kernel queued just before the listening socket closed is reset unanswered: the same refusal, seen later)."""
    try:
        return httpx.get(url + "/health", timeout=10).status_code == 503
    except CLOSED:
        return True


def test_sigterm_drains_the_in_flight_stream_refuses_new_requests_and_exits_0(tiny_path):
    args = [sys.executable, "-m", "specgate", "serve", "--target", tiny_path, "--draft", "ngram", "--port", "0", "--policy", "fixed", "--json"]
    env = {**os.environ, "SPECGATE_API_KEY": "t0ken"}  # the key from the environment, not the command line
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    key = {"Authorization": "Bearer t0ken"}
    try:
        info = read_json_object(proc)  # the --json object, printed once listening
        url = info["url"]
        assert info["host"] == "127.0.0.1"  # loopback unless --host says otherwise
        assert_error(httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=10), 401, code="invalid_api_key")
        body = {"prompt": PROMPT, "max_tokens": 700, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=key, timeout=120) as raw:
            lines = iter(raw.iter_lines())
            first = next(line for line in lines if line.startswith("data: {"))
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: refusing(url))  # the signal was handled (not: a pause long enough on this host)
            try:  # a new request after SIGTERM: 503 while the socket is still open, or refused once it is closed
                late = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=key, timeout=10)
                assert_error(late, 503, code="server_draining")
            except CLOSED:
                pass
            rest = [first, *(line for line in lines if line)]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 700  # it ran to the end
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
        with pytest.raises(httpx.ConnectError):
            httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_defaults_bind_loopback_and_checkpoint_code_is_never_executed(tiny_path, tmp_path):
    """Security defaults: loopback bind; a checkpoint whose config / tokenizer point at bundled Python code
    (auto_map, what trust_remote_code=True would import) loads with the built-in classes or is refused, and its
    code never runs."""
    import shutil

    from specgate.serving.server import ServerConfig as Config

    assert Config(target="x").host == "127.0.0.1"
    evil = tmp_path / "evil-model"
    shutil.copytree(tiny_path, evil)
    marker = tmp_path / "remote-code-ran"
    (evil / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nclass EvilConfig: pass\nclass EvilModel: pass\nclass EvilTokenizer: pass\n")
    for name, auto_map in (("config.json", {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}),
                           ("tokenizer_config.json", {"AutoTokenizer": ["evil.EvilTokenizer", None]})):
        data = json.loads((evil / name).read_text())
        data["auto_map"] = auto_map
        (evil / name).write_text(json.dumps(data))
    try:
        loaded = load_model(str(evil))
        assert type(loaded.model).__module__.startswith("specgate.")
    except (ValueError, FileNotFoundError) as exc:  # refused: fine, as long as it says so and runs nothing
        assert str(exc)
    assert not marker.exists(), "the checkpoint's bundled code was executed"


def test_a_stopped_engine_answers_waiting_clients_instead_of_leaving_them_hanging(tiny_path):
    handle = start_server(ServerConfig(target=tiny_path, draft="none", port=0, policy="off", max_num_seqs=1))
    try:
        body = {"prompt": PROMPT, "max_tokens": 950, "ignore_eos": True}
        outcome: dict[str, httpx.Response] = {}
        waiter = threading.Thread(target=lambda: outcome.__setitem__("plain", httpx.post(handle.url + "/v1/completions", json=body, timeout=60)))
        scheduler = handle.engine.scheduler
        with StepGate(scheduler, has_text) as gate, httpx.stream("POST", handle.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as raw:
            lines = raw.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            assert gate.held.wait(60)  # the stream is held mid-step: it cannot finish before the engine stops
            waiter.start()  # queued behind the stream (one slot)
            wait_for(lambda: len(scheduler.waiting) == 1)
            scheduler.stop(timeout_s=0)  # the loop ends after the held step; nothing will ever finish these requests
            gate.open()
            scheduler.thread.join(30)
            assert not scheduler.thread.is_alive()
            rest = [line for line in lines if line]
        waiter.join(30)
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == "engine_unavailable"
        assert_error(outcome["plain"], 503, code="engine_unavailable")
        assert_error(httpx.post(handle.url + "/v1/completions", json=body, timeout=10), 503, code="engine_unavailable")
    finally:
        handle.stop()
