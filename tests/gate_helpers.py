"""Checks shared by the gate's end-to-end tests: every verdict is the rule applied to its own criteria."""

from __future__ import annotations


def rule(criteria: list[dict]) -> str:
    """NO-GO when a binding criterion FAILs, INCONCLUSIVE when one is UNDECIDED, else GO (N/A ignored)."""
    binding = [c for c in criteria if c["binding"] and c["state"] != "N/A"]
    if any(c["state"] == "FAIL" for c in binding):
        return "NO-GO"
    return "INCONCLUSIVE" if any(c["state"] == "UNDECIDED" for c in binding) else "GO"


def check_verdicts_follow_the_rule(report: dict, summary: dict | None = None) -> None:
    """Per configuration and per load, the verdict is the rule over its criteria; the headline is the recommendation's."""
    assert report["configs"], "no speculative configuration was decided"
    for name, config in report["configs"].items():
        assert config["verdict"] == rule(config["criteria"]), name
        for load in config["loads"]:
            assert load["verdict"] == rule(load["criteria"]), (name, load["load"])
    rec = report["recommendation"]
    assert report["verdict"] == rec["verdict"]
    if summary is not None:  # what the CLI prints is the report's
        assert summary["configs"] == {name: c["verdict"] for name, c in report["configs"].items()}
        assert summary["verdict"] == report["verdict"] and summary["notes"] == report["notes"]
    if rec["kind"] != "off":  # a measured recommendation: its own criteria decide
        assert report["config"] == rec["config"] and report["verdict"] == report["configs"][rec["config"]]["verdict"]
        assert report["criteria"] == report["configs"][report["config"]]["criteria"]
    else:
        assert report["verdict"] == "NO-GO" and report["config"] is None


def criterion(report_or_config: dict, name: str) -> dict:
    return next(c for c in report_or_config["criteria"] if c["name"] == name)
