"""Figures of the analytical model, drawn with matplotlib's Agg canvas (no display, no global backend switch)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib import colors
from matplotlib.figure import Figure

from specgate import theory

DEFAULT_ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9)


def sweep_figure(
    out: str | Path,
    c: float = 0.1,
    alphas: Sequence[float] = DEFAULT_ALPHAS,
    gamma_max: int = 16,
    break_even_gammas: Sequence[int] = (4, 8),
) -> dict:
    """Write a two-panel PNG to `out` and return the plotted numbers.

    Left: speedup vs gamma (1..gamma_max) for each alpha at draft cost ratio c, best gamma marked.
    Right: the break-even map over (alpha, c): best speedup over gamma <= gamma_max as a heatmap, its S = 1
    contour (which is the diagonal alpha = c: gamma = 1 is the last to break even, Cor. 3.9 is tight), and the
    fixed-gamma break-even curves c = c_break(alpha, gamma) for break_even_gammas.
    """
    cost = theory.check_cost(c)
    alphas = theory.check_profile(list(alphas), "alphas")
    g_max = theory.check_gamma(gamma_max, "gamma_max")
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise ValueError(f"out={str(out)!r} does not end in .png; pass a file name like sweep.png")
    out.parent.mkdir(parents=True, exist_ok=True)

    gammas = list(range(1, g_max + 1))
    curves = {a: [theory.speedup(a, g, cost) for g in gammas] for a in alphas}
    best = {a: theory.best_gamma(a, cost, g_max) for a in alphas}

    fig = Figure(figsize=(13, 5.2), layout="constrained")
    left, right = fig.subplots(1, 2)

    for a, speedups in curves.items():
        (line,) = left.plot(gammas, speedups, marker="o", markersize=3.5, label=f"alpha = {a:g}")
        g_star, s_star = best[a]
        left.plot([g_star], [s_star], marker="*", markersize=13, color=line.get_color(), markeredgecolor="black")
    left.axhline(1.0, color="black", linestyle="--", linewidth=1, label="S = 1 (break-even)")
    left.set_xlabel("gamma (draft tokens per iteration)")
    left.set_ylabel("speedup S = E[T] / (gamma c + 1)")
    left.set_title(f"Speedup vs gamma at c = {cost:g} (star = best gamma)")
    left.set_xticks(gammas)
    left.grid(alpha=0.3)
    left.legend(loc="best", fontsize=9)

    alpha_grid = np.linspace(0.0, 0.99, 199)  # [A]
    c_grid = np.linspace(0.0, 1.0, 201)  # [C]
    _, best_speedup = theory.best_speedup_grid(alpha_grid, c_grid, g_max)  # [A, C]
    # Colour by log2(S*) so that 0.5x and 2x are equally far from break-even and large speedups do not
    # wash out the interesting region near S* = 1.
    log_speedup = np.log2(best_speedup)  # [A, C]
    norm = colors.TwoSlopeNorm(vmin=float(log_speedup.min()), vcenter=0.0, vmax=float(log_speedup.max()))
    mesh = right.pcolormesh(alpha_grid, c_grid, log_speedup.T, cmap="RdBu", norm=norm, shading="auto")
    ticks = [t for t in (0.5, 0.67, 0.8, 1, 1.25, 1.5, 2, 3, 4, 6, 8, 12, 16) if t <= best_speedup.max()]
    bar = fig.colorbar(mesh, ax=right, ticks=np.log2(ticks), label=f"best speedup S* over gamma <= {g_max}")
    bar.ax.set_yticklabels([f"{t:g}x" for t in ticks])
    levels = right.contour(alpha_grid, c_grid, best_speedup.T, levels=[1.5, 2, 3, 5], colors="dimgray", linewidths=0.8)
    right.clabel(levels, fmt="S*=%g", fontsize=8)
    right.contour(alpha_grid, c_grid, best_speedup.T, levels=[1.0], colors="black", linewidths=2.2)
    right.plot([], [], color="black", linewidth=2.2, label="S* = 1: break-even (alpha = c)")
    for g, style in zip(break_even_gammas, ("--", ":", "-.")):
        c_breaks = [theory.c_break(a, g) for a in alpha_grid]
        right.plot(alpha_grid, c_breaks, color="darkgreen", linestyle=style, linewidth=1.6, label=f"S = 1 at gamma = {g}")
    right.axhline(cost, color="darkorange", linewidth=1.2, label=f"c = {cost:g} (left panel)")
    right.set_xlim(0.0, 0.99)
    right.set_ylim(0.0, 1.0)
    right.set_xlabel("alpha (per-token acceptance probability)")
    right.set_ylabel("c (draft / target cost per forward pass)")
    right.set_title("Break-even map: red = speculation slows down, blue = it helps")
    right.legend(loc="upper left", fontsize=8, framealpha=0.9)

    fig.savefig(out, dpi=110)
    return {
        "out": str(out),
        "c": cost,
        "gammas": gammas,
        "speedup_by_alpha": {f"{a:g}": s for a, s in curves.items()},
        "best_gamma_by_alpha": {f"{a:g}": {"gamma": g, "speedup": s} for a, (g, s) in best.items()},
    }
