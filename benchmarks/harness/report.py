"""Reports of `Outcome`s: the markdown tables, one-line summaries and plots of the docs pages.

`table` gives each method's final loss and its steps and seconds to the problem's target (from the
first call and compiled); `first_call_table` splits each method's first call by stage; `summary`
names who reaches the target first; `plot` draws the smoothed loss against steps and seconds.
"""

import os
from collections.abc import Sequence

import numpy as np

from .methods import KFAC_METHODS
from .outcome import Outcome
from .record import WINDOW

COLORS = {"kfac": "tab:green", "recipe": "tab:olive", "kfac_muon": "tab:pink", "adam": "tab:blue", "muon": "tab:red",
          "sophia": "tab:purple", "psgd": "tab:brown", "adamw": "tab:blue", "adabelief": "tab:cyan",
          "sgd": "tab:orange"}


def _spread(values: Sequence[float], spec: str) -> str:
    """`median` or `median [min, max]` of the finite values, `-` if none."""
    finite = [v for v in values if np.isfinite(v)]
    if not finite:
        return "-"
    text = format(float(np.median(finite)), spec)
    if len(values) > 1:
        text += f" [{min(finite):{spec}}, {max(finite):{spec}}]"
    return text + ("" if len(finite) == len(values) else f" ({len(finite)}/{len(values)})")


def _rate(runs: Sequence, grid: Sequence) -> str:
    if runs[0].learning_rate is None:
        return "adaptive" if runs[0].method == "kfac" else "default"
    if len(grid) == 1:
        return f"{runs[0].learning_rate:g}"
    rates = ", ".join(f"{r.learning_rate:g}" for r in sorted(grid, key=lambda r: r.learning_rate))
    return f"{runs[0].learning_rate:g} ({rates})"


def table(outcomes: Sequence[Outcome], grid_seconds: bool = True) -> str:
    """The markdown table: one row per problem and method.

    Values over seeds are `median [min, max]`, with `(k/n)` when only `k` of the `n` seeds
    reached the target or stayed finite. `grid s` (left out when `grid_seconds` is false, for
    outcomes without a learning-rate search) is the wall time of the whole learning-rate search of
    that method (seed 0), what tuning it cost.
    """
    columns = (
        "problem | method | lr (grid) | final loss | steps to target | s to target (first call) "
        "| s to target (compiled) | ms/step | first call s" + (" | grid s" if grid_seconds else "")
    )
    lines = [f"| {columns} |", "|" + "---|" * (columns.count("|") + 1)]
    for outcome in outcomes:
        for method, runs in outcome.seeds.items():
            grid = outcome.grids[method]
            reaches = outcome.reaches(method)
            lines.append(
                f"| {outcome.problem} | {method} | {_rate(runs, grid)} "
                f"| {_spread([r.final_loss(WINDOW) for r in runs], '.4f')} "
                f"| {_spread([np.inf if r is None else r.steps for r in reaches], '.0f')} "
                f"| {_spread([np.inf if r is None else r.wall for r in reaches], '.1f')} "
                f"| {_spread([np.inf if r is None else r.compiled for r in reaches], '.2f')} "
                f"| {_spread([r.ms_per_step for r in runs], '.1f')} "
                f"| {_spread([r.first_call.total for r in runs], '.1f')} "
                + (f"| {sum(r.wall for r in grid):.0f} |" if grid_seconds else "|")
            )
    return "\n".join(lines)


def first_call_table(outcomes: Sequence[Outcome], baseline: dict[str, str]) -> str:
    """The markdown table of each method's first call by stage (seed 0), against a baseline's.

    **Arguments:**

    - `outcomes`: the problems' results.
    - `baseline`: `problem -> method` whose first call and step the ratios divide by.

    **Returns:**

    The table: setup (building the optimizer and its state), trace, lower, compile and the first
    step's run in seconds, the whole first call and its ratio to the baseline's, the median
    compiled step and its ratio.
    """
    header = (
        "| problem | method | setup s | trace s | lower s | compile s | run s | first call s "
        "| x baseline | ms/step | x baseline |"
    )
    lines = [header, "|" + "---|" * 11]
    for outcome in outcomes:
        base = outcome.seeds[baseline[outcome.problem]][0]
        for method, runs in outcome.seeds.items():
            run, first = runs[0], runs[0].first_call
            lines.append(
                f"| {outcome.problem} | {method} | {first.setup:.2f} | {first.trace:.2f} "
                f"| {first.lower:.2f} | {first.compile:.2f} | {first.run:.3f} | {first.total:.1f} "
                f"| {first.total / base.first_call.total:.1f} | {run.ms_per_step:.2f} "
                f"| {run.ms_per_step / base.ms_per_step:.1f} |"
            )
    return "\n".join(lines)


def summary(outcome: Outcome) -> str:
    """Which method reaches the target first from the first call, and the ratio to the runner-up.

    **Returns:**

    A line naming the fastest method (median over seeds), the fastest K-FAC form and the fastest
    baseline, with the baseline's time over K-FAC's.
    """
    walls = {m: outcome.median_wall(m) for m in outcome.seeds}
    winner = min(walls, key=walls.get)
    kfac = min((m for m in walls if m in KFAC_METHODS), key=walls.get, default=None)
    other = min((m for m in walls if m not in KFAC_METHODS), key=walls.get)
    text = f"{outcome.problem}: first {winner} ({walls[winner]:.1f} s)"
    if kfac is not None and np.isfinite(walls[kfac]):
        text += (f"; K-FAC's best {kfac} {walls[kfac]:.1f} s, baselines' best {other} "
                 f"{walls[other]:.1f} s: {walls[other] / walls[kfac]:.2f}x")
    elif kfac is not None:
        text += "; neither K-FAC form reaches the target (median over seeds)"
    return text + f" (target {outcome.target(0):.4f} on seed 0)"


def plot(outcome: Outcome, path: str) -> None:
    """Writes the smoothed loss of each method's chosen run (seed 0) against steps and seconds.

    **Arguments:**

    - `outcome`: the problem's results.
    - `path`: the PNG to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for method, runs in outcome.seeds.items():
        run = runs[0]
        style = dict(color=COLORS.get(method), lw=1.8 if method in KFAC_METHODS else 1.1, label=run.label)
        axes[0].plot(run.smoothed(), **style)
        axes[1].plot(run.elapsed(), run.smoothed(), **style)
    for ax, xlabel in zip(axes, ("step", "seconds from the first call (compilation included)")):
        ax.axhline(outcome.target(0), color="gray", ls="--", lw=0.8, label="target")
        if outcome.exact is None:
            ax.set_yscale("log")
        else:
            ax.axhline(outcome.exact, color="k", ls=":", lw=0.8, label="exact")
            ax.set_ylim(outcome.exact - 0.05, outcome.exact + 0.6)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"training loss, mean of the last {WINDOW} steps")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{outcome.problem}: {outcome.steps} steps, seed 0")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
