"""Cost of one curvature-estimator update and one cache update, relative to one `value_and_grad`.

The model is the deep autoencoder of the K-FAC paper (784-1000-500-250-30-250-500-1000-784, tanh,
sigmoid cross-entropy), batch 512, float32, with `BlockDiagonalCurvature`'s default K-FAC blocks.
Every timed function is jitted and compiled first; then the functions are timed in alternation
(one call of each per round, so slow drifts of the machine hit all of them alike) and the table
reports medians over rounds and each median divided by the `value_and_grad` median.

    python benchmarks/estimator_cost.py              # full size
    python benchmarks/estimator_cost.py --quick      # small widths and few rounds (a smoke run)
"""

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp

from eqx_kfac import BlockDiagonalCurvature
from benchmarks.model_zoo.tanh_mlp import TanhMLP, autoencoder_data_loss as loss_fn


AUTOENCODER = (784, 1000, 500, 250, 30, 250, 500, 1000, 784)


def block_until_ready(tree):
    return jax.tree.map(lambda a: a.block_until_ready() if isinstance(a, jax.Array) else a, tree)


def make_jobs(sizes, batch_size, modes):
    """`(jobs, num_blocks)`: the timed functions, each compiled and ready to call."""
    model = TanhMLP(sizes, jax.random.key(0))
    x = jax.random.uniform(jax.random.key(1), (batch_size, sizes[0]), jnp.float32)
    x = (x > 0.5).astype(jnp.float32)
    params, static = eqx.partition(model, eqx.is_inexact_array)

    estimator = BlockDiagonalCurvature(loss_fn, (model, x))
    state = estimator.init(
        jax.random.key(2), exact_powers_to_cache=-1, approx_powers_to_cache=-1
    )
    damping = jnp.float32(1e-3)

    @jax.jit
    def value_and_grad(params, x):
        return jax.value_and_grad(lambda p: loss_fn(eqx.combine(p, static), x))(params)

    def make_update(mode):
        @jax.jit
        def update(state, params, x, key):
            return estimator.update_curvature_matrix_estimate(
                state, 0.95, 1.0, batch_size, key, (eqx.combine(params, static), x), mode
            )

        return update

    @jax.jit
    def cache_approx(state):
        return estimator.update_cache(state, damping, approx_powers=-1)

    @jax.jit
    def cache_exact(state):
        return estimator.update_cache(state, damping, exact_powers=-1)

    @jax.jit
    def precondition(state, grads):
        return estimator.multiply_inverse(state, grads, damping, exact_power=False, use_cached=True)

    updates = {m: make_update(m) for m in modes}
    state = block_until_ready(updates[modes[0]](state, params, x, jax.random.key(3)))
    _, grads = value_and_grad(params, x)
    state = block_until_ready(cache_exact(cache_approx(state)))

    jobs = {"value_and_grad": lambda: value_and_grad(params, x)}
    for mode, update in updates.items():
        jobs[f"update ({mode})"] = lambda update=update: update(state, params, x, jax.random.key(4))
    jobs["update_cache (approx inverse)"] = lambda: cache_approx(state)
    jobs["update_cache (exact inverse)"] = lambda: cache_exact(state)
    jobs["multiply_inverse (cached)"] = lambda: precondition(state, grads)
    for job in jobs.values():  # compile everything before timing
        block_until_ready(job())
    return jobs, estimator.num_blocks


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="timing rounds (default 10)")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="widths / 10 and 3 rounds")
    parser.add_argument(
        "--modes",
        default="fisher_gradients,ggn_curvature_prop",
        help="comma-separated estimation modes to time",
    )
    args = parser.parse_args()
    sizes = AUTOENCODER
    rounds = args.rounds
    if args.quick:
        sizes = tuple(max(2, s // 10) for s in sizes)
        rounds = min(rounds, 3)
    jobs, num_blocks = make_jobs(sizes, args.batch_size, [m for m in args.modes.split(",") if m])
    times = {name: [] for name in jobs}
    for _ in range(rounds):
        for name, job in jobs.items():
            start = time.perf_counter()
            block_until_ready(job())
            times[name].append(time.perf_counter() - start)

    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["value_and_grad"]
    print(
        f"MLP autoencoder {'-'.join(map(str, sizes))}, B={args.batch_size}, float32, "
        f"{num_blocks} blocks, {rounds} alternated rounds, device {jax.devices()[0]}"
    )
    width = max(len(n) for n in jobs)
    print(f"{'operation':<{width}}  {'median (ms)':>12}  {'x value_and_grad':>16}")
    for name, median in medians.items():
        print(f"{name:<{width}}  {1e3 * median:>12.2f}  {median / base:>16.2f}")


if __name__ == "__main__":
    main()
