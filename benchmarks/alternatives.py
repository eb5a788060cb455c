"""Should I use K-FAC? Time-to-result against the optimizers users would pick instead.

    pip install -e ".[dev,bench]"
    python benchmarks/alternatives.py --quick      # one seed, shorter runs (under 10 minutes)
    python benchmarks/alternatives.py              # three seeds, full step budgets
    python benchmarks/alternatives.py --problems cnn --methods kfac adam muon --plots docs/img

Problems: the two full-batch digits problems of the main job (`model_zoo/tanh_mlp.py`:
`classifier`, `autoencoder`, with the main job's K-FAC settings) and three problems of the model
zoo (`model_zoo`: the `cnn` and the `transformer` on minibatches of 128 digits, and the
variational Monte Carlo ansatz `vmc_rule`, whose loss is the Monte Carlo energy of 256 walkers).

Methods (`METHODS`), every one training the same function from the same initial parameters on the
same batches for the same number of steps:

- `kfac`: `eqx_kfac.Optimizer` with adaptive learning rate, momentum and damping
  (`benchmarks.harness.make_optimizer`); it has no learning rate to tune.
- `recipe`: `eqx_kfac.kfac_optax`, the optax K-FAC recipe.
- `kfac_muon`: `eqx_kfac.kfac_optax(direction=eqx_kfac.KroneckerMuon(), momentum=None)`: Muon's
  polar step in the geometry of the K-FAC factors, its statistics every 10th step and its
  eigendecompositions every 50th (`benchmarks.harness.KFAC_OPTAX`).
- `adam`: `optax.adam`.
- `muon`: `optax.contrib.muon` (Newton-Schulz orthogonalised momentum on 2-D leaves, Adam on
  the others, the learning rate shared).
- `sophia`: `optax.contrib.sophia` (clipped diagonal-Hessian preconditioning; Hutchinson's
  estimate every 10 steps needs the objective, passed to `update` as `obj_fn`).
- `psgd`: `psgd_jax.kron.kron` (Kronecker-factored PSGD), from the `bench` extra.

Learning rates: each method starts from its reference rate (`REFERENCE_LR`) and the two
neighbours on the ladder 1e-4, 3e-4, 1e-3, 3e-3, ...; while the lowest final loss is at an end
of the grid (a diverged run counts as the worst), the next rate beyond that end is added, up to
`--max-grid` rates. Every method is tuned by this rule on seed 0; the other seeds reuse the rate.

Target and timing: the final loss is the mean training loss of the last 10 steps; a method
reaches a loss at the first step whose mean over the last 10 steps (fewer at the start) is at or
below it. The target of a problem and seed is the lowest final loss of the methods other than
K-FAC's forms (the best baseline). The runs of one round (one rate or seed of every method)
advance one step each in turn (`benchmarks.harness.run_round`), so load from other processes falls
on all methods alike. Seconds "from the first call" count building the optimizer and its state,
the first step with its tracing and compilation, and the steps and batches after it; "compiled"
seconds count the steps only, the first at the median step time.
"""

import argparse
import dataclasses
import os
import pickle
import sys
import time
from collections.abc import Callable, Sequence

import jax

import eqx_kfac
from benchmarks import model_zoo
from benchmarks.harness import (
    KFAC_METHODS,
    KFAC_OPTAX,
    WINDOW,
    Method,
    Outcome,
    Problem,
    Run,
    best,
    ladder,
    usable,
    report,
    run_round,
)
from benchmarks.model_zoo import tanh_mlp

METHODS = ("kfac", "recipe", "kfac_muon", "adam", "muon", "sophia", "psgd")
PROBLEMS = ("classifier", "autoencoder", "cnn", "transformer", "vmc_rule")
# The documented starting points: optax's and Kingma & Ba's Adam 1e-3; Muon's reference
# implementation 0.02 (rounded to the ladder); Sophia has no default in optax and is tuned like
# AdamW in its paper; psgd-jax's default 1e-3; kfac_optax's default 0.1; Muon in K-FAC's geometry
# as Muon.
REFERENCE_LR = {"recipe": 0.1, "kfac_muon": 0.03, "adam": 1e-3, "muon": 0.03, "sophia": 1e-3, "psgd": 1e-3}


@dataclasses.dataclass(frozen=True)
class Setting:
    """How one problem is run.

    **Fields:**

    - `make`: `seed -> Problem` (the initial parameters depend on the seed).
    - `steps`, `quick_steps`: the step budget of every method, in full and `--quick` runs.
    - `kfac_options`: keywords for both K-FAC forms (`kfac_optax`'s; `Optimizer` takes them as
      parts, `optimizer_options`; those in `_OPTIMIZER_ONLY` for `Optimizer` only).
    """

    make: Callable[[int], Problem]
    steps: int
    quick_steps: int
    kfac_options: dict


def _digits(name: str) -> Callable[[int], Problem]:
    """A full-batch digits problem of the main job (the batch: all 1,797 images)."""
    return lambda seed: tanh_mlp.problem(name, jax.random.key(seed))


def _zoo(name: str) -> Callable[[int], Problem]:
    return lambda seed: model_zoo.PROBLEMS[name](jax.random.key(seed))


# The digits problems use the main job's K-FAC settings (benchmarks/run.py): l2_reg in the
# damping, curvature from Gauss-Newton products, the library's minimum damping (full batches with
# an L2 term do not need the zoo's floor of 1e-4, which slowed the classifier from 324 to 772
# steps to its target).
_DIGITS_KFAC = dict(l2_reg=tanh_mlp.L2_REG, estimation_mode="ggn_curvature_prop", min_damping=1e-8)
# Keywords for `Optimizer` alone (`kfac_optax` does not take them).
_OPTIMIZER_ONLY = ("min_damping",)
SETTINGS = {
    "classifier": Setting(_digits("classifier"), 1000, 300, _DIGITS_KFAC),
    "autoencoder": Setting(_digits("autoencoder"), 600, 150, _DIGITS_KFAC),
    "cnn": Setting(_zoo("cnn"), 600, 150, {}),
    "transformer": Setting(_zoo("transformer"), 150, 40, {}),
    "vmc_rule": Setting(_zoo("vmc_rule"), 400, 100, {}),
}


def make_method(name: str, learning_rate: float | None, kfac_options: dict) -> Method:
    """The `Method` of one run: `kfac_options` go to K-FAC's forms (`Optimizer`-only ones to
    `"kfac"` alone)."""
    if name == "kfac":
        return Method(name, None, optimizer_options(kfac_options))
    if name in KFAC_OPTAX:
        return Method(name, learning_rate, {k: v for k, v in kfac_options.items() if k not in _OPTIMIZER_ONLY})
    return Method(name, learning_rate)


def optimizer_options(kfac_options: dict) -> dict:
    """`Optimizer`'s keywords for the K-FAC options of a setting: `l2_reg` as it is,
    `estimation_mode` in the `CurvatureOptions`, `min_damping` as the floor of the recommended
    damping rule (the other parts at their defaults)."""
    unknown = set(kfac_options) - {"l2_reg", "estimation_mode", "min_damping"}
    if unknown:
        raise ValueError(f"optimizer_options: no translation for {sorted(unknown)}; add one.")
    options = {k: v for k, v in kfac_options.items() if k == "l2_reg"}
    if "estimation_mode" in kfac_options:
        options["curvature"] = eqx_kfac.CurvatureOptions(estimation_mode=kfac_options["estimation_mode"])
    if "min_damping" in kfac_options:
        options["damping_rule"] = eqx_kfac.LevenbergMarquardtDamping(
            1e-2, minimum=kfac_options["min_damping"], fault_increase=2.0
        )
    return options


def initial_grid(method: str, max_grid: int) -> list[float | None]:
    """The first rates of a method (`ladder.initial_grid` from its reference rate)."""
    return ladder.initial_grid(REFERENCE_LR.get(method), max_grid)


def extension(runs: Sequence[Run], max_grid: int) -> float | None:
    """The next rate to try for one method (`ladder.extension`, scored by the final loss), or
    `None` when its best rate is inside the grid, the method has no rate, or the grid is full."""
    scores = {r.learning_rate: r.final_loss(WINDOW) for r in runs if r.learning_rate is not None}
    return ladder.extension(scores, max_grid)


def tune(
    problem: Problem, methods: Sequence[str], steps: int, max_grid: int, kfac_options: dict
) -> dict[str, list[Run]]:
    """Every method's learning-rate grid on seed 0, in rounds of interleaved runs.

    **Arguments:**

    - `problem`: the problem (seed 0's initial parameters).
    - `methods`: the methods.
    - `steps`: the step budget.
    - `max_grid`: the most rates per method.
    - `kfac_options`: keywords for the K-FAC methods.

    **Returns:**

    `method -> runs`, one per rate tried.
    """
    return ladder.tune(
        {method: initial_grid(method, max_grid) for method in methods},
        lambda pending: run_round(problem, [make_method(m, lr, kfac_options) for m, lr in pending], steps, 0),
        lambda method, runs: extension(runs, max_grid),
    )


def run_problem(
    name: str, methods: Sequence[str], steps: int, seeds: int, max_grid: int
) -> Outcome:
    """Tunes every method on seed 0 and repeats the chosen rates on the other seeds.

    **Arguments:**

    - `name`: a key of `SETTINGS`.
    - `methods`: the methods (at least one that is not K-FAC, for the target).
    - `steps`: the step budget.
    - `seeds`: how many seeds (0, 1, ...).
    - `max_grid`: the most rates per method.

    **Returns:**

    The `Outcome`.
    """
    setting = SETTINGS[name]
    problem = setting.make(0)
    grids = tune(problem, methods, steps, max_grid, setting.kfac_options)
    chosen = {method: best(runs) for method, runs in grids.items()}
    repeats = {method: [run] for method, run in chosen.items()}
    for seed in range(1, seeds):
        again = [make_method(m, run.learning_rate, setting.kfac_options) for m, run in chosen.items()]
        for run in run_round(setting.make(seed), again, steps, seed):
            repeats[run.method].append(run)
    return Outcome(name, steps, grids, repeats, problem.exact_loss)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see `--help`)."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--problems", nargs="+", choices=PROBLEMS, default=list(PROBLEMS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--quick", action="store_true",
                        help="the quick step budgets, one seed, the reference rates only")
    parser.add_argument("--steps", type=int, help="the step budget of every problem "
                        "(default: each problem's, see SETTINGS)")
    ladder.add_arguments(parser)
    parser.add_argument("--plots", help="write choosing_<problem>.png to this folder")
    parser.add_argument("--save", help="pickle the list of `Outcome`s (every run) to this file, after each problem")
    args = parser.parse_args(argv)
    ladder.settle_arguments(parser, args)
    if not set(args.methods) - set(KFAC_METHODS):
        parser.error(f"--methods needs a method other than K-FAC's forms {KFAC_METHODS} (the target)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    methods = usable(args.methods)
    start = time.perf_counter()
    outcomes = []
    for name in args.problems:
        setting = SETTINGS[name]
        steps = args.steps or (setting.quick_steps if args.quick else setting.steps)
        outcomes.append(run_problem(name, methods, steps, args.seeds, args.max_grid))
        # Each problem's rows as soon as it is done (a long run shows its progress).
        print("\n".join(report.table(outcomes[-1:]).splitlines()[2:]), flush=True)
        print(report.summary(outcomes[-1]), flush=True)
        if args.plots:
            report.plot(outcomes[-1], os.path.join(args.plots, f"choosing_{name}.png"))
        if args.save:
            with open(args.save, "wb") as file:
                pickle.dump(outcomes, file)
    print()
    print(report.table(outcomes))
    print()
    for outcome in outcomes:
        print(report.summary(outcome))
    print(f"\n{time.perf_counter() - start:.0f} s in all; {args.seeds} seed(s), at most "
          f"{args.max_grid} learning rate(s) per method; {jax.devices()[0].platform}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
