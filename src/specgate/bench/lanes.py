"""Lanes of a serving benchmark: the speculation setting a server runs, its label, and the order lanes take turns in.

A lane is written `off`, `fixed=G` (`fixed`: the default gamma), `adaptive` or `adaptive:key=value[:key=value]` (an
adaptive variant: LANE_OPTIONS), each with an optional `#tag`: `fixed=4#b` is a second server of `fixed=4`, a twin
that measures the judge's own noise (judges.judge) and is never a candidate for the best lane.
"""

from __future__ import annotations

from specgate.serving import AdaptivePolicy, SpeculationPolicy, make_policy

POLICIES = ("off", "fixed", "adaptive")

# an adaptive lane's options: name -> (AdaptivePolicy keyword, or None for the scheduler's prior weight; type; check; meaning)
LANE_OPTIONS = {
    "prior": (None, float, lambda v: v > 0, "W > 0: pseudo-tests of the traffic's acceptance in a request's estimate"),
    "margin": ("margin", float, lambda v: 0 <= v < 0.5, "0 <= M < 0.5: the hysteresis"),
    "probe": ("probe_every", int, lambda v: v >= 0, "N >= 0: decisions between probes (0 = never)"),
}


def parse_lane(lane: str, gamma: int) -> tuple[str, int]:
    """'off' / 'adaptive' / 'fixed' / 'fixed=G' (with optional options and tag) -> (policy name, gamma)."""
    name, _, value = lane.partition("#")[0].partition(":")[0].partition("=")
    if name not in POLICIES:
        raise ValueError(f"lane {lane!r}: the policy must be off, fixed, fixed=G or adaptive (with optional :key=value options and a #tag)")
    lane_options(lane)
    return name, int(value) if value else gamma


def lane_options(lane: str) -> dict[str, float | int]:
    """'adaptive:prior=1:margin=0' -> {'prior': 1.0, 'margin': 0.0}, in the order given. prior: the lane's scheduler
    weighs the traffic's acceptance profile by W pseudo-tests in each request's estimate (Scheduler
    request_prior_weight); margin, probe: AdaptivePolicy's margin and probe_every."""
    text = lane.partition("#")[0].partition(":")[2]
    options: dict[str, float | int] = {}
    for option in text.split(":") if text else []:
        key, _, raw = option.partition("=")
        if key not in LANE_OPTIONS:
            raise ValueError(f"lane {lane!r}: the option {key!r} is unknown: use {', '.join(f'{k}=' for k in LANE_OPTIONS)} (adaptive lanes only)")
        _, kind, check, meaning = LANE_OPTIONS[key]
        try:
            value = kind(raw)
        except ValueError:
            value = None
        if value is None or not check(value):
            raise ValueError(f"lane {lane!r}: the option must be :{key}=" + meaning)
        options[key] = value
    if options and not lane.startswith("adaptive"):
        raise ValueError(f"lane {lane!r}: options are for adaptive lanes only")
    return options


def lane_prior_weight(lane: str) -> float | None:
    """'adaptive:prior=1' -> 1.0 (None: the scheduler's default weight)."""
    return lane_options(lane).get("prior")


def lane_policy(lane: str, gamma: int, cost_model) -> SpeculationPolicy:
    """The lane's policy: make_policy by name, or the adaptive policy with the lane's options (on this cost model)."""
    name = parse_lane(lane, gamma)[0]
    keywords = {LANE_OPTIONS[k][0]: v for k, v in lane_options(lane).items() if LANE_OPTIONS[k][0] is not None}
    if keywords:
        return AdaptivePolicy(cost_model, gamma_max=gamma, **keywords)
    return make_policy(name, gamma=gamma, cost_model=cost_model)


def lane_label(lane: str, gamma: int, gamma_max: int) -> tuple[str, str, int]:
    """(policy name, label, gamma): 'fixed=4#b' -> ('fixed', 'fixed g=4 #b', 4); 'adaptive:prior=1' -> ('adaptive',
    'adaptive prior=1', gamma_max). gamma: a plain `fixed` lane's gamma."""
    name, gamma = parse_lane(lane, gamma_max if lane.startswith("adaptive") else gamma)
    tag = lane.partition("#")[2]
    label = f"fixed g={gamma}" if name == "fixed" else name
    label += "".join(f" {key}={value:g}" if isinstance(value, float) else f" {key}={value}" for key, value in lane_options(lane).items())
    return name, f"{label} #{tag}" if tag else label, gamma


def base_lane(label: str) -> str:
    """'fixed g=4 #b' -> 'fixed g=4': a tagged lane is a second server of the same setting."""
    return label.partition(" #")[0]


def is_twin(label: str) -> bool:
    """A tagged lane ('fixed g=4 #b'): a twin of its setting, a control of the judge."""
    return base_lane(label) != label


def lane_order(labels: list[str], index: int, order: str = "rotate") -> list[str]:
    """The lanes' order in round (or tick) `index`.

    rotate: a cyclic shift by `index`: every round starts from a different lane, but each lane always follows the
    same one. balanced: a Williams design: round i runs (base + i) mod n with base 0, 1, n-1, 2, n-2, ..., and for
    odd n every second block of n rounds runs those orders reversed; over 2n rounds (n for even n) every lane runs
    at every position equally often and follows every other lane equally often (first-order carry-over balanced)."""
    n = len(labels)
    if order == "rotate":
        shift = index % n
        return labels[shift:] + labels[:shift]
    if order != "balanced":
        raise ValueError(f"order={order!r} is unknown: use rotate or balanced")
    base = [0]
    for k in range(1, n):
        base.append((k + 1) // 2 if k % 2 else n - k // 2)
    row = [labels[(b + index) % n] for b in base]
    return row[::-1] if n % 2 and (index // n) % 2 else row
