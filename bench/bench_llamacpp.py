"""specgate against llama.cpp on the same GGUF, threads and prompts, in one run, alternating (ratios within a run).

Lanes, greedy, N new tokens per prompt, rounds alternating lane by lane:
- llama.cpp target-only: llama-server (as `specgate engines path llama.cpp` builds it), --spec-type none;
  decode tok/s = its own timings.predicted_per_second, end to end = the request's wall time.
- llama.cpp n-gram: a second llama-server with --spec-type ngram-simple --spec-draft-n-max GAMMA.
- specgate target-only and n-gram: specgate.engine.generate in this process on the GGUF's own quantized blocks
  (--dtype gguf); decode tok/s = new tokens / (wall - prefill), end to end = wall.
Also the cost of a verification forward of 5 (and 9) tokens over a 1-token step of specgate's model, and whether
each lane's greedy output equals its own target-only output (specgate guarantees it; llama.cpp does not).

    PYTHONPATH=src python bench/bench_llamacpp.py --threads 2 --tokens 96 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

import torch

PROMPTS = {  # grounded / code prompts: text the answer copies from, where n-gram drafting has something to find
    "code_rewrite": ("def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
                     "    return total / len(values)\n\n\n# The same function with type hints and a docstring:\n"
                     "def mean(values: list[float]) -> float:\n"),
    "code_complete": "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return it as a dict.\"\"\"\n",
    "grounded_qa": ("Context: The Eiffel Tower is 330 metres tall and was completed in 1889 for the World's Fair in "
                    "Paris. It was designed by the engineering company of Gustave Eiffel.\n"
                    "Question: When was the Eiffel Tower completed and who designed it?\nAnswer: The Eiffel Tower"),
}


def start_server(binary: Path, gguf: Path, port: int, threads: int, spec: list[str]) -> subprocess.Popen:
    command = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", "2048", "-np", "1",
               "--port", str(port), "--host", "127.0.0.1", "--no-warmup", *spec]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
                if reply.status == 200:
                    return process
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"llama-server on port {port} did not come up: {' '.join(command)}")


def llama_complete(port: int, prompt: str, tokens: int) -> dict:
    body = json.dumps({"prompt": prompt, "n_predict": tokens, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                       "seed": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as reply:
        result = json.loads(reply.read())
    timings = result["timings"]
    return {"text": result["content"], "decode_tps": timings["predicted_per_second"],
            "e2e_tps": timings["predicted_n"] / (time.perf_counter() - start)}


def specgate_complete(model, prompt: str, tokens: int, gamma: int) -> dict:
    from specgate.drafting import NgramDrafter, NoDrafter
    from specgate.engine import generate
    from specgate.sampling import SamplingParams

    drafter = NgramDrafter() if gamma else NoDrafter()
    result = generate(prompt, model, drafter, gamma, SamplingParams(temperature=0.0), max_new_tokens=tokens,
                      eos_ids=set())
    stats = result.stats
    return {"text": result.text if hasattr(result, "text") else "", "tokens": result.tokens,
            "decode_tps": stats.new_tokens / max(stats.wall_s - stats.prefill_ms / 1e3, 1e-9),
            "e2e_tps": stats.new_tokens / stats.wall_s}


def verify_ratio(model, widths=(1, 5, 9), repeats: int = 20) -> dict[int, float]:
    """Median ms of a forward of w tokens after a 64-token prefix, alternating widths."""
    m = model.model
    cache = m.new_cache(1, 256)
    prefix = torch.randint(10, 1000, (1, 64))
    times: dict[int, list[float]] = {w: [] for w in widths}
    with torch.inference_mode():
        m(prefix, torch.arange(64)[None], cache, torch.tensor([0]), logits=False)
        for _ in range(repeats):
            for w in widths:
                ids = torch.randint(10, 1000, (1, w))
                start = time.perf_counter()
                m(ids, torch.arange(64, 64 + w)[None], cache, torch.tensor([0]))
                times[w].append((time.perf_counter() - start) * 1e3)
    return {w: statistics.median(t) for w, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="the .gguf (default: the packaged Gemma-3-270M Q4_K_M)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gamma", type=int, default=8, help="n-gram draft length for both engines")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    from specgate.engines import llamacpp
    from specgate.models import load_model
    from specgate.models.loading import default_gguf_path

    torch.set_num_threads(args.threads)
    gguf = Path(args.gguf) if args.gguf else default_gguf_path()
    binary = llamacpp.binary_path("llama-server")
    model = load_model(str(gguf), dtype="gguf")
    servers = {"llama.cpp": (start_server(binary, gguf, 18391, args.threads, []), 18391),
               "llama.cpp ngram": (start_server(binary, gguf, 18392, args.threads,
                                                ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(args.gamma)]), 18392)}
    lanes = {
        "llama.cpp": lambda p: llama_complete(18391, p, args.tokens),
        "specgate": lambda p: specgate_complete(model, p, args.tokens, 0),
        "llama.cpp ngram": lambda p: llama_complete(18392, p, args.tokens),
        "specgate ngram": lambda p: specgate_complete(model, p, args.tokens, args.gamma),
    }
    results: dict[str, dict[str, list]] = {lane: {"decode_tps": [], "e2e_tps": [], "same_as_target_only": []} for lane in lanes}
    try:
        for lane in lanes:  # warm-up, one short request each
            lanes[lane]("Hello")
        for _ in range(args.rounds):
            for name, prompt in PROMPTS.items():
                outputs = {}
                for lane, run in lanes.items():
                    out = run(prompt)
                    outputs[lane] = out
                    results[lane]["decode_tps"].append(out["decode_tps"])
                    results[lane]["e2e_tps"].append(out["e2e_tps"])
                results["llama.cpp ngram"]["same_as_target_only"].append(outputs["llama.cpp ngram"]["text"] == outputs["llama.cpp"]["text"])
                results["specgate ngram"]["same_as_target_only"].append(outputs["specgate ngram"]["tokens"] == outputs["specgate"]["tokens"])
        ratios = verify_ratio(model)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=30)

    summary = {lane: {"decode_tps": statistics.median(r["decode_tps"]), "e2e_tps": statistics.median(r["e2e_tps"]),
                      "same_as_target_only": f"{sum(r['same_as_target_only'])}/{len(r['same_as_target_only'])}" if r["same_as_target_only"] else "-"}
               for lane, r in results.items()}
    print(f"GGUF {gguf.name}, {args.threads} threads, greedy, {args.tokens} new tokens, {len(PROMPTS)} prompts x {args.rounds} rounds (medians)")
    print(f"{'lane':<18}{'decode tok/s':>14}{'end-to-end tok/s':>18}{'== target-only':>16}")
    for lane, s in summary.items():
        print(f"{lane:<18}{s['decode_tps']:>14.1f}{s['e2e_tps']:>18.1f}{s['same_as_target_only']:>16}")
    print(f"specgate / llama.cpp decode: target-only {summary['specgate']['decode_tps'] / summary['llama.cpp']['decode_tps']:.2f}x, "
          f"n-gram {summary['specgate ngram']['decode_tps'] / summary['llama.cpp ngram']['decode_tps']:.2f}x")
    print("specgate forward ms by tokens: " + ", ".join(f"{w}: {ms:.1f}" for w, ms in ratios.items())
          + f"  (5 / 1 = {ratios[5] / ratios[1]:.2f}x, 9 / 1 = {ratios[9] / ratios[1]:.2f}x)")
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "raw": results, "forward_ms": ratios}, indent=1))


if __name__ == "__main__":
    main()
