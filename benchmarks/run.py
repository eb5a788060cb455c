"""K-FAC vs Adam vs SGD on scikit-learn's bundled digits, full batch, on this machine.

    pip install -e ".[dev]" && python benchmarks/run.py

Problems (`benchmarks/model_zoo/tanh_mlp.py`): an MLP classifier 64-128-128-10 (softmax
cross-entropy) and a deep autoencoder 64-256-128-64-16-64-128-256-64 (sigmoid cross-entropy on the
[0, 1] pixels), both tanh, full batch (1,797 images), with `1e-5 / 2 * |θ|²` added to the loss.

Optimizers:
- Adam: every learning rate of a small grid for `--steps-adam` steps; the best final loss is the
  target the others are measured against.
- SGD with momentum 0.9: a small learning-rate grid, as many steps as Adam.
- K-FAC (`eqx_kfac.Optimizer`): adaptive learning rate, momentum and damping (initial damping
  1.0), `--kfac-estimation-mode` curvature, at most `--steps-kfac` steps.

The runs of a grid advance one step each in turn (`benchmarks.harness.run_round`). Every step is
compiled once (the first call, timed on its own) and timed until its loss is ready. The table
gives, per run, the final loss, the steps and seconds (compiled steps only) to reach Adam's best
final loss, that time as a fraction of the best Adam run's total time, the same fraction counted
from the first call (compilation included), and the total time; plots of loss against steps and
against seconds go to `--out`.
"""

import argparse
import os
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import eqx_kfac
from benchmarks.harness import Method, best, run_round, train
from benchmarks.model_zoo import tanh_mlp

PROBLEMS = ("classifier", "autoencoder")
OPTIMIZERS = ("adam", "sgd", "kfac")
# The learning rates of the first-order baselines: each grid brackets the best rate (one step
# larger is unstable or no better, see docs/benchmarks.md).
GRIDS = {
    "classifier": {"adam": (3e-4, 1e-3, 3e-3, 1e-2), "sgd": (1e-1, 3e-1)},
    "autoencoder": {"adam": (3e-4, 1e-3, 3e-3, 1e-2), "sgd": (1e-2, 3e-2)},
}
DENSE_BLOCKS = {"kfac": eqx_kfac.DenseTwoKroneckerFactored, "ekfac": eqx_kfac.DenseEigenbasisKFAC}
ESTIMATION_MODES = (
    "fisher_gradients",
    "fisher_empirical",
    "fisher_exact",
    "fisher_curvature_prop",
    "ggn_exact",
    "ggn_curvature_prop",
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see `--help`)."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--problems", nargs="+", choices=PROBLEMS, default=list(PROBLEMS))
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    parser.add_argument("--steps-adam", type=int, default=3000,
                        help="steps of every Adam run (and of every SGD run)")
    parser.add_argument("--steps-kfac", type=int, default=200,
                        help="steps of every K-FAC run (the most, with --kfac-stop-at-target)")
    parser.add_argument("--kfac-stop-at-target", action="store_true",
                        help="stop K-FAC as soon as it reaches Adam's best final loss")
    parser.add_argument("--kfac-estimation-mode", choices=ESTIMATION_MODES,
                        default="ggn_curvature_prop")
    parser.add_argument("--kfac-dense-block", choices=("kfac", "ekfac"), default="kfac",
                        help="curvature block of dense layers: K-FAC or eigenvalue-corrected K-FAC")
    parser.add_argument("--kfac-burnin", type=int, default=10,
                        help="K-FAC curvature updates on the batch before its first step")
    parser.add_argument("--seeds", type=int, default=1,
                        help="number of seeds (0, 1, ...): model initialisation and K-FAC keys")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"),
                        help="folder for the plots")
    parser.add_argument("--no-plots", action="store_true", help="do not write plots")
    parser.add_argument("--float64", action="store_true", help="train in float64 (default float32)")
    args = parser.parse_args(argv)
    for name in ("steps_adam", "steps_kfac", "seeds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def _fmt(value: float | int | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(runs: list, adam: dict) -> str:
    """A markdown table, one row per run, measured against Adam's best run.

    **Arguments:**

    - `runs`: the runs to list (`benchmarks.harness.Run`s).
    - `adam`: `(problem, seed) -> ` the best Adam run (absent without Adam).

    **Returns:**

    The table as text. A run's losses are the objective before each step, its final loss the last
    of them. "s to Adam's best" counts compiled steps only (the first at the median step time);
    "x Adam" divides it by the best Adam run's compiled steps; "x Adam (medians)" estimates the
    same ratio from median step times (steps to reach x median step time, over Adam's steps x
    Adam's median step time), which a machine shared with other work disturbs less; "x Adam from
    first call" counts both times from the first call, compilation included; "compile s" is the
    first call (building the optimizer, tracing, compiling and running the first step).
    """
    header = (
        "| problem | seed | optimizer | final loss | steps to Adam's best | s to Adam's best "
        "| x Adam | x Adam (medians) | x Adam from first call | total s | ms/step (median) "
        "| compile s |"
    )
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for run in runs:
        best = adam.get((run.problem, run.seed))
        reach = None if best is None else run.reach(best.final_loss(1), window=1)
        seconds = ratio = median_ratio = first_call_ratio = None
        if reach is not None:
            seconds = reach.compiled
            ratio = seconds / best.compiled
            median_ratio = (reach.steps * float(np.median(run.times))) / (
                len(best.losses) * float(np.median(best.times))
            )
            first_call_ratio = reach.wall / best.wall
        lines.append(
            f"| {run.problem} | {run.seed} | {run.label} | {_fmt(run.final_loss(1), '.4f')} "
            f"| {_fmt(None if reach is None else reach.steps, 'd')} | {_fmt(seconds, '.2f')} "
            f"| {_fmt(ratio, '.3f')} | {_fmt(median_ratio, '.3f')} | {_fmt(first_call_ratio, '.3f')} "
            f"| {run.compiled:.2f} | {run.ms_per_step:.2f} | {run.first_call.total:.1f} |"
        )
    return "\n".join(lines)


def plot(problem: str, runs: list, best: list, target: float | None, out: str) -> str:
    """Writes `out/<problem>.png`: loss against steps and against seconds, log scale.

    **Arguments:**

    - `problem`: the problem's name.
    - `runs`: every run of the problem (the grids' other runs are drawn faintly).
    - `best`: the runs to draw in full and label.
    - `target`: Adam's best final loss (a dashed line), or `None`.
    - `out`: the folder.

    **Returns:**

    The path of the image.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"adam": "tab:blue", "sgd": "tab:orange", "kfac": "tab:green"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for run in runs:
        is_best = any(run is b for b in best)
        style = dict(color=colors[run.method], lw=1.6 if is_best else 0.8,
                     alpha=1.0 if is_best else 0.25,
                     label=run.label if is_best and run.seed == 0 else None)
        axes[0].plot(range(len(run.losses)), run.losses, **style)
        axes[1].plot(run.compiled_elapsed(), run.losses, **style)
    for ax, xlabel in zip(axes, ("step", "seconds (compiled steps)")):
        if target is not None:
            ax.axhline(target, color="gray", ls="--", lw=0.8, label="Adam's best final loss")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("training loss (incl. l2)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"digits {problem}, full batch")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{problem}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def kfac_method(args: argparse.Namespace) -> Method:
    """K-FAC with the main job's settings (kfac-jax's usual ones) and the command line's choices."""
    return Method("kfac", options=dict(
        l2_reg=tanh_mlp.L2_REG,
        curvature=eqx_kfac.CurvatureOptions(
            estimation_mode=args.kfac_estimation_mode,
            layer_tag_to_block_ctor={"dense": DENSE_BLOCKS[args.kfac_dense_block]},
        ),
        # The recommended damping rule (interval 5), started at 1.0; statistics' moving average
        # 0.95 and inverses every 5 steps (the defaults).
        damping_rule=eqx_kfac.LevenbergMarquardtDamping(1.0, minimum=1e-6, fault_increase=2.0),
        refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=args.kfac_burnin),
    ))


def grid_runs(problem, optimizer: str, seed: int, steps: int) -> list:
    """The runs of one first-order optimizer's learning-rate grid, side by side."""
    options = {"momentum": 0.9} if optimizer == "sgd" else {}
    methods = [Method(optimizer, lr, options) for lr in GRIDS[problem.name][optimizer]]
    return run_round(problem, methods, steps, seed)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.float64:
        jax.config.update("jax_enable_x64", True)
    dtype = jnp.float64 if args.float64 else jnp.float32
    listed, adam, plots = [], {}, []
    for name in args.problems:
        problem_runs, problem_best = [], []
        for seed in range(args.seeds):
            problem = tanh_mlp.problem(name, jax.random.key(seed), dtype)
            chosen = {}
            for optimizer in ("adam", "sgd"):
                if optimizer not in args.optimizers:
                    continue
                grid = grid_runs(problem, optimizer, seed, args.steps_adam)
                problem_runs += grid
                winner = best(grid, window=1)
                if np.isfinite(winner.final_loss(1)):
                    chosen[optimizer] = winner
                print(f"{name} seed {seed} {optimizer}: final loss per lr: "
                      + ", ".join(f"{r.learning_rate:g}: {r.final_loss(1):.4f}" for r in grid))
            if "adam" in chosen:
                adam[(name, seed)] = chosen["adam"]
            if "kfac" in args.optimizers:
                target = adam[(name, seed)].final_loss(1) if (name, seed) in adam else None
                stop_below = target if args.kfac_stop_at_target else None
                chosen["kfac"] = train(problem, kfac_method(args), args.steps_kfac, seed, stop_below=stop_below)
                problem_runs.append(chosen["kfac"])
            ordered = [chosen[o] for o in OPTIMIZERS if o in chosen]
            listed += ordered
            problem_best += ordered
        if not args.no_plots and problem_runs:
            target = adam[(name, 0)].final_loss(1) if (name, 0) in adam else None
            plots.append(plot(name, problem_runs, problem_best, target, args.out))

    print()
    print(table(listed, adam))
    for path in plots:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
