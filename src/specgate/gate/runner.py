"""Run the gate: start (or reach) the servers, measure every configuration phase by phase, score quality,
decide, write the report.

Embedded mode (default): one `specgate serve` subprocess per configuration on 127.0.0.1 with a free port,
one at a time (so two servers never share the cores): the baseline (`--draft none`), then each speculative
draft (`--policy fixed --gamma G`, so the measured gamma is the configured one). External mode: the
`--baseline-endpoint` and `--endpoint` URLs (any OpenAI-compatible engine) with their Prometheus `/metrics`
(or `--metrics-url`), read before and after each phase.

Phases per configuration, in order (each one's counters are the delta over that phase):
  warmup -> c1:<category> (closed loop, concurrency 1, greedy, one phase per category: per-category
  acceptance, the greedy outputs for exact match, step times) -> c<n> for the other concurrencies ->
  poisson (open loop at --qps) -> math (greedy, few-shot) -> sample (temperature 1, seeded per prompt).
A server that dies (or stops answering) ends its configuration: what was measured is kept, the rest of its
phases are skipped, and the configuration records which phase failed and why.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specgate.gate import client as gate_client
from specgate.gate import decision, launch, prom, quality, recommend
from specgate.gate.launch import Endpoint, ServerStartError
from specgate.gate import workload as wl



@dataclass
class GateOptions:
    out: Path
    target: str = "gemma-3-270m"
    drafts: list[str] = field(default_factory=lambda: ["default", "ngram"])  # specgate: --draft (each at --policy fixed)
    gamma: int = 4
    gammas: list[int] = field(default_factory=list)  # every draft length to try (--gamma 2,4,8); [gamma] when empty
    dtype: str = "auto"  # what `specgate serve` loads the target in: the gate measures the deployment a user runs
    lossy: str | None = None  # embedded: add one LOSSY configuration (ngram drafts, --lossy SPEC) to the comparison
    engine: str | None = None  # the engine to launch (default specgate) or behind --endpoint (default: read from its answers)
    specs: list[str] = field(default_factory=list)  # --spec: the engine's speculative methods (default per engine)
    server_cmd: str | None = None  # a launch template for any engine: {port}, {gamma}, {model}
    baseline_cmd: str | None = None
    threads: int | None = None  # llama.cpp: -t (default: every core)
    adaptive: bool = True  # specgate: also measure --policy adaptive on the best fixed draft
    recommend: bool = True  # launch and measure the recommended configuration
    endpoint: str | None = None
    baseline_endpoint: str | None = None
    metrics_urls: list[str] = field(default_factory=list)  # external: [spec, baseline] metrics URLs (default URL/metrics)
    model: str | None = None
    api_key: str | None = None
    workload: str = wl.BUILTIN
    math: str = wl.BUILTIN
    text: str = wl.BUILTIN
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    qps: float = 1.0
    per_category: int = 6
    requests_per_level: int = 16
    poisson_requests: int = 16
    max_tokens: int = 64
    greedy_tokens: int = 128  # tokens per prompt of the concurrency-1 greedy phase (exact match, acceptance per category)
    math_items: int = 40
    sample_prompts: int = 24
    max_num_seqs: int = 8
    max_seq_len: int = 1024
    seed: int = 0
    score: bool = True  # score perplexity / sampled log-likelihood with the target's weights in this process
    request_timeout_s: float = 300.0
    thresholds: decision.Thresholds = field(default_factory=decision.Thresholds)

    @staticmethod
    def quick(out: Path) -> "GateOptions":
        """~5 minutes of gate work on Gemma-3-270M on 2 cores (plus model loading)."""
        return GateOptions(out=out, concurrency=[1, 4], per_category=2, requests_per_level=6, poisson_requests=5, qps=1.0,
                           max_tokens=24, greedy_tokens=64, math_items=8, sample_prompts=8, max_num_seqs=4, max_seq_len=512)

    @property
    def external(self) -> bool:
        return self.endpoint is not None or self.baseline_endpoint is not None

    def launch_options(self) -> launch.LaunchOptions:
        engine = self.engine or ("unknown" if self.server_cmd or self.baseline_cmd else "specgate")  # a template's engine: read from its server
        specs = self.specs or (self.drafts if engine == "specgate" else launch.DEFAULT_SPECS.get(engine, []))
        return launch.LaunchOptions(
            engine=engine, target=self.target, specs=list(specs), gamma=self.gamma, gammas=list(self.gammas),
            max_num_seqs=self.max_num_seqs, max_seq_len=self.max_seq_len, dtype=resolve_dtype(self.dtype, self.target), lossy=self.lossy,
            model=self.model, threads=self.threads, server_cmd=self.server_cmd, baseline_cmd=self.baseline_cmd,
        )

    def validate(self) -> None:
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
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"--concurrency {self.concurrency} must be a list of integers >= 1, e.g. 1,2,4,8")
        self.concurrency = sorted(set(self.concurrency))
        if self.thresholds.target_concurrency not in self.concurrency:
            raise ValueError(
                f"--target-concurrency {self.thresholds.target_concurrency} is not among the measured --concurrency "
                f"{','.join(map(str, self.concurrency))}: add it to --concurrency or pick one of them"
            )
        self.gammas = self.gammas or [self.gamma]
        self.gamma = self.gammas[0]
        for g in self.gammas:
            if not 1 <= g <= 64:
                raise ValueError(f"--gamma {g} is out of range 1..64 (draft tokens per step)")
        for name in ("per_category", "requests_per_level", "poisson_requests", "max_tokens", "greedy_tokens", "math_items", "sample_prompts", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if not self.qps > 0:
            raise ValueError(f"--qps {self.qps} must be > 0 (Poisson arrival rate, requests per second)")
        if not self.external and self.engine in (None, "specgate") and not self.server_cmd and self.target != "gemma-3-270m" \
                and not Path(self.target).expanduser().exists():
            raise ValueError(f"--target {self.target!r} does not exist: give gemma-3-270m, a local HF directory or a .gguf file")
        if self.dtype not in GATE_WEIGHTS:
            raise ValueError(f"--dtype {self.dtype!r} is not supported: use one of {', '.join(GATE_WEIGHTS)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads {self.threads} must be >= 1")
        self.thresholds.validate()
        if not self.external:
            launch.build_profiles(self.launch_options())  # a bad engine, spec or template is one line now, not mid-run


def check_out_dir(out: Path) -> Path:
    """Create --out if needed and prove it is writable; ValueError naming the directory otherwise."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".specgate-write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"--out {str(out)!r} is not a writable directory ({exc.strerror or exc}): choose a directory you can write to") from None
    return out


GATE_WEIGHTS = ("auto", "float32", "bfloat16", "gguf", "int8")  # specgate.models.dtypes.WEIGHT_CHOICES


def resolve_dtype(dtype: str, target: str = "") -> str:
    """'auto' -> what `specgate serve --dtype auto` loads TARGET in (specgate.models.dtypes.resolve_weights): a .gguf
    target's own blocks ("gguf") where the native kernels run, else the runtime's default dtype name."""
    if dtype != "auto":
        return dtype
    from specgate.models.dtypes import resolve_weights, weights_name

    return weights_name(resolve_weights(dtype, target))


# ------------------------------------------------------------------------------------------ servers


def mem_total_mib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def gpu_memory_mib(pid: int | None = None) -> dict[str, float] | None:
    """GPU memory via nvidia-smi where present: {used, total} MiB (used by `pid` when given and listed)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        total_out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True, timeout=10, check=True).stdout
        used, total = (sum(float(line.split(",")[i]) for line in total_out.strip().splitlines()) for i in (0, 1))
        if pid is not None:
            apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=10, check=True).stdout
            mine = [float(line.split(",")[1]) for line in apps.strip().splitlines() if line.split(",")[0].strip() == str(pid)]
            used = sum(mine) if mine else used
        return {"used": used, "total": total}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def default_draft_unavailable(target: str) -> str | None:
    """Why `--draft default` cannot work for `target` (None when a default draft is registered for it)."""
    from specgate.drafting.registry import DEFAULT_DRAFTS, EAGLE_PREFIX

    name = Path(target).name if os.sep in target else target
    if name in DEFAULT_DRAFTS:
        spec = DEFAULT_DRAFTS[name].removeprefix(EAGLE_PREFIX)
        where = Path(spec)
        if os.sep in spec and not any((where / f).is_file() for f in ("config.json", "eagle_config.json")) and not where.is_file():
            return f"the default draft for {target} is unavailable (its weights are not at {where} yet): continuing without it"
        return None
    known = ", ".join(sorted(DEFAULT_DRAFTS)) or "none yet"
    return (f"the default draft for {target} is unavailable (not registered in specgate.drafting.registry.DEFAULT_DRAFTS; "
            f"targets with one: {known}): continuing without it")


# ------------------------------------------------------------------------------------------ phases


@dataclass
class Plan:
    """The requests of every phase, identical for every configuration (paired comparisons)."""

    c1_by_category: dict[str, list[gate_client.RequestSpec]]
    load: list[gate_client.RequestSpec]
    poisson: list[gate_client.RequestSpec]
    math: list[gate_client.RequestSpec]
    sample: list[gate_client.RequestSpec]
    math_items: list[wl.MathItem]
    categories: dict[str, str]

    def total(self, concurrency: list[int], requests_per_level: int) -> int:
        levels = [c for c in concurrency if c != 1]
        return (1 + sum(len(v) for v in self.c1_by_category.values()) + len(levels) * requests_per_level
                + len(self.poisson) + len(self.math) + len(self.sample))


def make_plan(options: GateOptions) -> Plan:
    prompts = wl.take_balanced(wl.load_prompts(options.workload), options.per_category)
    math_items = wl.load_math(options.math)[: options.math_items]

    def spec(p: wl.Prompt, **kw: Any) -> gate_client.RequestSpec:
        return gate_client.RequestSpec(p.id, p.category, p.prompt, p.max_tokens or options.max_tokens, **kw)

    by_category: dict[str, list[gate_client.RequestSpec]] = {}
    for p in prompts:  # the greedy phase is long enough to show a divergence that 24 tokens hide
        by_category.setdefault(p.category, []).append(gate_client.RequestSpec(p.id, p.category, p.prompt, p.max_tokens or options.greedy_tokens))
    load = [spec(prompts[i % len(prompts)]) for i in range(options.requests_per_level)]
    poisson = [spec(prompts[i % len(prompts)]) for i in range(options.poisson_requests)]
    math_specs = [gate_client.RequestSpec(m.id, "math-set", quality.math_prompt(m), 8, ignore_eos=False, stop=["\n"]) for m in math_items]
    sample = [spec(prompts[i % len(prompts)], temperature=1.0, seed=options.seed * 7919 + i) for i in range(min(options.sample_prompts, len(prompts)))]
    return Plan(by_category, load, poisson, math_specs, sample, math_items, {p.id: p.category for p in prompts})


async def _scrape(http: Any, url: str) -> prom.SpecSnapshot | None:
    try:
        response = await http.get(url, timeout=10.0)
        if response.status_code != 200:
            return None
        return prom.read_spec(prom.parse_exposition(response.text))
    except Exception:  # the server is gone, or not Prometheus: no counters for this phase
        return None


async def _healthy(http: Any, url: str) -> bool:
    try:
        return (await http.get(f"{url}/health", timeout=10.0)).status_code == 200
    except Exception:
        return False


PhaseHook = Callable[[str, str, Endpoint], None]


async def measure_config(
    endpoint: Endpoint, plan: Plan, options: GateOptions, result: dict[str, Any], records: list[dict], *,
    advance: Callable[[int], None], after_phase: PhaseHook | None = None,
) -> None:
    """Run every phase against one endpoint, filling `result` (sweep, poisson, windows, outputs, memory)."""
    import httpx

    client = gate_client.Client(endpoint.url, model=options.model, api_key=options.api_key, timeout_s=options.request_timeout_s)
    http = httpx.AsyncClient()
    phases = _Phases(endpoint, http, result, records, after_phase)
    result.update({"sweep": [], "per_category": {}, "per_category_latency": {}, "greedy": {}, "math_outputs": {}, "samples": {}, "phases": []})
    try:
        await _run_phases(phases, client, plan, options, advance)
    except ServerDied as exc:
        result["failure"] = str(exc)
    finally:
        snapshot = await _scrape(http, endpoint.metrics_url)
        result["spec_total"] = prom.merge_windows(phases.windows).to_dict() if phases.windows else None
        result["timings_total"] = gate_client.sum_timings(phases.timed)
        result["memory"] = _memory(endpoint, snapshot)
        await client.close()
        await http.aclose()


class _Phases:
    """Runs one endpoint's phases: each between two scrapes of its metrics, its records kept, the server checked."""

    def __init__(self, endpoint: Endpoint, http: Any, result: dict[str, Any], records: list[dict], after_phase: PhaseHook | None) -> None:
        self.endpoint, self.http, self.result, self.records, self.after_phase = endpoint, http, result, records, after_phase
        self.windows: list[prom.SpecWindow] = []  # the speculation counters' deltas, one per phase that has them
        self.timed: list[gate_client.RequestRecord] = []  # the records whose timings cover the same requests as the counters

    async def run(self, phase_name: str, run: Callable[[], Any]) -> tuple[gate_client.PhaseResult, prom.SpecWindow | None]:
        """Run one phase; ServerDied if the server died during it or after it."""
        endpoint = self.endpoint
        before = await _scrape(self.http, endpoint.metrics_url)
        phase_start = time.perf_counter()
        outcome = await run()
        after = await _scrape(self.http, endpoint.metrics_url)
        window = prom.spec_window(before, after) if before is not None and after is not None else None
        if window is not None:
            self.windows.append(window)
        for record in outcome.records:
            self.records.append(record.to_dict())
        if window is not None or before is None:  # the timings cover the same requests as the counters
            self.timed.extend(outcome.records)
        self.result["phases"].append({"name": phase_name, "wall_s": time.perf_counter() - phase_start, "failed": sum(not r.ok for r in outcome.records)})
        failed = [r for r in outcome.records if not r.ok]
        if self.after_phase is not None:
            self.after_phase(endpoint.name, phase_name, endpoint)
        if failed and (not endpoint.alive() or not await _healthy(self.http, endpoint.url)):
            raise ServerDied(f"{endpoint.exit_description()} during phase '{phase_name}' "
                             f"({len(failed)}/{len(outcome.records)} requests failed: {failed[0].error})")
        if not endpoint.alive():
            raise ServerDied(f"{endpoint.exit_description()} after phase '{phase_name}'")
        return outcome, window


async def _run_phases(phases: _Phases, client: Any, plan: Plan, options: GateOptions, advance: Callable[[int], None]) -> None:
    """warmup, concurrency 1 per category, the other concurrency levels, poisson, math and sample, into phases.result."""
    name, result = phases.endpoint.name, phases.result

    def closed(specs: list, concurrency: int, phase_name: str) -> Callable[[], Any]:
        return lambda: gate_client.closed_loop(client, specs, concurrency, config=name, phase=phase_name, on_done=lambda _: advance(1))

    warm = [gate_client.RequestSpec("warmup", "warmup", "Hello", 4)]
    await phases.run("warmup", closed(warm, 1, "warmup"))
    level1_records: list[gate_client.RequestRecord] = []
    level1_wall, level1_windows = 0.0, []
    for category, specs in plan.c1_by_category.items():
        outcome, window = await phases.run(f"c1:{category}", closed(specs, 1, f"c1:{category}"))
        level1_records += outcome.records
        level1_wall += outcome.wall_s
        result["per_category"][category] = window.to_dict() if window else None
        result["per_category_latency"][category] = gate_client.summarise(outcome)
        if window:
            level1_windows.append(window)
        result["greedy"].update({r.prompt_id: r.text for r in outcome.ok})
    level = gate_client.summarise(gate_client.PhaseResult(level1_records, level1_wall))
    level.update(concurrency=1, spec=prom.merge_windows(level1_windows).to_dict() if level1_windows else None)
    result["sweep"].append(level)
    for concurrency in [c for c in options.concurrency if c != 1]:
        outcome, window = await phases.run(f"c{concurrency}", closed(plan.load, concurrency, f"c{concurrency}"))
        level = gate_client.summarise(outcome)
        level.update(concurrency=concurrency, spec=window.to_dict() if window else None)
        result["sweep"].append(level)
    outcome, window = await phases.run("poisson", lambda: gate_client.open_loop(
        client, plan.poisson, options.qps, config=name, phase="poisson", seed=options.seed, on_done=lambda _: advance(1)))
    result["poisson"] = {**gate_client.summarise(outcome), "qps": options.qps, "spec": window.to_dict() if window else None}
    outcome, _ = await phases.run("math", closed(plan.math, max(options.concurrency), "math"))
    result["math_outputs"] = {r.prompt_id: r.text for r in outcome.ok}
    outcome, _ = await phases.run("sample", closed(plan.sample, max(options.concurrency), "sample"))
    result["samples"] = {r.prompt_id: r.text for r in outcome.ok}


def _memory(endpoint: Endpoint, snapshot: Any) -> dict[str, Any]:
    """The server's peak RSS, the machine's RAM, GPU memory used / total and the KV slots and preemptions counters."""
    rss = endpoint.peak_rss_mib()
    gpu = gpu_memory_mib(endpoint.process.pid if endpoint.process else None)
    return {
        "peak_rss_mib": rss, "mem_total_mib": mem_total_mib() if endpoint.process else None,
        "gpu_memory_used_mib": gpu["used"] if gpu else None, "gpu_memory_total_mib": gpu["total"] if gpu else None,
        "kv_slots_total": snapshot.kv_slots_total if snapshot else None,
        "preemptions": snapshot.preemptions if snapshot else None,
    }


class ServerDied(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------ the whole run


def _profiles(options: GateOptions, notes: list[str]) -> list[launch.LaunchProfile]:
    """Every configuration to launch, the baseline first; `--draft default` without a default draft is a note."""
    profiles = launch.build_profiles(options.launch_options())
    kept = []
    for profile in profiles:
        if profile.engine == "specgate" and profile.draft == "default":
            why = default_draft_unavailable(options.target)
            if why is not None:
                if why not in notes:
                    notes.append(why)
                continue
        kept.append(profile)
    return kept


def _adaptive_profile(options: GateOptions, profiles: list[launch.LaunchProfile], results: dict[str, dict]) -> launch.LaunchProfile | None:
    """specgate's adaptive policy on the fixed draft with the best throughput at the target concurrency."""
    fixed = [p for p in profiles if p.engine == "specgate" and p.policy == "fixed" and not p.lossy and not results.get(p.name, {}).get("failure")]
    if not options.adaptive or not fixed or any(p.policy == "adaptive" for p in profiles):
        return None
    best = max(fixed, key=lambda p: recommend.throughput(results[p.name], options.thresholds.target_concurrency) or 0.0)
    o = options.launch_options()
    gamma = max(max(options.gammas or [options.gamma]), 8 if options.gamma <= 8 else options.gamma)  # serve's default gamma_max is 8
    name = f"{best.name.split('-g')[0]}-adaptive"
    return launch.LaunchProfile(name, "specgate", launch.specgate_command(o, best.draft, "adaptive", gamma), f"adaptive:{best.draft}", gamma,
                                "adaptive", draft=best.draft)


class _Measurer:
    """Starts each profile, measures it phase by phase, stops it; a server that fails to start is a failure entry."""

    def __init__(self, options: GateOptions, plan: Plan, results: dict, records: list, progress: Any, after_phase: PhaseHook | None, log: Callable[[str], None]) -> None:
        self.options, self.plan, self.results, self.records = options, plan, results, records
        self.progress, self.after_phase, self.log = progress, after_phase, log
        self.total = plan.total(options.concurrency, options.requests_per_level)

    def measure(self, endpoint: Endpoint, meta: dict[str, Any]) -> None:
        task = self.progress.add_task(f"{endpoint.name}", total=self.total) if self.progress else None
        result = self.results.setdefault(endpoint.name, meta)
        advance = (lambda n: self.progress.advance(task, n)) if self.progress else (lambda n: None)
        asyncio.run(measure_config(endpoint, self.plan, self.options, result, self.records, advance=advance, after_phase=self.after_phase))
        if self.progress:
            self.progress.update(task, completed=self.total)

    def launch(self, profile: launch.LaunchProfile) -> None:
        meta = profile.meta()
        self.log(f"starting {profile.name}: {profile.command()}")
        start_s = time.perf_counter()
        try:
            endpoint = launch.start(profile, self.options.out)
        except ServerStartError as exc:
            self.results[profile.name] = {**meta, "failure": f"server did not start: {exc}"}
            self.log(f"{profile.name}: {exc}")
            return
        meta["server"], meta["startup_s"] = endpoint.info, time.perf_counter() - start_s
        if meta["engine"] == "unknown":  # a --server-cmd template: the server says what it is
            meta["engine"] = launch.detect_engine(endpoint.url)
        try:
            self.measure(endpoint, meta)
        finally:
            endpoint.stop()


def _measure_external(options: GateOptions, measurer: _Measurer, log: Callable[[str], None]) -> None:
    metrics = options.metrics_urls + [None] * (2 - len(options.metrics_urls))
    pairs = [("baseline", options.baseline_endpoint, metrics[1], "none"), ("speculative", options.endpoint, metrics[0], "external")]
    for name, url, murl, draft in pairs:
        url = url.rstrip("/")
        engine = options.engine or launch.detect_engine(url)
        log(f"measuring {name} at {url} ({engine})")
        endpoint = Endpoint(name, url, murl or f"{url}/metrics")
        measurer.measure(endpoint, {"name": name, "engine": engine, "draft": draft, "spec": draft, "gamma": options.gamma if draft != "none" else 0,
                                    "url": url, "lossy": None, "policy": "engine", "command": None})


def run_gate(options: GateOptions, *, progress: Any = None, after_phase: PhaseHook | None = None, log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Measure, recommend, measure the recommendation, score, decide and write the report (also as report.json)."""
    from specgate.gate import report as gate_report

    options.validate()
    out = check_out_dir(options.out)
    started = time.perf_counter()
    plan = make_plan(options)
    notes: list[str] = []
    results: dict[str, dict[str, Any]] = {}
    records: list[dict] = []
    measurer = _Measurer(options, plan, results, records, progress, after_phase, log)
    profiles: list[launch.LaunchProfile] = []
    if options.external:
        _measure_external(options, measurer, log)
    else:
        profiles = _profiles(options, notes)
        for profile in profiles:
            measurer.launch(profile)
        adaptive = _adaptive_profile(options, profiles, results)
        if adaptive is not None:
            profiles.append(adaptive)
            measurer.launch(adaptive)
    advice = recommend.recommend(options, plan, results, profiles)
    if advice.profile is not None and options.recommend:
        measurer.launch(advice.profile)
    scoring_start = time.perf_counter()
    scored = score_quality(options, plan, results, notes, log)
    scored["scoring_s"] = time.perf_counter() - scoring_start
    report = gate_report.build_report(options, plan, results, scored, notes, wall_s=time.perf_counter() - started, advice=advice)
    gate_report.write_outputs(out, report, records)
    return report


def score_quality(options: GateOptions, plan: Plan, results: dict[str, dict], notes: list[str], log: Callable[[str], None]) -> dict[str, Any]:
    """Target-side scoring in this process (after every server stopped): text perplexity and sampled log-likelihoods."""
    scored: dict[str, Any] = {"perplexity": None, "loglik": {}}
    if not options.score:
        notes.append("target scoring skipped (--no-score): no perplexity, no sampled log-likelihood test")
        return scored
    try:
        from specgate.models import load_model
        from specgate.models.dtypes import resolve_weights

        weights = resolve_weights(resolve_dtype(options.dtype, options.target), options.target)  # as the served target
        log(f"scoring with the target {options.target} in this process")
        loaded = load_model(options.target, dtype=weights)
        scorer = quality.TargetScorer(loaded)
        scored["tokenizer"] = loaded.tokenizer  # token positions of greedy mismatches
    except (FileNotFoundError, ValueError, OSError) as exc:
        notes.append(f"target scoring unavailable ({exc}): give --target with local weights for perplexity and the log-likelihood test")
        return scored
    scored["perplexity"] = scorer.perplexity(wl.load_text(options.text), seed=options.seed)
    prompts = {s.prompt_id: s.prompt for s in plan.sample}
    for name, result in results.items():
        scored["loglik"][name] = {pid: scorer.continuation_logprob(prompts[pid], text) for pid, text in (result.get("samples") or {}).items() if pid in prompts}
    return scored
