"""Run the gate: start (or reach) the servers, measure them as an experiment, decide once, write the report.

Embedded mode (default), in order:
1. The baseline's server starts first (it prepares the target's caches), then every configuration's server whose
   memory fits beside it (the rest wait for a later group); the target is loaded in this process to score quality.
2. Fixed work per server, one server at a time: a warm-up request; the greedy phase, one per category, batched
   (acceptance per category, the texts for exact match: a batch-variant engine shows its divergences there); the
   math set; the sampled continuations, scored by the target at once.
3. Screening: `--rounds` blocks of paired rounds (rounds.py) over the baseline and every configuration, at every
   closed-loop concurrency; each configuration is decided on them (decision.decide_config).
4. The recommendation, chosen on the screening's intervals (decision.choose): a configuration, its schedule
   (a new `--policy table` server, with its own fixed work) or no speculation.
5. Confirmation: the recommendation against the baseline in fresh paired rounds, at every concurrency and under
   open-loop Poisson arrivals, block after block until every binding criterion that more rounds can decide is
   decided or `--budget-s` is spent. Each look decides at 95% family-wise over the looks the budget allows
   (Bonferroni), so stopping early does not inflate the error rate. The verdict is the confirmation's.
External mode: the two endpoints are the baseline and the one configuration: fixed work, then the confirmation.
A server that dies (or stops answering) ends its configuration: what was measured is kept, its failure is named.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specgate.gate import client as gate_client
from specgate.gate import decision, launch, prom, quality, rounds, stats
from specgate.gate import workload as wl
from specgate.gate.launch import Endpoint, ServerStartError
from specgate.gate.options import QPS_FRACTION, GateOptions, resolve_dtype
from specgate.gate.records import ConfigRun

SCREEN, CONFIRM = "screen", "confirm"
STAGES = (SCREEN, CONFIRM)
RECOMMENDED = "recommended"
MEMORY_SHARE = 0.7  # servers kept up together may take this share of the memory available when the baseline is up
BASELINE = "baseline"

__all__ = ["GateOptions", "resolve_dtype", "run_gate", "check_out_dir", "make_plan", "target_tokenizer"]


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


def mem_info_mib(key: str = "MemTotal") -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{key}:"):
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


# ------------------------------------------------------------------------------------------ the plan


@dataclass
class Plan:
    """The requests of every phase, identical for every configuration (paired comparisons)."""

    greedy_by_category: dict[str, list[gate_client.RequestSpec]]
    load: list[gate_client.RequestSpec]  # the paired rounds' request pool (each block draws a permutation of it)
    math: list[gate_client.RequestSpec]
    sample: list[gate_client.RequestSpec]
    math_items: list[wl.MathItem]
    categories: dict[str, str]
    sample_prompts: dict[str, str]  # sample id -> its prompt (for scoring)
    traffic: dict[str, Any] | None = None  # the workload at a glance (workload.describe), for the report
    recorded: bool = False  # open-loop rounds replay the load's own arrival times, in its order (--arrivals recorded)

    @property
    def fixed_requests(self) -> int:
        return 1 + sum(len(v) for v in self.greedy_by_category.values()) + len(self.math) + len(self.sample)


def target_tokenizer(target: str) -> Any:
    """The target's tokenizer where it is local (the embedded default, an HF directory, a .gguf), else None: then
    token counts are estimated and chat turns take the plain format (specgate.chat)."""
    from specgate.models import loading

    path = Path(target).expanduser()
    try:
        if target == loading.DEFAULT_MODEL:
            return loading.load_tokenizer(loading.ensure_default_model())
        if path.is_dir() and (path / "config.json").is_file():
            return loading.load_tokenizer(path)
        if path.is_file() and path.suffix == ".gguf":
            return loading.load_tokenizer(path.parent, gguf_file=path.name)
    except (OSError, ValueError):
        return None
    return None


def token_counter(tokenizer: Any) -> Callable[[str], int] | None:
    """The target's token count of a text (None without a tokenizer: the workload estimates)."""
    return (lambda text: len(tokenizer(text)["input_ids"])) if tokenizer is not None else None


def load_workload(options: GateOptions, tokenizer: Any) -> wl.Traffic:
    """--workload as prompts: the built-in set balanced by category, any other source through workload.load_traffic
    (chat turns rendered as the target's servers render them, so every engine gets the same text)."""
    from specgate import chat

    count = token_counter(tokenizer)
    if options.workload == wl.BUILTIN and options.arrivals != "recorded":
        traffic = wl.load_traffic(wl.BUILTIN, count_tokens=count, max_context=options.max_seq_len, max_tokens=options.max_tokens,
                                  categories=options.workload_category or None)
        return replace(traffic, prompts=wl.take_balanced(traffic.prompts, options.per_category))
    traffic = wl.load_traffic(options.workload, count_tokens=count, render=lambda messages: chat.render_for_completions(tokenizer, messages),
                              max_context=options.max_seq_len, max_tokens=options.max_tokens, sample=options.requests, seed=options.seed,
                              categories=options.workload_category or None)
    if options.arrivals == "recorded" and any(p.arrival_s is None for p in traffic.prompts):
        raise ValueError(f"--arrivals recorded replays a request log's timestamps, and --workload {options.workload} has none: "
                         "give a log whose lines carry a timestamp, or --arrivals poisson")
    return traffic


def _load_spec(p: wl.Prompt, max_tokens: int) -> gate_client.RequestSpec:
    """A paired-round request: the prompt's own length and sampling where its source gives them (a replayed log)."""
    sampling = dict(p.sampling)
    return gate_client.RequestSpec(
        p.id, p.category, p.prompt, p.max_tokens or max_tokens, temperature=float(sampling.get("temperature", 0.0)),
        seed=sampling.get("seed"), ignore_eos=bool(sampling.get("ignore_eos", True)),
        stop=[sampling["stop"]] if isinstance(sampling.get("stop"), str) else sampling.get("stop"),
        top_p=sampling.get("top_p"), top_k=sampling.get("top_k"), arrival_s=p.arrival_s,
    )


def make_plan(options: GateOptions, tokenizer: Any = None) -> Plan:
    traffic = load_workload(options, tokenizer)
    prompts = traffic.prompts
    math_items = wl.load_math(options.math)[: options.math_items]
    by_category: dict[str, list[gate_client.RequestSpec]] = {}
    for p in prompts:  # greedy and long enough to show a divergence that a short one hides, whatever the traffic's lengths
        by_category.setdefault(p.category, []).append(gate_client.RequestSpec(p.id, p.category, p.prompt, options.greedy_tokens))
    load = [_load_spec(p, options.max_tokens) for p in prompts]
    math_specs = [gate_client.RequestSpec(m.id, "math-set", quality.math_prompt(m), 12, ignore_eos=False, stop=["\n"]) for m in math_items]
    sample = []
    for i in range(options.sample_prompts):  # more samples than prompts: each prompt again with another seed
        p = prompts[i % len(prompts)]
        sample.append(gate_client.RequestSpec(f"{p.id}#{i // len(prompts)}", p.category, p.prompt, options.sample_tokens, temperature=1.0,
                                              seed=options.seed * 7919 + i))
    return Plan(by_category, load, math_specs, sample, math_items, {p.id: p.category for p in prompts}, {s.prompt_id: s.prompt for s in sample},
                traffic=traffic_summary(traffic, load, tokenizer), recorded=options.arrivals == "recorded")


def traffic_summary(traffic: wl.Traffic, load: list[gate_client.RequestSpec], tokenizer: Any) -> dict[str, Any]:
    """The workload at a glance for the report: its source, what was left out and why, every request's prompt and
    output tokens (their quantiles), the category mix."""
    count = token_counter(tokenizer)
    described = wl.describe(traffic, count)
    prompt_tokens = [(count or wl.estimate_tokens)(p.prompt) for p in traffic.prompts]
    output_tokens = [spec.max_tokens for spec in load]
    return {**described, "prompts": len(traffic.prompts), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "quantiles": {"prompt_tokens": described["prompt_tokens"], "output_tokens": wl.quantiles(output_tokens)}}


# ------------------------------------------------------------------------------------------ servers


@dataclass
class Server:
    run: ConfigRun
    endpoint: Endpoint
    target: rounds.Target


class ServerDied(RuntimeError):
    pass


PhaseHook = Callable[[str, str, Endpoint], None]


class Gate:
    """One gate run: its servers, what they measured, and the decisions."""

    def __init__(self, options: GateOptions, plan: Plan, progress: Any, log: Callable[[str], None], after_phase: PhaseHook | None) -> None:
        self.options, self.plan, self.progress, self.log, self.after_phase = options, plan, progress, log, after_phase
        self.out = Path(options.out)
        self.runs: dict[str, ConfigRun] = {}
        self.servers: dict[str, Server] = {}
        self.records: list[dict] = []
        self.notes: list[str] = []
        self.scorer: Any = None
        self.http: Any = None
        self.window_s: dict[str, float] = {}
        self.stages: dict[str, dict[str, Any]] = {}
        self.screening: dict[str, decision.ConfigDecision] = {}
        self.confirmation: decision.ConfigDecision | None = None
        self.advice: decision.Advice | None = None
        self.profiles: dict[str, launch.LaunchProfile] = {}
        self.single = False  # one configuration only: measured to a decision in the first stage

    # -------------------------------------------------------------- servers
    def spawn(self, profile: launch.LaunchProfile) -> Endpoint | None:
        run = self.runs.setdefault(profile.name, ConfigRun(profile.name, profile.engine, profile.spec, profile.gamma, profile.policy,
                                                           profile.draft, profile.lossy, profile.gamma_table, profile.command()))
        self.log(f"starting {profile.name}: {profile.command()}")
        try:
            endpoint = launch.spawn(profile, self.out)
        except ServerStartError as exc:
            run.failure = f"server did not start: {exc}"
            return None
        endpoint.info["spawned_at"] = time.perf_counter()
        return endpoint

    def ready(self, endpoint: Endpoint | None) -> Server | None:
        if endpoint is None:
            return None
        run = self.runs[endpoint.name]
        try:
            launch.wait_ready(endpoint)
        except ServerStartError as exc:
            run.failure = f"server did not start: {exc}"
            self.log(f"{endpoint.name}: {exc}")
            return None
        run.startup_s, run.url, run.server = time.perf_counter() - endpoint.info["spawned_at"], endpoint.url, dict(endpoint.info)
        if run.engine == "unknown":  # a --server-cmd template: the server says what it is
            run.engine = launch.detect_engine(endpoint.url)
        server = Server(run, endpoint, self.target(endpoint.name, endpoint))
        self.servers[endpoint.name] = server
        return server

    def target(self, name: str, endpoint: Endpoint) -> rounds.Target:
        client = gate_client.Client(endpoint.url, model=self.options.model, api_key=self.options.api_key, timeout_s=self.options.request_timeout_s)

        async def scrape() -> prom.SpecSnapshot | None:
            return await _scrape(self.http, endpoint.metrics_url)

        async def healthy() -> bool:
            return endpoint.alive() and await _healthy(self.http, endpoint.url)

        return rounds.Target(name, client, scrape, healthy)

    async def stop(self, name: str) -> None:
        server = self.servers.pop(name, None)
        if server is None:
            return
        await self.read_memory([name], server)
        await server.target.client.close()
        server.endpoint.stop()

    async def read_memory(self, names: list[str], server: Server | None = None) -> None:
        """Each server's memory so far (peak RSS, GPU, KV slots, preemptions), for the decision and the report."""
        for name in names:
            found = server or self.servers.get(name)
            if found is not None and found.endpoint.alive():
                found.run.memory = _memory(found.endpoint, await _scrape(self.http, found.endpoint.metrics_url))

    # -------------------------------------------------------------- fixed work
    async def fixed_work(self, server: Server) -> None:
        """Warm-up, the greedy phase per category, math and the samples (then scored), one server alone."""
        run, plan = server.run, self.plan
        task = self.progress.add_task(f"{run.name}: phases", total=plan.fixed_requests) if self.progress else None
        advance = (lambda _: self.progress.advance(task, 1)) if task is not None else (lambda _: None)
        level = self.options.max_num_seqs  # fixed work at the servers' full batch: it is not what the rounds time
        try:
            await self.phase(server, "warmup", [gate_client.RequestSpec("warmup", "warmup", "Hello", 4)], 1, advance)
            for category, specs in plan.greedy_by_category.items():  # batched: the greedy output must not depend on the batch
                outcome, window = await self.phase(server, f"greedy:{category}", specs, level, advance)
                run.per_category[category] = window.to_dict() if window else None
                run.per_category_latency[category] = gate_client.summarise(outcome)
                run.greedy.update({r.prompt_id: r.text for r in outcome.ok})
                run.greedy_tpot.update({r.prompt_id: r.tpot_s for r in outcome.ok if r.tpot_s})
                run.greedy_drafts.update({r.prompt_id: (r.draft_tokens, r.accepted_tokens or 0, r.draft_steps or 0) for r in outcome.ok if r.draft_tokens})
            outcome, _ = await self.phase(server, "math", plan.math, level, advance)
            run.math_outputs = {r.prompt_id: r.text for r in outcome.ok}
            outcome, _ = await self.phase(server, "sample", plan.sample, level, advance)
            run.samples = {r.prompt_id: r.text for r in outcome.ok}
        except ServerDied as exc:
            run.failure = str(exc)
        finally:
            if task is not None:
                self.progress.update(task, completed=plan.fixed_requests)
        self.score(run)

    async def phase(self, server: Server, name: str, specs: list[gate_client.RequestSpec], concurrency: int,
                    advance: Callable[[Any], None]) -> tuple[gate_client.PhaseResult, prom.SpecWindow | None]:
        """One closed-loop phase between two scrapes of the server's counters; ServerDied if the server died."""
        endpoint, run = server.endpoint, server.run
        before = await server.target.scrape()
        started = time.perf_counter()
        outcome = await gate_client.closed_loop(server.target.client, specs, concurrency, config=run.name, phase=name, on_done=advance)
        after = await server.target.scrape()
        window = prom.spec_window(before, after) if before is not None and after is not None else None
        if window is not None:
            run.phase_windows.append(window)
        timed = gate_client.sum_timings(outcome.records)
        if timed:
            run.timings = {k: (run.timings or {}).get(k, 0) + v for k, v in timed.items()}
        self.records += [r.to_dict() for r in outcome.records]
        failed = [r for r in outcome.records if not r.ok]
        run.phases.append({"name": name, "wall_s": time.perf_counter() - started, "failed": len(failed)})
        if self.after_phase is not None:
            self.after_phase(run.name, name, endpoint)
        if failed and (not endpoint.alive() or not await _healthy(self.http, endpoint.url)):
            raise ServerDied(f"{endpoint.exit_description()} during phase '{name}' ({len(failed)}/{len(outcome.records)} requests failed: {failed[0].error})")
        if not endpoint.alive():
            raise ServerDied(f"{endpoint.exit_description()} after phase '{name}'")
        return outcome, window

    def score(self, run: ConfigRun) -> None:
        """The target's scores of the run's sampled continuations (in this process; the servers sit idle)."""
        if self.scorer is None or not run.samples:
            return
        run.scores = {sid: self.scorer.score_continuation(self.plan.sample_prompts[sid], text)
                      for sid, text in run.samples.items() if sid in self.plan.sample_prompts}

    def load_scorer(self) -> None:
        if not self.options.score:
            self.notes.append("target scoring skipped (--no-score): no perplexity, no sampled log-likelihood test")
            return
        try:
            from specgate.models import load_model
            from specgate.models.dtypes import resolve_weights

            weights = resolve_weights(resolve_dtype(self.options.dtype, self.options.target), self.options.target)  # as the served target
            self.log(f"loading the target {self.options.target} in this process to score quality")
            self.scorer = quality.TargetScorer(load_model(self.options.target, dtype=weights))
        except (FileNotFoundError, ValueError, OSError) as exc:
            self.notes.append(f"target scoring unavailable ({exc}): give --target with local weights for perplexity and the log-likelihood test")

    # -------------------------------------------------------------- paired rounds
    def loads(self, poisson: bool) -> list[rounds.Load]:
        out = [rounds.closed(c) for c in self.options.concurrency]
        return out + [rounds.Load(rounds.POISSON, qps=self.options.qps)] if poisson else out

    def poisson_qps(self) -> float:
        """--qps, else QPS_FRACTION of the baseline's capacity at the target concurrency (requests/s it completed)."""
        if self.plan.recorded:
            qps = len(self.plan.load) / rounds.replay_period_s(self.plan.load)
            self.notes.append(f"open-loop rounds replay the log's own arrivals ({len(self.plan.load)} requests, {qps:.3g} requests/s on average) "
                              "in its order; the criteria named 'under Poisson' judge them")
            return qps
        if self.options.qps:
            return self.options.qps
        target = f"c{self.options.judged_concurrency}"
        windows = [w for w in self.runs[BASELINE].windows if w.load == target]
        tokens_per_request = sum(s.max_tokens for s in self.plan.load) / len(self.plan.load)
        if not windows:
            self.notes.append(f"the baseline was not measured at {target}: the Poisson rate defaults to 1 request/s")
            return 1.0
        qps = QPS_FRACTION * sum(w.tokens_per_s for w in windows) / len(windows) / tokens_per_request
        self.notes.append(f"Poisson arrivals at {qps:.3g} requests/s: {QPS_FRACTION:g} x the baseline's capacity at {target}")
        return qps

    async def measure_block(self, stage: str, block: int, names: list[str], loads: list[rounds.Load]) -> float:
        """One block of paired rounds: every load, the servers in the block's order; its wall seconds."""
        started = time.perf_counter()
        for load in loads:
            if load.name == rounds.POISSON and load.qps is None:
                load.qps = self.poisson_qps()
            window_s = self.window_s.get(load.name, self.options.round_s)
            sequence = rounds.block_sequence(self.plan.load, block, self.options.seed)
            gaps = []
            for name in rounds.block_order(names, block):
                server = self.servers.get(name)
                if server is None or server.run.failure:
                    continue
                window = await self.measure_round(server, stage, block, load, sequence, window_s)
                if window is not None and window.chunk_gap_p50_s:
                    gaps.append(window.chunk_gap_p50_s)
            if gaps:  # the next blocks' windows span at least rounds.STEPS_PER_WINDOW steps of the slowest server
                self.window_s[load.name] = rounds.window_length_s(self.options.round_s, max(gaps))
        return time.perf_counter() - started

    async def measure_round(self, server: Server, stage: str, block: int, load: rounds.Load, sequence: list[gate_client.RequestSpec],
                            window_s: float) -> rounds.Window | None:
        try:
            if load.closed:
                done, before, after = await rounds.closed_round(server.target, load, sequence, block, window_s)
            else:
                done, before, after = await rounds.open_round(server.target, load, self.plan.load if self.plan.recorded else sequence, block, window_s,
                                                              self.options.seed, recorded=self.plan.recorded)
        except rounds.ServerGone as exc:
            server.run.failure = f"{server.endpoint.exit_description()} during paired round {block} at {load.name} ({exc})"
            self.log(f"{server.run.name}: {server.run.failure}")
            return None
        window = rounds.summarise_round(done, before, after)
        window.stage = stage
        server.run.windows.append(window)
        self.records += [r.to_dict() for r in done.records]
        return window

    def alive(self, names: list[str]) -> list[str]:
        return [n for n in names if n in self.servers and not self.runs[n].failure]

    def quality(self, name: str) -> dict[str, Any]:
        configurations = len([n for n in self.runs if n not in (BASELINE, RECOMMENDED)]) + (1 if self.options.recommend else 0)
        return decision.quality_of(self.runs[BASELINE], self.runs[name], self.plan, self.options, configurations)

    async def screen(self, names: list[str], first_block: int) -> int:
        """`--rounds` blocks over the baseline and `names`, at every closed-loop concurrency; each decided at 95%."""
        loads = self.loads(poisson=False)
        task = self.progress.add_task("screening: paired rounds", total=self.options.rounds) if self.progress else None
        started, measured = time.perf_counter(), 0
        for block in range(first_block, first_block + self.options.rounds):
            alive = self.alive([BASELINE, *names])
            if BASELINE not in alive or len(alive) < 2:
                break
            await self.measure_block(SCREEN, block, alive, loads)
            measured += 1
            if task is not None:
                self.progress.advance(task, 1)
        stage = self.stages.setdefault(SCREEN, {"blocks": 0, "wall_s": 0.0, "level": stats.LEVEL, "looks": 1, "loads": [x.name for x in loads]})
        stage["blocks"] += measured
        stage["wall_s"] += time.perf_counter() - started
        await self.read_memory([BASELINE, *names])
        for name in names:
            self.screening[name] = decision.decide_config(self.runs[BASELINE], self.runs[name], SCREEN, stage["loads"], self.quality(name),
                                                          self.options, stats.LEVEL, categories=self.plan.categories)
        return first_block + self.options.rounds

    async def sequential(self, name: str, stage: str = CONFIRM) -> decision.ConfigDecision:
        """Fresh paired rounds of `name` against the baseline at every load, Poisson included, until every binding
        criterion that rounds can decide is decided or the budget is spent (module docstring: looks and levels)."""
        loads = self.loads(poisson=True)
        started, block, looks, level = time.perf_counter(), 0, [self.options.rounds], stats.LEVEL
        verb = "confirming" if stage == CONFIRM else "measuring"
        task = self.progress.add_task(f"{verb} {name}: paired rounds", total=self.options.rounds) if self.progress else None
        decided: decision.ConfigDecision | None = None
        while set(self.alive([BASELINE, name])) == {BASELINE, name}:
            block_s = await self.measure_block(stage, block, [BASELINE, name], loads)
            block += 1
            if block == 2:  # the budget's looks, planned from the second block's length (the first block's windows
                # are --round-s; from the second on they span rounds.STEPS_PER_WINDOW steps, often longer)
                looks = planned_looks(self.options.rounds, self.options.budget_s, block_s, done=1, spent_s=time.perf_counter() - started - block_s)
                level = stats.split_level(stats.LEVEL, len(looks))
                if task is not None:
                    self.progress.update(task, total=looks[-1])
            if task is not None:
                self.progress.advance(task, 1)
            out_of_budget = block >= self.options.rounds and time.perf_counter() - started + block_s > self.options.budget_s
            if block in looks or out_of_budget or block >= looks[-1]:
                decided = await self.decide(name, stage, loads, level)
                if decision.rounds_decided(decided, self.options) or out_of_budget or block >= looks[-1]:
                    break
        self.stages[stage] = {"blocks": block, "wall_s": time.perf_counter() - started, "level": level, "looks": len(looks),
                              "planned_blocks": looks, "budget_s": self.options.budget_s, "loads": [x.name for x in loads],
                              "qps": next((x.qps for x in loads if x.name == rounds.POISSON), None)}
        return decided or await self.decide(name, stage, loads, level)  # a server died before the first look

    async def decide(self, name: str, stage: str, loads: list[rounds.Load], level: float) -> decision.ConfigDecision:
        await self.read_memory([BASELINE, name])
        decided = decision.decide_config(self.runs[BASELINE], self.runs[name], stage, [x.name for x in loads], self.quality(name), self.options, level,
                                         categories=self.plan.categories)
        if stage == CONFIRM:
            self.confirmation = decided
        else:
            self.screening[name] = decided
        return decided


    # -------------------------------------------------------------- the two modes
    async def embedded(self) -> None:
        profiles = _profiles(self.options, self.notes)
        self.profiles = {p.name: p for p in profiles}
        base = self.ready(self.spawn(profiles[0]))  # alone first: it prepares the target's caches for the others
        if base is None:  # nothing to compare with: each configuration is only started, to report whether it would
            for profile in profiles[1:]:
                server = self.ready(self.spawn(profile))
                if server is not None:
                    await self.stop(profile.name)
                    server.run.failure = "not measured: the baseline's server did not start"
            return
        groups = memory_groups(profiles[1:], base.endpoint.peak_rss_mib())
        if len(groups) > 1:
            self.notes.append(f"memory holds {len(groups[0])} configuration server(s) beside the baseline: screened in {len(groups)} groups")
        block = 0
        for index, group in enumerate(groups or [[]]):
            endpoints = [self.spawn(p) for p in group]
            if index == 0:
                self.load_scorer()  # while the group's servers start
            servers = [s for s in (self.ready(e) for e in endpoints) if s is not None]
            if index == 0:
                await self.fixed_work(base)
            for server in servers:
                await self.fixed_work(server)
            names = [p.name for p in group]  # a server that failed is decided too (its `completed` criterion fails)
            if len(profiles) == 2 and self.alive(names):  # one configuration: no choice to be cursed by, measured to a decision at once
                self.single = True
                await self.sequential(names[0], SCREEN)
            else:
                block = await self.screen(names, block)
            if index < len(groups) - 1:
                for server in servers:
                    await self.stop(server.run.name)
        if self.options.recommend and self.screening:
            name = await self.recommendation()
            if name is not None and not self.runs[name].failure:
                await self.sequential(name, CONFIRM)
        elif self.screening:
            self.advice = decision.choose(self.screening, self.runs, self.options)

    async def recommendation(self) -> str | None:
        """Choose on the screening; a schedule gets its own server and fixed work, a configuration its server again."""
        advice = self.advice = decision.choose(self.screening, self.runs, self.options)
        self.log(f"recommendation: {advice.kind} {advice.based_on or ''}: {advice.reason}")
        if advice.kind == "off" or advice.based_on is None:
            return None
        source = self.runs[advice.based_on]
        if advice.kind == "config" and self.single:
            return None  # the only configuration, measured to a decision in its own rounds: that decision is the verdict
        if advice.kind == "schedule":
            profile = launch.table_profile(self.options.launch_options(), source.draft or "ngram", advice.gamma_table or "", name=RECOMMENDED)
            server = self.ready(self.spawn(profile))
            if server is not None:
                await self.fixed_work(server)
            return RECOMMENDED
        server = self.servers.get(advice.based_on)
        if server is None:  # screened in an earlier memory group: started again
            server = self.ready(self.spawn(launch.with_name(self.profiles[advice.based_on], advice.based_on)))
            if server is None:
                return None
        run = replace(source, name=RECOMMENDED, windows=[], failure=None)  # its fixed work is the same server's
        self.runs[RECOMMENDED] = run
        self.servers[RECOMMENDED] = Server(run, server.endpoint, self.target(RECOMMENDED, server.endpoint))
        return RECOMMENDED

    async def external(self) -> None:
        o = self.options
        metrics = o.metrics_urls + [None] * (2 - len(o.metrics_urls))
        for name, url, murl in ((BASELINE, o.baseline_endpoint, metrics[1]), ("speculative", o.endpoint, metrics[0])):
            url = str(url).rstrip("/")
            engine = o.engine or launch.detect_engine(url)
            self.log(f"measuring {name} at {url} ({engine})")
            endpoint = Endpoint(name, url, murl or f"{url}/metrics", info={"url": url})
            spec = "none" if name == BASELINE else "external"
            self.runs[name] = ConfigRun(name, engine, spec, 0 if name == BASELINE else o.gamma, "off" if name == BASELINE else "engine",
                                        draft=spec, url=url)
            self.servers[name] = Server(self.runs[name], endpoint, self.target(name, endpoint))
        self.load_scorer()
        for name in (BASELINE, "speculative"):
            await self.fixed_work(self.servers[name])
        if not self.runs["speculative"].failure and not self.runs[BASELINE].failure:
            await self.sequential("speculative", CONFIRM)

    async def main(self) -> None:
        import httpx

        self.http = httpx.AsyncClient()
        try:
            await (self.external() if self.options.external else self.embedded())
        finally:
            for name in reversed(list(self.servers)):  # the recommendation first: it may share its source's server
                await self.stop(name)
            await self.http.aclose()


def planned_looks(first: int, budget_s: float, block_s: float, done: int = 0, spent_s: float = 0.0) -> list[int]:
    """The block counts at which a stage decides: after `first` blocks (--rounds, whatever the budget), then every 2
    (whole ABBA pairs) while the budget holds more blocks of `block_s` after `done` blocks took `spent_s`."""
    most = max(first, done + int(max(budget_s - spent_s, 0.0) // max(block_s, 1e-9)))
    looks = list(range(first, most + 1, 2))
    return looks if looks[-1] == most else [*looks, most]


# ------------------------------------------------------------------------------------------ the whole run


def _profiles(options: GateOptions, notes: list[str]) -> list[launch.LaunchProfile]:
    """Every configuration to launch, the baseline first; `--draft default` without a default draft is a note; with
    --adaptive, specgate's adaptive policy on the first speculative draft."""
    kept, dropped = [], None
    for profile in launch.build_profiles(options.launch_options()):
        if profile.engine == "specgate" and profile.draft == "default":
            why = default_draft_unavailable(options.target)
            if why is not None:
                if why not in notes:
                    notes.append(why)
                dropped = profile
                continue
        kept.append(profile)
    if dropped is not None and len(kept) == 1:  # nothing left to measure: prompt lookup needs no model
        argv = launch.specgate_command(options.launch_options(), "ngram", "fixed", dropped.gamma)
        kept.append(launch.LaunchProfile("ngram", "specgate", argv, "ngram", dropped.gamma, "fixed", draft="ngram"))
        notes.append("measuring --draft ngram in its place (prompt lookup needs no draft model)")
    fixed = [p for p in kept if p.engine == "specgate" and p.policy == "fixed" and not p.lossy]
    if options.adaptive and fixed and not any(p.policy == "adaptive" for p in kept):
        draft = fixed[0].draft or "ngram"
        gamma = max(max(options.gammas), 8)  # serve's default gamma_max is 8
        argv = launch.specgate_command(options.launch_options(), draft, "adaptive", gamma)
        name = f"{fixed[0].name.split('-g')[0]}-adaptive"
        kept.append(launch.LaunchProfile(name, "specgate", argv, f"adaptive:{draft}", gamma, "adaptive", draft=draft))
    return kept


def memory_groups(profiles: list[launch.LaunchProfile], baseline_rss_mib: float | None) -> list[list[launch.LaunchProfile]]:
    """The configurations in groups whose servers fit beside the baseline in MEMORY_SHARE of the available memory
    (each assumed as large as the baseline, a draft's weights given a third more)."""
    available = mem_info_mib("MemAvailable")
    if not profiles or not baseline_rss_mib or not available:
        return [profiles] if profiles else []
    size = max(1, int(MEMORY_SHARE * available // (1.33 * baseline_rss_mib)))
    return [profiles[i : i + size] for i in range(0, len(profiles), size)]


def run_gate(options: GateOptions, *, plan: Plan | None = None, progress: Any = None, after_phase: PhaseHook | None = None,
             log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Measure, decide and write the report; the report (also report.json). `plan`: make_plan's, when the caller
    made it already (to refuse a bad workload before any progress display)."""
    from specgate.gate import report as gate_report

    options.validate()
    check_out_dir(options.out)
    started = time.perf_counter()
    gate = Gate(options, plan or make_plan(options, target_tokenizer(options.target)), progress, log, after_phase)
    asyncio.run(gate.main())
    perplexity = None
    if gate.scorer is not None:
        perplexity = gate.scorer.perplexity(wl.load_text(options.text), seed=options.seed)
    result = decision.conclude(gate.advice, gate.screening, gate.confirmation, gate.runs, gate.stages, gate.notes, perplexity)
    report = gate_report.build_report(options, gate.plan, result, tokenizer=gate.scorer.tokenizer if gate.scorer else None,
                                      wall_s=time.perf_counter() - started)
    return gate_report.write_outputs(Path(options.out), report, gate.records)


async def _scrape(http: Any, url: str) -> prom.SpecSnapshot | None:
    try:
        response = await http.get(url, timeout=10.0)
        if response.status_code != 200:
            return None
        return prom.read_spec(prom.parse_exposition(response.text))
    except Exception:  # the server is gone, or not Prometheus: no counters for this window
        return None


async def _healthy(http: Any, url: str) -> bool:
    try:
        return (await http.get(f"{url}/health", timeout=10.0)).status_code == 200
    except Exception:
        return False


def _memory(endpoint: Endpoint, snapshot: Any) -> dict[str, Any]:
    """The server's peak RSS, the machine's RAM, GPU memory used / total and the KV slots and preemptions counters."""
    gpu = gpu_memory_mib(endpoint.process.pid if endpoint.process else None)
    return {
        "peak_rss_mib": endpoint.peak_rss_mib(), "mem_total_mib": mem_info_mib() if endpoint.process else None,
        "gpu_memory_used_mib": gpu["used"] if gpu else None, "gpu_memory_total_mib": gpu["total"] if gpu else None,
        "kv_slots_total": snapshot.kv_slots_total if snapshot else None, "preemptions": snapshot.preemptions if snapshot else None,
    }
