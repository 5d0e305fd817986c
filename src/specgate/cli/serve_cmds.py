"""`specgate serve`: the OpenAI-compatible server with continuous batching and a speculation policy."""

from __future__ import annotations

import typer

from specgate.cli import common


def register(app: typer.Typer) -> None:
    """Add `serve` to `app`."""

    @app.command()
    def serve(
        target: str = typer.Option("gemma-3-270m", help="Target model: gemma-3-270m, an HF directory, or a .gguf file."),
        draft: str = typer.Option("ngram", help="Drafter: none, ngram (prompt lookup), default (the target's registered draft), eagle (the EAGLE head shipped for the target), eagle:DIR (one saved for it), or a draft model name / PATH sharing the target's tokenizer."),
        host: str = typer.Option("127.0.0.1", help="Address to bind (loopback by default; 0.0.0.0 exposes the server)."),
        port: int = typer.Option(8000, help="TCP port (0 = any free port, printed at start)."),
        policy: str = typer.Option("adaptive", help="Speculation policy: adaptive (calibrated goodput model), fixed, table, off."),
        gamma: int = typer.Option(None, help="Draft tokens per step for --policy fixed (default 4); the largest gamma --policy adaptive may pick (default 8)."),
        gamma_table: str = typer.Option(None, help="--policy table: per-batch-size gamma, e.g. '1-4:4,5-8:2,9-64:0'."),
        api_key: str = typer.Option(None, envvar="SPECGATE_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/* (401 otherwise); prefer the SPECGATE_API_KEY environment variable (a command line is visible to other users in ps)."),
        max_num_seqs: int = typer.Option(8, help="KV slots: requests decoded at once."),
        max_waiting: int = typer.Option(64, help="Requests allowed to wait for a slot; more get HTTP 429."),
        max_seq_len: int = typer.Option(1024, help="Positions per KV slot: prompt + max_tokens must fit."),
        served_model_name: str = typer.Option(None, help="Model id reported by /v1/models (default: the target's name)."),
        dtype: str = typer.Option("auto", help="Target weights: auto (a .gguf target's own quantized blocks where the native kernels run, else bfloat16 weights with float32 arithmetic where the native kernel runs or the CPU has bf16 instructions, else float32), gguf, int8 (Q8_0 on load: changes the target model), float32 or bfloat16. A draft model gets the torch dtype."),
        lossy: str = typer.Option(None, help="LOSSY verification for cost studies: typical (Medusa) or synthetic:0.8,0.6 (fixed acceptance rates); metrics say lossless=\"false\"."),
        request_timeout_s: float = typer.Option(None, help="End a request still running this many seconds after arrival (HTTP 504; default: no limit)."),
        max_body_bytes: int = typer.Option(1 << 20, help="Largest request body accepted, in bytes (HTTP 413 above it)."),
        drain_timeout_s: float = typer.Option(30.0, help="On SIGTERM: new requests get 503 and in-flight ones get this many seconds to finish."),
        debug_step_delay_ms: float = typer.Option(0.0, help="Tests only: sleep this many ms after every engine step, a server slower by a known amount (the gate's negative control)."),
        json_output: bool = typer.Option(False, "--json", help="Print one JSON object {url, host, port, model, policy} once listening."),
    ) -> None:
        """Serve TARGET with speculative decoding behind an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /metrics).

        SIGTERM drains: new requests get 503, running ones finish, then the process exits 0.
        """
        from specgate.models.dtypes import resolve_weights, weights_name
        from specgate.serving.server import ServerConfig, build_engine
        from specgate.serving.server import serve as run_server

        try:
            dtype = weights_name(resolve_weights(dtype, target))  # auto -> gguf for a .gguf target, as in `generate`
        except ValueError as exc:
            raise common.UserError(str(exc)) from None

        config = ServerConfig(
            target=target, draft=draft, host=host, port=port, policy=policy, gamma=gamma, gamma_table=gamma_table,
            api_key=api_key, max_num_seqs=max_num_seqs, max_waiting=max_waiting, max_seq_len=max_seq_len,
            served_model_name=served_model_name, dtype=dtype, lossy=lossy, request_timeout_s=request_timeout_s,
            max_body_bytes=max_body_bytes, drain_timeout_s=drain_timeout_s, debug_step_delay_ms=debug_step_delay_ms,
        )
        config.validate()
        if policy == "table" and not gamma_table:
            raise common.UserError("--policy table needs --gamma-table, e.g. '1-4:4,5-8:2,9-64:0'")
        with common.err_console.status(f"loading {target} and preparing the {policy} policy"):
            engine = build_engine(config)

        def on_ready(bound_host: str, bound_port: int) -> None:
            url = f"http://{bound_host}:{bound_port}"
            info = {
                "url": url, "host": bound_host, "port": bound_port, "model": engine.model_name,
                "draft": engine.scheduler.draft_name, "policy": engine.scheduler.policy.describe(),
                "lossless": lossy is None, "max_num_seqs": max_num_seqs, "max_waiting": max_waiting, "max_seq_len": engine.scheduler.max_seq_len,
            }
            if json_output:
                common.print_json(info)
            else:
                common.err_console.print(
                    f"specgate serving [bold]{engine.model_name}[/] (draft {info['draft']}, policy {policy}) at {url}/v1",
                    highlight=False,
                )

        run_server(config, engine, on_ready=on_ready)
