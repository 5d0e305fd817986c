"""Launch profiles: spec parsing, templates, each engine's rendered command, and one-line errors for bad input."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from specgate.gate import launch


def options(engine: str, specs: list[str], **kw) -> launch.LaunchOptions:
    base = dict(engine=engine, target="org/model", specs=specs, gamma=4, max_num_seqs=4, max_seq_len=512)
    return launch.LaunchOptions(**{**base, **kw})


@pytest.mark.parametrize("spec, parsed", [
    ("ngram-simple", ("ngram-simple", None, None)),
    ("ngram-mod:8", ("ngram-mod", None, 8)),
    ("draft:/m/d.gguf", ("draft", "/m/d.gguf", None)),
    ("draft:/m/d.gguf:6", ("draft", "/m/d.gguf", 6)),
    ("adaptive", ("adaptive", None, None)),
    ("adaptive:12", ("adaptive", None, 12)),
    ("adaptive:ngram:8", ("adaptive", "ngram", 8)),
    ("eagle3:org/eagle", ("eagle3", "org/eagle", None)),
])
def test_specs_parse(spec, parsed):
    assert launch.parse_spec(spec) == parsed


@pytest.mark.parametrize("spec, message", [
    (":4", "empty before ':'"), ("ngram-simple:x", "must be a draft length"), ("draft:", "needs a model"),
])
def test_bad_specs_name_the_fix(spec, message):
    with pytest.raises(ValueError, match=message):
        launch.parse_spec(spec)


def test_a_spec_without_a_length_runs_at_every_gamma_and_names_carry_it():
    profiles = launch.build_profiles(options("specgate", ["ngram", "ngram:3"], gammas=[2, 6]))
    assert [p.name for p in profiles] == ["baseline", "ngram-g2", "ngram-g6", "ngram-g3"]
    assert [p.gamma for p in profiles] == [0, 2, 6, 3]
    argv = profiles[2].argv(8123)
    assert argv[argv.index("--port") + 1] == "8123" and argv[argv.index("--gamma") + 1] == "6"
    assert profiles[0].argv(1)[profiles[0].argv(1).index("--draft") + 1] == "none"
    with pytest.raises(ValueError, match="out of range"):
        launch.build_profiles(options("specgate", ["ngram:99"]))


def test_templates_need_port_and_fill_gamma_and_model_literally():
    with pytest.raises(ValueError, match=r"has no \{port\}"):
        launch.render_template("llama-server -m x.gguf")
    with pytest.raises(ValueError, match="give --model"):
        launch.render_template("serve {model} --port {port}")
    with pytest.raises(ValueError, match="check its quotes"):
        launch.render_template("serve --port {port} 'unclosed")
    spec = '{"method": "ngram", "num_speculative_tokens": {gamma}}'
    argv = launch.render_template(f"vllm serve {{model}} --port {{port}} --speculative-config '{spec}'", gamma=5, model="m")
    assert json.loads(argv[-1]) == {"method": "ngram", "num_speculative_tokens": 5} and argv[2] == "m"
    profiles = launch.build_profiles(options("unknown", [], server_cmd="srv --port {port} --n {gamma}", baseline_cmd="srv --port {port}", gammas=[2, 4]))
    assert [(p.name, p.gamma, p.engine) for p in profiles] == [("baseline", 0, "unknown"), ("server-cmd-g2", 2, "unknown"), ("server-cmd-g4", 4, "unknown")]
    with pytest.raises(ValueError, match="go together"):
        launch.build_profiles(options("unknown", [], server_cmd="srv --port {port}"))


def test_vllm_profiles_render_its_documented_speculative_config():
    profiles = launch.build_profiles(options("vllm", ["ngram", "eagle3:org/eagle3-head:3"]))
    assert profiles[0].argv(9)[:3] == ["vllm", "serve", "org/model"] and "--speculative-config" not in profiles[0].argv(9)
    ngram, eagle = (json.loads(p.argv(9)[p.argv(9).index("--speculative-config") + 1]) for p in profiles[1:])
    assert ngram == {"num_speculative_tokens": 4, "method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    assert eagle == {"num_speculative_tokens": 3, "method": "eagle3", "model": "org/eagle3-head"}
    assert shlex.split(profiles[1].command())[profiles[1].argv(9).index("--port") + 1] == "8000"  # the command to paste
    with pytest.raises(ValueError, match="not a vLLM method"):
        launch.build_profiles(options("vllm", ["ngram-simple"]))


def test_sglang_profiles_render_its_launch_flags():
    profiles = launch.build_profiles(options("sglang", ["ngram", "draft:org/small:5"]))
    argv = profiles[2].argv(7)
    assert argv[:3] == ["python", "-m", "sglang.launch_server"] and "--enable-metrics" in argv
    flag = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--speculative")}
    assert flag == {"--speculative-algorithm": "STANDALONE", "--speculative-num-steps": "5", "--speculative-eagle-topk": "1",
                    "--speculative-num-draft-tokens": "6", "--speculative-draft-model-path": "org/small"}
    assert profiles[1].argv(7)[profiles[1].argv(7).index("--speculative-algorithm") + 1] == "NGRAM"


def test_unknown_engine_and_llamacpp_spec_are_named():
    with pytest.raises(ValueError, match="--engine 'tgi' is not known"):
        launch.build_profiles(options("tgi", ["ngram"]))
    with pytest.raises(ValueError, match="specgate serves"):
        launch.build_profiles(options("specgate", ["eagle3:x"]))


def test_specgate_serves_a_saved_eagle_head_as_its_draft():
    profiles = launch.build_profiles(options("specgate", ["eagle:/heads/gemma-eagle", "adaptive:eagle:/heads/gemma-eagle"]))
    fixed, adaptive = profiles[1:]
    assert fixed.draft == "eagle:/heads/gemma-eagle" and fixed.name.startswith("eagle-gemma-eagle") and fixed.policy == "fixed"
    assert adaptive.draft == "eagle:/heads/gemma-eagle" and adaptive.policy == "adaptive"
    for profile in (fixed, adaptive):
        argv = profile.argv(9)
        assert argv[argv.index("--draft") + 1] == "eagle:/heads/gemma-eagle"


def test_a_binary_that_exits_at_start_is_a_start_error_with_its_last_line(tmp_path):
    script = "import sys; print('loading'); print('error: model file not found', file=sys.stderr); sys.exit(3)"
    profile = launch.LaunchProfile("broken", "unknown", [sys.executable, "-c", script, "{port}"], "server-cmd", 4, "engine")
    with pytest.raises(launch.ServerStartError, match="exited with status 3: error: model file not found"):
        launch.start(profile, tmp_path, timeout_s=60)
    missing = launch.LaunchProfile("missing", "llama.cpp", [str(tmp_path / "no-such-server"), "--port", "{port}"], "none", 0, "off")
    with pytest.raises(launch.ServerStartError, match="is llama.cpp installed here"):
        launch.start(missing, tmp_path)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specgate", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, message", [
    (["--engine", "tgi"], "--engine 'tgi' is not known"),
    (["--engine", "vllm", "--spec", "ngram-simple"], "is not a vLLM method"),
    (["--server-cmd", "srv --n {gamma}", "--baseline-cmd", "srv --port {port}"], "has no {port}"),
    (["--require", "speed"], "--require speed is not a target"),
    (["--gamma", "2,x"], "--gamma"),
    (["--margin", "0.6"], "--margin 0.6 is out of range (0, 0.5)"),
    (["--margin", "0"], "--margin 0.0 is out of range (0, 0.5)"),
    (["--quick", "--budget-s", "5"], "--budget-s 5 is too small for one round"),
    (["--rounds", "1"], "--rounds 1 must be >= 2"),
    (["--spec", "table:ngram"], "a schedule is table:DRAFT:TABLE"),
])
def test_gate_bad_launch_input_is_one_line_exit_2(args, message, tmp_path):
    done = _cli("gate", "--out", str(tmp_path), *args)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], done.stderr


def test_a_gate_whose_server_exits_at_start_reports_the_failure(tmp_path):
    """Every configuration's server dies at start: the report says so per configuration, the gate exits normally."""
    dying = f"{sys.executable} -c \"import sys; print('error: bad flag'); sys.exit(1)\" {{port}}"
    done = _cli("gate", "--server-cmd", dying, "--baseline-cmd", dying, "--no-score", "--quick", "--out", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((Path(tmp_path) / "report.json").read_text())
    assert report["verdict"] == "NO-GO" and report["recommendation"]["config"] == "off" and report["config"] is None
    for name in ("baseline", "server-cmd"):
        assert "server did not start" in report["measurements"][name]["failure"] and "error: bad flag" in report["measurements"][name]["failure"]


def test_llamacpp_profiles_set_each_types_own_draft_length(monkeypatch, tmp_path):
    from specgate.engines import llamacpp

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(llamacpp, "binary_path", lambda name="llama-server": tmp_path / "llama-server")  # argv only: nothing starts
    profiles = launch.build_profiles(options("llama.cpp", ["ngram-simple", "ngram-mod", "ngram-cache", f"draft:{gguf}"], target=str(gguf), gammas=[4, 6], threads=2))
    by_name = {p.name: " ".join(p.argv(1)) for p in profiles}
    assert list(by_name) == ["baseline", "ngram-simple-g4", "ngram-simple-g6", "ngram-mod-g4", "ngram-mod-g6", "ngram-cache-g8", "draft-m-g4", "draft-m-g6"]
    assert "--spec-type ngram-simple --spec-ngram-simple-size-m 6 --spec-ngram-simple-size-n 6" in by_name["ngram-simple-g6"]
    assert "--spec-ngram-mod-n-max 4 --spec-ngram-mod-n-min 4" in by_name["ngram-mod-g4"]
    assert "--spec-type ngram-cache" in by_name["ngram-cache-g8"] and "size-m" not in by_name["ngram-cache-g8"]
    assert f"-md {gguf} --spec-type draft-simple --spec-draft-n-max 6" in by_name["draft-m-g6"]
    assert "--metrics" in by_name["baseline"] and "-t 2 -tb 2" in by_name["baseline"] and "--spec-type" not in by_name["baseline"]
    with pytest.raises(ValueError, match="ngram-cache always drafts 8"):
        launch.build_profiles(options("llama.cpp", ["ngram-cache:4"], target=str(gguf)))
    with pytest.raises(ValueError, match="not a llama.cpp speculative type"):
        launch.build_profiles(options("llama.cpp", ["eagle3:x"], target=str(gguf)))
    with pytest.raises(ValueError, match="serves a .gguf file"):
        launch.build_profiles(options("llama.cpp", ["ngram-simple"], target=str(tmp_path)))


def test_the_gate_measures_the_weights_serve_loads_by_default(tmp_path):
    """`specgate gate` and `specgate serve` share the --dtype default, and the gate's options resolve it as serve does
    (for the embedded default: the GGUF's own blocks where the native kernels run), so a gate run measures the
    deployment a user starts; the servers it launches get the resolved name."""
    import typer

    from specgate.cli.main import app
    from specgate.gate.options import GateOptions, resolve_dtype
    from specgate.models.dtypes import resolve_weights, weights_name

    commands = typer.main.get_command(app).commands
    defaults = {name: {p.name: p.default for p in commands[name].params} for name in ("gate", "serve")}
    assert defaults["gate"]["dtype"] is None  # the gate's options take their defaults from GateOptions, declared once
    assert defaults["serve"]["dtype"] == GateOptions(out=tmp_path).dtype == GateOptions.quick(tmp_path).dtype == "auto"
    served = weights_name(resolve_weights("auto", "gemma-3-270m"))
    assert resolve_dtype("auto", "gemma-3-270m") == served and resolve_dtype("float32", "gemma-3-270m") == "float32"
    chosen = launch.LaunchOptions(engine="specgate", target="gemma-3-270m", specs=["ngram"], gamma=4, max_num_seqs=2, max_seq_len=64,
                                   dtype=resolve_dtype("auto", "gemma-3-270m"))
    argv = launch.build_profiles(chosen)[0].argv(9)  # the baseline server
    assert argv[argv.index("--dtype") + 1] == served


def test_the_option_table_in_gate_md_is_the_generated_one():
    """docs/GATE.md's option table comes from GateOptions (`python -m specgate.gate.options`): a changed default,
    --quick value or help text fails here until the table is regenerated."""
    from specgate.gate.options import option_markdown

    doc = (Path(__file__).resolve().parents[1] / "docs" / "GATE.md").read_text()
    assert option_markdown().strip() in doc
