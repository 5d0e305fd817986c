"""Build and run the server: load models, choose the policy (calibrating the adaptive one), start the model
thread and uvicorn on a socket we bind ourselves (so port 0 gives a known free port before serving starts).

    handle = start_server(ServerConfig(target="path/to/model", draft="ngram"))   # uvicorn in a thread
    ... handle.url ...
    handle.stop()

`serve(config)` does the same in the foreground (the `specgate serve` command). There SIGTERM (and a first
Ctrl-C) drains: the scheduler stops admitting (new requests get 503 with Retry-After), uvicorn closes the
listening socket (later connections are refused) and waits for the in-flight requests, which run to the end,
at most drain_timeout_s; then the model thread stops and, after SIGTERM, the process exits 0.

Security defaults: loopback only unless --host says otherwise; the API key is compared in constant time
(api.py); the model and draft are fixed here, at start (requests cannot name paths); models load with
trust_remote_code=False (specgate.models.loading) and never from the network.
"""

from __future__ import annotations

import math
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from specgate.serving.api import DEFAULT_MAX_BODY_BYTES, create_app
from specgate.serving.metrics import ServingMetrics
from specgate.serving.policy import DEFAULT_FIXED_GAMMA, DEFAULT_GAMMA_MAX, POLICY_NAMES, calibrate_cost_model, make_policy
from specgate.serving.scheduler import Scheduler


SERVED_WEIGHTS = ("auto", "float32", "bfloat16", "gguf", "int8")  # specgate.models.dtypes.WEIGHT_CHOICES (not imported: torch)


@dataclass
class ServerConfig:
    target: Any  # a model name / path for load_model, or a LoadedModel
    draft: Any = "ngram"  # "none", "ngram", "default", "eagle", "eagle:<dir>", a draft model name / path, or a LoadedModel
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port
    policy: str = "adaptive"
    gamma: int | None = None  # fixed policy's gamma (default 4); the adaptive policy's gamma_max (default 8): resolved_gamma
    gamma_table: str | None = None  # table policy, e.g. "1-4:4,5-8:2,9-64:0"
    api_key: str | None = None
    max_num_seqs: int = 8  # KV slots = requests decoded at once
    max_waiting: int = 64
    max_seq_len: int = 1024  # positions per slot (prompt + max_tokens)
    served_model_name: str | None = None
    default_max_tokens: int = 16
    dtype: str = "float32"  # target weights: auto, float32, bfloat16, gguf (a .gguf's own blocks) or int8 (Q8_0 on load); drafts get draft_dtype
    lossy: str | None = None  # LOSSY verification: "typical" (Medusa) or "synthetic:R1,R2,..." (fixed rates)
    request_timeout_s: float | None = None  # a request still running this long after arrival ends (504); None = never
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413
    drain_timeout_s: float = 30.0  # on SIGTERM, how long in-flight requests may take before their connections are cut
    debug_step_delay_ms: float = 0.0  # tests only: sleep this long after every engine step (a known slowdown)

    def resolved_gamma(self) -> int:
        """--gamma, or the policy's default when it is left out: fixed 4, adaptive gamma_max 8 (DEFAULT_GAMMA_MAX).

        Why two defaults: at concurrency 1 the best fixed setting on this machine is gamma 8 (docs/BENCHMARKS.md,
        serving sweep), and an adaptive policy capped at 4 could not reach it;
        the adaptive policy picks narrower widths itself where the load makes them pay."""
        if self.gamma is not None:
            return self.gamma
        return DEFAULT_GAMMA_MAX if self.policy == "adaptive" else DEFAULT_FIXED_GAMMA

    def validate(self) -> None:
        if not 0.0 <= self.debug_step_delay_ms <= 10_000.0:
            raise ValueError(f"--debug-step-delay-ms {self.debug_step_delay_ms} is out of range [0, 10000] (ms slept after each step; tests only)")
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"--policy {self.policy!r} is unknown: use one of {', '.join(POLICY_NAMES)}")
        if self.gamma is not None and (isinstance(self.gamma, bool) or not isinstance(self.gamma, int) or not 0 <= self.gamma <= 64):
            raise ValueError(f"--gamma {self.gamma!r} is out of range: use an integer in 0..64, or leave it out (fixed 4, adaptive 8)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is out of range 0..65535 (0 = any free port)")
        if isinstance(self.draft, str) and self.draft.startswith("synthetic"):
            raise ValueError(
                f"--draft {self.draft!r}: the server has no synthetic drafter; for cost studies use --draft ngram with "
                "--lossy synthetic:RATE (labelled lossy), or a real draft model"
            )
        parse_lossy(self.lossy)
        if self.dtype not in SERVED_WEIGHTS:
            raise ValueError(f"--dtype {self.dtype!r} is not supported: use one of {', '.join(SERVED_WEIGHTS)}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key is empty: give a non-empty key or leave the option out")
        if self.request_timeout_s is not None and not (math.isfinite(self.request_timeout_s) and self.request_timeout_s > 0):
            raise ValueError(f"--request-timeout-s {self.request_timeout_s} is invalid: use seconds > 0, or leave it out for no limit")
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes {self.max_body_bytes} is invalid: use a positive byte count (default {DEFAULT_MAX_BODY_BYTES})")
        if not (math.isfinite(self.drain_timeout_s) and self.drain_timeout_s > 0):
            raise ValueError(f"--drain-timeout-s {self.drain_timeout_s} is invalid: use seconds > 0 (default 30)")
        if self.max_num_seqs < 1 or self.max_waiting < 0:
            raise ValueError(
                f"--max-num-seqs {self.max_num_seqs} / --max-waiting {self.max_waiting} are invalid: use >= 1 slots and >= 0 waiting"
            )


@dataclass
class Engine:
    scheduler: Scheduler
    metrics: ServingMetrics
    model_name: str
    app: Any


def parse_lossy(spec: str | None) -> Any:
    """--lossy: None (exact), "typical" or "synthetic:0.8,0.6" -> a specgate.sampling.lossy mode."""
    from specgate.sampling import SyntheticAcceptanceLossy, TypicalAcceptanceLossy

    if spec is None:
        return None
    if spec == "typical":
        return TypicalAcceptanceLossy()
    if spec.startswith("synthetic:"):
        try:
            rates = [float(r) for r in spec.split(":", 1)[1].split(",")]
        except ValueError:
            rates = []
        if rates:
            return SyntheticAcceptanceLossy(rates)
    raise ValueError(f"--lossy {spec!r} is unknown: use 'typical' or 'synthetic:RATE[,RATE...]' (each in [0, 1]), or leave it out for exact verification")


def build_engine(config: ServerConfig) -> Engine:
    """Load the models, build the policy (calibrating the adaptive cost model on this machine) and the app."""
    from specgate.models import load_model

    from specgate.models.dtypes import draft_dtype, resolve_weights

    config.validate()
    weights = resolve_weights(config.dtype, config.target if isinstance(config.target, str) else "")  # a dtype, "gguf" or "int8"
    target = load_model(config.target, dtype=weights) if isinstance(config.target, str) else config.target
    dtype = draft_dtype(weights)  # a draft model's torch dtype (bf16 / float32 beside a quantized target)
    draft = config.draft
    if isinstance(draft, str):
        from specgate.drafting.model_drafter import is_draft_dir
        from specgate.drafting.registry import resolve_default, resolve_eagle

        # `default`: the target's registered draft (ValueError naming the options if none); `eagle`: its shipped head
        draft = resolve_eagle(resolve_default(draft, target.name), target.name)
    if isinstance(draft, str) and (draft.startswith("eagle:") or is_draft_dir(draft)):  # checked against the target
        from specgate.drafting import make_drafter

        drafter = make_drafter(draft, target, dtype=dtype)
        draft = drafter.head if draft.startswith("eagle:") else drafter.draft
    elif isinstance(draft, str) and draft not in ("none", "ngram"):
        draft = load_model(draft, dtype=dtype)
    cost_model = None
    if config.policy == "adaptive":
        cost_model = calibrate_cost_model(target.model, _draft_cost_model(draft), gamma_max=config.resolved_gamma())
    policy = make_policy(config.policy, gamma=config.resolved_gamma(), table=config.gamma_table, cost_model=cost_model)
    if isinstance(draft, str) and draft == "none" and config.policy != "off":
        policy = make_policy("off")  # nothing can draft: speculation is off whatever the policy says
    model_name = config.served_model_name or target.name
    metrics = ServingMetrics(model_name, config.max_num_seqs)
    scheduler = Scheduler(
        target, draft, policy, num_slots=config.max_num_seqs, max_seq_len=min(config.max_seq_len, int(target.model.max_position_embeddings)),
        max_waiting=config.max_waiting, metrics=metrics, lossy=parse_lossy(config.lossy),
    )
    scheduler.step_delay_s = config.debug_step_delay_ms / 1000.0
    app = create_app(
        scheduler, model_name=model_name, metrics=metrics, api_key=config.api_key, default_max_tokens=config.default_max_tokens,
        request_timeout_s=config.request_timeout_s, max_body_bytes=config.max_body_bytes,
    )
    return Engine(scheduler, metrics, model_name, app)


def _draft_cost_model(draft: Any) -> Any:
    """What calibrate_cost_model times as the draft pass: the draft CausalLM, the EAGLE head's step, or None (lookups)."""
    from specgate.drafting.eagle import EagleHead
    from specgate.drafting.eagle_drafter import HeadCostProxy

    if isinstance(draft, str):
        return None
    return HeadCostProxy(draft) if isinstance(draft, EagleHead) else draft.model


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot bind {host}:{port} ({exc.strerror}): pick another --port (0 = any free port) or --host") from None
    sock.set_inheritable(True)
    return sock


@dataclass
class ServerHandle:
    engine: Engine
    server: Any  # uvicorn.Server
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.engine.scheduler.stop(timeout_s)


def _uvicorn_server(engine: Engine, host: str, port: int, drain_timeout_s: float = 30.0):
    """A uvicorn server whose exit signals (SIGTERM, SIGINT; not should_exit, which stops at once) first drain the scheduler."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            engine.scheduler.drain()  # refuse new requests (503) at once; running and waiting ones finish
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        engine.app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
        timeout_graceful_shutdown=drain_timeout_s,
    )
    return DrainingServer(config)


def start_server(config: ServerConfig, engine: Engine | None = None, *, ready_timeout_s: float = 30.0) -> ServerHandle:
    """Start the model thread and uvicorn (in a daemon thread) and return once the socket accepts requests."""
    engine = engine or build_engine(config)
    sock = bind_socket(config.host, config.port)
    host, port = sock.getsockname()[:2]
    server = _uvicorn_server(engine, host, port, config.drain_timeout_s)
    engine.scheduler.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="specgate-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + ready_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            engine.scheduler.stop()
            raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.02)
    return ServerHandle(engine, server, thread, host, port)


def serve(config: ServerConfig, engine: Engine | None = None, on_ready: Any = None) -> None:
    """Run the server in the foreground until SIGTERM (drain, then return) or Ctrl-C (drain, then KeyboardInterrupt)."""
    engine = engine or build_engine(config)
    sock = bind_socket(config.host, config.port)
    host, port = sock.getsockname()[:2]
    server = _uvicorn_server(engine, host, port, config.drain_timeout_s)
    engine.scheduler.start()
    # uvicorn re-raises the signal it shut down for once it is done; for SIGTERM that must not kill the
    # process (exit status -15): a drained shutdown is a normal exit, status 0.
    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: engine.scheduler.drain()) if main_thread else None
    if on_ready is not None:
        on_ready(host, port)
    try:
        server.run(sockets=[sock])
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        engine.scheduler.stop(config.drain_timeout_s)
