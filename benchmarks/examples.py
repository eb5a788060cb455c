"""Equinox's example notebooks trained with K-FAC: steps and seconds to the notebook's own result.

    python benchmarks/examples.py --quick                   # short budgets, a smoke run
    python benchmarks/examples.py --plots docs/img          # the budgets of issue 27's table
    python benchmarks/examples.py --examples rnn vit --steps 20
    python benchmarks/examples.py --examples --unet         # only the U-Net's first step
    python benchmarks/examples.py --compilation-cache /tmp/c  # twice: a script's second run

The models (`benchmarks/model_zoo/equinox_examples`) are those of Equinox's example notebooks,
rebuilt from their published architectures on data that ships with scikit-learn or is generated:
the MNIST CNN (AdamW), the vision transformer (AdamW), the score-based diffusion Mixer (AdaBelief),
the RNN (Adam), the stateful BatchNorm model (Adam) and the frozen-layer MLP (SGD). Each is
trained from the same initial parameters on the same batches for the same number of steps by

- `kfac`: `eqx_kfac.Optimizer` in its recommended configuration (adaptive learning rate, momentum
  and damping, `benchmarks.harness.make_optimizer`);
- `recipe`: `eqx_kfac.kfac_optax` with its defaults;
- the notebook's optimizer at the notebook's settings (the target).

The runs of an example advance one step each in turn. The target is the notebook optimizer's
final loss (the mean training loss of its last 10 steps); a method reaches it at the first step
whose 10-step mean is at or below it. Seconds *from the first call* count building the optimizer
and its state, the first step's tracing, lowering, compilation and run, and the steps and batches
after it; *compiled* seconds count the steps only. The first-call table splits each method's first
call into those stages: `setup` (building the optimizer and its state: for K-FAC, tracing the loss
and registering its layers), `trace` (tracing the step: Python), `lower`, `compile` (XLA) and
`run` (the compiled first step). `Optimizer.step` compiles itself and is called directly, as its
users call it: its stages are the seconds JAX's monitoring events report for every program the
call compiled (the step and its burn-in update), and `run` is the rest of the call (the ten
burn-in updates, the step, and the Python around them).

Each example runs in a subprocess of its own (XLA's compiler keeps gigabytes of the ViT's K-FAC
step, and an example the machine runs out of memory for is reported, not fatal). With
`--compilation-cache DIR` every subprocess first turns on JAX's persistent compilation cache in
`DIR` (`eqx_kfac.enable_compilation_cache(DIR, min_compile_time_secs=0)`: every program, the
baselines' too): the first run of the command fills it, and a second run times what a user waits
for when running the same script again. `--unet` measures
the first call of every method on the diffusion example's U-Net (the notebook's other score
model), each in a subprocess that is stopped after `--unet-timeout` seconds: the stages it
finished are reported, and `>` the time it ran.
"""

import argparse
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import jax

import eqx_kfac
from benchmarks.harness import Method, Outcome, first_call, registration_summary, report, run_round
from benchmarks.model_zoo.equinox_examples import EXAMPLES, diffusion, unet

HERE = os.path.dirname(os.path.abspath(__file__))
# Steps of every method: issue 27's budgets, and `--quick`'s.
STEPS = {
    "mnist_cnn": (300, 60),
    "vit": (150, 30),
    "diffusion_mixer": (40, 10),
    "rnn": (200, 50),
    "stateful": (200, 50),
    "frozen_layer": (300, 60),
}
# The notebooks' model seed.
MODEL_SEED = 5678
STAGES = ("setup", "trace", "lower", "compile", "run")


def methods(baseline: Method, cache: bool = False) -> list[Method]:
    """K-FAC's two forms and the notebook's optimizer. With the persistent compilation cache on
    (`cache`), `kfac_optax` leaves its faults-in-a-row check out of the program, as its docs
    advise there (a host callback, which the cache does not store; a user checks in Python with
    `eqx_kfac.check_consecutive_faults`, one read of a scalar per step, which the loop's read of
    each step's loss already pays here)."""
    recipe = Method("recipe", options={"max_consecutive_faults": None} if cache else {})
    return [Method("kfac"), recipe, baseline]


def run_example(name: str, steps: int, cache: bool = False) -> tuple[Outcome, str]:
    """Trains one example with every method.

    **Arguments:**

    - `name`: a key of `EXAMPLES`.
    - `steps`: the step budget.
    - `cache`: whether the persistent compilation cache is on (see `methods`).

    **Returns:**

    The `Outcome` (one run per method) and a table row of K-FAC's registration: its blocks, and
    the parameters left in generic (diagonal) blocks.
    """
    module = EXAMPLES[name]
    problem = module.problem(jax.random.key(MODEL_SEED))
    blocks, generic = registration_summary(problem)
    runs = {run.method: [run] for run in run_round(problem, methods(module.NOTEBOOK_OPTIMIZER, cache), steps)}
    return Outcome(name, steps, runs, runs), f"| {name} | {blocks} | {generic} |"


def run_in_subprocess(name: str, steps: int, cache: str | None = None) -> tuple[Outcome, str] | str:
    """`run_example` in a subprocess of its own (with the persistent compilation cache in `cache`,
    if given); what went wrong (a line) if it did not finish."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "outcome.pickle")
        command = [sys.executable, os.path.abspath(__file__), "--example-child", name, "--steps", str(steps),
                   "--save", path, *(["--compilation-cache", cache] if cache else [])]
        code = subprocess.run(command).returncode
        if code != 0:
            return f"{name}: the subprocess ended with code {code} (a negative code is the signal that killed it)"
        with open(path, "rb") as file:
            return pickle.load(file)


def _example_child(name: str, steps: int, path: str, cache: bool) -> None:
    """In the subprocess: `run_example`, its result pickled to `path`."""
    with open(path, "wb") as file:
        pickle.dump(run_example(name, steps, cache), file)


def _unet_child(method: str, cache: bool) -> None:
    """In the subprocess: the U-Net's first call of one method, a line per finished stage."""
    problem = unet.problem(jax.random.key(MODEL_SEED))
    chosen = {m.name: m for m in methods(diffusion.NOTEBOOK_OPTIMIZER, cache)}[method]
    first_call(problem, chosen, on_stage=lambda stage, seconds: print(f"stage {stage} {seconds}", flush=True))


def unet_first_call(method: str, timeout: float, cache: str | None = None) -> dict[str, float]:
    """The U-Net's first call of `method`, stage by stage, in a subprocess stopped at `timeout` s
    (with the persistent compilation cache in `cache`, if given).

    **Returns:**

    `stage -> seconds` of the stages that finished; when the call did not finish, `"running"`
    holds the seconds the unfinished stage ran until the subprocess was stopped.
    """
    command = [sys.executable, os.path.abspath(__file__), "--unet-child", method,
               *(["--compilation-cache", cache] if cache else [])]
    start = time.perf_counter()
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout).stdout
        finished = True
    except subprocess.TimeoutExpired as expired:
        out = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else expired.stdout or ""
        finished = False
    stages = {line.split()[1]: float(line.split()[2]) for line in out.splitlines() if line.startswith("stage ")}
    if not finished:
        stages["running"] = time.perf_counter() - start - sum(stages.values())
    return stages


def unet_table(results: dict[str, dict[str, float]]) -> str:
    """The markdown table of the U-Net's first calls (`>` marks a stage stopped by the timeout)."""
    lines = ["| method | " + " | ".join(f"{s} s" for s in STAGES) + " | first call s |", "|---" * 7 + "|"]
    for method, stages in results.items():
        unfinished = next((s for s in STAGES if s not in stages), None)
        cells = [
            f"{stages[s]:.2f}" if s in stages else (f"> {stages['running']:.0f}" if s == unfinished else "-")
            for s in STAGES
        ]
        total = sum(stages.values())
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {'> ' if unfinished else ''}{total:.1f} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see `--help`)."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--examples", nargs="*", choices=list(EXAMPLES), default=list(EXAMPLES),
                        help="the examples to train (none: only --unet)")
    parser.add_argument("--quick", action="store_true", help="the short step budgets")
    parser.add_argument("--steps", type=int, help="the step budget of every example (default: STEPS)")
    parser.add_argument("--unet", action="store_true", help="also time the U-Net's first calls")
    parser.add_argument("--unet-timeout", type=float, default=900.0, help="seconds per U-Net first call")
    parser.add_argument("--plots", help="write examples_<name>.png to this folder")
    parser.add_argument("--save", default=os.path.join(HERE, "results", "examples.md"),
                        help="write the tables (markdown) to this file")
    parser.add_argument("--compilation-cache", metavar="DIR",
                        help="JAX's persistent compilation cache in DIR for every method (run twice)")
    parser.add_argument("--unet-child", help=argparse.SUPPRESS)
    parser.add_argument("--example-child", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compilation_cache:
        eqx_kfac.enable_compilation_cache(args.compilation_cache, min_compile_time_secs=0)
    if args.unet_child or args.example_child:
        if args.unet_child:
            _unet_child(args.unet_child, bool(args.compilation_cache))
        else:
            _example_child(args.example_child, args.steps, args.save, bool(args.compilation_cache))
        return 0
    start = time.perf_counter()
    outcomes, failures, registrations = [], [], ["| example | K-FAC blocks | generic params |", "|---|---|---|"]
    for name in args.examples:
        result = run_in_subprocess(name, args.steps or STEPS[name][1 if args.quick else 0], args.compilation_cache)
        if isinstance(result, str):
            failures.append(result)
            print(result, flush=True)
            continue
        outcomes.append(result[0])
        registrations.append(result[1])
        print("\n".join(report.table(outcomes[-1:], grid_seconds=False).splitlines()[2:]), flush=True)
        print(report.summary(outcomes[-1]), flush=True)
        if args.plots:
            report.plot(outcomes[-1], os.path.join(args.plots, f"examples_{name}.png"))
    baselines = {o.problem: EXAMPLES[o.problem].NOTEBOOK_OPTIMIZER.name for o in outcomes}
    sections = [
        report.table(outcomes, grid_seconds=False),
        report.first_call_table(outcomes, baselines),
        "\n".join(registrations),
        "\n".join([*(report.summary(outcome) for outcome in outcomes), *failures]),
    ] if outcomes else failures
    if args.unet:
        results = {
            m.name: unet_first_call(m.name, args.unet_timeout, args.compilation_cache)
            for m in methods(diffusion.NOTEBOOK_OPTIMIZER)
        }
        sections.append("U-Net (diffusion), first call by stage:\n\n" + unet_table(results))
    sections.append(f"{time.perf_counter() - start:.0f} s in all on {jax.devices()[0].platform}.")
    text = "\n\n".join(sections)
    print("\n" + text)
    os.makedirs(os.path.dirname(args.save) or ".", exist_ok=True)
    with open(args.save, "w") as file:
        file.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
