"""Should I use K-FAC? Time-to-result against the optimizers users would pick instead.

    pip install -e ".[dev,bench]"
    python benchmarks/alternatives.py --quick      # one seed, shorter runs (under 10 minutes)
    python benchmarks/alternatives.py              # three seeds, full step budgets
    python benchmarks/alternatives.py --problems cnn --methods kfac adam muon --plots docs/img

Problems: the two full-batch digits problems of the main job (`_problems.py`: `classifier`,
`autoencoder`, with the main job's K-FAC settings) and three problems of the model zoo
(`model_zoo`: the `cnn` and the `transformer` on minibatches of 128 digits, and the variational
Monte Carlo ansatz `vmc_rule`, whose loss is the Monte Carlo energy of 256 walkers).

Methods (`METHODS`), every one training the same function from the same initial parameters on the
same batches for the same number of steps:

- `kfac`: `eqx_kfac.Optimizer` with adaptive learning rate, momentum and damping
  (`model_zoo.training.make_optimizer`); it has no learning rate to tune.
- `recipe`: `eqx_kfac.kfac_optax`, the optax K-FAC recipe.
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
K-FAC's two forms (the best baseline). The runs of one round (one rate or seed of every method)
advance one step each in turn, so load from other processes falls on all methods alike. Seconds
"from the first call" count building the optimizer and its state, the first step with its tracing
and compilation, and the compiled steps after it; "compiled" seconds count the steps only, the
first at the median step time. Sampling batches (the Monte Carlo moves) is not timed.
"""

import argparse
import contextlib
import dataclasses
import io
import os
import pickle
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _problems  # noqa: E402
import model_zoo  # noqa: E402
from model_zoo import training  # noqa: E402
from model_zoo.training import ZooRun  # noqa: E402
from zoo import best  # noqa: E402

from _alternatives_report import KFAC_METHODS, WINDOW, plot, summary, table  # noqa: E402

METHODS = ("kfac", "recipe", "adam", "muon", "sophia", "psgd")
PROBLEMS = ("classifier", "autoencoder", "cnn", "transformer", "vmc_rule")
# The documented starting points: optax's and Kingma & Ba's Adam 1e-3; Muon's reference
# implementation 0.02 (rounded to the ladder); Sophia has no default in optax and is tuned like
# AdamW in its paper; psgd-jax's default 1e-3; kfac_optax's default 0.1.
REFERENCE_LR = {"recipe": 0.1, "adam": 1e-3, "muon": 0.03, "sophia": 1e-3, "psgd": 1e-3}


@dataclasses.dataclass(frozen=True)
class Setting:
    """How one problem is run.

    **Fields:**

    - `make`: `seed -> ZooProblem` (the initial parameters depend on the seed).
    - `steps`, `quick_steps`: the step budget of every method, in full and `--quick` runs.
    - `kfac_options`: keywords for both K-FAC forms (`Optimizer` and `kfac_optax`; those in
      `_OPTIMIZER_ONLY` for `Optimizer` only).
    """

    make: Callable[[int], model_zoo.ZooProblem]
    steps: int
    quick_steps: int
    kfac_options: dict


def _digits(name: str) -> Callable[[int], model_zoo.ZooProblem]:
    """A full-batch digits problem of the main job as a `ZooProblem` (the batch: all 1,797 images)."""
    problem = _problems.make_problems()[name]

    def make(seed: int) -> model_zoo.ZooProblem:
        return model_zoo.ZooProblem(
            name=name,
            model=problem.make_model(jax.random.key(seed)),
            loss=problem.loss,
            next_batch=lambda model, step, key, previous: problem.batch,
            batch_size=len(jax.tree.leaves(problem.batch)[0]),
        )

    return make


def _zoo(name: str) -> Callable[[int], model_zoo.ZooProblem]:
    return lambda seed: model_zoo.PROBLEMS[name](jax.random.key(seed))


# The digits problems use the main job's K-FAC settings (`_training.make_kfac`): l2_reg in the
# damping, curvature from Gauss-Newton products, the library's minimum damping (full batches with
# an L2 term do not need the zoo's floor of 1e-4, which slowed the classifier from 324 to 772
# steps to its target).
_DIGITS_KFAC = dict(l2_reg=_problems.L2_REG, estimation_mode="ggn_curvature_prop", min_damping=1e-8)
# Keywords of `Optimizer` that `kfac_optax` does not take.
_OPTIMIZER_ONLY = ("min_damping",)
SETTINGS = {
    "classifier": Setting(_digits("classifier"), 1000, 300, _DIGITS_KFAC),
    "autoencoder": Setting(_digits("autoencoder"), 600, 150, _DIGITS_KFAC),
    "cnn": Setting(_zoo("cnn"), 600, 150, {}),
    "transformer": Setting(_zoo("transformer"), 150, 40, {}),
    "vmc_rule": Setting(_zoo("vmc_rule"), 400, 100, {}),
}


def psgd_kron(learning_rate: float) -> optax.GradientTransformationExtraArgs:
    """psgd-jax's `kron` (its init prints the preconditioner's size; that is silenced).

    psgd-jax 0.2.9 imports `optax._src.clipping`, which optax 0.2.8 moved to
    `optax.transforms._clipping`; `kron` uses nothing from it, so the old name is aliased first.
    """
    import optax.transforms._clipping

    sys.modules.setdefault("optax._src.clipping", optax.transforms._clipping)
    from psgd_jax.kron import kron

    transform = kron(learning_rate)
    quiet_init = lambda params: _quiet(transform.init, params)  # noqa: E731
    return optax.GradientTransformationExtraArgs(quiet_init, transform.update)


def _quiet(function: Callable, *args: Any) -> Any:
    with contextlib.redirect_stdout(io.StringIO()):
        return function(*args)


def _optax_step(
    problem: model_zoo.ZooProblem, transform: optax.GradientTransformation, needs_objective: bool
) -> tuple[Callable, Any]:
    """A step of an optax transform on a zoo problem, `obj_fn` (the batch's loss) passed if asked."""
    value_and_grad = eqx.filter_value_and_grad(
        lambda *args: problem.loss(*args), has_aux=problem.has_state
    )

    @eqx.filter_jit
    def step(model, state, key, batch):
        opt_state, func_state = state
        args = training._func_args(problem, model, func_state, key, batch)
        out, grads = value_and_grad(*args)
        loss, new_func_state = training._split(problem, out)
        params, static = eqx.partition(model, eqx.is_inexact_array)
        extra = {}
        if needs_objective:
            extra["obj_fn"] = lambda p: training._split(
                problem, problem.loss(eqx.combine(p, static), *args[1:])
            )[0]
        updates, opt_state = transform.update(grads, opt_state, params, **extra)
        return eqx.apply_updates(model, updates), (opt_state, new_func_state), loss

    params = eqx.filter(problem.model, eqx.is_inexact_array)
    return step, (transform.init(params), problem.func_state)


def make_step(
    problem: model_zoo.ZooProblem, method: str, learning_rate: float | None, batch: Any,
    kfac_options: dict,
) -> tuple[Callable, Any]:
    """`(step, state)` of one method: `step(model, state, key, batch) -> (model, state, loss)`.

    **Arguments:**

    - `problem`: the problem.
    - `method`: one of `METHODS`.
    - `learning_rate`: the rate (ignored by `"kfac"`).
    - `batch`: the first batch (K-FAC's burn-in and structure).
    - `kfac_options`: keywords for `"kfac"` and `"recipe"`.

    **Returns:**

    The jitted step and the initial state.
    """
    if method == "kfac":
        return training._kfac(problem, batch, **kfac_options)
    if method == "recipe":
        recipe_options = {k: v for k, v in kfac_options.items() if k not in _OPTIMIZER_ONLY}
        return training._recipe(problem, batch, learning_rate, **recipe_options)
    transforms = {
        "adam": lambda: optax.adam(learning_rate),
        "muon": lambda: optax.contrib.muon(learning_rate),
        "sophia": lambda: optax.contrib.sophia(learning_rate),
        "psgd": lambda: psgd_kron(learning_rate),
    }
    if method not in transforms:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    return _optax_step(problem, transforms[method](), needs_objective=method == "sophia")


@dataclasses.dataclass(frozen=True)
class Reach:
    """When a run first reaches a target loss.

    **Fields:**

    - `steps`: the number of steps whose parameters reach it.
    - `wall`: seconds from the first call: building the optimizer, the first step (compilation
      included), the steps and batches after it.
    - `compiled`: the same without building and compiling (the first step at the median).
    """

    steps: int
    wall: float
    compiled: float


@dataclasses.dataclass(frozen=True)
class Run(ZooRun):
    """A `ZooRun` with its seed and the time spent sampling its batches.

    **Fields** (beyond `ZooRun`'s):

    - `seed`: the seed of the initial parameters and of the batch stream.
    - `batch_times`: `(steps - 1,)`, seconds of `next_batch` before each step after the first
      (the first batch is shared by all the runs of a round and not timed).
    """

    seed: int = 0
    batch_times: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))

    def smoothed(self) -> np.ndarray:
        """The mean loss of the last `WINDOW` steps (fewer at the start), after every step."""
        sums = np.cumsum(self.losses)
        lagged = np.concatenate([np.zeros(WINDOW), sums])[: len(sums)]
        return (sums - lagged) / np.minimum(np.arange(1, len(sums) + 1), WINDOW)

    def elapsed(self) -> np.ndarray:
        """`(len(losses),)`: seconds from the first call until the parameters of each loss exist."""
        work = np.cumsum(self.times + self.batch_times[: len(self.times)])
        return np.concatenate([[0.0], self.first_call + np.concatenate([[0.0], work])])[
            : len(self.losses)
        ]

    @property
    def wall(self) -> float:
        """Seconds of the whole run from the first call (batches included)."""
        return self.first_call + float(np.sum(self.times) + np.sum(self.batch_times))

    def reach(self, target: float) -> Reach | None:
        """When the smoothed loss first is at most `target` (`None` if never)."""
        reached = np.flatnonzero(self.smoothed() <= target)
        if not reached.size:
            return None
        steps = int(reached[0])
        wall = float(self.elapsed()[steps])
        compiled = wall - self.first_call + self.ms_per_step / 1e3 if steps else 0.0
        return Reach(steps, wall, compiled)


@dataclasses.dataclass
class _Training:
    """A run in progress inside `run_round`."""

    method: str
    learning_rate: float | None
    step: Callable
    state: Any
    model: Any
    batch: Any
    first_call: float
    losses: list = dataclasses.field(default_factory=list)
    times: list = dataclasses.field(default_factory=list)
    batch_times: list = dataclasses.field(default_factory=list)


def _timed(function: Callable, *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = jax.block_until_ready(function(*args))
    return out, time.perf_counter() - start


def run_round(
    problem: model_zoo.ZooProblem,
    configs: Sequence[tuple[str, float | None]],
    steps: int,
    seed: int,
    kfac_options: dict,
) -> list[Run]:
    """Trains one run per `(method, learning_rate)`, the runs taking one step each in turn.

    Every run sees the batch stream of `model_zoo.training.train` for this seed (the same keys,
    the same data) from the problem's initial model, and stops at a non-finite loss.
    `next_batch` is called once before the round so that its compilation (the Monte Carlo moves)
    is not charged to the first run.

    **Arguments:**

    - `problem`: the problem.
    - `configs`: the runs.
    - `steps`: steps of each run.
    - `seed`: seeds the batch stream's keys.
    - `kfac_options`: keywords for the K-FAC methods.

    **Returns:**

    One `Run` per config, in order; its `first_call` includes building the optimizer and its
    state.
    """
    keys = jax.random.split(jax.random.key(seed), 2 * steps).reshape(steps, 2)
    first_batch = problem.next_batch(problem.model, 0, keys[0, 0], None)
    jax.block_until_ready(problem.next_batch(problem.model, 1, keys[0, 0], first_batch))
    runs = []
    for method, learning_rate in configs:
        (step, state), setup = _timed(
            _quiet, make_step, problem, method, learning_rate, first_batch, kfac_options
        )
        (model, state, loss), first = _timed(step, problem.model, state, keys[0, 1], first_batch)
        runs.append(_Training(method, learning_rate, step, state, model, first_batch,
                              setup + first, [float(loss)]))
    for t in range(1, steps):
        for run in runs:
            if not np.isfinite(run.losses[-1]):
                continue
            run.batch, seconds = _timed(problem.next_batch, run.model, t, keys[t, 0], run.batch)
            run.batch_times.append(seconds)
            (run.model, run.state, loss), seconds = _timed(
                run.step, run.model, run.state, keys[t, 1], run.batch
            )
            run.times.append(seconds)
            run.losses.append(float(loss))
    # The round's compiled steps are not used again. XLA on CPU maps each compiled kernel into
    # the process (a K-FAC step has about a thousand), and a process that keeps every round's
    # programs reaches Linux's limit on memory mappings and dies in the compiler.
    jax.clear_caches()
    return [
        Run(problem.name, r.method, r.learning_rate, np.asarray(r.losses), np.asarray(r.times),
            r.first_call, seed=seed, batch_times=np.asarray(r.batch_times))
        for r in runs
    ]


def _neighbour(learning_rate: float, up: bool) -> float:
    """The next rate on the ladder ..., 1e-3, 3e-3, 1e-2, ... above or below `learning_rate`."""
    mantissa = learning_rate / 10 ** np.floor(np.log10(learning_rate) + 1e-9)
    factor = (3.0 if mantissa < 2 else 10 / 3) if up else (1 / 3 if mantissa > 2 else 0.3)
    return float(f"{learning_rate * factor:.0e}")


def initial_grid(method: str, max_grid: int) -> list[float | None]:
    """The first rates of a method: its reference and, if `max_grid >= 3`, its two neighbours."""
    if method == "kfac":
        return [None]
    reference = REFERENCE_LR[method]
    if max_grid == 1:
        return [reference]
    return [_neighbour(reference, up=False), reference, _neighbour(reference, up=True)]


def extension(runs: Sequence[Run], max_grid: int) -> float | None:
    """The next rate to try for one method, or `None` when its best rate is inside the grid.

    **Arguments:**

    - `runs`: the method's runs so far.
    - `max_grid`: the most rates to try.

    **Returns:**

    The rate beyond the end of the grid where the lowest final loss is (below the lowest rate if
    every run diverged), or `None` if that loss is inside the grid, the method has no rate, or
    the grid is full.
    """
    rates = sorted(r.learning_rate for r in runs if r.learning_rate is not None)
    if not rates or len(rates) >= max_grid:
        return None
    winner = best(runs)
    if not np.isfinite(winner.final_loss(WINDOW)) or winner.learning_rate == rates[0]:
        return _neighbour(rates[0], up=False)
    if winner.learning_rate == rates[-1]:
        return _neighbour(rates[-1], up=True)
    return None


def tune(
    problem: model_zoo.ZooProblem, methods: Sequence[str], steps: int, max_grid: int,
    kfac_options: dict,
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
    grids = {method: [] for method in methods}
    pending = [(method, lr) for method in methods for lr in initial_grid(method, max_grid)]
    while pending:
        for run in run_round(problem, pending, steps, 0, kfac_options):
            grids[run.method].append(run)
        pending = [(m, lr) for m in methods if (lr := extension(grids[m], max_grid)) is not None]
    return grids


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One problem's results.

    **Fields:**

    - `problem`: its name.
    - `steps`: the step budget.
    - `grids`: `method -> runs` of the learning-rate search (seed 0).
    - `seeds`: `method -> runs`, one per seed, at the chosen rate (seed 0's is the grid's best).
    - `exact`: the exact optimum when known (the VMC ground-state energy).
    """

    problem: str
    steps: int
    grids: dict[str, list[Run]]
    seeds: dict[str, list[Run]]
    exact: float | None

    def target(self, seed: int) -> float:
        """The lowest final loss of the baselines (methods other than K-FAC's) on a seed."""
        return min(
            r.final_loss(WINDOW) for m, runs in self.seeds.items() if m not in KFAC_METHODS
            for r in runs if r.seed == seed and np.isfinite(r.final_loss(WINDOW))
        )

    def reaches(self, method: str) -> list[Reach | None]:
        """When each seed's run of `method` reaches that seed's target."""
        return [r.reach(self.target(r.seed)) for r in self.seeds[method]]

    def median_wall(self, method: str) -> float:
        """The median over seeds of the seconds to the target from the first call (inf: never)."""
        return float(np.median([np.inf if r is None else r.wall for r in self.reaches(method)]))


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
        configs = [(m, run.learning_rate) for m, run in chosen.items()]
        for run in run_round(setting.make(seed), configs, steps, seed, setting.kfac_options):
            repeats[run.method].append(run)
    return Outcome(name, steps, grids, repeats, problem.exact_loss)


def psgd_error() -> str | None:
    """Why psgd-jax's `kron` cannot be used here (the exception), or `None` if it can."""
    try:
        psgd_kron(1e-3)
    except Exception as error:  # noqa: BLE001 -- any import failure is reported, not raised
        return f"{type(error).__name__}: {error}"
    return None


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
    parser.add_argument("--seeds", type=int, help="number of seeds (default 3, 1 with --quick)")
    parser.add_argument("--max-grid", type=int,
                        help="most learning rates per method (default 5, 1 with --quick)")
    parser.add_argument("--plots", help="write choosing_<problem>.png to this folder")
    parser.add_argument("--save", help="pickle the list of `Outcome`s (every run) to this file, after each problem")
    args = parser.parse_args(argv)
    args.seeds = args.seeds or (1 if args.quick else 3)
    args.max_grid = args.max_grid or (1 if args.quick else 5)
    if args.max_grid == 2 or args.max_grid < 1:
        parser.error("--max-grid is 1 (the reference rate) or at least 3 (it and its neighbours)")
    if not set(args.methods) - set(KFAC_METHODS):
        parser.error("--methods needs a method other than kfac and recipe (the target)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    methods = list(args.methods)
    if "psgd" in methods and (error := psgd_error()) is not None:
        print(f"psgd-jax's kron left out: {error}")
        methods.remove("psgd")
    start = time.perf_counter()
    outcomes = []
    for name in args.problems:
        setting = SETTINGS[name]
        steps = args.steps or (setting.quick_steps if args.quick else setting.steps)
        outcomes.append(run_problem(name, methods, steps, args.seeds, args.max_grid))
        # Each problem's rows as soon as it is done (a long run shows its progress).
        print("\n".join(table(outcomes[-1:]).splitlines()[2:]), flush=True)
        print(summary(outcomes[-1]), flush=True)
        if args.plots:
            plot(outcomes[-1], os.path.join(args.plots, f"choosing_{name}.png"))
        if args.save:
            with open(args.save, "wb") as file:
                pickle.dump(outcomes, file)
    print()
    print(table(outcomes))
    print()
    for outcome in outcomes:
        print(summary(outcome))
    print(f"\n{time.perf_counter() - start:.0f} s in all; {args.seeds} seed(s), at most "
          f"{args.max_grid} learning rate(s) per method; {jax.devices()[0].platform}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
