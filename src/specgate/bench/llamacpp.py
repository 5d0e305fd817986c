"""specgate against llama.cpp on the same GGUF, threads and prompts, in one run, lanes taking turns (ratios within a run).

Decode lanes (one request at a time, greedy, N new tokens per prompt):
- llama.cpp target-only and n-gram: llama-server (as `specgate engines path llama.cpp` builds it) with
  --spec-type none / ngram-simple; decode tok/s = its own timings.predicted_per_second, end to end = wall time.
- specgate target-only and n-gram: specgate.engine.generate in this process on the GGUF's own quantized blocks
  (--dtype gguf); decode tok/s = new tokens / (wall - prefill), end to end = wall.
- specgate default and specgate EAGLE head (head_gamma > 0, where the target's `--draft default` is an EAGLE head):
  the default drafter (prompt lookup where the context repeats, the head elsewhere) and its head alone (no
  lookups). llama.cpp has no lane for a head (llama-server's draft lanes load a second GGUF model over token ids,
  not a head on the target's hidden states), so both are compared with llama.cpp's best lane.
Also the cost of a verification forward of 5 (and 9) tokens over a 1-token step of specgate's model, and whether
each n-gram lane's greedy output equals its own target-only output (specgate guarantees it; llama.cpp does not).

Served lanes (closed-loop clients at each concurrency C, no think time, greedy, EOS ignored, the same sequence of
requests for every lane): `specgate serve --dtype gguf` (n-gram drafts; --policy adaptive and --policy fixed) against
`llama-server -np C` (--spec-type none, ngram-simple and ngram-mod); output tokens per second = completion tokens
of all requests / the wall time from the first send to the last reply. The ratio per level is specgate's best lane
over llama.cpp's best lane.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from specgate.bench.timing import timed_s, turn_order
from specgate.bench.workloads import SERVING_PROMPTS

DECODE_PROMPTS = {  # grounded / code prompts: text the answer copies from, where n-gram drafting has something to find
    "code_rewrite": ("def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
                     "    return total / len(values)\n\n\n# The same function with type hints and a docstring:\n"
                     "def mean(values: list[float]) -> float:\n"),
    "code_complete": "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return it as a dict.\"\"\"\n",
    "grounded_qa": ("Context: The Eiffel Tower is 330 metres tall and was completed in 1889 for the World's Fair in "
                    "Paris. It was designed by the engineering company of Gustave Eiffel.\n"
                    "Question: When was the Eiffel Tower completed and who designed it?\nAnswer: The Eiffel Tower"),
}
SERVED_PROMPTS = [*DECODE_PROMPTS.values(), *SERVING_PROMPTS["repetitive"]]  # grounded + code, cycled in order

LLAMA_SERVED_SPECS = {  # lane -> llama-server speculation flags ({gamma}: the draft length)
    "llama.cpp": [],
    "llama.cpp ngram-simple": ["--spec-type", "ngram-simple", "--spec-draft-n-max", "{gamma}"],
    "llama.cpp ngram-mod": ["--spec-type", "ngram-mod", "--spec-draft-n-max", "{gamma}"],
}
SPECGATE_SERVED_POLICIES = {"specgate adaptive": ["--policy", "adaptive"], "specgate fixed": ["--policy", "fixed", "--gamma", "{gamma}"]}


# ------------------------------------------------------------------------------------------ servers


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float, command: list[str]) -> None:
    """Return once URL/health answers 200; RuntimeError naming the command if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before answering /health: {' '.join(command)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"server did not answer {url}/health within {timeout_s:.0f} s: {' '.join(command)}")


def start_llama(binary: Path, gguf: Path, port: int, threads: int, spec: list[str], slots: int = 1, ctx_per_slot: int = 2048) -> subprocess.Popen:
    """llama-server with `slots` parallel sequences (-np) of ctx_per_slot positions each."""
    command = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(ctx_per_slot * slots),
               "-np", str(slots), "--port", str(port), "--host", "127.0.0.1", "--no-warmup", *spec]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_healthy(f"http://127.0.0.1:{port}", process, 120, command)
    return process


def start_specgates(gguf: Path, threads: int, slots: int, policies: dict[int, list[str]]) -> list[subprocess.Popen]:
    """`specgate serve` on the GGUF's own blocks with n-gram drafts, one per port -> policy flags, started together
    (loading and the adaptive policy's calibration take minutes on a busy 2-core machine)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    started = []
    for port, policy in policies.items():
        command = [sys.executable, "-m", "specgate", "serve", "--target", str(gguf), "--dtype", "gguf", "--draft", "ngram",
                   "--port", str(port), "--max-num-seqs", str(slots), "--max-waiting", "1024", "--max-seq-len", "1024", *policy]
        started.append((subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env), port, command))
    try:
        for process, port, command in started:
            wait_healthy(f"http://127.0.0.1:{port}", process, 1800, command)
    except RuntimeError:
        stop([process for process, _, _ in started])
        raise
    return [process for process, _, _ in started]


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=900) as reply:
        return json.loads(reply.read())


# ------------------------------------------------------------------------------------------ requests


def llama_complete(port: int, prompt: str, tokens: int) -> dict:
    """One greedy /completion: its text, decode tok/s (llama.cpp's own timing), end-to-end tok/s and token count."""
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0.0, "top_k": 1, "cache_prompt": False, "seed": 0, "ignore_eos": True}
    result, wall_s = timed_s(lambda: post_json(f"http://127.0.0.1:{port}/completion", body))
    timings = result["timings"]
    return {"text": result["content"], "decode_tps": timings["predicted_per_second"], "e2e_tps": timings["predicted_n"] / wall_s,
            "tokens": timings["predicted_n"]}


def specgate_served(port: int, prompt: str, tokens: int) -> dict:
    """One greedy /v1/completions to `specgate serve`: its text and completion token count."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    result = post_json(f"http://127.0.0.1:{port}/v1/completions", body)
    return {"text": result["choices"][0]["text"], "tokens": result["usage"]["completion_tokens"]}


def specgate_complete(model, prompt: str, tokens: int, gamma: int, drafter: Any = None) -> dict:
    """One greedy request through specgate.engine.generate in this process (drafter, default: n-gram drafts when
    gamma > 0)."""
    from specgate.drafting import NgramDrafter, NoDrafter
    from specgate.engine import generate
    from specgate.sampling import SamplingParams

    if drafter is None:
        drafter = NgramDrafter() if gamma else NoDrafter()
    result = generate(prompt, model, drafter, gamma, SamplingParams(temperature=0.0), max_new_tokens=tokens, eos_ids=set())
    stats = result.stats
    return {"text": result.text, "tokens": result.tokens,
            "decode_tps": stats.new_tokens / max(stats.wall_s - stats.prefill_ms / 1e3, 1e-9), "e2e_tps": stats.new_tokens / stats.wall_s}


# ------------------------------------------------------------------------------------------ closed loop


@dataclass
class LoopResult:
    concurrency: int
    requests: int
    tokens: int  # completion tokens of all requests
    wall_s: float  # first send to last reply
    texts: list[str] = field(default_factory=list)  # request k's text, in the order sent

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def closed_loop(send: Callable[[str, int], dict], prompts: list[str], concurrency: int, requests: int, max_tokens: int) -> LoopResult:
    """`concurrency` client threads, no think time: each takes the next request k (prompt k mod len(prompts)) as
    soon as its last one returns, until `requests` were sent. send(prompt, max_tokens) -> {"text", "tokens"}."""
    if concurrency < 1 or requests < 1:
        raise ValueError(f"concurrency={concurrency}, requests={requests}: both must be >= 1")
    lock = threading.Lock()
    next_k = [0]
    texts: list[str] = [""] * requests
    counts = [0] * requests
    errors: list[BaseException] = []

    def client() -> None:
        while True:
            with lock:
                k = next_k[0]
                next_k[0] += 1
            if k >= requests or errors:
                return
            try:
                reply = send(prompts[k % len(prompts)], max_tokens)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                errors.append(exc)
                return
            texts[k], counts[k] = reply["text"], int(reply["tokens"])

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall_s = time.perf_counter() - start
    if errors:
        raise errors[0]
    return LoopResult(concurrency, requests, sum(counts), wall_s, texts)


def served_summary(runs: dict[str, dict[int, list[float]]]) -> dict[int, dict[str, Any]]:
    """lane -> concurrency -> tok/s of each round => per level: each lane's median, the best specgate lane and the
    best llama.cpp lane (by median), and their ratio (specgate / llama.cpp)."""
    levels = sorted({c for per_level in runs.values() for c in per_level})
    summary: dict[int, dict[str, Any]] = {}
    for c in levels:
        medians = {lane: statistics.median(per_level[c]) for lane, per_level in runs.items() if per_level.get(c)}
        best = {engine: max((lane for lane in medians if lane.startswith(engine)), key=medians.__getitem__, default=None)
                for engine in ("specgate", "llama.cpp")}
        ours, theirs = (medians[best[e]] if best[e] else None for e in ("specgate", "llama.cpp"))
        summary[c] = {"medians": medians, "best_specgate": best["specgate"], "best_llamacpp": best["llama.cpp"],
                      "ratio": ours / theirs if ours is not None and theirs else None}
    return summary


def served_table(summary: dict[int, dict[str, Any]]) -> list[str]:
    """Markdown: one row per concurrency, each lane's median output tok/s, the best of each engine and the ratio."""
    lanes = sorted({lane for row in summary.values() for lane in row["medians"]})
    lines = ["| concurrency | " + " | ".join(lanes) + " | specgate / llama.cpp (best lanes) |", "|---" * (len(lanes) + 2) + "|"]
    for c, row in summary.items():
        cells = [f"{row['medians'][lane]:.1f}" if lane in row["medians"] else "-" for lane in lanes]
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {ratio} |")
    return lines


# ------------------------------------------------------------------------------------------ the two benchmarks


def verify_ratio(model, widths=(1, 5, 9), repeats: int = 20) -> dict[int, float]:
    """Median ms of a forward of w tokens after a 64-token prefix, widths taking turns."""
    import torch

    m = model.model
    cache = m.new_cache(1, 256)
    prefix = torch.randint(10, 1000, (1, 64))
    times: dict[int, list[float]] = {w: [] for w in widths}
    with torch.inference_mode():
        m(prefix, torch.arange(64)[None], cache, torch.tensor([0]), logits=False)
        for _ in range(repeats):
            for w in widths:
                ids = torch.randint(10, 1000, (1, w))
                _, seconds = timed_s(lambda: m(ids, torch.arange(64, 64 + w)[None], cache, torch.tensor([0])))
                times[w].append(seconds * 1e3)
    return {w: statistics.median(t) for w, t in times.items()}


HEAD_LANES = ("specgate default", "specgate EAGLE head")  # lanes llama.cpp cannot run: divided by its best lane


def run_decode(gguf: Path, threads: int, tokens: int, rounds: int, gamma: int, port: int = 18391, head_gamma: int = 0) -> dict[str, Any]:
    """The decode lanes, prompt by prompt, lanes in turn (reversed every second round); medians and raw values.
    head_gamma > 0 adds the "specgate default" lane (the model's `--draft default`, an EAGLE drafter) and the
    "specgate EAGLE head" lane (its head alone), at that draft length."""
    import torch

    from specgate.drafting import make_drafter
    from specgate.drafting.eagle_drafter import EagleDrafter
    from specgate.drafting.registry import EAGLE_PREFIX, resolve_default
    from specgate.engines import llamacpp
    from specgate.models import load_model
    from specgate.models.loading import DEFAULT_MODEL, default_gguf_path

    torch.set_num_threads(threads)
    binary = llamacpp.binary_path("llama-server")
    model = load_model(DEFAULT_MODEL if gguf == default_gguf_path() else str(gguf), dtype="gguf")  # the registry knows the default by name
    servers = [start_llama(binary, gguf, port, threads, []),
               start_llama(binary, gguf, port + 1, threads, ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(gamma)])]
    lanes = {"llama.cpp": lambda p: llama_complete(port, p, tokens), "specgate": lambda p: specgate_complete(model, p, tokens, 0),
             "llama.cpp ngram": lambda p: llama_complete(port + 1, p, tokens), "specgate ngram": lambda p: specgate_complete(model, p, tokens, gamma)}
    if head_gamma > 0:
        if not resolve_default("default", model.name).startswith(EAGLE_PREFIX):
            raise ValueError(f"head_gamma={head_gamma}: {model.name}'s --draft default is not an EAGLE head: use head_gamma=0")
        default = make_drafter("default", model)
        head = EagleDrafter(default.head, model, name=default.name, lookup_min_n=0)  # the same head, alone
        lanes["specgate default"] = lambda p: specgate_complete(model, p, tokens, head_gamma, default)
        lanes["specgate EAGLE head"] = lambda p: specgate_complete(model, p, tokens, head_gamma, head)
    raw: dict[str, dict[str, list]] = {lane: {"decode_tps": [], "e2e_tps": [], "same_as_target_only": []} for lane in lanes}
    try:
        for run in lanes.values():  # warm-up, one short request each
            run("Hello")
        for round_ in range(rounds):
            for prompt in DECODE_PROMPTS.values():
                outputs = {lane: lanes[lane](prompt) for lane in turn_order(list(lanes), round_, alternate=True)}
                for lane, out in outputs.items():
                    raw[lane]["decode_tps"].append(out["decode_tps"])
                    raw[lane]["e2e_tps"].append(out["e2e_tps"])
                for engine in ("llama.cpp", "specgate"):
                    key = "text" if engine == "llama.cpp" else "tokens"
                    raw[f"{engine} ngram"]["same_as_target_only"].append(outputs[f"{engine} ngram"][key] == outputs[engine][key])
                for lane in HEAD_LANES:
                    if lane in outputs:
                        raw[lane]["same_as_target_only"].append(outputs[lane]["tokens"] == outputs["specgate"]["tokens"])
        forward_ms = verify_ratio(model)
    finally:
        stop(servers)
    summary = {lane: {"decode_tps": statistics.median(r["decode_tps"]), "e2e_tps": statistics.median(r["e2e_tps"]),
                      "pooled_tps": pooled_tps(r["decode_tps"]),
                      "same_as_target_only": f"{sum(r['same_as_target_only'])}/{len(r['same_as_target_only'])}" if r["same_as_target_only"] else "-"}
               for lane, r in raw.items()}
    return {"summary": summary, "raw": raw, "forward_ms": forward_ms}


def pooled_tps(rates: list[float]) -> float:
    """Tokens over time across requests of equal length: the harmonic mean of their tok/s (a slow prompt weighs
    what its time weighs, unlike a median across prompts of different kinds)."""
    return len(rates) / sum(1.0 / r for r in rates)


def pooled_ratio(ours: list[float], theirs: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """pooled_tps(ours) / pooled_tps(theirs) with a 95% bootstrap interval over the paired requests (same prompt
    and round resampled for both lanes)."""
    rng = random.Random(seed)
    n = len(ours)
    ratios = sorted(pooled_tps([ours[i] for i in idx]) / pooled_tps([theirs[i] for i in idx])
                    for idx in ([rng.randrange(n) for _ in range(n)] for _ in range(draws)))
    return pooled_tps(ours) / pooled_tps(theirs), ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def decode_lines(result: dict[str, Any]) -> list[str]:
    summary, forward_ms, raw = result["summary"], result["forward_ms"], result["raw"]
    lines = ["| lane | decode tok/s (median) | pooled decode tok/s | end-to-end tok/s | same output as target-only |", "|---|---|---|---|---|"]
    lines += [f"| {lane} | {s['decode_tps']:.1f} | {s['pooled_tps']:.1f} | {s['e2e_tps']:.1f} | {s['same_as_target_only']} |" for lane, s in summary.items()]
    pairs = [("target-only", "specgate", "llama.cpp"), ("n-gram", "specgate ngram", "llama.cpp ngram")]
    best = max(("llama.cpp", "llama.cpp ngram"), key=lambda lane: summary[lane]["pooled_tps"])
    pairs += [(f"{lane.removeprefix('specgate ')} / {best}", lane, best) for lane in HEAD_LANES if lane in raw]
    ratios = [(name, *pooled_ratio(raw[ours]["decode_tps"], raw[theirs]["decode_tps"])) for name, ours, theirs in pairs]
    lines.append("specgate / llama.cpp pooled decode: " + ", ".join(f"{name} {r:.2f}x [{lo:.2f}-{hi:.2f}]" for name, r, lo, hi in ratios))
    lines.append("specgate forward ms by tokens: " + ", ".join(f"{w}: {ms:.1f}" for w, ms in forward_ms.items())
                 + f" (5 / 1 = {forward_ms[5] / forward_ms[1]:.2f}x, 9 / 1 = {forward_ms[9] / forward_ms[1]:.2f}x)")
    return lines


def served_senders(gguf: Path, threads: int, gamma: int, level: int, specgate_ports: dict[str, int], port: int) -> tuple[dict, list]:
    """Start llama-server -np LEVEL once per llama.cpp lane; lane -> send function (specgate servers already run)."""
    from specgate.engines import llamacpp

    binary = llamacpp.binary_path("llama-server")
    senders: dict[str, Callable[[str, int], dict]] = {}
    processes = []
    for i, (lane, spec) in enumerate(LLAMA_SERVED_SPECS.items()):
        processes.append(start_llama(binary, gguf, port + i, threads, [s.format(gamma=gamma) for s in spec], slots=level, ctx_per_slot=1024))
        senders[lane] = lambda p, n, port=port + i: llama_complete(port, p, n)
    for lane, specgate_port in specgate_ports.items():
        senders[lane] = lambda p, n, port=specgate_port: specgate_served(port, p, n)
    return senders, processes


def run_served(gguf: Path, threads: int, tokens: int, rounds: int, gamma: int, levels: list[int], requests_per_client: int = 2,
               port: int = 18400, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every lane at every level, lanes in turn (reversed every second round); lane -> level -> tok/s per round."""
    specgate_ports = {lane: port + 10 + i for i, lane in enumerate(SPECGATE_SERVED_POLICIES)}
    specgate_servers = start_specgates(gguf, threads, max(levels), {specgate_ports[lane]: [s.format(gamma=gamma) for s in policy]
                                                                    for lane, policy in SPECGATE_SERVED_POLICIES.items()})
    log(f"specgate servers up: {', '.join(specgate_ports)}")
    runs: dict[str, dict[int, list[float]]] = {lane: {} for lane in [*LLAMA_SERVED_SPECS, *SPECGATE_SERVED_POLICIES]}
    try:
        for level in levels:
            senders, processes = served_senders(gguf, threads, gamma, level, specgate_ports, port)
            try:
                for send in senders.values():  # warm-up
                    send("Hello", 4)
                for round_ in range(rounds):
                    for lane in turn_order(list(senders), round_, alternate=True):
                        result = closed_loop(senders[lane], SERVED_PROMPTS, level, max(level * requests_per_client, 4), tokens)
                        runs[lane].setdefault(level, []).append(result.tokens_per_s)
                        log(f"C={level} round {round_} {lane}: {result.tokens_per_s:.1f} tok/s ({result.tokens} tokens in {result.wall_s:.1f} s)")
            finally:
                stop(processes)
    finally:
        stop(specgate_servers)
    return {"runs": runs, "summary": served_summary(runs)}
