"""Language models: K-FAC against AdamW, Muon, SOAP, Shampoo and PSGD-Kron at equal seconds.

    pip install -e ".[dev,bench]"
    python benchmarks/language_model.py --quick     # one seed, 60 s per method, reference rates
    python benchmarks/language_model.py             # three seeds, 600 s per method, rate ladders
    python benchmarks/language_model.py --methods kfac adamw muon --seconds 120 --plots docs/img
    python benchmarks/language_model.py --rates adamw=0.003 muon=0.1    # these rates, not tuned

The model (`benchmarks/model_zoo/gpt.py`): a decoder-only transformer written as Equinox users
write one (token and position embeddings, pre-norm blocks with RMSNorm, causal multi-head
attention, a 4x MLP, an untied head), trained on the characters of Python's own help topics
(`pydoc_data.topics`), the last tenth held out for the validation loss. `--model lm1b`: Flax's
lm1b transformer (Linen, `benchmarks/model_zoo/lm1b.py`) on the same text, splits and batches.

Methods (`METHODS`), all from the same initial parameters on the same batches:

- `kfac`: `eqx_kfac.Optimizer` in its recommended configuration (rate, momentum and damping
  adapted; no rate to tune).
- `recipe`: `eqx_kfac.kfac_optax` (K-FAC preconditioning, norm constraint, momentum), its
  statistics every 5th step and its inverses every 25th (`KFAC_PERIODS`).
- `eigen`: `eqx_kfac.kfac_optax(direction=eqx_kfac.EigenbasisAdam(), momentum=None)`: Adam's
  moments in the K-FAC eigenbasis (SOAP's step with K-FAC's factors), the same periods.
- `kfac_muon`: `eqx_kfac.kfac_optax(direction=eqx_kfac.KroneckerMuon(), momentum=None)`: Muon's
  orthogonalised momentum in the geometry of the K-FAC factors, with the harness's periods
  (`benchmarks.harness.KFAC_OPTAX`: statistics every 10th step, eigendecompositions every 50th).
- `adamw`: `optax.adamw` with GPT-2's moments and decay (b2 0.95, weight decay 0.1).
- `muon`: `optax.contrib.muon`.
- `soap`, `shampoo`: written here from their papers (`benchmarks/harness/soap.py`, `shampoo.py`).
- `psgd`: `psgd_jax.kron.kron` (PSGD-Kron), from the `bench` extra.

Budgets and schedules: every method gets the same compiled seconds (`--seconds`). A calibration
round measures each method's mean step time (its batches included) over `CALIBRATION_STEPS`
steps, or over one whole period of its refreshes where that is longer (a step that takes the
statistics or refreshes the inverses costs more than the others); its step budget is the seconds
over that time. Every method with a rate follows the same
schedule over its own budget: a linear warmup over the first `WARMUP` of the steps to the peak
rate, then a cosine decay to a tenth of it. The peak rate is tuned on seed 0 by one rule for every
method (`benchmarks.harness.ladder`: the reference rate `REFERENCE_LR` and its two neighbours,
extended while the best final validation loss is at an end, up to `--max-grid` rates), at the
budget of `--tune-seconds` (default: `--seconds`, when the tuned runs are seed 0's runs); the other
seeds, and seed 0 when the budgets differ, reuse it. The runs of a round advance one step each in
turn, so load falls on all alike.

A default run takes hours: with `--journal FILE` every finished calibration and round is kept in
FILE (`benchmarks.harness.journal`), and the same command run again skips what is there (a change
of the methods' code is not seen: start a new file then).

Measured: the validation loss (`EVALUATIONS` times per run, outside the timed work) against steps,
compiled seconds and seconds from the first call (building the optimizer, tracing and compiling
its step included); each method's validation loss at the compiled seconds every run lasted, and
at the seconds from the first call every run lasted (`common_seconds`); the time to reach AdamW's final validation
loss; the peak memory of one step (`step_memory`: arguments, outputs and temporaries of the step
compiled alone, less what it aliases). Medians over the seeds.
"""

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType

import equinox as eqx
import jax
import numpy as np
import optax
from jaxtyping import Array

import eqx_kfac
from benchmarks.harness import KFAC_OPTAX, ladder, make_step, Method, Problem, Run, run_round, usable
from benchmarks.harness.journal import Journal, record_from_json, record_to_json
from benchmarks.model_zoo import gpt, lm1b

METHODS = ("kfac", "recipe", "eigen", "kfac_muon", "adamw", "muon", "soap", "shampoo", "psgd")
# The documented starting points: kfac_optax's default 0.1; SOAP's paper 3e-3 (also for Adam in
# the K-FAC eigenbasis); GPT-2-style AdamW 1e-3; Muon's reference 0.02 (rounded up to the ladder);
# Shampoo grafted on Adam and PSGD-Kron (psgd-jax's default) 1e-3; Muon in K-FAC's geometry as Muon.
REFERENCE_LR = {"recipe": 0.1, "eigen": 3e-3, "kfac_muon": 0.03, "adamw": 1e-3, "muon": 0.03, "soap": 3e-3,
                "shampoo": 1e-3, "psgd": 1e-3}
# kfac_optax's two forms fold the statistics in every 5th step and refresh the inverses every
# 25th: on this model (the defaults: width 128, 50 steps) that made the step 1.5x cheaper
# (332 -> 226 ms; AdamW 173) for a training loss 0.016 higher at step 50.
KFAC_PERIODS = dict(curvature_update_period=5, inverse_update_period=25)
CALIBRATION_STEPS = 12
WARMUP = 0.05
EVALUATIONS = 24
# The models (`--model`): each module's `problem`, `validation_batch` and `mean_cross_entropy`.
MODELS = {"gpt": gpt, "lm1b": lm1b}


def warmup_cosine(steps: int) -> Callable[[float], optax.Schedule]:
    """`peak -> schedule`: linear warmup over `WARMUP` of `steps`, then cosine to `peak / 10`."""
    warmup = max(1, int(WARMUP * steps))
    return lambda peak: optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(steps, warmup + 1), peak / 10)


def make_method(name: str, learning_rate: float | None, steps: int) -> Method:
    """The `Method` of one run: its peak rate on the shared schedule over `steps` steps."""
    if name == "kfac":
        return Method("kfac")
    options = dict(
        recipe=KFAC_PERIODS,
        eigen=dict(direction=eqx_kfac.EigenbasisAdam(b1=0.95, b2=0.95), momentum=None, **KFAC_PERIODS),
        adamw=dict(b2=0.95, weight_decay=0.1),
    ).get(name, {})
    return Method("recipe" if name == "eigen" else name, learning_rate, options, warmup_cosine(steps))


@dataclasses.dataclass
class Trial:
    """One run and its validation losses (`evaluated[i]` after step `steps[i]`)."""

    name: str
    run: Run
    steps: list
    evaluated: list

    def clock(self, compiled: bool) -> np.ndarray:
        """`(steps,)`: seconds until the parameters after each step exist, from the first call
        (`compiled`: counting the steps and batches only, the first step at the median)."""
        run = self.run
        work = np.concatenate([[0.0], np.cumsum(run.times + run.batch_times)])
        return (run.ms_per_step / 1e3 if compiled else run.first_call.total) + work

    def at(self, seconds: float, compiled: bool) -> float:
        """The last validation loss at most `seconds` into the run (NaN before the first)."""
        clock = self.clock(compiled)
        kept = [v for s, v in zip(self.steps, self.evaluated) if clock[s] <= seconds]
        return kept[-1] if kept else float("nan")

    def reach(self, target: float, compiled: bool) -> float:
        """Seconds until the validation loss is at most `target` (NaN: never)."""
        clock = self.clock(compiled)
        hits = [clock[s] for s, v in zip(self.steps, self.evaluated) if v <= target]
        return float(hits[0]) if hits else float("nan")

    @property
    def final(self) -> float:
        return self.evaluated[-1] if self.evaluated else float("nan")


def _round(
    problem: Problem, zoo: ModuleType, validation: Array, names: Sequence[str], rates: Sequence[float | None],
    budgets: Sequence[int], seed: int,
) -> list[Trial]:
    """One round: each method at its rate and step budget, validated `EVALUATIONS` times on the
    held-out windows `validation` with the model's module `zoo` (`MODELS`)."""
    evaluate = eqx.filter_jit(zoo.mean_cross_entropy)
    every = [max(1, b // EVALUATIONS) for b in budgets]
    log = [([], []) for _ in names]

    def observe(index: int, step: int, model: eqx.Module) -> None:
        if step % every[index] == 0 or step == budgets[index] - 1:
            log[index][0].append(step)
            log[index][1].append(float(evaluate(model, validation)))

    methods = [make_method(n, r, b) for n, r, b in zip(names, rates, budgets)]
    runs = run_round(problem, methods, budgets, seed, observe=observe)
    return [Trial(n, run, *entry) for n, run, entry in zip(names, runs, log)]


def calibration_steps(method: Method) -> int:
    """`CALIBRATION_STEPS`, or one whole refresh period of the method after its first two steps
    where that is longer."""
    options = KFAC_OPTAX.get(method.name, {}) | dict(method.options)
    return max(CALIBRATION_STEPS, 2 + options.get("inverse_update_period", 0))


def _mean_step_seconds(run: Run) -> float:
    """The mean seconds of `run`'s steps, their batches included, its first two steps left out."""
    return float(np.mean(run.times[1:] + run.batch_times[1:]))


def calibrate(problem: Problem, names: Sequence[str]) -> dict[str, float]:
    """Each method's mean step time (batches included; its first two steps left out) in one round
    at its reference rate, over `calibration_steps`."""
    rates = [REFERENCE_LR.get(n) for n in names]
    steps = [calibration_steps(make_method(n, r, 1)) for n, r in zip(names, rates)]
    runs = run_round(problem, [make_method(n, r, s) for n, r, s in zip(names, rates, steps)], steps)
    return {n: _mean_step_seconds(r) for n, r in zip(names, runs)}


def step_budgets(step_seconds: dict[str, float], seconds: float) -> dict[str, int]:
    """Each method's step budget: `seconds` over its step time (at least `CALIBRATION_STEPS`)."""
    return {n: max(CALIBRATION_STEPS, int(seconds / t)) for n, t in step_seconds.items()}


def calibration_drift(step_seconds: dict[str, float], repeats: dict[str, list[Trial]],
                      tolerance: float = 0.15) -> list[str]:
    """A line for each method whose steps in `repeats` took on average more than `tolerance`
    longer or shorter than `step_seconds` (both by `_mean_step_seconds`): its runs then lasted
    about that much more or less than `--seconds`, because the calibration or the round shared the
    machine with other work."""
    lines = []
    for name, trials in repeats.items():
        ran = float(np.mean([_mean_step_seconds(t.run) for t in trials]))
        if abs(ratio := ran / step_seconds[name] - 1) > tolerance:
            lines.append(
                f"note: {name}'s steps took {1e3 * ran:.0f} ms, calibrated at {1e3 * step_seconds[name]:.0f} ms "
                f"({ratio:+.0%}), so its runs lasted about {ratio:+.0%} against the seconds asked; for runs of "
                "the seconds asked, calibrate on a quiet machine (a new --journal file)")
    return lines


Play = Callable[[Sequence[str], Sequence[float | None], Sequence[int], int], list[Trial]]


def tune(
    play: Play, names: Sequence[str], budgets: dict[str, int], max_grid: int,
    given: dict[str, float] | None = None,
) -> dict[str, list[Trial]]:
    """Every method's rate ladder on seed 0, scored by the final validation loss (a method in
    `given` runs at its given rate only); `play(names, rates, budgets, seed)` trains a round."""
    given = given or {}

    def run(pending: list[tuple[str, float | None]]) -> list[Trial]:
        methods, rates = zip(*pending)
        return play(methods, rates, [budgets[m] for m in methods], 0)

    def extend(name: str, trials: list[Trial]) -> float | None:
        if name in given:
            return None
        scores = {t.run.learning_rate: t.final for t in trials if t.run.learning_rate is not None}
        return ladder.extension(scores, max_grid)

    first = {n: [given[n]] if n in given else ladder.initial_grid(REFERENCE_LR.get(n), max_grid) for n in names}
    return ladder.tune(first, run, extend)


def journaled(journal: Journal, settings: dict, train: Play) -> Play:
    """`train`, each round kept in `journal` under its methods, rates, budgets, seed and
    `settings`, and taken from it when there."""

    def play(names, rates, budgets, seed):
        key = Journal.key(round=seed, names=list(names), rates=list(rates), budgets=list(budgets), **settings)
        if (done := journal.get(key)) is not None:
            print(f"seed {seed}: {', '.join(names)} taken from the journal", flush=True)
            return [Trial(t["name"], record_from_json(t["run"]), t["steps"], t["evaluated"]) for t in done]
        trials = train(names, rates, budgets, seed)
        journal.put(key, [dict(name=t.name, run=record_to_json(t.run), steps=t.steps, evaluated=t.evaluated)
                          for t in trials])
        return trials

    return play


def _best(trials: Sequence[Trial]) -> Trial:
    return min(trials, key=lambda t: (not np.isfinite(t.final), t.final))


def step_memory(problem: Problem, name: str, learning_rate: float | None) -> int:
    """Peak bytes of one step of a method, compiled alone: its arguments (parameters, optimizer
    state, batch), outputs and temporaries, less the buffers the outputs alias."""
    key = jax.random.key(0)
    batch = problem.next_batch(problem.model, 0, key, None)
    step, state = make_step(problem, make_method(name, learning_rate, 100), batch)
    memory = eqx.filter_jit(step).lower(problem.model, state, key, batch).compile().compiled.memory_analysis()
    return int(memory.argument_size_in_bytes + memory.output_size_in_bytes
               + memory.temp_size_in_bytes - memory.alias_size_in_bytes)


def common_seconds(repeats: dict[str, list[Trial]]) -> tuple[float, float]:
    """The seconds every run lasted, compiled and from the first call: where the methods are
    compared (a calibration slowed by other load leaves every run short of `--seconds` alike)."""
    trials = [t for ts in repeats.values() for t in ts]
    return min(t.clock(True)[-1] for t in trials), min(t.clock(False)[-1] for t in trials)


def summarise(repeats: dict[str, list[Trial]], memory: dict[str, int]) -> dict[str, dict]:
    """Per method, medians over seeds: see the module docstring (and `table`)."""
    adamw = repeats.get("adamw")
    target = float(np.median([t.final for t in adamw])) if adamw else float("nan")
    compiled, wall = common_seconds(repeats)

    def median(values) -> float:
        """The median, a target never reached (NaN) counting as later than any reached."""
        middle = float(np.median(np.where(np.isnan(values), np.inf, values)))
        return middle if np.isfinite(middle) else float("nan")

    rows = {}
    for name, trials in repeats.items():
        rows[name] = dict(
            learning_rate=trials[0].run.learning_rate, steps=len(trials[0].run.losses),
            step_ms=median([t.run.ms_per_step for t in trials]),
            first_call=median([t.run.first_call.total for t in trials]),
            final=median([t.final for t in trials]),
            compiled=median([t.at(compiled, True) for t in trials]),
            from_first_call=median([t.at(wall, False) for t in trials]),
            reach_compiled=median([t.reach(target, True) for t in trials]),
            reach_first_call=median([t.reach(target, False) for t in trials]),
            memory_mib=memory[name] / 2**20,
        )
    return rows


def table(rows: dict[str, dict], compiled: float, wall: float) -> str:
    """The summary as a markdown table, ratios to AdamW's where it ran (`compiled`, `wall`: the
    seconds of `common_seconds`)."""
    base = rows.get("adamw", {})

    def cell(row, key, digits):
        """`row[key]` and its ratio to AdamW's; "never" for a target not reached."""
        if not np.isfinite(row[key]):
            return "never"
        known = base.get(key) and np.isfinite(base[key])
        return f"{row[key]:.{digits}f}" + (f" ({row[key] / base[key]:.2f}x)" if known else "")

    lines = [
        f"| method | peak rate | steps | step ms | first call s | val. loss at {compiled:.1f} s compiled "
        f"| at {wall:.1f} s from the first call | to AdamW's final, compiled s | from the first call s "
        "| memory MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        rate = "adapted" if row["learning_rate"] is None else f"{row['learning_rate']:g}"
        lines.append(
            f"| {name} | {rate} | {row['steps']} | {cell(row, 'step_ms', 0)} | {row['first_call']:.1f} "
            f"| {row['compiled']:.3f} | {row['from_first_call']:.3f} | {cell(row, 'reach_compiled', 0)} "
            f"| {cell(row, 'reach_first_call', 0)} | {cell(row, 'memory_mib', 1)} |"
        )
    return "\n".join(lines)


def plot(repeats: dict[str, list[Trial]], path: str) -> None:
    """Seed 0's validation loss against steps, compiled seconds and seconds from the first call."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    for name, trials in repeats.items():
        trial = trials[0]
        steps = np.asarray(trial.steps)
        for axis, x in zip(axes, (steps, trial.clock(True)[steps], trial.clock(False)[steps])):
            axis.plot(x, trial.evaluated, label=name)
    for axis, label in zip(axes, ("steps", "compiled seconds", "seconds from the first call")):
        axis.set_xlabel(label)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss (nats per character)")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see `--help`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--quick", action="store_true", help="60 s per method, one seed, reference rates")
    parser.add_argument("--seconds", type=float, help="compiled seconds per method (default 600, 60 with --quick)")
    ladder.add_arguments(parser)
    parser.add_argument("--model", choices=tuple(MODELS), default="gpt",
                        help="the Equinox GPT, or Flax's lm1b transformer (Linen)")
    parser.add_argument("--corpus", choices=tuple(gpt.CORPORA), default="topics",
                        help="Python's help topics (465 thousand characters), or its standard library's "
                        "sources (12 million: for runs that would pass over the topics many times)")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--length", type=int, default=64, help="characters of context")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rates", nargs="+", default=[], metavar="METHOD=RATE",
                        help="peak rates to use as given, without tuning (e.g. muon=0.1 soap=0.01)")
    parser.add_argument("--plots", help="write language_model.png to this folder")
    parser.add_argument("--save", help="write the summary and every seed's curves to this JSON file")
    parser.add_argument("--tune-seconds", type=float,
                        help="compiled seconds of the rate ladder's runs on seed 0 (default: --seconds)")
    parser.add_argument("--journal", help="keep finished work in this JSON-lines file and skip what it holds")
    args = parser.parse_args(argv)
    if args.seconds is None:
        args.seconds = 60.0 if args.quick else 600.0
    if args.tune_seconds is None:
        args.tune_seconds = args.seconds
    for flag, seconds in (("--seconds", args.seconds), ("--tune-seconds", args.tune_seconds)):
        if not seconds > 0:
            parser.error(f"{flag} must be positive, got {seconds:g}")
    ladder.settle_arguments(parser, args)
    args.rates = dict(_given_rate(parser, text, args.methods) for text in args.rates)
    return args


def _given_rate(parser: argparse.ArgumentParser, text: str, methods: Sequence[str]) -> tuple[str, float]:
    """`"muon=0.1"` as `("muon", 0.1)`, or a parser error that says what is wrong."""
    name, _, rate = text.partition("=")
    if name not in methods or name == "kfac":
        parser.error(f"--rates {text}: {name!r} is not one of the methods with a rate, {[m for m in methods if m != 'kfac']}")
    try:
        return name, float(rate)
    except ValueError:
        parser.error(f"--rates {text}: write METHOD=RATE with a number, e.g. {name}=0.01")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    names = usable(args.methods)
    start = time.perf_counter()

    zoo = MODELS[args.model]

    validation = zoo.validation_batch(args.length, corpus=args.corpus)

    def problem(seed: int) -> Problem:
        return zoo.problem(jax.random.key(seed), width=args.width, depth=args.depth,
                           length=args.length, batch_size=args.batch_size, corpus=args.corpus)

    def train(names, rates, budgets, seed) -> list[Trial]:
        return _round(problem(seed), zoo, validation, names, rates, budgets, seed)

    settings = dict(model=args.model, corpus=args.corpus, width=args.width, depth=args.depth,
                    length=args.length, batch_size=args.batch_size)
    journal = Journal(args.journal)
    calibration = Journal.key(calibration=names, **settings)
    if (step_seconds := journal.get(calibration)) is None:
        step_seconds = calibrate(problem(0), names)
        journal.put(calibration, step_seconds)
    budgets = step_budgets(step_seconds, args.seconds)
    tuning = step_budgets(step_seconds, args.tune_seconds)
    print("step budgets:", budgets, "" if tuning == budgets else f"(tuned at {tuning})", flush=True)
    play = journaled(journal, settings, train)
    grids = tune(play, names, tuning, args.max_grid, args.rates)
    rates = {n: _best(trials).run.learning_rate for n, trials in grids.items()}
    tuned_is_seed_0 = tuning == budgets
    repeats = {n: [_best(grids[n])] if tuned_is_seed_0 else [] for n in names}
    for seed in range(1 if tuned_is_seed_0 else 0, args.seeds):
        for trial in play(names, [rates[n] for n in names], [budgets[n] for n in names], seed):
            repeats[trial.name].append(trial)
    memory = {n: step_memory(problem(0), n, rates[n]) for n in names}
    rows = summarise(repeats, memory)
    print(table(rows, *common_seconds(repeats)))
    for line in calibration_drift(step_seconds, repeats):
        print(line)
    print(f"\n{time.perf_counter() - start:.0f} s in all; {args.seeds} seed(s), at most {args.max_grid} "
          f"rate(s) per method; {args.model} on {args.corpus}, width {args.width}, depth {args.depth}, "
          f"context {args.length}, batch {args.batch_size}; {jax.devices()[0].platform}.")
    if args.plots:
        plot(repeats, f"{args.plots}/language_model{'' if args.model == 'gpt' else '_' + args.model}.png")
    if args.save:
        curves = {n: [dict(steps=t.steps, validation=t.evaluated, compiled=t.clock(True)[t.steps].tolist(),
                           from_first_call=t.clock(False)[t.steps].tolist()) for t in trials]
                  for n, trials in repeats.items()}
        with open(args.save, "w") as file:
            json.dump(dict(args=vars(args), rows=rows, curves=curves), file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
