"""Prometheus text exposition parsing and the speculative-decoding counter adapters (vLLM, SGLang, specgate).

    samples = parse_exposition(text)                 # [Sample(name, labels, value), ...]
    before, after = read_spec(samples0), read_spec(samples1)
    window = spec_window(before, after)              # counter deltas over the measured window

Flavours (the names each engine documents):
- vLLM: counters `vllm:spec_decode_num_drafts_total`, `vllm:spec_decode_num_draft_tokens_total`,
  `vllm:spec_decode_num_accepted_tokens_total`, `vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}`;
  `vllm:num_preemptions_total`, `vllm:generation_tokens_total`.
- specgate: the same names under `specgate:`, plus a `lossless` label, `specgate:kv_slots_total`.
- llama.cpp (`llama-server --metrics`): the same spec-decode names under `llamacpp:`, with vLLM's meanings.
- SGLang: gauges `sglang:spec_accept_length` and `sglang:spec_accept_rate` (the most recent batch, not
  cumulative: the window reports the value read after it, and AR / AL cannot be derived from deltas).
From counter deltas: AR = accepted / draft_tokens; mean AL = 1 + accepted / drafts; per-position rate
(marginal) = accepted_per_pos / drafts. Several label sets of one counter (models, engines) are summed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
FLAVOURS = ("vllm", "specgate", "llamacpp")


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


def _unescape(value: str) -> str:
    return value.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")


def _parse_value(text: str, line_number: int) -> float:
    special = {"+Inf": math.inf, "Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}
    if text in special:
        return special[text]
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"metrics line {line_number}: value {text!r} is not a number (Prometheus text format)") from None


def parse_exposition(text: str) -> list[Sample]:
    """Parse Prometheus text exposition format 0.0.4 (comments and blank lines skipped).

    Raises ValueError naming the line for a line that is not `name{labels} value [timestamp]`.
    """
    samples = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise ValueError(f"metrics line {number}: {line[:80]!r} is not 'name{{labels}} value' (Prometheus text format)")
        name, _, label_text, value = match.group(1), match.group(2), match.group(3), match.group(4)
        labels = tuple((k, _unescape(v)) for k, v in _LABEL.findall(label_text or ""))
        samples.append(Sample(name, labels, _parse_value(value, number)))
    return samples


def _sum(samples: list[Sample], name: str, **where: str) -> float | None:
    """Sum of every sample called `name` whose labels match `where`; None if there is none."""
    values = [s.value for s in samples if s.name == name and all(s.label(k) == v for k, v in where.items())]
    return float(sum(values)) if values else None


@dataclass
class SpecSnapshot:
    """Speculative-decoding metrics read at one instant (counters cumulative since the server started)."""

    flavour: str | None  # "vllm", "specgate", "llamacpp", "sglang" or None (no spec-decode metrics found)
    num_drafts: float | None = None
    num_draft_tokens: float | None = None
    num_accepted_tokens: float | None = None
    accepted_per_pos: dict[int, float] = field(default_factory=dict)
    lossy_steps: float = 0.0  # specgate: drafts verified under lossless="false"
    accept_length_gauge: float | None = None  # SGLang
    accept_rate_gauge: float | None = None  # SGLang
    generation_tokens: float | None = None
    preemptions: float | None = None
    kv_slots_total: float | None = None


def read_spec(samples: list[Sample]) -> SpecSnapshot:
    """Pick the flavour whose counters are present (vLLM, then specgate, then SGLang's gauges)."""
    names = {s.name for s in samples}
    for prefix in FLAVOURS:
        drafts = f"{prefix}:spec_decode_num_drafts_total"
        if drafts in names or f"{prefix}:generation_tokens_total" in names:
            per_pos: dict[int, float] = {}
            for s in samples:
                if s.name == f"{prefix}:spec_decode_num_accepted_tokens_per_pos_total" and s.label("position") is not None:
                    position = int(s.label("position"))
                    per_pos[position] = per_pos.get(position, 0.0) + s.value
            return SpecSnapshot(
                flavour=prefix,
                num_drafts=_sum(samples, drafts),
                num_draft_tokens=_sum(samples, f"{prefix}:spec_decode_num_draft_tokens_total"),
                num_accepted_tokens=_sum(samples, f"{prefix}:spec_decode_num_accepted_tokens_total"),
                accepted_per_pos=per_pos,
                lossy_steps=_sum(samples, drafts, lossless="false") or 0.0,
                generation_tokens=_sum(samples, f"{prefix}:generation_tokens_total"),
                preemptions=_sum(samples, f"{prefix}:num_preemptions_total"),
                kv_slots_total=_sum(samples, f"{prefix}:kv_slots_total"),
            )
    if "sglang:spec_accept_length" in names or "sglang:spec_accept_rate" in names:
        return SpecSnapshot(
            flavour="sglang",
            accept_length_gauge=_sum(samples, "sglang:spec_accept_length"),
            accept_rate_gauge=_sum(samples, "sglang:spec_accept_rate"),
            generation_tokens=_sum(samples, "sglang:generation_tokens_total"),
            preemptions=_sum(samples, "sglang:num_retracted_reqs") if "sglang:num_retracted_reqs" in names else None,
        )
    return SpecSnapshot(flavour=None)


@dataclass
class SpecWindow:
    """Spec-decode figures over one measured window (counter deltas; SGLang: the gauges read at its end)."""

    flavour: str | None
    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_pos: list[float] = field(default_factory=list)  # marginal counts, position 0..G-1
    generation_tokens: float | None = None
    preemptions: float | None = None
    lossy: bool = False
    acceptance_rate: float | None = None  # AR = accepted / draft_tokens
    acceptance_length: float | None = None  # mean AL = 1 + accepted / drafts (tokens per verify step)
    per_position_rate: list[float] = field(default_factory=list)  # accepted_per_pos / drafts (marginal)
    mean_draft_len: float | None = None  # draft_tokens / drafts

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _delta(after: float | None, before: float | None) -> float | None:
    if after is None:
        return None
    return after - (before or 0.0)


def spec_window(before: SpecSnapshot, after: SpecSnapshot) -> SpecWindow:
    """Deltas of the counters between two snapshots of one server, with AR, AL and per-position rates."""
    if after.flavour == "sglang":
        rate, length = after.accept_rate_gauge, after.accept_length_gauge
        return SpecWindow(
            "sglang", acceptance_rate=rate, acceptance_length=length,
            generation_tokens=_delta(after.generation_tokens, before.generation_tokens),
            preemptions=_delta(after.preemptions, before.preemptions),
        )
    drafts = _delta(after.num_drafts, before.num_drafts) or 0.0
    draft_tokens = _delta(after.num_draft_tokens, before.num_draft_tokens) or 0.0
    accepted = _delta(after.num_accepted_tokens, before.num_accepted_tokens) or 0.0
    positions = sorted(set(after.accepted_per_pos) | set(before.accepted_per_pos))
    per_pos = [after.accepted_per_pos.get(i, 0.0) - before.accepted_per_pos.get(i, 0.0) for i in range(positions[-1] + 1)] if positions else []
    window = SpecWindow(
        after.flavour, drafts, draft_tokens, accepted, per_pos,
        generation_tokens=_delta(after.generation_tokens, before.generation_tokens),
        preemptions=_delta(after.preemptions, before.preemptions),
        lossy=(after.lossy_steps - before.lossy_steps) > 0,
    )
    if draft_tokens > 0:
        window.acceptance_rate = accepted / draft_tokens
    if drafts > 0:
        window.acceptance_length = 1.0 + accepted / drafts
        window.per_position_rate = [count / drafts for count in per_pos]
        window.mean_draft_len = draft_tokens / drafts
    return window


def merge_windows(windows: list[SpecWindow]) -> SpecWindow:
    """Sum several counter windows of one server (e.g. the phases of a run) into one."""
    flavours = {w.flavour for w in windows if w.flavour}
    flavour = flavours.pop() if len(flavours) == 1 else None
    if flavour == "sglang":
        return windows[-1]
    before = SpecSnapshot(flavour, 0.0, 0.0, 0.0, {})
    after = SpecSnapshot(
        flavour, sum(w.num_drafts for w in windows), sum(w.num_draft_tokens for w in windows),
        sum(w.num_accepted_tokens for w in windows), {},
        lossy_steps=float(any(w.lossy for w in windows)),
    )
    for w in windows:
        for i, count in enumerate(w.accepted_per_pos):
            after.accepted_per_pos[i] = after.accepted_per_pos.get(i, 0.0) + count
    gens = [w.generation_tokens for w in windows if w.generation_tokens is not None]
    pre = [w.preemptions for w in windows if w.preemptions is not None]
    after.generation_tokens = sum(gens) if gens else None
    after.preemptions = sum(pre) if pre else None
    return spec_window(before, after)


def gauge(samples: list[Sample], name: str) -> float | None:
    """The summed value of a metric (any labels), None if absent."""
    return _sum(samples, name)
