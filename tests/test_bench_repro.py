"""The reproducibility benchmark's judgement of several gate runs (specgate.bench.repro), on hand-made rows."""

from specgate.bench import repro


def iv(estimate: float, low: float, high: float) -> dict:
    return {"estimate": estimate, "low": low, "high": high, "level": 0.95, "n": 4}


def test_agreement_needs_one_verdict_and_pairwise_overlapping_intervals():
    same = [{"verdict": "GO", "ratio": iv(1.1, 1.05, 1.15), "wall_s": 1.0}, {"verdict": "GO", "ratio": iv(1.12, 1.08, 1.17), "wall_s": 1.0}]
    assert repro.agreement(same) == {"same_verdict": True, "intervals_overlap": True, "verdicts": ["GO"]}
    apart = [same[0], {"verdict": "GO", "ratio": iv(1.3, 1.2, 1.4), "wall_s": 1.0}]
    assert repro.agreement(apart)["intervals_overlap"] is False  # [1.05, 1.15] and [1.2, 1.4] do not meet
    flipped = [same[0], {"verdict": "NO-GO", "ratio": iv(1.1, 1.0, 1.2), "wall_s": 1.0}]
    assert repro.agreement(flipped)["same_verdict"] is False
    failed = [same[0], {"exit": 2, "error": "boom", "wall_s": 3.0}]
    assert repro.agreement(failed) == {"same_verdict": False, "intervals_overlap": False, "verdicts": ["GO"]}
    off = [{"verdict": "NO-GO", "kind": "off", "ratio": None, "wall_s": 1.0}] * 3
    assert repro.agreement(off) == {"same_verdict": True, "intervals_overlap": None, "verdicts": ["NO-GO"]}  # nothing to compare
    lines = repro.table("quick", [*same, failed[1]])
    assert lines[2].startswith("| 1 | GO |") and "1.1 [1.05, 1.15]" not in lines[2] and "1.100 [1.050, 1.150]" in lines[2]
    assert lines[4].startswith("| 3 | error |")
