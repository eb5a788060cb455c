"""Model gallery: structured curvature and training on idiomatic Equinox models, K-FAC vs Adam.

    python benchmarks/zoo.py                       # every model, 200 steps
    python benchmarks/zoo.py --quick               # fewer steps and smaller grids
    python benchmarks/zoo.py --models cnn gru --plot docs/img/zoo.png

The models are those of `benchmarks/model_zoo` (the tests use them too). For each model:

- the registration summary: how many blocks of each kind the curvature has, and how many
  parameters fell back to a generic (diagonal) block (zero is the goal);
- Adam, with the learning rate of a small grid that reaches the lowest final loss;
- `eqx_kfac.Optimizer` with adaptive learning rate, momentum and damping (no tuning);
- the optax recipe `eqx_kfac.kfac_optax` (K-FAC preconditioning, a norm constraint, momentum),
  with the learning rate of its own small grid chosen the same way.

Every method starts from the same parameters and sees the same batches. The final loss is the
mean training loss of the last 10 steps (for the variational Monte Carlo problems, the energy,
whose exact value is 1.5). Step times are medians of compiled steps, measured in one process;
the first call includes tracing and compilation, as a user waits for it. Ratios to Adam are what
carries over between machines.
"""

import argparse
import collections
import os
import sys
from collections.abc import Sequence

import jax
import numpy as np

import eqx_kfac

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import model_zoo  # noqa: E402
from model_zoo.training import ZooRun, train  # noqa: E402

ADAM_GRID = (1e-3, 3e-3, 1e-2)
RECIPE_GRID = (0.03, 0.1, 0.3)


def registration_summary(problem: model_zoo.ZooProblem) -> tuple[str, int]:
    """`("3 DenseTwoKroneckerFactored, 2 ScaleAndShiftDiagonal", parameters in generic blocks)`."""
    batch = problem.next_batch(problem.model, 0, jax.random.key(0), None)
    args = (problem.model,)
    args += (problem.func_state,) if problem.has_state else ()
    args += (jax.random.key(0),) if problem.has_rng else ()
    estimator = eqx_kfac.BlockDiagonalCurvature(problem.loss, (*args, batch), on_unmatched="ignore")
    kinds = collections.Counter(type(b).__name__ for b in estimator.blocks)
    generic = sum(
        int(np.prod(s)) for b in estimator.blocks if b.spec.tag == "generic" for s in b.param_shapes
    )
    return ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())), generic


def best(runs: Sequence[ZooRun]) -> ZooRun:
    """The run with the lowest final loss (a diverged run never wins)."""
    return min(runs, key=lambda r: (not np.isfinite(r.final_loss()), r.final_loss()))


def run_model(name: str, steps: int, adam_grid: Sequence[float], recipe_grid: Sequence[float]) -> dict:
    """All runs of one model: the registration summary and the best run of each method."""
    problem = model_zoo.PROBLEMS[name](jax.random.key(0))
    blocks, generic = registration_summary(problem)
    adam = best([train(problem, "adam", steps, lr) for lr in adam_grid])
    kfac = train(problem, "kfac", steps)
    recipe = best([train(problem, "recipe", steps, lr) for lr in recipe_grid])
    return dict(name=name, blocks=blocks, generic=generic, adam=adam, kfac=kfac, recipe=recipe,
                exact=problem.exact_loss)


def table(rows: Sequence[dict]) -> str:
    """The markdown table of the gallery."""
    header = (
        "| model | blocks | generic params | Adam loss (lr) | K-FAC loss | recipe loss (lr) "
        "| K-FAC ms/step (x Adam) | recipe ms/step (x Adam) | first call s: Adam / K-FAC / recipe |"
    )
    lines = [header, "|" + "---|" * 9]
    for row in rows:
        adam, kfac, recipe = row["adam"], row["kfac"], row["recipe"]
        name = row["name"] + (f" (exact {row['exact']:g})" if row["exact"] is not None else "")
        lines.append(
            f"| {name} | {row['blocks']} | {row['generic']} "
            f"| {adam.final_loss():.4f} ({adam.learning_rate:g}) | {kfac.final_loss():.4f} "
            f"| {recipe.final_loss():.4f} ({recipe.learning_rate:g}) "
            f"| {kfac.ms_per_step:.1f} ({kfac.ms_per_step / adam.ms_per_step:.1f}) "
            f"| {recipe.ms_per_step:.1f} ({recipe.ms_per_step / adam.ms_per_step:.1f}) "
            f"| {adam.first_call:.1f} / {kfac.first_call:.1f} / {recipe.first_call:.1f} |"
        )
    return "\n".join(lines)


def plot(rows: Sequence[dict], path: str) -> None:
    """Training loss against steps, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 4
    rows_n = -(-len(rows) // columns)
    fig, axes = plt.subplots(rows_n, columns, figsize=(4 * columns, 3 * rows_n), squeeze=False)
    for ax, row in zip(axes.flat, rows):
        for method, style in (("adam", "C0"), ("kfac", "C3"), ("recipe", "C2")):
            run = row[method]
            label = method if run.learning_rate is None else f"{method} lr={run.learning_rate:g}"
            ax.plot(run.losses, color=style, label=label, lw=1)
        if row["exact"] is not None:
            ax.axhline(row["exact"], color="k", ls=":", lw=1)
        else:
            ax.set_yscale("log")
        ax.set_title(row["name"])
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    for ax in axes.flat[len(rows):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(model_zoo.PROBLEMS), default=list(model_zoo.PROBLEMS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="60 steps, one Adam and one recipe rate")
    parser.add_argument("--plot", help="write the loss curves to this PNG")
    args = parser.parse_args(argv)
    steps, adam_grid, recipe_grid = args.steps, ADAM_GRID, RECIPE_GRID
    if args.quick:
        steps, adam_grid, recipe_grid = min(steps, 60), (3e-3,), (0.1,)
    rows = []
    for name in args.models:
        rows.append(run_model(name, steps, adam_grid, recipe_grid))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"\n{steps} steps per run on {jax.devices()[0].platform}; Adam grid {adam_grid}, recipe grid {recipe_grid}.\n")
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)
        print(f"\nwrote {args.plot}")


if __name__ == "__main__":
    main()
