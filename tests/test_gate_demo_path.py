"""`specgate gate --quick`'s default-draft path, end to end on a tiny Gemma-3 target.

`--quick` measures `--draft default` against the baseline (and `--draft ngram` in its place where the target has no
default draft). Two gate runs, side by side, each starting real `specgate serve` subprocesses:
- registered: `python -m specgate gate --quick --draft default --json` where a tiny recipe-format draft
  (specgate.drafting.distill's writer) is the target's entry in specgate.drafting.registry.DEFAULT_DRAFTS, in the
  gate and in every server it starts: a sitecustomize.py on PYTHONPATH adds the entries of
  $SPECGATE_TEST_DEFAULT_DRAFTS to the registry of each fresh interpreter (a monkeypatch in this process could not
  reach them). The n-gram draft is left to the other run. The `default` configuration must be measured, with
  acceptance from the server's counters, and be lossless.
- unregistered: the same weights under a name with no entry, with --quick's own drafts, run in this process
  (run_gate on GateOptions.quick, as the CLI builds it). The report must carry the note naming the missing default
  draft, and the gate must go on with the baseline and the n-gram draft in its place.
In both, each verdict is the rule over its own criteria, and the headline verdict is the recommendation's. The options
are `--quick` cut down to a few requests per phase and short rounds (tests/test_gate_e2e.py measures more)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specgate.drafting import distill, registry
from specgate.models import load_model

from conftest import recipe_draft_info
from gate_helpers import check_verdicts_follow_the_rule

GAMMA = 4  # --quick's draft length
GATE_TIMEOUT_S = 600
SMALL = dict(concurrency=[1, 2], per_category=2, max_tokens=12, greedy_tokens=24, math_items=8, sample_prompts=8, sample_tokens=8,
             round_s=0.5, rounds=2, budget_s=6.0)
SMALL_ARGS = [arg for key, value in SMALL.items()
              for arg in (f"--{key.replace('_', '-')}", ",".join(map(str, value)) if isinstance(value, list) else str(value))]
SHIM = '''import json, os
_drafts = os.environ.get("SPECGATE_TEST_DEFAULT_DRAFTS")
if _drafts:  # a test registers default drafts in every specgate subprocess
    from specgate.drafting import registry
    registry.DEFAULT_DRAFTS.update(json.loads(_drafts))
'''


def write_default_draft(target_dir: Path, out_dir: Path) -> Path:
    """A recipe-format draft of the target: its layer 0 over the whole vocabulary (untrained, but correlated)."""
    target = load_model(str(target_dir))
    d2t = torch.arange(int(target.model.vocab_size))
    config = distill.student_config(target.model.config, [0], d2t.numel())
    student = distill.build_student(config, distill.student_state_from_target(target.model, [0], d2t))
    distill.save_student(student, config, d2t, out_dir, recipe_draft_info(target, d2t))
    return out_dir


def start_cli_gate(target: Path, out: Path, env: dict[str, str], *extra: str) -> subprocess.Popen:
    """`python -m specgate gate --quick --json` on target (SMALL options), started in the background."""
    args = [sys.executable, "-m", "specgate", "gate", "--quick", "--target", str(target), "--out", str(out), "--json", *SMALL_ARGS, *extra]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)


def finish_cli_gate(process: subprocess.Popen) -> tuple[dict, dict]:
    """(the printed summary, report.json) of a gate started by start_cli_gate."""
    stdout, stderr = process.communicate(timeout=GATE_TIMEOUT_S)
    assert process.returncode == 0, f"gate exited {process.returncode}: {stderr[-3000:]}"
    summary = json.loads(stdout)
    return summary, json.loads(Path(summary["report"]["json"]).read_text())


def run_quick_gate_here(target: Path, out: Path) -> dict:
    """The same gate in this process: GateOptions.quick with the SMALL options, as the CLI sets them."""
    from specgate.gate.options import GateOptions
    from specgate.gate.runner import run_gate

    options = GateOptions.quick(out)
    options.target = str(target)
    for key, value in SMALL.items():
        setattr(options, key, value)
    return run_gate(options)


@pytest.fixture(scope="module")
def gate_runs(tiny_model_dir, tmp_path_factory):
    """Both runs, side by side (each mostly waits for its servers to start, ~10 s apiece on 2 cores): the registered
    one through the CLI in a subprocess, the unregistered one in this process (no interpreter and model-loading
    start-up to pay again). {"registered": (summary, report, target), "unregistered": (report, target)}."""
    root = tmp_path_factory.mktemp("gate-default")
    with_default = Path(shutil.copytree(tiny_model_dir("gemma3"), root / "tiny-gemma-with-default"))
    without_default = Path(shutil.copytree(with_default, root / "tiny-gemma-without-default"))
    draft = write_default_draft(with_default, root / "tiny-gemma-default-draft")
    assert with_default.name not in registry.DEFAULT_DRAFTS and without_default.name not in registry.DEFAULT_DRAFTS
    shim = root / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SHIM)
    env = dict(os.environ, SPECGATE_TEST_DEFAULT_DRAFTS=json.dumps({with_default.name: str(draft)}))
    env["PYTHONPATH"] = os.pathsep.join([str(shim), *filter(None, [os.environ.get("PYTHONPATH")])])
    process = start_cli_gate(with_default, root / "out-registered", env, "--draft", "default")
    try:
        unregistered = run_quick_gate_here(without_default, root / "out-unregistered")
        registered = finish_cli_gate(process)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return {"registered": (*registered, with_default), "unregistered": (unregistered, without_default)}


def test_quick_gate_measures_the_registered_default_draft(gate_runs):
    summary, report, target = gate_runs["registered"]
    assert report["options"]["target"] == str(target) and report["options"]["drafts"] == ["default"] and report["options"]["gammas"] == [GAMMA]
    assert set(report["configs"]) - {"recommended"} == {"default"} and set(report["measurements"]) - {"recommended"} == {"baseline", "default"}
    assert ("recommended" in report["configs"]) == (report["recommendation"]["kind"] == "schedule")  # only a schedule is launched again
    measured = report["measurements"]["default"]
    assert not measured.get("failure"), measured.get("failure")  # its server found the registered draft (else: it exits)
    assert measured["draft"] == "default" and "--draft default" in measured["command"]
    assert [p["name"] for p in measured["phases"]][-1] == "sample" and measured["windows"]  # every phase ran, then paired rounds
    assert measured["spec_total"]["flavour"] == "specgate" and measured["spec_total"]["num_draft_tokens"] > 0
    acceptance = report["configs"]["default"]["acceptance"]
    assert acceptance["source"] == "counters" and acceptance["ar"] == measured["spec_total"]["acceptance_rate"]
    assert 0.0 < acceptance["ar"] <= 1.0  # the target's own layer 0: some drafts survive
    assert len(acceptance["per_position"]) == GAMMA and all(0.0 <= r <= 1.0 for r in acceptance["per_position"])
    greedy = report["configs"]["default"]["quality"]["greedy"]
    assert greedy["pairs"] > 0 and greedy["rate"] == 1.0, greedy["mismatches"]  # lossless
    assert not any("default draft" in note for note in report["notes"]), report["notes"]
    log = (Path(report["options"]["out"]) / "server-default.log").read_text()
    assert "Traceback" not in log
    check_verdicts_follow_the_rule(report, summary)


def test_quick_gate_without_a_default_draft_notes_it_and_goes_on(gate_runs):
    report, target = gate_runs["unregistered"]
    notes = [n for n in report["notes"] if "default draft" in n]
    assert len(notes) == 1
    assert f"the default draft for {target} is unavailable" in notes[0]
    assert "not registered in specgate.drafting.registry.DEFAULT_DRAFTS" in notes[0] and "continuing without it" in notes[0]
    assert any("measuring --draft ngram in its place" in n for n in report["notes"])
    assert report["options"]["drafts"] == ["default"]  # --quick's own draft
    assert "default" not in report["measurements"] and "default" not in report["configs"]
    assert not (Path(report["options"]["out"]) / "server-default.log").exists()  # never launched
    assert {"baseline", "ngram"} <= set(report["measurements"]) and "ngram" in report["configs"]
    ngram = report["measurements"]["ngram"]
    assert not ngram.get("failure") and ngram["spec_total"]["num_draft_tokens"] > 0
    check_verdicts_follow_the_rule(report)


def test_a_registered_default_draft_without_weights_is_a_note_not_a_launch(tmp_path, monkeypatch):
    """The other unavailable case (registered, weights not built yet) is decided before any server starts."""
    from specgate.gate.options import GateOptions
    from specgate.gate.runner import _profiles, default_draft_unavailable

    target = tmp_path / "tiny-target"
    target.mkdir()
    missing = tmp_path / "not-built-yet"
    monkeypatch.setitem(registry.DEFAULT_DRAFTS, target.name, str(missing))
    why = default_draft_unavailable(str(target))
    assert why == f"the default draft for {target} is unavailable (its weights are not at {missing} yet): continuing without it"
    notes: list[str] = []
    profiles = _profiles(GateOptions(out=tmp_path / "out", target=str(target), drafts=["default", "ngram"], adaptive=False), notes)
    assert [p.name for p in profiles] == ["baseline", "ngram"] and notes == [why]
    missing.mkdir()
    (missing / "config.json").write_text("{}")
    assert default_draft_unavailable(str(target)) is None  # built: launched like any other draft


def test_a_server_asked_for_an_unregistered_default_draft_refuses_it():
    """Why the gate must skip `default` rather than launch it: the server's drafter refuses it, naming the way out."""
    from specgate.drafting import make_drafter

    with pytest.raises(ValueError, match="target 'tiny-gemma-without-default' has no default draft model.*--draft ngram"):
        make_drafter("default", SimpleNamespace(name="tiny-gemma-without-default"))
