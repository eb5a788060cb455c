"""The command line of `python benchmarks/flax_examples.py`: trains the examples, prints the
table, writes the JSON record and the plots (see the package's docstring)."""

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from eqx_kfac._optim.optimizer import DEFAULT_DAMPING

import eqx_kfac

from ..harness import Method, Outcome, Run, best, report, run_round
from ..harness.methods import OPTAX
from ..harness.record import WINDOW
from .examples import EXAMPLES, Example

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Steps of every method, full and `--quick`.
STEPS = {"mnist": (100, 8), "seq2seq": (150, 8), "lm1b": (150, 8), "vae": (150, 8), "sst2": (100, 8),
         "ogbg": (100, 8), "imagenet": (80, 6)}
# The baseline's learning rates: the config's and its neighbours on a 3x ladder.
LADDER_STEP = 3.0
LADDER = (1 / LADDER_STEP, 1.0, LADDER_STEP)
# How many rungs the ladder may grow past an end that holds its best run.
MAX_EXTRA_RUNGS = 2
KFAC_FORMS = {
    "kfac": "Optimizer", "warm": "Optimizer+WarmStart", "recipe": "kfac_optax",
    "recipe_warm": "kfac_optax+WarmStart",
}
# The recommended damping rule's floor.
DAMPING_FLOOR = float(DEFAULT_DAMPING.minimum)
MISSING_JRAPH = ("ogbg skipped: jraph is not installed (pip install -e \".[flax-examples]\", or "
                 "pip install jraph)")


def ladder(baseline: Method, quick: bool = False) -> list[Method]:
    """The baseline at its config's learning rate and the two neighbours on a 3x ladder (`quick`:
    the config's rate only)."""
    factors = (1.0,) if quick else LADDER
    return [dataclasses.replace(baseline, learning_rate=baseline.learning_rate * f) for f in factors]


def extended(problem: Any, baseline: Method, grid: list[Run], steps: int) -> list[Run]:
    """The ladder extended one 3x rung at a time past an end that holds its best run, at most
    `MAX_EXTRA_RUNGS` times: a baseline whose best rate is the ladder's largest (or smallest) is
    not tuned yet. Each extra rung is trained in a round of its own (the same batches and initial
    parameters); the ladder is returned sorted by learning rate."""
    grid = sorted(grid, key=lambda run: run.learning_rate)
    for _ in range(MAX_EXTRA_RUNGS):
        top = best(grid)
        if top is grid[-1]:
            rate, at = grid[-1].learning_rate * LADDER_STEP, len(grid)
        elif top is grid[0]:
            rate, at = grid[0].learning_rate / LADDER_STEP, 0
        else:
            break
        grid.insert(at, run_round(problem, [dataclasses.replace(baseline, learning_rate=rate)], steps)[0])
    return grid


def warm_methods(baseline: Method, warm_steps: int, when_ready: bool) -> list[Method]:
    """`Optimizer` with a `WarmStart` of `warm_steps` steps of the example's own optimizer (at its
    config's learning rate), switching as soon as K-FAC's step is compiled with `when_ready`, and
    `kfac_optax` with the same warm start through `OptaxTraining`."""
    transformation = OPTAX[baseline.name](baseline.learning_rate, **baseline.options)
    warm_start = eqx_kfac.WarmStart(warm_steps, transformation, switch_when_ready=when_ready)
    return [Method(name, options={"warm_start": warm_start}) for name in ("warm", "recipe_warm")]


def run_example(
    name: str, steps: int, quick: bool, warm_steps: int = 0, when_ready: bool = False
) -> tuple[Outcome, Example]:
    """Trains one example: both K-FAC forms and the baseline's ladder, alternated step by step,
    then the ladder extended while its best rate is at an end (`extended`; not `quick`), then
    with `warm_steps`, `Optimizer` and `kfac_optax` with a warm start, each in a round of its own
    (`warm_methods`; their compilation threads would slow the steps of the runs they alternated
    with).

    **Arguments:**

    - `name`: a key of `EXAMPLES`.
    - `steps`: the step budget of every run.
    - `quick`: the tiny sizes, and the config's learning rate only.
    - `warm_steps`, `when_ready`: the warm start's (none for `0`).

    **Returns:**

    The `Outcome` (the ladder in `grids`, its best run in `seeds`) and the `Example`.
    """
    example = EXAMPLES[name](steps, quick)
    runs = run_round(example.problem, [Method("kfac"), Method("recipe"), *ladder(example.baseline, quick)], steps)
    kfac, recipe, grid = runs[0], runs[1], runs[2:]
    if not quick:
        grid = extended(example.problem, example.baseline, grid, steps)
    base = example.baseline.name
    forms = {"kfac": [kfac], "recipe": [recipe]}
    if warm_steps:
        for method in warm_methods(example.baseline, warm_steps, when_ready):
            forms[method.name] = run_round(example.problem, [method], steps)
    return Outcome(name, steps, {**forms, base: grid}, {**forms, base: [best(grid)]}), example


def _cell(values: Sequence[float | None], spec: str) -> str:
    """The values formatted by `spec`, joined by ` / ` (`-`: never reached)."""
    return " / ".join("-" if v is None else format(v, spec) for v in values)


def table(outcomes: Sequence[Outcome], examples: dict[str, Example]) -> str:
    """The markdown table of the issue: for each example, the steps and seconds (from the first
    call; compiled) of each K-FAC form trained (`KFAC_FORMS`) and the baseline to the baseline's
    final loss, and the step and first-call ratios of the K-FAC forms to the baseline."""
    names = " / ".join(KFAC_FORMS[m] for m in _forms(outcomes))
    lines = [
        f"| example | baseline (lr) | steps to target: {names} / baseline "
        f"| s from the first call | s compiled | step x baseline ({names}) | first call x baseline |",
        "|---|---|---|---|---|---|---|",
    ]
    for outcome in outcomes:
        base_name = examples[outcome.problem].baseline.name
        base = outcome.seeds[base_name][0]
        order = (*_forms([outcome]), base_name)
        reach = {m: outcome.reaches(m)[0] for m in order}
        get = lambda field: [None if reach[m] is None else getattr(reach[m], field) for m in order]  # noqa: E731
        step = [outcome.seeds[m][0].ms_per_step / base.ms_per_step for m in order[:-1]]
        first = [outcome.seeds[m][0].first_call.total / base.first_call.total for m in order[:-1]]
        lines.append(
            f"| {outcome.problem} | {base.label} | {_cell(get('steps'), '.0f')} | {_cell(get('wall'), '.1f')} "
            f"| {_cell(get('compiled'), '.2f')} | {_cell(step, '.1f')} | {_cell(first, '.1f')} |"
        )
    return "\n".join(lines)


def _forms(outcomes: Sequence[Outcome]) -> list[str]:
    """The K-FAC forms the outcomes trained, in `KFAC_FORMS`' order."""
    return [m for m in KFAC_FORMS if all(m in outcome.seeds for outcome in outcomes)]


def medians(outcomes: Sequence[Outcome], examples: dict[str, Example]) -> str:
    """A line: the median step ratio of each K-FAC form over the examples, and who is first."""
    forms = _forms(outcomes)
    ratios = {m: [] for m in forms}
    first = {"wall": 0, "compiled": 0}
    for outcome in outcomes:
        base = examples[outcome.problem].baseline.name
        for m in forms:
            ratios[m].append(outcome.seeds[m][0].ms_per_step / outcome.seeds[base][0].ms_per_step)
        for field in first:
            seconds = {m: np.inf if r is None else getattr(r, field)
                       for m in (*forms, base) for r in outcome.reaches(m)[:1]}
            first[field] += min(seconds[m] for m in forms) < seconds[base]
    steps = ", ".join(f"{KFAC_FORMS[m]} {np.median(r):.1f}x" for m, r in ratios.items())
    return (f"Median step ratio over {len(outcomes)}: {steps}. K-FAC's better form first to the target from "
            f"the first call on {first['wall']} of {len(outcomes)}, counting compiled steps on {first['compiled']}.")


def trajectories(outcomes: Sequence[Outcome]) -> str:
    """The markdown table of `Optimizer`'s adapted damping and learning rate: first, smallest and
    last values, and the first step at the damping rule's floor (`-`: never)."""
    lines = ["| example | damping: first / min / last | at the floor from step "
             "| learning rate: first / median / last |", "|---|---|---|---|"]
    for outcome in outcomes:
        stats = outcome.seeds["kfac"][0].stats
        damping, rate = np.asarray(stats["damping"], float), np.asarray(stats["learning_rate"], float)
        floor = np.flatnonzero(damping <= DAMPING_FLOOR * 1.0001)
        lines.append(
            f"| {outcome.problem} | {damping[0]:.1e} / {damping.min():.1e} / {damping[-1]:.1e} "
            f"| {floor[0] if floor.size else '-'} | {rate[0]:.2g} / {np.median(rate):.2g} / {rate[-1]:.2g} |"
        )
    return "\n".join(lines)


def _series(values: np.ndarray) -> list[float | None]:
    return [float(f"{v:.4g}") if np.isfinite(v) else None for v in np.asarray(values, float)]


def _run_record(run: Run, target: float) -> dict[str, Any]:
    reach = run.reach(target)
    record = {
        "label": run.label, "final_loss": run.final_loss(WINDOW), "ms_per_step": run.ms_per_step,
        "first_call": dataclasses.asdict(run.first_call), "first_call_s": run.first_call.total,
        "reach": None if reach is None else dataclasses.asdict(reach),
        "losses": _series(run.losses),
    }
    record.update({k: _series(run.stats[k]) for k in ("learning_rate", "damping", "momentum") if k in run.stats})
    return record


def record(outcome: Outcome, example: Example) -> dict[str, Any]:
    """The JSON record of one example: what it is, the target, the ladder's final losses, and per
    method its final loss, median step and first call (by stage), reach, every step's loss (and for
    `Optimizer` its learning-rate, momentum and damping trajectories)."""
    target = outcome.target(0)
    base = example.baseline.name
    return {
        "about": example.about, "steps": outcome.steps, "target": target, "baseline": base,
        "ladder": {r.label: r.final_loss(WINDOW) for r in outcome.grids[base]},
        "methods": {KFAC_FORMS.get(m, m): _run_record(runs[0], target) for m, runs in outcome.seeds.items()},
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see `--help`)."""
    parser = argparse.ArgumentParser(description="Flax's examples: K-FAC against each config's optimizer.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--examples", nargs="+", choices=list(EXAMPLES), default=list(EXAMPLES))
    parser.add_argument("--quick", action="store_true", help="tiny sizes and a few steps (a smoke run)")
    parser.add_argument("--steps", type=int, help="the step budget of every example (default: STEPS)")
    parser.add_argument("--warm-start", type=int, default=0, metavar="STEPS",
                        help="also train Optimizer and kfac_optax (through OptaxTraining) with a WarmStart "
                             "of this many steps of the example's optimizer (each in a round of its own)")
    parser.add_argument("--when-ready", action="store_true",
                        help="the warm start switches as soon as K-FAC's step is compiled")
    parser.add_argument("--plots", help="write flax_<example>.png (loss vs steps and vs seconds) to this folder")
    parser.add_argument("--save", default=os.path.join(HERE, "results", "flax_examples.json"),
                        help="the JSON record (the table, each run's losses and times)")
    return parser.parse_args(argv)


def save(path: str, outcomes: Sequence[Outcome], examples: dict[str, Example], notes: Sequence[str],
         seconds: float) -> str:
    """Writes the JSON record of the examples trained so far to `path`; returns the report (the
    table, the medians, the notes)."""
    lines = [table(outcomes, examples), medians(outcomes, examples) if outcomes else "",
             trajectories(outcomes) if outcomes else "", *notes,
             f"{seconds:.0f} s in all on {jax.devices()[0].platform}."]
    text = "\n\n".join(line for line in lines if line)
    records = {o.problem: record(o, examples[o.problem]) for o in outcomes}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as file:
        content = {"command": " ".join(sys.argv), "table": text, "examples": records}
        json.dump(content, file, separators=(",", ":"))
    return text


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    outcomes, examples, notes = [], {}, []
    for name in args.examples:
        if name == "ogbg" and importlib.util.find_spec("jraph") is None:
            notes.append(MISSING_JRAPH)
            print(MISSING_JRAPH, flush=True)
            continue
        outcome, examples[name] = run_example(
            name, args.steps or STEPS[name][bool(args.quick)], args.quick, args.warm_start, args.when_ready
        )
        outcomes.append(outcome)
        print(table([outcome], examples).splitlines()[-1], flush=True)
        # Written after every example: a run stopped early keeps the examples it finished.
        save(args.save, outcomes, examples, notes, time.perf_counter() - start)
        if args.plots:
            report.plot(outcome, os.path.join(args.plots, f"flax_{name}.png"))
    print("\n" + save(args.save, outcomes, examples, notes, time.perf_counter() - start))
    return 0
