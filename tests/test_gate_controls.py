"""The gate's controls, each a gate run against real `specgate serve` servers on a tiny model:
- a configuration made slower on purpose by a known amount (serve's test-only --debug-step-delay-ms, through a launch
  template) is NO-GO on throughput;
- a twin of the baseline (the very same command) is never NO-GO on throughput, at any load;
- a schedule that pays at C=1 and is off above (a copy of the target as its own draft model, `table:DRAFT:1-1:3,2-64:0`)
  is judged GO at C=1 and, at C=2, on non-inferiority alone (acceptance N/A: it does not speculate there).
(A lossy mode failing quality is tests/test_gate_e2e.py's LOSSY twin.)"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from gate_helpers import check_verdicts_follow_the_rule, criterion

CHEAP = dict(concurrency=[1, 2], target_concurrency=2, per_category=2, max_tokens=16, greedy_tokens=16, math_items=8, sample_prompts=4,
             sample_tokens=8, max_num_seqs=2, max_seq_len=256, round_s=1.0, rounds=6, budget_s=40.0, margin=0.1)  # tiny-model rounds swing with the host


def serve(target: Path) -> str:
    return f"{sys.executable} -m specgate serve --target {target} --host 127.0.0.1 --port {{port}} --max-num-seqs 2 --max-seq-len 256 --draft none --policy off"


def gate(tmp_path: Path, name: str, target: Path, **kw):
    from specgate.gate.options import GateOptions
    from specgate.gate.runner import run_gate

    return run_gate(GateOptions(out=tmp_path / name, target=str(target), **{**CHEAP, **kw}))


def loads(config: dict) -> dict[str, dict]:
    return {a["load"]: a for a in config["loads"]}


def test_a_configuration_slowed_by_a_known_amount_is_no_go_on_throughput(tiny_model_dir, tmp_path):
    target = tiny_model_dir("llama")
    # 6 longer rounds: the tiny model's baseline at C=2 swings 2x between rounds (the client shares the 2 cores), and
    # 4 short ones left one slow round straddling the bound about one run in four
    report = gate(tmp_path, "slow", target, baseline_cmd=serve(target), server_cmd=serve(target) + " --debug-step-delay-ms 3",
                  rounds=6, round_s=1.0, budget_s=60.0)
    config = report["configs"]["server-cmd"]
    throughput = criterion(config, "throughput_at_target_concurrency")
    assert throughput["state"] == "FAIL" and throughput["interval"]["high"] < 0.9, throughput["reason"]
    assert config["verdict"] == report["verdict"] == "NO-GO"
    check_verdicts_follow_the_rule(report)


def test_a_twin_of_the_baseline_is_never_no_go_on_throughput(tiny_model_dir, tmp_path):
    target = tiny_model_dir("llama")
    report = gate(tmp_path, "twin", target, baseline_cmd=serve(target), server_cmd=serve(target))
    config = report["configs"]["server-cmd"]
    for load, analysis in loads(config).items():
        assert all(c["state"] != "FAIL" for c in analysis["criteria"]), (load, [c["reason"] for c in analysis["criteria"]])
        assert analysis["throughput_ratio"]["low"] < 1.0 < analysis["throughput_ratio"]["high"] or analysis["verdict"] == "GO"
    assert criterion(config, "acceptance_above_alpha_min")["state"] == "N/A"  # it drafts nothing: judged on non-inferiority alone
    assert report["verdict"] != "NO-GO"
    check_verdicts_follow_the_rule(report)


def test_a_schedule_that_pays_at_c1_is_go_there_and_judged_on_non_inferiority_above(tiny_model_dir, tmp_path):
    target = tiny_model_dir("llama")
    itself = Path(shutil.copytree(target, tmp_path / "self-draft"))
    report = gate(tmp_path, "schedule", target, drafts=[f"table:{itself}:1-1:3,2-64:0"], gammas=[3])
    config = report["configs"][f"table-{itself.name}"]
    c1, c2 = loads(config)["c1"], loads(config)["c2"]
    assert c1["speculating"] and c1["verdict"] == "GO", [c["reason"] for c in c1["criteria"]]
    assert not c2["speculating"] and criterion(c2, "acceptance_above_alpha_min")["state"] == "N/A"
    assert criterion(c2, "throughput_at_target_concurrency")["state"] != "FAIL"
    assert config["schedule"]["table"][:2] == [[1, 1, 3], [2, 2, 0]]
    check_verdicts_follow_the_rule(report)
