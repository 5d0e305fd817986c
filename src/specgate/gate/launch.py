"""Launch profiles: how the gate starts each configuration's server, for any engine that starts from a command line.

A profile is a configuration's name, its engine, an argv template and what it measures (the baseline, or one
speculative method at one draft length). The gate starts the profiles one after another on 127.0.0.1 (never two
at once: on a small machine they would share the cores and each would measure the other), waits until
`/health` answers 200, measures, and stops the server before the next one starts.

Templates: `{port}` (required: the gate picks a free port), `{gamma}` (the draft length) and `{model}` are
replaced literally, so JSON in a template (vLLM's `--speculative-config '{"method": ...}'`) needs no escaping.

Engines and what their profiles run:
- specgate: `python -m specgate serve --draft D --policy off|fixed|table|adaptive ...`;
- llama.cpp: `llama-server -m GGUF --metrics -np N ...`, speculation by `--spec-type TYPE` and the type's own
  draft-length flag (LLAMACPP_LENGTH_FLAGS), or `-md DRAFT.gguf --spec-draft-n-max G` (a draft model);
- vllm, sglang: their documented launch commands (`vllm serve M --speculative-config JSON`,
  `python -m sglang.launch_server --speculative-algorithm ...`); they need a GPU machine with the engine installed;
- anything else: `--server-cmd` / `--baseline-cmd` templates.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ENGINES = ("specgate", "llama.cpp", "vllm", "sglang")
LLAMACPP_SPECS = ("ngram-simple", "ngram-mod", "ngram-cache", "ngram-map-k", "ngram-map-k4v")
NGRAM_CACHE_DRAFT = 8
# The flag that sets each llama.cpp n-gram type's draft length (`--spec-draft-n-max` governs draft models only):
# ngram-simple / ngram-map-* draft the m-gram that followed the matched n-gram (size-m, default 48); ngram-mod
# drafts between n-min and n-max tokens or nothing (default 48..64): here exactly G tokens or nothing.
LLAMACPP_LENGTH_FLAGS = {
    # ngram-simple drafts nothing when its draft would be shorter than its lookup key (size-n, default 12)
    "ngram-simple": lambda g: ["--spec-ngram-simple-size-m", str(g), "--spec-ngram-simple-size-n", str(min(12, g))],
    "ngram-map-k": lambda g: ["--spec-ngram-map-k-size-m", str(g)],
    "ngram-map-k4v": lambda g: ["--spec-ngram-map-k4v-size-m", str(g)],
    "ngram-mod": lambda g: ["--spec-ngram-mod-n-max", str(g), "--spec-ngram-mod-n-min", str(g)],
    "ngram-cache": lambda g: [],
}
VLLM_SPECS = ("ngram", "suffix")  # plus draft:PATH, eagle:PATH, eagle3:PATH
SGLANG_SPECS = ("ngram",)  # plus draft:PATH, eagle:PATH, eagle3:PATH
SPECGATE_SPECS = ("ngram", "default", "adaptive", "table")  # plus a draft model PATH, eagle:DIR (a saved EAGLE head); adaptive[:DRAFT]; table:DRAFT:TABLE
MODEL_SPEC_KINDS = ("draft", "eagle", "eagle3")
DEFAULT_SPECS = {"specgate": ["default", "ngram"], "llama.cpp": ["ngram-simple:8", "ngram-mod:8"], "vllm": ["ngram"], "sglang": ["ngram"]}
SERVER_START_TIMEOUT_S = 900.0  # the first Gemma conversion takes ~2 minutes on 2 cores
PASTE_PORT = 8000  # the port shown in a command to paste


class ServerStartError(RuntimeError):
    pass


@dataclass
class LaunchProfile:
    """One configuration's server: argv with placeholders, and what it measures."""

    name: str
    engine: str
    template: list[str]
    spec: str  # "none" for the baseline; the method otherwise (ngram-simple, draft:PATH, ngram, adaptive:ngram, ...)
    gamma: int  # draft tokens per step (0: baseline; adaptive: the largest it may pick)
    policy: str = "fixed"  # off | fixed | table | adaptive (specgate); engine (the engine's own rule)
    lossy: str | None = None
    draft: str | None = None  # specgate: the --draft it serves (none, ngram, default, PATH)
    gamma_table: str | None = None  # specgate --policy table

    def argv(self, port: int) -> list[str]:
        return [part.replace("{port}", str(port)) for part in self.template]

    def command(self, port: int = PASTE_PORT) -> str:
        """The command line to paste (the gate's own interpreter shown as `python`)."""
        argv = self.argv(port)
        if argv and argv[0] == sys.executable:
            argv = ["python", *argv[1:]]
        return shlex.join(argv)

    def meta(self) -> dict[str, Any]:
        return {"name": self.name, "engine": self.engine, "spec": self.spec, "gamma": self.gamma, "policy": self.policy,
                "lossy": self.lossy, "draft": self.draft or self.spec, "gamma_table": self.gamma_table, "command": self.command()}


def render_template(template: str, *, gamma: int | None = None, model: str | None = None, what: str = "--server-cmd") -> list[str]:
    """Split a command template and fill {gamma} / {model}; ValueError naming the template when {port} is missing."""
    if "{port}" not in template:
        raise ValueError(f"{what} {template!r} has no {{port}}: put {{port}} where the server takes its port, e.g. --port {{port}}")
    if "{gamma}" in template and gamma is None:
        raise ValueError(f"{what} {template!r} uses {{gamma}} but no draft length applies there: remove {{gamma}} from it")
    if "{model}" in template and not model:
        raise ValueError(f"{what} {template!r} uses {{model}}: give --model NAME")
    try:
        argv = shlex.split(template)
    except ValueError as exc:
        raise ValueError(f"{what} {template!r} is not a valid command line ({exc}): check its quotes") from None
    if not argv:
        raise ValueError(f"{what} is empty: give the command that starts the server")
    return [part.replace("{gamma}", str(gamma)).replace("{model}", model or "") for part in argv]


def parse_spec(spec: str) -> tuple[str, str | None, int | None]:
    """'ngram-simple' -> ('ngram-simple', None, None); 'ngram-simple:8' -> draft length 8; 'draft:PATH[:G]' -> ('draft', PATH, G)."""
    head, _, rest = spec.strip().partition(":")
    if not head:
        raise ValueError(f"--spec {spec!r} is empty before ':': name a method, e.g. ngram-simple:8")
    if head == "table":  # table:DRAFT:'1-1:4,2-64:0' (specgate: a per-batch-size schedule)
        draft, sep, table = rest.partition(":")
        if not draft or not sep or not table:
            raise ValueError(f"--spec {spec!r}: a schedule is table:DRAFT:TABLE, e.g. table:ngram:1-1:4,2-64:0")
        return head, f"{draft}:{table}", None
    if head in MODEL_SPEC_KINDS or head == "adaptive":
        arg, gamma = rest, None
        path, sep, tail = rest.rpartition(":")
        if sep and tail.isdigit():
            arg, gamma = path, int(tail)
        elif rest.isdigit():
            arg, gamma = "", int(rest)
        if head in MODEL_SPEC_KINDS and not arg:
            raise ValueError(f"--spec {spec!r}: {head} needs a model, e.g. {head}:PATH")
        return head, arg or None, gamma
    if rest:
        if not rest.isdigit():
            raise ValueError(f"--spec {spec!r}: the part after ':' must be a draft length, e.g. {head}:8")
        return head, None, int(rest)
    return head, None, None


def expand_specs(o: "LaunchOptions") -> list[tuple[str, str, str | None, int, bool]]:
    """(spec, kind, arg, gamma, named_gamma) per configuration: a spec without ':N' runs at every --gamma."""
    out = []
    for spec in o.specs:
        kind, arg, gamma = parse_spec(spec)
        for g in [gamma] if gamma is not None else o.gammas:
            if not 1 <= g <= 64:
                raise ValueError(f"--spec {spec!r}: draft length {g} is out of range 1..64")
            out.append((spec, kind, arg, g, gamma is not None or len(o.gammas) > 1))
    return out


@dataclass
class LaunchOptions:
    """What every engine's profiles need (a subset of the gate's options)."""

    engine: str
    target: str
    specs: list[str]
    gamma: int
    max_num_seqs: int
    max_seq_len: int
    dtype: str = "float32"
    lossy: str | None = None
    model: str | None = None
    threads: int | None = None
    server_cmd: str | None = None
    baseline_cmd: str | None = None
    gammas: list[int] = field(default_factory=list)  # every draft length to measure (--gamma 4 or 2,4,8)

    def __post_init__(self) -> None:
        self.gammas = self.gammas or [self.gamma]


def build_profiles(o: LaunchOptions) -> list[LaunchProfile]:
    """The baseline first, then one profile per spec (or per gamma of a --server-cmd template)."""
    if o.server_cmd or o.baseline_cmd:
        return template_profiles(o)
    if o.engine not in ENGINES:
        raise ValueError(f"--engine {o.engine!r} is not known: use one of {', '.join(ENGINES)}, or --server-cmd / --baseline-cmd templates")
    builder = {"specgate": specgate_profiles, "llama.cpp": llamacpp_profiles, "vllm": vllm_profiles, "sglang": sglang_profiles}[o.engine]
    return builder(o)


def template_profiles(o: LaunchOptions) -> list[LaunchProfile]:
    if not (o.server_cmd and o.baseline_cmd):
        raise ValueError("--server-cmd and --baseline-cmd go together: the speculative server's template and the same server without speculation")
    engine = o.engine if o.engine in ENGINES else "unknown"
    profiles = [LaunchProfile("baseline", engine, render_template(o.baseline_cmd, model=o.model, what="--baseline-cmd"), "none", 0, "off")]
    gammas = o.gammas if "{gamma}" in o.server_cmd else [o.gamma]
    for gamma in gammas:
        name = f"server-cmd-g{gamma}" if "{gamma}" in o.server_cmd else "server-cmd"
        profiles.append(LaunchProfile(name, engine, render_template(o.server_cmd, gamma=gamma, model=o.model), "server-cmd", gamma, "engine"))
    return profiles


# ------------------------------------------------------------------------------------------ specgate


def specgate_command(o: LaunchOptions, draft: str, policy: str, gamma: int, *, gamma_table: str | None = None, lossy: str | None = None) -> list[str]:
    argv = [sys.executable, "-m", "specgate", "serve", "--target", o.target, "--draft", draft, "--host", "127.0.0.1", "--port", "{port}",
            "--policy", policy, "--max-num-seqs", str(o.max_num_seqs), "--max-waiting", "1024", "--max-seq-len", str(o.max_seq_len),
            "--dtype", o.dtype]
    if policy in ("fixed", "adaptive"):
        argv += ["--gamma", str(gamma)]
    if gamma_table:
        argv += ["--gamma-table", gamma_table]
    if lossy:
        argv += ["--lossy", lossy]
    return argv


def table_profile(o: LaunchOptions, draft: str, table: str, name: str | None = None) -> LaunchProfile:
    """specgate --policy table --gamma-table TABLE with DRAFT (a schedule: gamma per batch size)."""
    from specgate.serving.policy.simple import TablePolicy

    gamma = TablePolicy.parse(table).max_gamma  # ValueError names a bad entry
    label = name or f"table-{Path(draft).name if os.sep in draft else draft}"
    return LaunchProfile(label, "specgate", specgate_command(o, draft, "table", 0, gamma_table=table), f"table:{draft}", gamma, "table",
                         draft=draft, gamma_table=table)


def _label(name: str, gamma: int, named_gamma: bool) -> str:
    return f"{name}-g{gamma}" if named_gamma else name


def specgate_profiles(o: LaunchOptions) -> list[LaunchProfile]:
    """Baseline (--draft none, policy off), each draft at --policy fixed, `adaptive[:DRAFT]` at --policy adaptive."""
    profiles = [LaunchProfile("baseline", "specgate", specgate_command(o, "none", "off", 0), "none", 0, "off", draft="none")]
    for spec, kind, arg, gamma, named in expand_specs(o):
        if kind == "none":
            continue
        if kind == "eagle3":
            raise ValueError(f"--spec {spec!r}: specgate serves ngram, default, eagle:DIR (a head saved by specgate), a draft model PATH "
                             "(or draft:PATH) and adaptive[:DRAFT]")
        if kind == "table":
            profiles.append(table_profile(o, *str(arg).split(":", 1)))
            continue
        if kind == "adaptive":
            draft = arg or "ngram"
            name = _label(f"{Path(draft).name if os.sep in draft else draft}-adaptive", gamma, named)
            profiles.append(LaunchProfile(name, "specgate", specgate_command(o, draft, "adaptive", gamma), f"adaptive:{draft}", gamma, "adaptive", draft=draft))
            continue
        draft = {"draft": arg, "eagle": f"eagle:{arg}"}.get(kind, kind)  # draft:PATH as for the other engines, eagle:DIR, or ngram / default / PATH
        name = _label(f"eagle-{Path(arg).name}" if kind == "eagle" else Path(draft).name if os.sep in draft else draft, gamma, named)
        profiles.append(LaunchProfile(name, "specgate", specgate_command(o, draft, "fixed", gamma), draft, gamma, "fixed", draft=draft))
    if o.lossy:  # the LOSSY twin of the first speculative configuration (ngram if there is none)
        first = next((p for p in profiles[1:] if p.policy == "fixed"), None)
        draft, gamma = (first.draft, first.gamma) if first else ("ngram", o.gamma)
        name = f"{first.name if first else 'ngram'}-lossy-{o.lossy.split(':')[0]}"
        profiles.append(LaunchProfile(name, "specgate", specgate_command(o, draft, "fixed", gamma, lossy=o.lossy), draft, gamma, "fixed",
                                      lossy=o.lossy, draft=draft))
    return profiles


# ------------------------------------------------------------------------------------------ llama.cpp


def llamacpp_base(o: LaunchOptions, server: str, gguf: str) -> list[str]:
    threads = o.threads or os.cpu_count() or 1
    return [server, "-m", gguf, "--host", "127.0.0.1", "--port", "{port}", "-t", str(threads), "-tb", str(threads),
            "-np", str(o.max_num_seqs), "-c", str(o.max_num_seqs * o.max_seq_len), "--metrics", "--no-webui"]


def llamacpp_profiles(o: LaunchOptions) -> list[LaunchProfile]:
    from specgate.engines import gemma_gguf_path
    from specgate.engines.llamacpp import binary_path

    server = str(binary_path("llama-server"))  # EngineNotInstalled names the install command
    gguf = str(gemma_gguf_path()) if o.target == "gemma-3-270m" else o.target
    if not gguf.endswith(".gguf") or not Path(gguf).is_file():
        raise ValueError(f"--target {o.target!r}: llama.cpp serves a .gguf file; give its path (or gemma-3-270m for the GGUF the package ships)")
    base = llamacpp_base(o, server, gguf)
    profiles = [LaunchProfile("baseline", "llama.cpp", base, "none", 0, "off")]
    seen = set()
    for spec, kind, arg, gamma, named in expand_specs(o):
        if kind == "ngram-cache":  # llama.cpp drafts 8 tokens with it, whatever it is told
            if gamma != NGRAM_CACHE_DRAFT and parse_spec(spec)[2] is not None:
                raise ValueError(f"--spec {spec!r}: llama.cpp's ngram-cache always drafts {NGRAM_CACHE_DRAFT} tokens; write ngram-cache")
            gamma = NGRAM_CACHE_DRAFT
        if (kind, arg, gamma) in seen:
            continue
        seen.add((kind, arg, gamma))
        if kind in LLAMACPP_SPECS:
            extra = ["--spec-type", kind, *LLAMACPP_LENGTH_FLAGS[kind](gamma)]
            name = kind
        elif kind == "draft":
            if not Path(arg).is_file():
                raise ValueError(f"--spec {spec!r}: draft model {arg!r} is not a file; give a .gguf that shares the target's vocabulary")
            extra = ["-md", arg, "--spec-type", "draft-simple", "--spec-draft-n-max", str(gamma)]
            name = f"draft-{Path(arg).stem}"
        else:
            known = ", ".join([*LLAMACPP_SPECS, "draft:PATH.gguf"])
            raise ValueError(f"--spec {spec!r} is not a llama.cpp speculative type: use one of {known} (optionally :N, the draft length)")
        profiles.append(LaunchProfile(_label(name, gamma, named), "llama.cpp", base + extra, spec, gamma, "engine"))
    return profiles


# ------------------------------------------------------------------------------------------ vLLM and SGLang (GPU engines)


def _model_specs(o: LaunchOptions, known: tuple[str, ...], engine: str) -> list[tuple[str, str, str | None, int, bool]]:
    specs = expand_specs(o)
    for spec, kind, _, _, _ in specs:
        if kind not in known and kind not in MODEL_SPEC_KINDS:
            raise ValueError(f"--spec {spec!r} is not a {engine} method here: use one of {', '.join([*known, 'draft:PATH', 'eagle:PATH', 'eagle3:PATH'])}")
    return specs


def vllm_profiles(o: LaunchOptions) -> list[LaunchProfile]:
    """`vllm serve MODEL --speculative-config JSON` (vLLM's documented methods: ngram, suffix, draft_model, eagle, eagle3)."""
    model = o.model or o.target
    base = ["vllm", "serve", model, "--host", "127.0.0.1", "--port", "{port}", "--max-num-seqs", str(o.max_num_seqs),
            "--max-model-len", str(o.max_seq_len), "--seed", "0"]
    profiles = [LaunchProfile("baseline", "vllm", base, "none", 0, "off")]
    for spec, kind, arg, gamma, _ in _model_specs(o, VLLM_SPECS, "vLLM"):
        config: dict[str, Any] = {"num_speculative_tokens": gamma}
        if kind == "ngram":
            config.update(method="ngram", prompt_lookup_min=1, prompt_lookup_max=4)
        elif kind == "suffix":
            config.update(method="suffix")
        else:
            config.update(method={"draft": "draft_model"}.get(kind, kind), model=arg)
        profiles.append(LaunchProfile(f"{kind}-g{gamma}", "vllm", base + ["--speculative-config", json.dumps(config)], spec, gamma, "engine"))
    return profiles


def sglang_profiles(o: LaunchOptions) -> list[LaunchProfile]:
    """`python -m sglang.launch_server --speculative-algorithm ...` (NGRAM, STANDALONE for a draft model, EAGLE, EAGLE3)."""
    model = o.model or o.target
    base = ["python", "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1", "--port", "{port}",
            "--max-running-requests", str(o.max_num_seqs), "--context-length", str(o.max_seq_len), "--enable-metrics"]
    profiles = [LaunchProfile("baseline", "sglang", base, "none", 0, "off")]
    for spec, kind, arg, gamma, _ in _model_specs(o, SGLANG_SPECS, "SGLang"):
        algorithm = {"ngram": "NGRAM", "draft": "STANDALONE", "eagle": "EAGLE", "eagle3": "EAGLE3"}[kind]
        extra = ["--speculative-algorithm", algorithm, "--speculative-num-steps", str(gamma), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(gamma + 1)]
        if arg:
            extra += ["--speculative-draft-model-path", arg]
        profiles.append(LaunchProfile(f"{kind}-g{gamma}", "sglang", base + extra, spec, gamma, "engine"))
    return profiles


# ------------------------------------------------------------------------------------------ running a server


@dataclass
class Endpoint:
    name: str
    url: str
    metrics_url: str
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def exit_description(self, wait_s: float = 2.0) -> str:
        """How the server ended. A process whose connections just broke may not have been reaped yet (its requests
        fail before waitpid sees it exit): wait up to wait_s for its exit status before calling it unresponsive."""
        if self.process is not None and self.process.returncode is None:
            try:
                self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
        if self.process is None or self.process.returncode is None:
            return "stopped answering"
        code = self.process.returncode
        how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return f"server process {self.process.pid} {how}"

    def peak_rss_mib(self) -> float | None:
        """VmHWM (peak resident set) of the server process, from /proc (Linux)."""
        if self.process is None:
            return None
        try:
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
        except OSError:
            return None
        return None

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)  # drains (running requests finish), exits 0
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def _last_error(log_path: Path | None) -> str:
    if log_path is None or not log_path.exists():
        return "no output"
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return next((line for line in reversed(lines) if "error" in line.lower()), lines[-1] if lines else "no output")


def spawn(profile: LaunchProfile, out: Path) -> Endpoint:
    """Start `profile`'s process on a free loopback port (its output to out/server-NAME.log); wait_ready() next."""
    port = free_port()
    argv = profile.argv(port)
    log_path = out / f"server-{profile.name}.log"
    try:
        with open(log_path, "wb") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        raise ServerStartError(f"`{argv[0]}` could not be started ({exc.strerror or exc}): is {profile.engine} installed here?") from None
    url = f"http://127.0.0.1:{port}"
    return Endpoint(profile.name, url, f"{url}/metrics", process, log_path, {"url": url, "command": profile.command(port)})


def wait_ready(endpoint: Endpoint, timeout_s: float = SERVER_START_TIMEOUT_S) -> Endpoint:
    """Return once /health answers 200; ServerStartError with the cause (its log's last error line) otherwise."""
    process, command = endpoint.process, endpoint.info.get("command", endpoint.name)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise ServerStartError(f"`{command}` exited with status {process.returncode}: {_last_error(endpoint.log_path)}")
        if _health(endpoint.url):
            return endpoint
        time.sleep(0.25)
    endpoint.stop()
    raise ServerStartError(f"`{command}` did not answer /health within {timeout_s:.0f} s (log: {endpoint.log_path})")


def start(profile: LaunchProfile, out: Path, timeout_s: float = SERVER_START_TIMEOUT_S) -> Endpoint:
    """spawn() then wait_ready(): a server answering /health, or ServerStartError."""
    return wait_ready(spawn(profile, out), timeout_s)


def detect_engine(url: str, samples: list | None = None) -> str:
    """The engine behind `url`: `owned_by` of /v1/models (specgate, llamacpp, vllm, sglang), else the metrics' prefix."""
    import httpx

    try:
        cards = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=10.0).json().get("data") or []
        owner = str(cards[0].get("owned_by", "")).lower() if cards else ""
    except (httpx.HTTPError, ValueError, AttributeError):
        owner = ""
    names = {getattr(s, "name", "") for s in samples or []}
    for engine, keys in (("specgate", ("specgate",)), ("llama.cpp", ("llamacpp", "llama.cpp")), ("vllm", ("vllm",)), ("sglang", ("sglang",))):
        if owner in keys or any(n.startswith(f"{k}:") for k in keys for n in names):
            return engine
    return "unknown"


def with_name(profile: LaunchProfile, name: str) -> LaunchProfile:
    return replace(profile, name=name)
