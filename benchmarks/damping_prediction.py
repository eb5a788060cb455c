"""The adapted damping with the step rule's prediction (the default) against its own
(`LevenbergMarquardtDamping(own_prediction=True)`): does the damping steer, and does it reach
targets sooner? (Issue 48; the "Damping" section of docs/optimizer.md.)

    python benchmarks/damping_prediction.py --problems mlp cnn --seeds 1 2 --steps 800
    python benchmarks/damping_prediction.py --flax flax_examples.json   # Flax's examples

The first form trains `benchmarks/stability.py`'s digits MLP and CNN (minibatches of 64) with
`eqx_kfac.Optimizer`'s default parts, once with each damping rule, and prints the damping and the
adapted learning rate along the run and the final full-data loss. The second trains each of
`benchmarks/flax_examples.py`'s examples for its budget, the two rules alternated step by step
in one process, and prints when each reaches the target of a `flax_examples.py` record (its
tuned baseline's final loss).
"""

import argparse
import dataclasses
import json
from collections.abc import Sequence

import numpy as np

from benchmarks import stability
from benchmarks.harness import Method, Run, run_round, train
from benchmarks.harness.record import WINDOW
from eqx_kfac import LevenbergMarquardtDamping
from eqx_kfac._optim.optimizer import DEFAULT_DAMPING

# The default damping rule, and the same rule predicting with the K-FAC estimate.
RULES = {"default": DEFAULT_DAMPING, "own_prediction": dataclasses.replace(DEFAULT_DAMPING, own_prediction=True)}


def _method(rule: LevenbergMarquardtDamping) -> Method:
    return Method("kfac", None, {"damping_rule": rule})


def _along(values: np.ndarray, steps: Sequence[int]) -> str:
    return ", ".join(f"{values[min(s, len(values) - 1)]:.2g}" for s in steps)


def zoo_problems(problems: Sequence[str], seeds: Sequence[int], steps: int) -> None:
    """Each problem and seed with each rule: the damping and learning rate along the run (at
    steps 0, 50, 100, 200, 400 and the last) and the final full-data loss."""
    marks = [0, 50, 100, 200, 400, steps - 1]
    for problem_name in problems:
        for seed in seeds:
            for name, rule in RULES.items():
                problem = stability.make_problem(problem_name, seed)
                run = train(problem, _method(rule), steps, seed, keep_final=True)
                full = stability._full_loss(problem, run.model)
                print(
                    f"{problem_name} seed {seed} {name}: full-data loss {full:.3g}; damping at steps "
                    f"{marks}: {_along(run.stats['damping'], marks)}; learning rate: "
                    f"{_along(run.stats['learning_rate'], marks)}", flush=True,
                )


def _reached(run: Run, target: float) -> str:
    reach = run.reach(target)
    return "not reached" if reach is None else f"step {reach.steps} ({reach.compiled:.1f} s compiled)"


def flax_examples(record_path: str, names: Sequence[str]) -> None:
    """Each Flax example with both rules alternated, against the record's target."""
    from benchmarks.flax_suite.examples import EXAMPLES
    from benchmarks.flax_suite.run import STEPS

    with open(record_path) as file:
        records = json.load(file)["examples"]
    for name in names or list(records):
        steps = STEPS[name][0]
        example = EXAMPLES[name](steps, False)
        target = records[name]["target"]
        runs = run_round(example.problem, [_method(rule) for rule in RULES.values()], steps)
        marks = [steps // 4, steps // 2, steps - 1]
        for rule_name, run in zip(RULES, runs):
            print(
                f"{name} {rule_name}: target {target:.4g} {_reached(run, target)}; final loss "
                f"{run.final_loss(WINDOW):.4g}; damping at steps {marks}: {_along(run.stats['damping'], marks)}",
                flush=True,
            )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="*", default=["mlp", "cnn"], choices=["mlp", "cnn"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--flax", metavar="RECORD", help="a flax_examples.py JSON record: train its examples instead")
    parser.add_argument("--examples", nargs="*", default=[], help="with --flax: these examples only")
    args = parser.parse_args(argv)
    if args.flax:
        flax_examples(args.flax, args.examples)
    else:
        zoo_problems(args.problems, args.seeds, args.steps)


if __name__ == "__main__":
    main()
