"""Timing helpers shared by the benchmarks: medians, timed calls, and lanes run in turn (interleaved or alternating).

Why interleave: on a shared host the speed moves by tens of percent within seconds; lanes that take turns call by
call see the same slow phases, so their ratio is steadier than the ratio of two separate stretches of time.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence


def median(values: Sequence[float]) -> float:
    """The median (the mean of the two middle values for an even count); ValueError on no values."""
    if not values:
        raise ValueError("median of no values: time at least one call (repeats >= 1)")
    return statistics.median(values)


def middle(runs: Sequence[Any], key: Callable[[Any], float]) -> Any:
    """The run at the middle of `runs` sorted by key (for an even count the upper one): a run that happened, not
    an average of two, so its tokens and counters go with its time."""
    if not runs:
        raise ValueError("middle of no runs: run every lane at least once (repeats >= 1)")
    return sorted(runs, key=key)[len(runs) // 2]


def timed_s(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn's result, its wall seconds)."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def median_call_s(fn: Callable[[], Any], repeats: int, warmup: int = 0) -> float:
    """Median wall seconds of `repeats` calls of fn, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    return median([timed_s(fn)[1] for _ in range(repeats)])


def turn_order(names: Sequence[str], repeat: int, alternate: bool = False) -> list[str]:
    """The lanes' order in repeat `repeat`: always as given, or with alternate=True reversed every second repeat
    (A B, B A, A B, ...: neither lane always runs right after the other's warm caches)."""
    return list(names)[::-1] if alternate and repeat % 2 else list(names)


def interleaved_s(calls: dict[str, Callable[[], Any]], repeats: int, alternate: bool = False,
                  advance: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Every call once per repeat, in turn (turn_order), `repeats` times: name -> its wall seconds, call by call.
    advance (optional) is called after each timed call (a progress bar)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for repeat in range(repeats):
        for name in turn_order(list(calls), repeat, alternate):
            times[name].append(timed_s(calls[name])[1])
            if advance is not None:
                advance()
    return times


def interleaved_median_ms(calls: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """name -> median ms of `repeats` interleaved calls, after `warmup` untimed calls of each."""
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    return {name: 1e3 * median(times) for name, times in interleaved_s(calls, repeats).items()}
