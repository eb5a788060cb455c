"""Where the first K-FAC step's time goes: tracing and lowering, and XLA's compilation, per part.

    python benchmarks/compile_time.py [--models autoencoder cnn ...] [--peer-venv PATH]

For each model, the K-FAC step (`eqx_kfac.Optimizer`, adaptive learning rate, momentum and
damping, burn-in inside the first step, inverses every 5 steps) is traced and lowered
(`jax.jit(...).lower`) and compiled (`.compile()`), each timed; then the step's parts are
compiled on their own, so their times show what each part costs XLA:

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
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import eqx_kfac
from eqx_kfac._optim.optimizer_compiled import _run_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import model_zoo as zoo  # noqa: E402
from model_zoo.training import make_optimizer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def compile_seconds(fn: Callable[..., Any], *args: Any) -> tuple[float, float]:
    """`(trace and lower, XLA compile)` seconds of `eqx.filter_jit(fn)(*args)`."""
    lowered, lower = _timed(lambda: eqx.filter_jit(fn).lower(*args))
    _, compile_ = _timed(lowered.compile)
    return lower, compile_


def _autoencoder_problem(key: Any) -> zoo.ZooProblem:
    from _problems import TanhNet

    sizes = (784, 1000, 500, 250, 30, 250, 500, 1000, 784)
    model = TanhNet(sizes, key)
    x = jax.random.uniform(jax.random.fold_in(key, 1), (512, 784))

    def loss(model, batch):
        logits = jax.vmap(model)(batch)
        eqx_kfac.register_sigmoid_cross_entropy_loss(logits, batch)
        return jnp.mean(jnp.sum(jax.nn.softplus(logits) - batch * logits, axis=-1))

    return zoo.ZooProblem("autoencoder", model, loss, lambda m, s, k, p: x, batch_size=512)


def _problem(name: str) -> tuple[zoo.ZooProblem, dict[str, Any]]:
    key = jax.random.key(0)
    if name == "autoencoder":
        return _autoencoder_problem(key), dict(estimation_mode="ggn_curvature_prop")
    if name.startswith("scan_mlp_"):
        depth = int(name.rsplit("_", 1)[1])
        return zoo.scan_mlp.problem(key, depth=depth), {}
    return zoo.PROBLEMS[name](key), {}


def breakdown(name: str) -> dict[str, tuple[float, float]]:
    """Seconds `(trace and lower, compile)` of the step and of its parts, for one model."""
    problem, options = _problem(name)
    batch = problem.next_batch(problem.model, 0, jax.random.key(1), None)
    optimizer = make_optimizer(problem, **options)
    state = optimizer.init(problem.model, jax.random.key(0), batch, func_state=problem.func_state)
    step_args = (problem.model, state, jax.random.key(2), batch, problem.func_state, (None,) * 3)
    times = {"step": compile_seconds(lambda o, a: _run_step(o, a, True), optimizer, step_args)}
    func_args = optimizer._func_args(problem.model, problem.func_state, jax.random.key(3), batch)
    block_diagonal, implicit = optimizer.estimators(func_args)
    grads = eqx.filter(problem.model, eqx.is_inexact_array)
    estimator_state = state.estimator_state
    times["value_and_grad"] = compile_seconds(optimizer.value_and_grad_func, *func_args)
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
    times["quadratic model"] = compile_seconds(
        lambda args, g: optimizer._exact_quad_model(implicit, args, [g, g], g), func_args, grads
    )
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
    print("| model | " + " | ".join(f"{p} (lower + compile s)" for p in parts) + " |")
    print("|---" * (len(parts) + 1) + "|")
    for name in args.models:
        times = breakdown(name)
        cells = [f"{times[p][0]:.1f} + {times[p][1]:.1f}" for p in parts]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    if args.peer_venv:
        print(f"kfac-jax first step on the autoencoder: {_peer_first_call(args.peer_venv)} s")


if __name__ == "__main__":
    main()
