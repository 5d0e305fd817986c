"""The real server on loopback, driven by the official `openai` client (and httpx for raw HTTP): no mocks.

A tiny random Llama (tests/conftest.py) is served with the n-gram drafter. The metric-delta test replays the
same greedy request through an in-process Scheduler and requires the /metrics counters to move by exactly
that request's drafted / accepted / per-position counts.
"""

import threading
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from specgate.models import load_model
from specgate.sampling import SamplingParams
from specgate.serving import FixedPolicy, Request, Scheduler
from specgate.serving.policy import calibration_tokens
from specgate.serving.server import ServerConfig, start_server

from conftest import StepGate, has_text, read_json_object

PROMPT = "def generate(prompt, max_new_tokens=16):\n    tokens = tokenize(prompt)\n    for step in range(max_new_tokens):"
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"


@pytest.fixture(scope="module")
def tiny_path(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def server(tiny_path):
    handle = start_server(ServerConfig(target=tiny_path, draft="ngram", port=0, policy="fixed", gamma=3, max_num_seqs=2, max_seq_len=1024))
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels without model_name): value}."""
    text = httpx.get(url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_completion_matches_scheduler_and_metrics_move_by_its_counts(server, client, tiny_path):
    before = scrape(server.url)
    response = client.completions.create(model=server.engine.model_name, prompt=PROMPT, max_tokens=24, temperature=0.0, extra_body={"ignore_eos": True})
    after = scrape(server.url)
    # the same request through an in-process scheduler: same text, and its counts are the metric deltas
    target = load_model(tiny_path)
    ids = target.tokenizer(PROMPT)["input_ids"]
    scheduler = Scheduler(target, "ngram", FixedPolicy(3), num_slots=1, max_seq_len=1024)
    replay = scheduler.submit(Request(torch.tensor(ids), SamplingParams(temperature=0.0), max_tokens=24, ignore_eos=True))
    scheduler.run_until_idle()
    choice = response.choices[0]
    assert choice.text == replay.text and choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(ids) and response.usage.completion_tokens == 24
    assert response.usage.total_tokens == len(ids) + 24
    stats = replay.stats
    assert stats.drafted_tokens > 0, "the prompt repeats itself: the n-gram drafter must propose"
    assert delta(after, before, "specgate:spec_decode_num_drafts_total", lossless="true") == stats.num_drafts
    assert delta(after, before, "specgate:spec_decode_num_draft_tokens_total", lossless="true") == stats.drafted_tokens
    assert delta(after, before, "specgate:spec_decode_num_accepted_tokens_total", lossless="true") == stats.accepted_tokens
    for position, count in enumerate(stats.accepted_per_position):
        name = "specgate:spec_decode_num_accepted_tokens_per_pos_total"
        assert delta(after, before, name, lossless="true", position=str(position)) == count
    assert delta(after, before, "specgate:generation_tokens_total") == 24
    assert delta(after, before, "specgate:request_success_total", finished_reason="length") == 1
    assert delta(after, before, "specgate:time_to_first_token_seconds_count") == 1
    assert delta(after, before, "specgate:e2e_request_latency_seconds_count") == 1
    assert delta(after, before, "specgate:inter_token_latency_seconds_count") == stats.steps - 1
    assert after[("specgate:kv_slots_in_use", ())] == 0 and after[("specgate:num_preemptions_total", ())] == 0


def test_concurrent_greedy_requests_equal_target_only_decoding(server, client, tiny_path):
    """Four simultaneous HTTP requests share the batch (2 slots, so some wait); each equals decoding it alone."""
    from specgate.drafting import NoDrafter
    from specgate.engine import generate

    prompts = [PROMPT, "Once upon a time there was a little robot", "The quick brown fox jumps over", "one, two, three, four,"]
    texts: dict[int, str] = {}

    def call(i: int) -> None:
        response = client.completions.create(model=server.engine.model_name, prompt=prompts[i], max_tokens=12 + 3 * i, temperature=0.0)
        texts[i] = response.choices[0].text

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    target = server.engine.scheduler.target
    for i, prompt in enumerate(prompts):
        alone = generate(prompt, target, NoDrafter(), 0, SamplingParams(temperature=0.0), max_new_tokens=12 + 3 * i)
        assert texts[i] == alone.text, prompt


def test_streaming_yields_the_same_text_then_done(server, client):
    whole = client.completions.create(model=server.engine.model_name, prompt=PROMPT, max_tokens=20, temperature=0.0, stop=["\n\n"])
    chunks = list(client.completions.create(model=server.engine.model_name, prompt=PROMPT, max_tokens=20, temperature=0.0, stop=["\n\n"], stream=True))
    assert len(chunks) >= 2 and chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    with_usage = list(client.completions.create(model=server.engine.model_name, prompt=PROMPT, max_tokens=5, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == 5
    with httpx.stream("POST", server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True}) as raw:
        lines = [line for line in raw.iter_lines() if line]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_models_health_and_openai_errors(server, client):
    assert [m.id for m in client.models.list().data] == [server.engine.model_name]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    with pytest.raises(openai.BadRequestError, match="role 'tool'"):
        client.chat.completions.create(model=server.engine.model_name, messages=[{"role": "tool", "content": "hi"}])
    cases = [
        ({"prompt": "x", "temperature": -1.0}, 400, "temperature"),
        ({"prompt": "x", "n": 2}, 400, "n"),
        ({"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": [10**9]}, 400, "prompt"),
        ({"prompt": "x", "logprobs": 2}, 400, "logprobs"),
        ({"prompt": "x", "top_p": 0.0}, 400, "top_p"),
        ({"prompt": "x", "stop": [""]}, 400, "stop"),
        ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ]
    for body, status, param in cases:
        response = httpx.post(server.url + "/v1/completions", json=body)
        assert response.status_code == status, body
        error = response.json()["error"]
        assert error["param"] == param and error["message"] and set(error) == {"message", "type", "param", "code"}
    garbage = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert garbage.status_code == 400 and "error" in garbage.json()
    missing = httpx.get(server.url + "/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def _wait_for(condition, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_disconnect_mid_stream_cancels_and_frees_the_slot(server):
    before = scrape(server.url)
    body = {"prompt": PROMPT, "max_tokens": 950, "stream": True, "ignore_eos": True, "temperature": 0.0}
    scheduler = server.engine.scheduler
    with StepGate(scheduler, has_text) as gate:  # held from its first text until the cancel: it cannot finish first
        def cancel_then_open(request_id: str) -> None:
            real_cancel(request_id)
            gate.open()

        real_cancel, scheduler.cancel = scheduler.cancel, cancel_then_open
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body) as raw:
                for line in raw.iter_lines():
                    if line.startswith("data: {"):
                        break  # one chunk received; leave
            _wait_for(lambda: delta(scrape(server.url), before, "specgate:request_success_total", finished_reason="cancelled") == 1)
        finally:
            del scheduler.cancel  # the method again
    after = scrape(server.url)
    assert after[("specgate:kv_slots_in_use", ())] == 0 and not server.engine.scheduler.running
    assert delta(after, before, "specgate:generation_tokens_total") < 950


def test_queue_full_is_429(tiny_path):
    """One slot, no waiting room: of several simultaneous long requests all but the first are refused with 429.
    The first is held at its first forward (StepGate) until the others have been answered, so it cannot finish
    and free the slot for a later one however fast the host decodes."""
    handle = start_server(ServerConfig(target=tiny_path, draft="ngram", port=0, policy="off", max_num_seqs=1, max_waiting=0))
    try:
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="x", max_retries=0, timeout=60)
        barrier, outcomes = threading.Barrier(6), []

        def call() -> None:
            barrier.wait()
            try:
                client.completions.create(model=handle.engine.model_name, prompt=PROMPT, max_tokens=600, extra_body={"ignore_eos": True})
                outcomes.append(200)
            except openai.RateLimitError as exc:
                outcomes.append(exc.status_code)

        threads = [threading.Thread(target=call) for _ in range(6)]
        with StepGate(handle.engine.scheduler, lambda scheduler: bool(scheduler.running)) as gate:
            for thread in threads:
                thread.start()
            _wait_for(lambda: len(outcomes) == 5)
            assert outcomes == [429] * 5
            gate.open()
            for thread in threads:
                thread.join()
        assert sorted(outcomes) == [200] + [429] * 5, outcomes
        assert scrape(handle.url)[("specgate:num_requests_rejected_total", ())] == outcomes.count(429)
    finally:
        handle.stop()


def test_api_key_and_chat_template(tiny_path):
    target = load_model(tiny_path)
    target.tokenizer.chat_template = CHAT_TEMPLATE  # this in-memory copy only: the served model gets a template
    handle = start_server(ServerConfig(target=target, draft="ngram", port=0, policy="fixed", gamma=2, api_key="s3cret"))
    try:
        for key in ("wrong", ""):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=handle.url + "/v1", api_key=key or "x", max_retries=0).models.list()
        assert httpx.get(handle.url + "/v1/models").status_code == 401
        unauthorised = httpx.post(handle.url + "/v1/completions", json={"prompt": 5}, headers={"Authorization": "Bearer nope"})
        assert unauthorised.status_code == 401 and unauthorised.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(handle.url + "/health").status_code == 200
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="s3cret", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "count: one, two, three"}]
        reply = client.chat.completions.create(model=target.name, messages=messages, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
        prompt = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        same = client.completions.create(model=target.name, prompt=target.tokenizer(prompt, add_special_tokens=False)["input_ids"], max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
        assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content == same.choices[0].text
        assert reply.usage.completion_tokens == 6
        streamed = list(client.chat.completions.create(model=target.name, messages=messages, max_tokens=6, temperature=0.0, stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == reply.choices[0].message.content
    finally:
        handle.stop()


CLI_SCRIPT = """
import sys
from specgate.cli import main, serve_cmds
if "serve" not in [c.name or c.callback.__name__ for c in main.app.registered_commands]:
    serve_cmds.register(main.app)  # until cli/main.py registers it
main.main(sys.argv[1:])
"""


def test_serve_command_end_to_end_with_adaptive_policy(tiny_path):
    """`specgate serve --port 0 --json` in a subprocess: calibrates, prints where it listens, answers, stops on SIGINT.
    Without --gamma the adaptive policy gets gamma_max 8, the configuration the serving benchmarks measured."""
    import signal
    import subprocess
    import sys

    args = ["serve", "--target", tiny_path, "--draft", "ngram", "--port", "0", "--policy", "adaptive", "--json"]
    proc = subprocess.Popen([sys.executable, "-c", CLI_SCRIPT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        info = read_json_object(proc)  # the --json object, printed once listening
        assert info["host"] == "127.0.0.1" and info["port"] > 0 and info["policy"]["policy"] == "adaptive"
        assert info["policy"]["gamma_max"] == 8
        assert {tuple(row[:2]) for row in info["policy"]["cost_model"]["target_ms"]} == {(b, t) for b in (1, 2, 4, 8, 16) for t in calibration_tokens(8)}
        _wait_for(lambda: _healthy(info["url"]))
        client = openai.OpenAI(base_url=info["url"] + "/v1", api_key="x", max_retries=0, timeout=60)
        response = client.completions.create(model=info["model"], prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True})
        assert response.usage.completion_tokens == 8
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_gamma_defaults_per_policy_and_bad_gamma_named():
    """--gamma left out: fixed 4, adaptive gamma_max 8; given, it is used as is; out of range, refused by name."""
    assert ServerConfig(target="t", policy="fixed").resolved_gamma() == 4
    assert ServerConfig(target="t", policy="adaptive").resolved_gamma() == 8
    assert ServerConfig(target="t", policy="adaptive", gamma=3).resolved_gamma() == 3
    assert ServerConfig(target="t", policy="fixed", gamma=0).resolved_gamma() == 0
    for bad in (-1, 65, 2.5):
        with pytest.raises(ValueError, match=f"--gamma {bad!r} is out of range"):
            ServerConfig(target="t", policy="fixed", gamma=bad).validate()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health").status_code == 200
    except httpx.TransportError:
        return False


def test_chat_without_a_template_takes_the_plain_turn_format(server, client):
    """A model without a chat template (a base model) answers chat in specgate.chat's plain format, tokenized as
    a completion's prompt: the same tokens, hence the same greedy reply, as /v1/completions of the rendered text
    (what the gate's clients send every engine)."""
    from specgate import chat

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    reply = client.chat.completions.create(model=server.engine.model_name, messages=messages, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
    text = chat.render_plain(messages)
    assert text == "System: Be brief.\n\nUser: Name a colour.\n\nAssistant:"
    completion = client.completions.create(model=server.engine.model_name, prompt=text, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == completion.choices[0].text
    assert reply.usage.prompt_tokens == completion.usage.prompt_tokens

