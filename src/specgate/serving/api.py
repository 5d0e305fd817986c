"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health, Prometheus metrics.

Handlers never touch the models: they validate, tokenize, `Scheduler.submit` a Request whose sink hands the
model thread's events to the handler's asyncio queue, and await. A client that disconnects (mid-stream, or
while waiting for a non-streamed answer) has its request cancelled; the scheduler frees its slot at the next
step. /health and /metrics stay open when an API key is set (as in vLLM); /v1/* need it.

Every error is an OpenAI-style JSON object, {"error": {"message", "type", "param", "code"}}, never a
traceback, and no input gives a 500 (500 means the engine itself failed on a request, e.g. non-finite logits):
  400  malformed body (not JSON, not UTF-8, unpaired surrogates), wrong types (body validation, like OpenAI),
       bad values, unsupported options (n != 1, logprobs, fields such as logit_bias or penalties whose meaning
       this server does not implement: ignoring them would silently change the output), fields that try to
       pick a model, draft or file (they are fixed when the server starts), too many or too long stop
       strings, a prompt or prompt + max_tokens past the context (code context_length_exceeded);
  401  missing or wrong API key (compared in constant time);
  404  unknown route, or a model other than the served one;
  413  a body larger than max_body_bytes (Content-Length or streamed);
  422  well-formed JSON that cannot be processed: a body that is not a JSON object, a conversation the chat
       template refuses;
  429  the waiting queue is full (with Retry-After);
  503  the server is draining (SIGTERM) or the engine is not running (with Retry-After);
  504  the request ran past the server's per-request timeout (--request-timeout-s); a stream gets an error
       event instead, then [DONE].
Other unknown fields are ignored (vLLM's behaviour). Extensions beyond OpenAI's fields (vLLM's names): top_k
(0 or -1 = off), ignore_eos; beside `usage`, a response carries llama.cpp's `timings` {draft_n, draft_n_accepted} and specgate's draft_steps. max_tokens defaults to 16 for completions (OpenAI) and to the slot's remaining
room for chat (vLLM). A temperature below 1e-5 is greedy (vLLM's rule: dividing logits by it overflows).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from specgate import chat
from specgate.sampling import SamplingParams
from specgate.serving.metrics import CONTENT_TYPE_LATEST
from specgate.serving.scheduler import QueueFullError, Request, RequestTooLongError, Scheduler, ServerDrainingError

DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks whether its client (and the engine) is still there
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB of JSON: far more than max_seq_len tokens of text
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
GREEDY_BELOW_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS: smaller temperatures are treated as greedy
RETRY_AFTER_FULL_S = 1  # 429: a slot frees as soon as any running request finishes
RETRY_AFTER_UNAVAILABLE_S = 5  # 503: draining or restarting takes longer
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
    422: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable",
    504: "timeout_error",
}
# Fields of OpenAI / vLLM requests this server does not implement: refused unless left at their no-op value.
UNSUPPORTED_FIELDS: dict[str, Callable[[Any], bool]] = {
    "logit_bias": lambda v: not v,
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "repetition_penalty": lambda v: v in (None, 1),
    "min_p": lambda v: v in (None, 0),
    "min_tokens": lambda v: v in (None, 0),
    "suffix": lambda v: not v,
    "top_logprobs": lambda v: v in (None, 0),
    "prompt_logprobs": lambda v: v is None,
    "stop_token_ids": lambda v: not v,
    "use_beam_search": lambda v: not v,
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none"),
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "guided_json": lambda v: v is None,
    "guided_regex": lambda v: v is None,
    "guided_choice": lambda v: v is None,
    "guided_grammar": lambda v: v is None,
}
# Fields that would choose another model, draft, adapter or file: the server's are fixed when it starts.
FIXED_AT_START = (
    "draft", "draft_model", "speculative_model", "speculative_config", "model_path", "tokenizer", "revision",
    "trust_remote_code", "lora_request", "adapter",
)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class ASCIIJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message quoting the client's text stays encodable (lone surrogates)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def retry_after(status: int) -> dict[str, str]:
    seconds = {429: RETRY_AFTER_FULL_S, 503: RETRY_AFTER_UNAVAILABLE_S}.get(status)
    return {} if seconds is None else {"Retry-After": str(seconds)}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return ASCIIJSONResponse(error_body(status, message, param, code), status_code=status, headers=retry_after(status))


class BodyLimit:
    """ASGI middleware: 413 for a request body over max_bytes (by Content-Length, or counted as it streams in).

    The body is read here (at most max_bytes) and replayed to the app; later receive() calls go to the
    client's connection, so the app still sees a disconnect.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        too_large = error_response(
            413, f"the request body is larger than this server's limit of {self.max_bytes} bytes: send a shorter "
            "prompt (or start the server with a larger --max-body-bytes)", code="request_too_large",
        )
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await error_response(400, f"Content-Length {declared[:32]!r} is not a byte count")(scope, receive, send)
            if int(declared) > self.max_bytes:
                return await too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await too_large(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are checked (UNSUPPORTED_FIELDS, FIXED_AT_START)
    model: str | None = None
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    logprobs: int | bool | None = None
    echo: bool = False
    best_of: int | None = None


class CompletionBody(SamplingFields):
    prompt: str | list[int] | list[str]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None


class ChatBody(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


def _param_named(message: str, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in message), None)


def check_text(name: str, text: str) -> str:
    """Refuse strings that are not valid Unicode (JSON escapes can smuggle in unpaired surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{name} contains an unpaired UTF-16 surrogate at index {exc.start}: send valid Unicode text", name) from None
    return text


def check_extra_fields(body: BaseModel) -> None:
    for name, value in (body.model_extra or {}).items():
        if name in FIXED_AT_START:
            raise APIError(
                400, f"'{name}' cannot be chosen per request: the model and draft are fixed when the server starts "
                "(specgate serve --target / --draft); leave the field out", name, "unsupported_parameter",
            )
        is_default = UNSUPPORTED_FIELDS.get(name)
        if is_default is not None and not is_default(value):
            raise APIError(400, f"{name}={value!r:.80} is not supported by this server: leave it out", name, "unsupported_parameter")


def check_stop(stop: str | list[str] | None) -> list[str]:
    """The stop strings as a list; APIError 400 for too many, empty, too long or invalid ones."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise APIError(400, f"stop has {len(stops)} strings: use at most {MAX_STOP_SEQUENCES}", "stop")
    for s in stops:
        if s == "":
            raise APIError(400, "stop contains an empty string: each stop string needs >= 1 character", "stop")
        if len(s) > MAX_STOP_CHARS:
            raise APIError(400, f"a stop string has {len(s)} characters: use at most {MAX_STOP_CHARS}", "stop")
        check_text("stop", s)
    return stops


def check_options(body: SamplingFields) -> None:
    """APIError 400 for options this server does not implement (extra fields, n != 1, logprobs, echo, best_of)."""
    check_extra_fields(body)
    if body.n != 1:
        raise APIError(400, f"n={body.n} is not supported: use n=1 (one choice per request)", "n")
    for name, value, default in (("logprobs", body.logprobs, None), ("echo", body.echo, False), ("best_of", body.best_of, None)):
        if value not in (default, False) and not (name == "best_of" and value == 1):
            raise APIError(400, f"{name}={value!r} is not supported by this server: leave it out", name)


def sampling_params(body: SamplingFields) -> SamplingParams:
    """The body's temperature, top_k and top_p as SamplingParams (a temperature below GREEDY_BELOW_TEMPERATURE is
    greedy; top_k -1 is off); APIError 400 for a bad value."""
    if body.top_k < -1:
        raise APIError(400, f"top_k={body.top_k} is invalid: use 0 or -1 (off) or a positive integer", "top_k")
    temperature = body.temperature
    if 0.0 <= temperature < GREEDY_BELOW_TEMPERATURE:
        temperature = 0.0
    try:
        return SamplingParams(temperature=temperature, top_k=max(body.top_k, 0), top_p=body.top_p)
    except ValueError as exc:
        raise APIError(400, str(exc), _param_named(str(exc), ("temperature", "top_k", "top_p"))) from None


def chat_messages(body: ChatBody) -> list[dict[str, str]]:
    """The body's messages as [{"role", "content"}] of text; APIError 400 for none or a part that is not text."""
    if not body.messages:
        raise APIError(400, "messages is empty: give at least one message", "messages")
    messages = []
    for i, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise APIError(400, f"messages[{i}].content has a part that is not {{'type': 'text', 'text': ...}}: this server takes text only", "messages")
            content = "".join(part.text for part in content)
        messages.append({"role": check_text("messages", message.role), "content": check_text("messages", content or "")})
    return messages


def usage(request: Request) -> dict[str, int]:
    completion = len(request.tokens)
    return {"prompt_tokens": request.prompt_len, "completion_tokens": completion, "total_tokens": request.prompt_len + completion}


def timings(request: Request) -> dict[str, int]:
    """This request's drafted and accepted tokens, under llama.cpp's per-response names (`timings.draft_n`,
    `draft_n_accepted`), and its drafts (`draft_steps`, specgate's): a client can read acceptance rate and length per
    request, which the Prometheus counters pool."""
    return {"draft_n": request.stats.drafted_tokens, "draft_n_accepted": request.stats.accepted_tokens, "draft_steps": request.stats.num_drafts}


class Completion:
    """The response objects of one completion (chat or text): stream chunks as server-sent events, and the whole
    answer."""

    def __init__(self, chat: bool, model_name: str) -> None:
        self.chat, self.model_name = chat, model_name
        self.ident = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        self.kind = "chat.completion" if chat else "text_completion"

    def _object(self, choices: list[dict], **extra: Any) -> dict[str, Any]:
        kind = self.kind + (".chunk" if self.chat else "")
        return {"id": self.ident, "object": kind, "created": int(time.time()), "model": self.model_name, "choices": choices, **extra}

    def chunk(self, delta: str | None, reason: str | None, *, first: bool = False) -> str:
        if self.chat:
            piece: dict[str, Any] = {"role": "assistant", "content": ""} if first else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": piece, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
        return f"data: {json.dumps(self._object([choice]))}\n\n"

    def usage_chunk(self, request: Request) -> str:
        return f"data: {json.dumps(self._object([], usage=usage(request), timings=timings(request)))}\n\n"

    def answer(self, request: Request, reason: str) -> JSONResponse:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": request.text}, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": request.text, "finish_reason": reason, "logprobs": None}
        return JSONResponse({"id": self.ident, "object": self.kind, "created": int(time.time()), "model": self.model_name, "choices": [choice], "usage": usage(request),
                             "timings": timings(request)})


async def _api_error(_: HTTPRequest, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param, exc.code)


async def _validation_error(_: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    kind = first.get("type", "")
    if kind == "json_invalid":
        return error_response(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'decode error')}): send a JSON object")
    loc = [str(p) for p in first.get("loc", []) if p != "body"]
    if not loc and kind == "missing":
        return error_response(400, "the body is empty or null: send a JSON object of request fields, e.g. {\"prompt\": \"Hello\"}")
    if not loc and kind in ("model_attributes_type", "dict_type", "model_type"):
        return error_response(422, "the body must be a JSON object of request fields, e.g. {\"prompt\": \"Hello\"}")
    param = ".".join(loc) or None
    return error_response(400, f"invalid request: {param or 'body'}: {first.get('msg', 'invalid value')}", param)


async def _http_error(_: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
    message = "the body could not be parsed: send UTF-8 JSON" if exc.status_code == 400 else str(exc.detail)
    return error_response(exc.status_code, message)


async def _unexpected(_: HTTPRequest, exc: Exception) -> JSONResponse:  # a bug: still an OpenAI-style object
    return error_response(500, f"internal error ({type(exc).__name__}): please report it")


class OpenAIServer:
    """The app's state (the scheduler and the server's settings) and one method per route.

    request_timeout_s: seconds from arrival after which a request is ended (Request.timeout_s; None = never).
    """

    def __init__(
        self, scheduler: Scheduler, *, model_name: str, metrics: Any, api_key: str | None, default_max_tokens: int,
        request_timeout_s: float | None,
    ) -> None:
        self.scheduler, self.model_name, self.metrics, self.api_key = scheduler, model_name, metrics, api_key
        self.default_max_tokens, self.request_timeout_s = default_max_tokens, request_timeout_s
        self.tokenizer = scheduler.target.tokenizer
        self.created = int(time.time())
        # no token spans more characters than the longest vocabulary entry: a text longer than that many
        # characters per context position cannot fit, and is refused without tokenizing it
        self.max_prompt_chars = max((len(token) for token in self.tokenizer.get_vocab()), default=1) * scheduler.max_seq_len

    # --- checks -------------------------------------------------------------------------------------------------
    async def require_key(self, request: HTTPRequest) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self.api_key.encode()):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    def check_model(self, name: str | None) -> None:
        if name not in (None, "", self.model_name):
            raise APIError(404, f"the model '{name:.200}' does not exist: this server serves '{self.model_name}'", "model", "model_not_found")

    def engine_alive(self) -> bool:
        return self.scheduler.thread is not None and self.scheduler.thread.is_alive()

    def check_prompt_chars(self, text: str, param: str) -> str:
        if len(text) > self.max_prompt_chars:
            raise APIError(
                400, f"the prompt has {len(text)} characters, more than {self.scheduler.max_seq_len} tokens (this server's context) "
                "can hold: shorten it", param, "context_length_exceeded",
            )
        return text

    def check_prompt_ids(self, prompt_ids: list[int], prompt_param: str) -> None:
        if not prompt_ids:
            raise APIError(400, f"the {prompt_param} is empty (0 tokens): give a non-empty prompt", prompt_param)
        if len(prompt_ids) >= self.scheduler.max_seq_len:
            raise APIError(
                400, f"the prompt has {len(prompt_ids)} tokens but this server's context is {self.scheduler.max_seq_len} "
                f"positions (prompt + max_tokens): shorten the prompt to at most {self.scheduler.max_seq_len - 1} tokens",
                prompt_param, "context_length_exceeded",
            )

    def build_request(self, body: SamplingFields, prompt_ids: list[int], max_tokens: int | None, prompt_param: str) -> Request:
        """A scheduler Request for a validated body (the checks run in the order the errors are reported)."""
        self.check_model(body.model)
        check_options(body)
        max_tokens = self.default_max_tokens if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise APIError(400, f"max_tokens={max_tokens} is invalid: it must be >= 1", "max_tokens")
        params = sampling_params(body)
        stop = check_stop(body.stop)
        self.check_prompt_ids(prompt_ids, prompt_param)
        seed = secrets.randbits(62) if body.seed is None else body.seed
        return Request(
            prompt_ids, params, max_tokens=max_tokens, seed=seed, stop=stop, ignore_eos=body.ignore_eos, timeout_s=self.request_timeout_s,
        )

    # --- running a request --------------------------------------------------------------------------------------
    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
        """Hand the request to the scheduler; its events arrive on the returned queue (from the model thread)."""
        if not self.engine_alive():
            raise APIError(503, "the engine is not running (starting up or shut down): retry later", code="engine_unavailable")
        queue: asyncio.Queue = asyncio.Queue()
        request.sink = lambda event: loop.call_soon_threadsafe(queue.put_nowait, event)
        try:
            self.scheduler.submit(request)
        except QueueFullError as exc:
            raise APIError(429, str(exc), code="queue_full") from None
        except ServerDrainingError as exc:
            raise APIError(503, str(exc) or "the server is shutting down: retry on another instance", code="server_draining") from None
        except RequestTooLongError as exc:
            raise APIError(400, str(exc), "max_tokens", "context_length_exceeded") from None
        except ValueError as exc:
            raise APIError(400, str(exc), "prompt") from None
        return queue

    async def events(self, request: Request, queue: asyncio.Queue, http: HTTPRequest) -> AsyncIterator[tuple]:
        """The request's events until "done"; cancels the request if the client goes away; ("dead",) if the engine stops."""
        finished, checked_s = False, time.monotonic()
        try:
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    event = None
                # check the client every DISCONNECT_POLL_S even while events keep coming (a busy request
                # never times out on its queue, and nothing else notices a non-streamed client leaving)
                if event is None or time.monotonic() - checked_s >= DISCONNECT_POLL_S:
                    checked_s = time.monotonic()
                    if await http.is_disconnected():
                        return
                if event is None:
                    if not self.engine_alive() and queue.empty():
                        finished = True
                        yield ("dead", None)
                        return
                    continue
                yield event
                if event[0] == "done":
                    finished = True
                    return
        finally:
            if not finished:
                self.scheduler.cancel(request.request_id)

    def failure(self, request: Request | None) -> tuple[int, str, str]:
        """(status, message, code) of a request that did not finish normally (None: the engine stopped)."""
        if request is None:
            return 503, "the engine stopped while this request was running: retry later", "engine_unavailable"
        if request.finish_reason == "timeout":
            return 504, (
                f"the request ran past this server's per-request timeout of {self.request_timeout_s:g} s after "
                f"{len(request.tokens)} tokens: ask for fewer max_tokens, or retry when the server is less busy"
            ), "request_timeout"
        return 500, f"the engine failed on this request: {request.error or self.scheduler.last_error!r}", "engine_error"

    async def run(self, http: HTTPRequest, request: Request, body: SamplingFields, chat: bool) -> Response:
        """Submit the request and answer: a stream of events if the body asks for one, else one JSON object."""
        queue = self.submit(request, asyncio.get_running_loop())
        completion = Completion(chat, self.model_name)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self.stream(http, request, queue, completion, include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        dead = False
        async for event in self.events(request, queue, http):
            dead = event[0] == "dead"
        if dead or request.finish_reason in ("timeout", "error"):
            status, message, code = self.failure(None if dead else request)
            return error_response(status, message, code=code)
        if request.finish_reason is None or request.finish_reason == "cancelled":
            return Response(status_code=499)  # the client went away; nobody reads this
        return completion.answer(request, "length" if request.finish_reason == "length" else "stop")

    async def stream(
        self, http: HTTPRequest, request: Request, queue: asyncio.Queue, completion: Completion, include_usage: bool,
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed answer: text chunks, then a finish chunk (and usage) or an error
        event, then [DONE]."""
        if completion.chat:
            yield completion.chunk(None, None, first=True)
        async for event in self.events(request, queue, http):
            if event[0] == "text":
                yield completion.chunk(event[1], None)
            elif event[0] == "dead" or request.finish_reason in ("timeout", "error"):
                status, message, code = self.failure(None if event[0] == "dead" else request)
                yield f"data: {json.dumps(error_body(status, message, None, code))}\n\n"
            else:
                yield completion.chunk(None, request.finish_reason if request.finish_reason == "length" else "stop")
                if include_usage:
                    yield completion.usage_chunk(request)
        yield "data: [DONE]\n\n"

    # --- routes -------------------------------------------------------------------------------------------------
    async def completions(self, body: CompletionBody, http: HTTPRequest) -> Response:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, f"prompt is a list of {len(prompt)} strings: send one prompt per request", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer(self.check_prompt_chars(check_text("prompt", prompt), "prompt"))["input_ids"] if prompt else []
        else:
            prompt_ids = [int(t) for t in prompt]
            vocab = int(self.scheduler.target.model.vocab_size)
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise APIError(400, f"prompt token ids must be in 0..{vocab - 1} (the model's vocabulary)", "prompt")
        request = self.build_request(body, list(prompt_ids), body.max_tokens, "prompt")
        return await self.run(http, request, body, chat=False)

    async def chat_completions(self, body: ChatBody, http: HTTPRequest) -> Response:
        """Messages through the model's chat template, or through specgate.chat's plain turn format where it has
        none (a base model): then the text is tokenized as a completion's prompt, so the gate's clients, which send
        every engine the same rendered text on /v1/completions, and this endpoint give the model the same tokens."""
        messages = chat_messages(body)
        templated = chat.has_chat_template(self.tokenizer)
        try:
            text = chat.render(self.tokenizer, messages)
        except ValueError as exc:  # the plain format's roles
            raise APIError(400, str(exc), "messages") from None
        except Exception as exc:  # the template rejects the conversation (e.g. roles out of order)
            raise APIError(422, f"the chat template rejected the messages: {exc}", "messages") from None
        prompt_ids = self.tokenizer(self.check_prompt_chars(text, "messages"), add_special_tokens=not templated)["input_ids"]
        max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        if max_tokens is None:  # chat default (vLLM's): whatever room the slot has left
            max_tokens = max(self.scheduler.max_seq_len - len(prompt_ids), 1)
        request = self.build_request(body, list(prompt_ids), max_tokens, "messages")
        return await self.run(http, request, body, chat=True)

    async def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specgate", "max_model_len": self.scheduler.max_seq_len}
        return {"object": "list", "data": [card]}

    async def health(self) -> Response:
        if not self.engine_alive():
            return error_response(503, "the engine is not running", code="engine_unavailable")
        if self.scheduler.draining:
            return error_response(503, "the server is draining (shutting down): send new requests elsewhere", code="server_draining")
        return JSONResponse({"status": "ok", "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting)})

    async def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def create_app(
    scheduler: Scheduler,
    *,
    model_name: str,
    metrics: Any,
    api_key: str | None = None,
    default_max_tokens: int = 16,
    request_timeout_s: float | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The FastAPI app serving `scheduler` (whose loop must run in its own thread) under the name model_name.

    request_timeout_s: seconds from arrival after which a request is ended (Request.timeout_s; None = never).
    max_body_bytes: the largest request body accepted (413 above it).
    """
    if request_timeout_s is not None and not (math.isfinite(request_timeout_s) and request_timeout_s > 0):
        raise ValueError(f"request_timeout_s={request_timeout_s} is invalid: use a number of seconds > 0, or None for no limit")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes={max_body_bytes} is invalid: use a positive byte count, e.g. {DEFAULT_MAX_BODY_BYTES}")
    app = FastAPI(title="specgate", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    for kind, handler in ((APIError, _api_error), (RequestValidationError, _validation_error),
                          (StarletteHTTPException, _http_error), (Exception, _unexpected)):
        app.add_exception_handler(kind, handler)
    server = OpenAIServer(
        scheduler, model_name=model_name, metrics=metrics, api_key=api_key, default_max_tokens=default_max_tokens,
        request_timeout_s=request_timeout_s,
    )
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(server.require_key)])
    v1.add_api_route("/completions", server.completions, methods=["POST"])
    v1.add_api_route("/chat/completions", server.chat_completions, methods=["POST"])
    v1.add_api_route("/models", server.models, methods=["GET"])
    app.include_router(v1)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.metrics_text, methods=["GET"])
    return app
