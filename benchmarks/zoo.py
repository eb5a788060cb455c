"""Model gallery: structured curvature and training on idiomatic Equinox models, K-FAC vs Adam.

    python benchmarks/zoo.py                       # every model, 200 steps
    python benchmarks/zoo.py --quick               # fewer steps and smaller grids
    python benchmarks/zoo.py --models cnn gru --plot docs/img/zoo.png
    python benchmarks/zoo.py --steps 30 --batch-size 32 --models cnn resnet mlp_norm_dropout \
        transformer gru lstm scan_mlp frozen_part    # tests/test_zoo_training.py's long version

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
from collections.abc import Sequence

import jax

from benchmarks import model_zoo
from benchmarks.harness import Method, best, registration_summary, train

ADAM_GRID = (1e-3, 3e-3, 1e-2)
RECIPE_GRID = (0.03, 0.1, 0.3)


def run_model(
    name: str, steps: int, adam_grid: Sequence[float], recipe_grid: Sequence[float], batch_size: int | None = None
) -> dict:
    """All runs of one model: the registration summary and the best run of each method."""
    sizes = {} if batch_size is None else {"batch_size": batch_size}
    problem = model_zoo.PROBLEMS[name](jax.random.key(0), **sizes)
    blocks, generic = registration_summary(problem)
    adam = best([train(problem, Method("adam", lr), steps) for lr in adam_grid])
    kfac = train(problem, Method("kfac"), steps)
    recipe = best([train(problem, Method("recipe", lr), steps) for lr in recipe_grid])
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
            f"| {adam.first_call.total:.1f} / {kfac.first_call.total:.1f} / {recipe.first_call.total:.1f} |"
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
    parser.add_argument("--batch-size", type=int, help="examples per batch (default: each model's)")
    args = parser.parse_args(argv)
    steps, adam_grid, recipe_grid = args.steps, ADAM_GRID, RECIPE_GRID
    if args.quick:
        steps, adam_grid, recipe_grid = min(steps, 60), (3e-3,), (0.1,)
    rows = []
    for name in args.models:
        rows.append(run_model(name, steps, adam_grid, recipe_grid, args.batch_size))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"\n{steps} steps per run on {jax.devices()[0].platform}; Adam grid {adam_grid}, recipe grid {recipe_grid}.\n")
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)
        print(f"\nwrote {args.plot}")


if __name__ == "__main__":
    main()
