"""Where the first K-FAC step's time goes: tracing and lowering, and XLA's compilation, per part.

    python benchmarks/compile_time.py [--models autoencoder cnn ...] [--peer-venv PATH]

For each model, the K-FAC step (`eqx_kfac.Optimizer`, adaptive learning rate, momentum and
damping, burn-in inside the first step, inverses every 5 steps) is traced and lowered
(`jax.jit(...).lower`) and compiled (`.compile()`), each timed in process CPU seconds (less
sensitive to a busy machine than the wall clock); then the step's parts are compiled on their
own, so their times show what each part costs XLA:

- `value_and_grad`: the loss and its gradient (what Adam compiles too);
- `curvature`: one curvature update (the estimator's forward and vmapped backward pass, the
  blocks' statistics);
- `inverses`: the refresh of the cached damped inverses;
- `precondition`: the preconditioned gradient from the cached inverses;
- `quadratic model`: the exact quadratic model of the adaptive learning rate and momentum.

The parts overlap (the step shares work between them) and their sum is not the step's. With
`--peer-venv`, kfac-jax's first step on the same autoencoder is measured in that venv
(`tests/reference/kfac_jax_step_time.py --first-call`). Models: the 784-1000-500-250-30 autoencoder
of the "Benchmarks" page (batch 512, `ggn_curvature_prop`), the scan-over-layers MLP at depths 4
and 32, and the zoo's models (`benchmarks/model_zoo`).
"""

import argparse
import os
import resource
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax

import eqx_kfac
from benchmarks import model_zoo as zoo, step_time
from benchmarks.harness import RECOMMENDED_KFAC_JAX_KEYWORDS, Problem, full_batch, make_optimizer, step_parts

HERE = os.path.dirname(os.path.abspath(__file__))


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """`fn()` and the process CPU seconds it took (less sensitive to a busy machine than the
    wall clock; XLA compiles on one thread)."""
    start = _cpu_seconds()
    out = fn()
    return out, _cpu_seconds() - start


def compile_seconds(fn: Callable[..., Any], *args: Any) -> tuple[float, float]:
    """`(trace and lower, XLA compile)` CPU seconds of `eqx.filter_jit(fn)(*args)`."""
    lowered, lower = _timed(lambda: eqx.filter_jit(fn).lower(*args))
    _, compile_ = _timed(lowered.compile)
    return lower, compile_


def _autoencoder_problem() -> tuple[Problem, Any]:
    """The autoencoder of `step_time.py` (and of kfac-jax's twin), with the same settings: the
    recommended configuration with kfac-jax's `value_func_for_estimator`, so
    `eqx_kfac.kfac_jax.Optimizer`."""
    model, x = step_time.make_problem(step_time.AUTOENCODER, 512)
    keywords = dict(RECOMMENDED_KFAC_JAX_KEYWORDS, estimation_mode="ggn_curvature_prop", num_burnin_steps=0)
    optimizer = eqx_kfac.kfac_jax.Optimizer(
        eqx.filter_value_and_grad(step_time.loss), step_time.L2_REG,
        value_func_for_estimator=step_time.data_loss, **keywords,
    )
    return full_batch("autoencoder", model, step_time.loss, x), optimizer


def _problem(name: str) -> tuple[Problem, Any]:
    """The problem and its optimizer (the recommended configuration)."""
    key = jax.random.key(0)
    if name == "autoencoder":
        return _autoencoder_problem()
    if name.startswith("scan_mlp_"):
        depth = int(name.rsplit("_", 1)[1])
        problem = zoo.scan_mlp.problem(key, depth=depth)
    else:
        problem = zoo.PROBLEMS[name](key)
    return problem, make_optimizer(problem)


def breakdown(name: str) -> dict[str, tuple[float, float]]:
    """Seconds `(trace and lower, compile)` of the step and of its parts, for one model."""
    problem, optimizer = _problem(name)
    batch = problem.next_batch(problem.model, 0, jax.random.key(1), None)
    state = optimizer.init(problem.model, jax.random.key(0), batch, func_state=problem.func_state)
    step_args = (problem.model, state, jax.random.key(2), batch, problem.func_state)
    times = {"step": compile_seconds(
        lambda o, a: o.step(a[0], a[1], a[2], batch=a[3], func_state=a[4]), optimizer, step_args
    )}
    func_args = optimizer.function.args(problem.model, problem.func_state, jax.random.key(3), batch)
    block_diagonal, implicit = optimizer.estimators(func_args)
    grads = eqx.filter(problem.model, eqx.is_inexact_array)
    estimator_state = state.estimator_state
    times["value_and_grad"] = compile_seconds(optimizer.function.value_and_grad, *func_args)
    times["curvature"] = compile_seconds(
        lambda s, args: block_diagonal.update_curvature_matrix_estimate(
            s, 0.95, 1.0, implicit.batch_size(args), jax.random.key(4), args
        ),
        estimator_state, func_args,
    )
    times["inverses"] = compile_seconds(
        lambda s: block_diagonal.update_cache(s, 1.0, None, -1), estimator_state
    )
    times["precondition"] = compile_seconds(
        lambda s, g: block_diagonal.multiply_matpower(s, g, 1.0, -1, False, True), estimator_state, grads
    )
    def quadratic_model(args, g):
        return step_parts.quadratic_model(optimizer, estimator_state, args, g, [g, g])

    times["quadratic model"] = compile_seconds(quadratic_model, func_args, grads)
    return times


def _peer_first_call(peer_venv: str) -> float | None:
    script = os.path.join(HERE, os.pardir, "tests", "reference", "kfac_jax_step_time.py")
    result = subprocess.run(
        [os.path.join(peer_venv, "bin", "python"), script, "--first-call"],
        capture_output=True, text=True,
    )
    for line in result.stdout.splitlines():
        if line.startswith("first_call_s"):
            return float(line.split()[1])
    print(f"kfac-jax run failed:\n{result.stderr[-2000:]}", file=sys.stderr)
    return None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["autoencoder", "scan_mlp_4", "scan_mlp_32", *zoo.PROBLEMS])
    parser.add_argument("--peer-venv", help="a venv with kfac-jax 0.0.8 (jax 0.8) for its first step")
    args = parser.parse_args(argv)
    parts = ("step", "value_and_grad", "curvature", "inverses", "precondition", "quadratic model")
    print("| model | " + " | ".join(f"{p} (lower + compile, CPU s)" for p in parts) + " |")
    print("|---" * (len(parts) + 1) + "|")
    for name in args.models:
        times = breakdown(name)
        cells = [f"{times[p][0]:.1f} + {times[p][1]:.1f}" for p in parts]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    if args.peer_venv:
        print(f"kfac-jax first step on the autoencoder: {_peer_first_call(args.peer_venv)} s")


if __name__ == "__main__":
    main()
