"""What the gate measured of one configuration's server, as typed records (the decision reads only these).

A `ConfigRun` holds a configuration's identity (engine, method, draft length, policy, command), the outputs of its
fixed-work phases (greedy texts and TPOTs per prompt, math answers, sampled continuations and their scores under the target,
acceptance per category), its paired-round `Window`s (runner.STAGES), its memory and, when its server died, why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specgate.gate import prom
from specgate.gate.rounds import Window


@dataclass
class SampleScore:
    """The target's view of one sampled continuation."""

    logprob_sum: float  # sum over its tokens of log p(x_t | context)
    tokens: int
    centered_sum: float  # sum of log p(x_t) + H(p_t): mean 0 when the tokens are drawn from p, with less spread

    @property
    def centered_mean(self) -> float:
        return self.centered_sum / self.tokens if self.tokens else 0.0


@dataclass
class ConfigRun:
    """One configuration as measured: the baseline, a speculative configuration, or the recommendation."""

    name: str
    engine: str
    spec: str  # "none" for the baseline; the method otherwise
    gamma: int  # configured draft length (0: baseline; adaptive: the largest it may pick)
    policy: str  # off | fixed | table | adaptive (specgate) | engine (the engine's own rule, or unknown)
    draft: str | None = None
    lossy: str | None = None
    gamma_table: str | None = None  # specgate --policy table
    command: str | None = None
    url: str | None = None
    startup_s: float | None = None
    failure: str | None = None  # why its server could not be measured to the end
    phases: list[dict[str, Any]] = field(default_factory=list)  # fixed-work phases: {name, wall_s, failed}
    greedy: dict[str, str] = field(default_factory=dict)  # prompt id -> greedy text (batched at --max-num-seqs)
    greedy_tpot: dict[str, float] = field(default_factory=dict)  # prompt id -> TPOT (s) of its greedy request: speedup per category
    greedy_drafts: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # prompt id -> (drafted, accepted, drafts; 0: not sent) of its greedy request (`timings`)
    per_category: dict[str, dict | None] = field(default_factory=dict)  # category -> counter window of its greedy phase
    per_category_latency: dict[str, dict] = field(default_factory=dict)
    math_outputs: dict[str, str] = field(default_factory=dict)
    samples: dict[str, str] = field(default_factory=dict)  # sample id -> continuation at temperature 1
    scores: dict[str, SampleScore] = field(default_factory=dict)  # sample id -> the target's scores of it
    windows: list[Window] = field(default_factory=list)  # every paired round of every stage
    phase_windows: list[prom.SpecWindow] = field(default_factory=list)  # counter deltas of the fixed-work phases
    timings: dict[str, int] | None = None  # llama.cpp's per-response draft counts summed, where sent
    memory: dict[str, Any] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=dict)

    def windows_at(self, stage: str, load: str) -> list[Window]:
        return [w for w in self.windows if w.stage == stage and w.load == load]

    def spec_total(self) -> prom.SpecWindow | None:
        """Counter deltas over every phase and window of this server (None when it exports no counters)."""
        windows = self.phase_windows + [w.spec for w in self.windows if w.spec is not None]
        return prom.merge_windows(windows) if windows else None

    def meta(self) -> dict[str, Any]:
        return {"name": self.name, "engine": self.engine, "spec": self.spec, "gamma": self.gamma, "policy": self.policy,
                "draft": self.draft, "lossy": self.lossy, "gamma_table": self.gamma_table, "command": self.command}

    def to_dict(self) -> dict[str, Any]:
        total = self.spec_total()
        return {
            **self.meta(), "url": self.url, "startup_s": self.startup_s, "failure": self.failure, "phases": self.phases,
            "per_category": self.per_category, "per_category_latency": self.per_category_latency, "memory": self.memory,
            "spec_total": total.to_dict() if total else None, "timings_total": self.timings, "server": self.server,
            "windows": [w.to_dict() for w in self.windows],
            "greedy": self.greedy, "greedy_tpot": self.greedy_tpot, "greedy_drafts": self.greedy_drafts, "math_outputs": self.math_outputs, "samples": self.samples,
            "scores": {k: v.__dict__ for k, v in self.scores.items()},
        }
