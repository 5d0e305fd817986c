"""Speculation policies: table lookup, cost-model interpolation, and the adaptive goodput choice (no timing)."""

import pytest
import typer
from typer.testing import CliRunner

from specgate.serving import AdaptivePolicy, CostModel, FixedPolicy, OffPolicy, TablePolicy, calibrate_cost_model, make_policy
from specgate.serving.policy import monotone
from specgate.theory import expected_tokens

# Gemma-3-270M fp32 on the 2-core dev machine (docs ANCHORS): target step ms for (batch, tokens per row)
ANCHOR_MS = {(1, 1): 72, (1, 5): 110, (1, 9): 130, (8, 1): 95, (8, 5): 199, (8, 9): 300, (16, 1): 117, (16, 5): 324, (16, 9): 582}


def test_off_fixed_table():
    assert OffPolicy().choose([0.9, None]) == [0, 0]
    assert FixedPolicy(3).choose([0.1, 0.9, None]) == [3, 3, 3]
    table = TablePolicy.parse("1-2:4, 3-8:2, 9-16:0")
    assert table.table == [(1, 2, 4), (3, 8, 2), (9, 16, 0)]
    assert [table.choose([None] * b)[0] for b in (1, 2, 3, 8, 9, 16, 17)] == [4, 4, 2, 2, 0, 0, 0]
    assert TablePolicy.parse("4:3").gamma_for(4) == 3
    with pytest.raises(ValueError, match="LO-HI:GAMMA"):
        TablePolicy.parse("1-4")
    with pytest.raises(ValueError, match="lo <= hi"):
        TablePolicy([(5, 2, 1)])
    with pytest.raises(ValueError, match="gamma=-1"):
        FixedPolicy(-1)
    with pytest.raises(ValueError, match="unknown"):
        make_policy("sometimes")


def test_cost_model_interpolates_and_extrapolates():
    model = CostModel(ANCHOR_MS, draft_ms={1: 10.0, 16: 40.0})
    assert model.target_step_ms(8, 5) == pytest.approx(199)
    assert model.target_step_ms(1, 3) == pytest.approx(91)  # halfway between 72 and 110
    assert model.target_step_ms(12, 1) == pytest.approx(106)  # halfway between bs8 and bs16
    assert model.target_step_ms(24, 1) == pytest.approx(139)  # last segment extended
    assert model.draft_step_ms(6) == pytest.approx(20.0) and model.step_ms(1, 4) == pytest.approx(4 * 10 + 110)
    with pytest.raises(ValueError, match="misses grid points"):
        CostModel({(1, 1): 1.0, (2, 1): 2.0, (1, 5): 3.0})


def brute_force_best(cost: CostModel, alphas: list[float], gamma_max: int) -> int:
    """Independent oracle: goodput from Leviathan's E[T] summed over requests, over gammas 0..gamma_max."""

    def goodput(g: int) -> float:
        tokens = sum(1.0 if g == 0 else expected_tokens(a, g) for a in alphas)
        return tokens / (g * cost.draft_step_ms(len(alphas)) + cost.target_step_ms(len(alphas), g + 1))

    return max(range(gamma_max + 1), key=lambda g: (goodput(g), -g))


def test_adaptive_speculates_alone_and_stops_under_heavy_batch_cost():
    cheap_alone = CostModel(ANCHOR_MS)  # n-gram drafts: no draft cost
    policy = AdaptivePolicy(cheap_alone, gamma_max=8)
    assert policy.choose([0.8])[0] > 0
    # compute-bound at batch 16: verifying 9 tokens costs 9x one token, so no gamma can pay
    linear = CostModel({(1, 1): 72, (1, 9): 130, (16, 1): 117, (16, 9): 117 * 9})
    assert AdaptivePolicy(linear, gamma_max=8).choose([0.8] * 16) == [0] * 16
    assert AdaptivePolicy(linear, gamma_max=8).choose([0.8])[0] > 0
    # a useless draft (alpha 0) never pays, an expensive draft model lowers the best gamma
    assert policy.choose([0.0, 0.0]) == [0, 0]
    pricey = CostModel(ANCHOR_MS, draft_ms={1: 30.0, 16: 60.0})
    assert 0 < AdaptivePolicy(pricey, gamma_max=8).choose([0.8])[0] < policy.choose([0.8])[0]
    assert policy.choose([]) == []


@pytest.mark.parametrize("batch", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.6, 0.9, 1.0])
def test_adaptive_choice_is_the_goodput_argmax(batch, alpha):
    cost = CostModel(ANCHOR_MS, draft_ms={1: 5.0, 8: 9.0, 16: 14.0})
    alphas = [alpha] * (batch - 1) + [min(alpha + 0.05, 1.0)]
    assert AdaptivePolicy(cost, gamma_max=8).choose(alphas) == [brute_force_best(cost, alphas, 8)] * batch


def test_adaptive_uses_the_prior_before_any_estimate():
    cost = CostModel(ANCHOR_MS)
    assert AdaptivePolicy(cost, prior_alpha=0.0).choose([None]) == [0]
    assert AdaptivePolicy(cost, prior_alpha=0.9).choose([None])[0] > 0


def test_calibration_measures_the_whole_grid(tiny_model_dir):
    from specgate.models import load_model

    target = load_model(str(tiny_model_dir("llama"))).model
    cost = calibrate_cost_model(target, target, gamma_max=3, batch_sizes=(1, 4), context_len=8, repeats=1)
    assert set(cost.target_ms) == {(1, 1), (1, 4), (4, 1), (4, 4)} and set(cost.draft_ms) == {1, 4}
    assert all(ms > 0 for ms in [*cost.target_ms.values(), *cost.draft_ms.values()])
    assert AdaptivePolicy(cost, gamma_max=3).choose([0.5, 0.5]) in ([g, g] for g in range(4))


def test_serve_command_refuses_bad_options():
    from specgate.cli import serve_cmds
    from specgate.cli.common import UserError

    app = typer.Typer()
    serve_cmds.register(app)
    app.command("noop")(lambda: None)  # a second command keeps `serve` a subcommand
    runner = CliRunner()
    for args, message in (
        (["serve", "--policy", "sometimes"], "--policy 'sometimes' is unknown"),
        (["serve", "--port", "70000"], "--port 70000 is out of range"),
        (["serve", "--policy", "table"], "needs --gamma-table"),
        (["serve", "--lossy", "sometimes"], "--lossy 'sometimes' is unknown"),
        (["serve", "--dtype", "int4"], "--dtype 'int4' is not supported"),
        (["serve", "--draft", "synthetic:AL=3", "--policy", "off"], "no synthetic drafter"),
    ):
        result = runner.invoke(app, args)
        assert isinstance(result.exception, (ValueError, UserError)) and message in str(result.exception), result.output


def test_monotone_removes_timing_noise_from_the_grid():
    noisy = CostModel({(1, 1): 70, (1, 5): 60, (2, 1): 65, (2, 5): 120}, draft_ms={1: 9.0, 2: 7.0})
    clean = monotone(noisy)
    assert clean.target_ms == {(1, 1): 70, (1, 5): 70, (2, 1): 70, (2, 5): 120} and clean.draft_ms == {1: 9.0, 2: 9.0}
