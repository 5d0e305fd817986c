"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health, Prometheus metrics.

Handlers never touch the models: they validate, tokenize, `Scheduler.submit` a Request whose sink hands the
model thread's events to the handler's asyncio queue, and await. A client that disconnects (mid-stream, or
while waiting for a non-streamed answer) has its request cancelled; the scheduler frees its slot at the next
step. Errors are OpenAI-style JSON, {"error": {"message", "type", "param", "code"}}: 400 bad parameters
(including body validation, like OpenAI), 401 missing/wrong API key, 404 unknown route or model, 429 queue full,
503 engine not running. /health and /metrics stay open when an API key is set (as in vLLM); /v1/* need it.
Extensions beyond OpenAI's fields (vLLM's names): top_k (0 or -1 = off), ignore_eos. max_tokens defaults to
16 for completions (OpenAI) and to the slot's remaining room for chat (vLLM).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from specgate.sampling import SamplingParams
from specgate.serving.metrics import CONTENT_TYPE_LATEST
from specgate.serving.scheduler import QueueFullError, Request, RequestTooLongError, Scheduler

DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks whether its client is still there
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 422: "invalid_request_error",
    429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatBody(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


def _param_named(message: str, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in message), None)


def create_app(scheduler: Scheduler, *, model_name: str, metrics: Any, api_key: str | None = None, default_max_tokens: int = 16) -> FastAPI:
    """The FastAPI app serving `scheduler` (whose loop must run in its own thread) under the name model_name."""
    app = FastAPI(title="specgate", docs_url=None, redoc_url=None, openapi_url=None)
    tokenizer = scheduler.target.tokenizer
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: HTTPRequest, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", []) if p != "body"]
        param = ".".join(loc) or None
        return error_response(400, f"invalid request: {param or 'body'}: {first.get('msg', 'invalid value')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    async def require_key(request: HTTPRequest) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    def check_model(name: str | None) -> None:
        if name not in (None, "", model_name):
            raise APIError(404, f"the model '{name}' does not exist: this server serves '{model_name}'", "model", "model_not_found")

    def engine_alive() -> bool:
        return scheduler.thread is not None and scheduler.thread.is_alive()

    def build_request(body: SamplingFields, prompt_ids: list[int], max_tokens: int | None) -> Request:
        check_model(body.model)
        if body.n != 1:
            raise APIError(400, f"n={body.n} is not supported: use n=1 (one choice per request)", "n")
        for name, value, default in (("logprobs", body.logprobs, None), ("echo", body.echo, False), ("best_of", body.best_of, None)):
            if value not in (default, False) and not (name == "best_of" and value == 1):
                raise APIError(400, f"{name}={value!r} is not supported by this server: leave it out", name)
        max_tokens = default_max_tokens if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise APIError(400, f"max_tokens={max_tokens} is invalid: it must be >= 1", "max_tokens")
        if body.top_k < -1:
            raise APIError(400, f"top_k={body.top_k} is invalid: use 0 or -1 (off) or a positive integer", "top_k")
        try:
            params = SamplingParams(temperature=body.temperature, top_k=max(body.top_k, 0), top_p=body.top_p)
        except ValueError as exc:
            raise APIError(400, str(exc), _param_named(str(exc), ("temperature", "top_k", "top_p"))) from None
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(s == "" for s in stop):
            raise APIError(400, "stop contains an empty string: each stop string needs >= 1 character", "stop")
        if not prompt_ids:
            raise APIError(400, "the prompt is empty (0 tokens): give a non-empty prompt", "prompt")
        seed = secrets.randbits(62) if body.seed is None else body.seed
        return Request(prompt_ids, params, max_tokens=max_tokens, seed=seed, stop=stop, ignore_eos=body.ignore_eos)

    def submit(request: Request, loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
        if not engine_alive():
            raise APIError(503, "the engine is not running (starting up or shut down): retry later")
        queue: asyncio.Queue = asyncio.Queue()
        request.sink = lambda event: loop.call_soon_threadsafe(queue.put_nowait, event)
        try:
            scheduler.submit(request)
        except QueueFullError as exc:
            raise APIError(429, str(exc), code="queue_full") from None
        except RequestTooLongError as exc:
            raise APIError(400, str(exc), "max_tokens", "context_length_exceeded") from None
        except ValueError as exc:
            raise APIError(400, str(exc), "prompt") from None
        return queue

    async def events(request: Request, queue: asyncio.Queue, http: HTTPRequest) -> AsyncIterator[tuple]:
        """The request's events until "done"; cancels the request if the client goes away."""
        finished = False
        try:
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        return
                    continue
                yield event
                if event[0] == "done":
                    finished = True
                    return
        finally:
            if not finished:
                scheduler.cancel(request.request_id)

    def usage(request: Request) -> dict[str, int]:
        completion = len(request.tokens)
        return {"prompt_tokens": request.prompt_len, "completion_tokens": completion, "total_tokens": request.prompt_len + completion}

    def finish_reason(request: Request) -> str:
        return "length" if request.finish_reason == "length" else "stop"

    async def run(http: HTTPRequest, request: Request, chat: bool) -> Response:
        loop = asyncio.get_running_loop()
        queue = submit(request, loop)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        kind = "chat.completion" if chat else "text_completion"
        include_usage = bool(http.state.stream_options and http.state.stream_options.include_usage)

        def chunk(delta: str | None, reason: str | None, *, first: bool = False) -> str:
            if chat:
                piece: dict[str, Any] = {"role": "assistant", "content": ""} if first else ({} if delta is None else {"content": delta})
                choice = {"index": 0, "delta": piece, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
            obj = {"id": ident, "object": kind + (".chunk" if chat else ""), "created": int(time.time()), "model": model_name, "choices": [choice]}
            return f"data: {json.dumps(obj)}\n\n"

        if http.state.stream:
            async def stream() -> AsyncIterator[str]:
                if chat:
                    yield chunk(None, None, first=True)
                async for event in events(request, queue, http):
                    if event[0] == "text":
                        yield chunk(event[1], None)
                    elif request.finish_reason == "error":
                        yield f"data: {json.dumps({'error': {'message': 'the engine failed on this request', 'type': 'internal_error', 'param': None, 'code': None}})}\n\n"
                    else:
                        yield chunk(None, finish_reason(request))
                        if include_usage:
                            obj = {"id": ident, "object": kind + (".chunk" if chat else ""), "created": int(time.time()), "model": model_name, "choices": [], "usage": usage(request)}
                            yield f"data: {json.dumps(obj)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        async for _ in events(request, queue, http):
            pass
        if request.finish_reason == "error":
            return error_response(500, f"the engine failed on this request: {scheduler.last_error!r}")
        if request.finish_reason is None or request.finish_reason == "cancelled":
            return Response(status_code=499)  # the client went away; nobody reads this
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": request.text}, "finish_reason": finish_reason(request), "logprobs": None}
        else:
            choice = {"index": 0, "text": request.text, "finish_reason": finish_reason(request), "logprobs": None}
        return JSONResponse({"id": ident, "object": kind, "created": int(time.time()), "model": model_name, "choices": [choice], "usage": usage(request)})

    @v1.post("/completions")
    async def completions(body: CompletionBody, http: HTTPRequest) -> Response:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, f"prompt is a list of {len(prompt)} strings: send one prompt per request", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = tokenizer(prompt)["input_ids"] if prompt else []
        else:
            prompt_ids = [int(t) for t in prompt]
            vocab = int(scheduler.target.model.vocab_size)
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise APIError(400, f"prompt token ids must be in 0..{vocab - 1} (the model's vocabulary)", "prompt")
        request = build_request(body, list(prompt_ids), body.max_tokens)
        http.state.stream, http.state.stream_options = body.stream, body.stream_options
        return await run(http, request, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatBody, http: HTTPRequest) -> Response:
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(
                400, f"the model '{model_name}' has no chat template: use /v1/completions with a plain prompt", "messages",
                "chat_template_missing",
            )
        if not body.messages:
            raise APIError(400, "messages is empty: give at least one message", "messages")
        messages = []
        for message in body.messages:
            content = message.content
            if isinstance(content, list):
                content = "".join(part.get("text", "") for part in content if part.get("type") == "text")
            messages.append({"role": message.role, "content": content or ""})
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template rejects the conversation (e.g. roles out of order)
            raise APIError(400, f"the chat template rejected the messages: {exc}", "messages") from None
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # chat default (vLLM's): whatever room the slot has left
            max_tokens = max(scheduler.max_seq_len - len(prompt_ids), 1)
        request = build_request(body, list(prompt_ids), max_tokens)
        http.state.stream, http.state.stream_options = body.stream, body.stream_options
        return await run(http, request, chat=True)

    @v1.get("/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "specgate", "max_model_len": scheduler.max_seq_len}
        return {"object": "list", "data": [card]}

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if not engine_alive():
            return error_response(503, "the engine is not running")
        return JSONResponse({"status": "ok", "running": len(scheduler.running), "waiting": len(scheduler.waiting)})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
