"""The statistical proof: the exact sampler passes, every negative control is caught, the CLI reports it."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from specgate.sampling.lossless_check import (
    build_cases,
    chi_square_test,
    exact_sampler,
    generate_sequences,
    run_synthetic_suite,
)


@pytest.fixture(scope="session")
def suite():
    """The full suite at its defaults (100,000 sequences per case, significance 0.01, Bonferroni)."""
    return run_synthetic_suite(progress=False)


def test_exact_sampler_passes_every_test(suite):
    failing = [c["name"] for c in suite["cases"] if c["verdict"] != "pass"]
    assert not failing, failing
    assert suite["verdict"] == "pass"
    assert suite["num_samples"] >= 100_000
    assert suite["per_test_alpha"] == pytest.approx(0.01 / suite["num_tests"])
    assert {c["sampler"] for c in suite["cases"]} == {"rejection_sample", "rejection_sample_logits", "rejection_sample_logits, torch", "rejection_sample_logits, SparseProbs q"}
    assert len(suite["cases"]) == suite["num_tests"]


def test_every_negative_control_is_caught(suite):
    names = {c["name"] for c in suite["negative_controls"]}
    assert {"shared_uniform_accept_and_residual", "unnormalised_residual", "p_q_swapped", "sparse_q_repeated_column_dropped"} <= names
    assert {"typical_acceptance_lossy", "synthetic_acceptance_lossy", "entropy_gated_lossy"} <= names
    not_caught = [c["name"] for c in suite["negative_controls"] if c["verdict"] != "fail"]
    assert not not_caught, not_caught
    assert suite["controls_caught"] is True


def test_cases_cover_the_required_shapes(suite):
    cases = build_cases(0)
    assert {c.gamma for c in cases} == {1, 3, 5}
    assert min(c.vocab_size for c in cases) == 5 and max(c.vocab_size for c in cases) == 50
    kinds = {c.kind for c in cases}
    assert {"q_misses_support", "p_with_zeros", "peaked_p_flat_q", "flat_p_peaked_q", "token_only"} <= kinds
    missing_support = [c for c in cases if c.kind == "q_misses_support"]
    assert all(((c.draft_table == 0) & (c.target_table > 0)).any() for c in missing_support)
    tests = {c["test"] for c in suite["cases"]}
    assert {"position 0", "position 5", "joint 0,1"} <= tests


def test_chained_sequences_fill_every_position():
    case = build_cases(0)[2]  # G = 5
    tokens = generate_sequences(case, exact_sampler, 2_000, torch.Generator().manual_seed(0))
    assert tokens.shape == (2_000, case.gamma + 1)
    assert (tokens >= 0).all()
    rows = torch.arange(case.gamma + 1)
    assert (case.target_table[rows, tokens] > 0).all()  # never a zero-probability token


def test_chi_square_detects_bias_and_pools_sparse_cells():
    rng = np.random.default_rng(0)
    probs = np.array([0.5, 0.3, 0.19, 0.005, 0.005])
    counts = np.bincount(rng.choice(5, 500, p=probs), minlength=5)
    statistic, dof, p_value = chi_square_test(counts, probs)
    assert p_value > 1e-3 and dof == 3  # the two sparse cells (expected 2.5 each) pooled into one
    counts = np.bincount(rng.choice(5, 10_000, p=probs), minlength=5)
    assert chi_square_test(counts, probs)[1] == 4  # expected 50 each: no pooling
    biased = np.bincount(rng.choice(5, 100_000, p=[0.52, 0.28, 0.19, 0.005, 0.005]), minlength=5)
    assert chi_square_test(biased, probs)[2] < 1e-6
    impossible = counts.copy()
    impossible_probs = np.array([0.5, 0.3, 0.2, 0.0, 0.0])
    statistic, _, p_value = chi_square_test(impossible, impossible_probs)
    assert statistic == float("inf") and p_value == 0.0


def test_suite_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_samples=10"):
        run_synthetic_suite(num_samples=10)
    with pytest.raises(ValueError, match="significance=1.5"):
        run_synthetic_suite(significance=1.5)


def test_cli_check_lossless_json():
    out = subprocess.run(
        [sys.executable, "-m", "specgate", "check-lossless", "--json", "--samples", "5000", "--seed", "1"],
        capture_output=True, text=True, timeout=300,
    )
    result = json.loads(out.stdout)
    assert set(result) >= {"verdict", "cases", "negative_controls"}
    assert all({"name", "statistic", "p_value", "verdict"} <= set(c) for c in result["cases"])
    # the exact sampler must pass every test (seed 1 fixes the draw; per-test significance 0.01 / tests), and exit 0
    failing = [(c["name"], c["p_value"]) for c in result["cases"] if c["verdict"] != "pass"]
    assert not failing and result["verdict"] == "pass", failing
    assert out.returncode == 0, out.stderr
    # every negative control must fail, the required ones among them
    names = {c["name"] for c in result["negative_controls"]}
    assert {"shared_uniform_accept_and_residual", "unnormalised_residual", "p_q_swapped", "typical_acceptance_lossy"} <= names
    not_caught = [c["name"] for c in result["negative_controls"] if c["verdict"] != "fail"]
    assert not not_caught and result["controls_caught"] is True, not_caught


def test_cli_check_lossless_bad_arguments_exit_2():
    for args in (["--samples", "10"], ["--gamma", "3"], ["--significance", "2"], ["--target", "x"]):
        out = subprocess.run([sys.executable, "-m", "specgate", "check-lossless", *args], capture_output=True, text=True)
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.strip().startswith("error:") and len(out.stderr.strip().splitlines()) == 1
