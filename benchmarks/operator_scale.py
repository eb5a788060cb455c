"""Trace and log-determinant of the damped K-FAC operator of a 3.1M-parameter MLP, factor-wise.

The model is `eqx.nn.MLP(1024, 10, 1024, 3)` (four dense layers, 3.1M parameters) with softmax
cross-entropy; `BlockDiagonalCurvature` accumulates its K-FAC statistics from one batch, and
`eqx_kfac.trace` / `eqx_kfac.logdet` are taken of `estimator.as_linear_operator(state, damping)`
in float32. Each is jitted and compiled first, then timed (median over rounds). The results are
compared with the sum over blocks of the factor-wise values computed here in float64 NumPy from
the same factors: `tr A · tr G + λ · dim` and `Σ log(s_A ⊗ s_G + λ)`. XLA's memory estimate of
each compiled function is printed too (a dense route would need `dim²` entries, 38 TB).

    python benchmarks/operator_scale.py            # full size
    python benchmarks/operator_scale.py --quick    # width 64 (a smoke run)
"""

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqx_kfac


def loss_fn(model, batch):
    x, labels = batch
    logits = jax.vmap(model)(x)
    eqx_kfac.register_softmax_cross_entropy_loss(logits, labels)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def factor_wise(estimator, state, damping):
    """`(trace, logdet)` of `C + λI`, block by block from the factors, in float64 NumPy."""
    total_trace, total_logdet = 0.0, 0.0
    for block, block_state in zip(estimator.blocks, state.block_states):
        a, g = (np.asarray(f.value, np.float64) for f in block_state.factors)
        total_trace += np.trace(a) * np.trace(g) + damping * block.dim
        values = np.outer(np.linalg.eigvalsh(a).clip(0.0), np.linalg.eigvalsh(g).clip(0.0))
        total_logdet += np.sum(np.log(values + damping))
    return total_trace, total_logdet


def timed(fn, args, rounds):
    """`(result, compile seconds, median seconds, memory analysis)` of a jitted `fn(*args)`."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_time = time.perf_counter() - start
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        result = compiled(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    memory = compiled.memory_analysis()
    return result, compile_time, statistics.median(times), memory


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--damping", type=float, default=1e-3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="width 64, 2 rounds")
    args = parser.parse_args()
    width = 64 if args.quick else args.width
    rounds = 2 if args.quick else args.rounds

    model = eqx.nn.MLP(width, 10, width, 3, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (args.batch_size, width), jnp.float32)
    labels = jax.random.randint(jax.random.key(2), (args.batch_size,), 0, 10)
    batch = (x, labels)
    estimator = eqx_kfac.BlockDiagonalCurvature(loss_fn, (model, batch))
    update = eqx.filter_jit(estimator.update_curvature_matrix_estimate)
    state = update(estimator.init(), 0.0, 1.0, args.batch_size, jax.random.key(3), (model, batch))
    jax.block_until_ready(state)
    print(
        f"MLP({width}, 10, {width}, 3): {estimator.dim:,} parameters, {estimator.num_blocks} "
        f"K-FAC blocks, damping {args.damping}, float32, {jax.device_count()} device(s) "
        f"{jax.devices()[0].platform}"
    )

    reference_trace, reference_logdet = factor_wise(estimator, state, args.damping)
    damping = jnp.asarray(args.damping, jnp.float32)
    for name, function, reference in (
        ("trace", eqx_kfac.trace, reference_trace),
        ("logdet", eqx_kfac.logdet, reference_logdet),
    ):

        def fn(state, damping, function=function):
            return function(estimator.as_linear_operator(state, damping))

        value, compile_time, seconds, memory = timed(fn, (state, damping), rounds)
        relative = abs(float(value) - reference) / abs(reference)
        temp = memory.temp_size_in_bytes / 2**20 if memory is not None else float("nan")
        print(
            f"{name:>6}: {float(value):.8g} (factor-wise float64: {reference:.8g}, relative "
            f"difference {relative:.1e}); {seconds:.3f} s per call (median of {rounds}), "
            f"compile {compile_time:.2f} s, XLA temp memory {temp:.1f} MiB"
        )


if __name__ == "__main__":
    main()
