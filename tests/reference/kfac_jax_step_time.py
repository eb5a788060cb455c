"""Per-step time of kfac-jax 0.0.8 vs optax Adam on the K-FAC paper's deep autoencoder (issue 10).

This is the Haiku twin of the performance model of `benchmarks/` (784-1000-500-250-30-250-500-
1000-784, tanh on every hidden layer, linear output logits, sigmoid cross-entropy summed over the
784 outputs and averaged over the batch, binary inputs, B=512, float32). It must run in the peer
venv (jax 0.8.2 + kfac-jax + dm-haiku + optax), never in the main venv:

    /work/peervenv/bin/python tests/reference/kfac_jax_step_time.py            # full size
    /work/peervenv/bin/python tests/reference/kfac_jax_step_time.py --quick    # smoke run
    /work/peervenv/bin/python tests/reference/kfac_jax_step_time.py --first-call

Timed steps (each already compiled; the step functions are called exactly as a user calls them):
- `adam`: `optax.adam(1e-3)` inside one `jax.jit` (value_and_grad + update + apply_updates);
- `kfac_adaptive`: `kfac_jax.Optimizer` with adaptive learning rate, momentum and damping
  (initial damping 1.0, interval 5), `estimation_mode="ggn_curvature_prop"`;
- `kfac_fixed`: the same with fixed learning rate 1e-3, momentum 0.9, damping 1e-2.
Both K-FAC settings use `inverse_update_period=5`, `curvature_ema=0.95`, `l2_reg=1e-5` (added
to the loss as `l2_reg / 2 * sum(p**2)`), `num_burnin_steps=0`, `multi_device=False`.
One round runs `--steps-per-round` consecutive steps (default 5 = one inverse-update period, so a
round's mean includes exactly one inverse update and one damping update) of each method in turn
(A B C A B C ...); the table reports the median over rounds of the per-step mean time, and
ratios to Adam.

`step MiB` is XLA's buffer assignment for one compiled step (arguments + outputs + temporaries -
donated buffers), as `benchmarks/step_time.py` reports for ours. kfac-jax jits its private
`Optimizer._step` when it is imported; this script captures that jitted function (by wrapping
`jax.jit` during the import) to lower it with the arguments of a real step. The adaptive setting
compiles one step that updates the damping and one that does not; the larger is reported.
`faults/step` counts the process's minor page faults during the timed steps, per step.

`first s` is the first call of each method's step, as a user waits for it: tracing, compilation
and one step, after `init` (untimed). The first calls come before any other step, in the order of
the table (a later method may find parts of JAX's tracing caches warm).
kfac-jax's adaptive first call compiles its step without the damping update; the variant that
updates the damping compiles at the fifth call (the first adaptation,
`damping_adaptation_interval=5`), a second wait of the same order that `first s` leaves out;
`steps s` counts it: the seconds of the first `2 * --steps-per-round` steps (10 by default) from
the first call, every variant's compilation included. `--first-call` builds the adaptive
setting only, times its first call and prints `first_call_s <seconds>` (for
`benchmarks/compile_time.py`).
"""

import argparse
import functools as ft
import resource
import statistics
import time

import haiku as hk
import jax
import jax.numpy as jnp
import optax

_JITTED = {}
_jax_jit = jax.jit


def _capturing_jit(fun=None, *args, **kwargs):
    if fun is None:  # `jax.jit(static_argnames=...)` as a decorator (JAX >= 0.10)
        return lambda f: _capturing_jit(f, *args, **kwargs)
    jitted = _jax_jit(fun, *args, **kwargs)
    _JITTED[getattr(fun, "__qualname__", "")] = jitted
    return jitted


jax.jit = _capturing_jit
import kfac_jax  # noqa: E402  (its staged methods call jax.jit at import time)

jax.jit = _jax_jit

AUTOENCODER = (784, 1000, 500, 250, 30, 250, 500, 1000, 784)
L2_REG = 1e-5


def make_loss(sizes):
    """Haiku autoencoder loss (mean sigmoid cross-entropy + l2_reg/2 * |params|^2)."""

    def logits_fn(x):
        h = x
        for i, n in enumerate(sizes[1:]):
            h = hk.Linear(n, name=f"linear_{i}")(h)
            if i < len(sizes) - 2:
                h = jnp.tanh(h)
        return h

    net = hk.without_apply_rng(hk.transform(logits_fn))

    def loss(params, batch):
        logits = net.apply(params, batch)
        kfac_jax.register_sigmoid_cross_entropy_loss(logits, batch)
        per_example = jnp.sum(jax.nn.softplus(logits) - batch * logits, axis=-1)
        reg = 0.5 * L2_REG * sum(jnp.sum(p**2) for p in jax.tree.leaves(params))
        return jnp.mean(per_example) + reg

    return net, loss


def make_kfac(loss, adaptive):
    common = dict(
        value_and_grad_func=jax.value_and_grad(loss),
        l2_reg=L2_REG,
        estimation_mode="ggn_curvature_prop",
        inverse_update_period=5,
        curvature_ema=0.95,
        num_burnin_steps=0,
        multi_device=False,
    )
    if adaptive:
        return kfac_jax.Optimizer(
            use_adaptive_learning_rate=True,
            use_adaptive_momentum=True,
            use_adaptive_damping=True,
            initial_damping=1.0,
            damping_adaptation_interval=5,
            **common,
        ), {}
    step_kwargs = dict(
        learning_rate=jnp.asarray(1e-3, jnp.float32),
        momentum=jnp.asarray(0.9, jnp.float32),
        damping=jnp.asarray(1e-2, jnp.float32),
    )
    return kfac_jax.Optimizer(**common), step_kwargs


def compiled_bytes(lowered):
    """Arguments + outputs + temporaries - donated (aliased) bytes of a lowered step."""
    stats = lowered.compile().memory_analysis()
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes
            + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


def kfac_step_bytes(opt, carry, x, step_kwargs, adaptive):
    """The larger of kfac-jax's compiled steps (with and without the damping update)."""
    hyper = tuple(step_kwargs.get(k) for k in ("learning_rate", "momentum", "damping"))
    step = _JITTED["Optimizer._step"]
    return max(
        compiled_bytes(step.lower(opt, carry[0], carry[1], carry[2], x, None, *hyper, True, damp))
        for damp in ((False, True) if adaptive else (False,))
    )


def block(tree):
    return jax.tree.map(lambda a: a.block_until_ready(), tree)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps-per-round", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="widths / 10, 2 rounds")
    parser.add_argument("--first-call", action="store_true",
                        help="only time the first call of the adaptive K-FAC step")
    parser.add_argument("--sync-dispatch", action="store_true",
                        help="run every program on the calling thread (jax_cpu_enable_async_dispatch off)")
    args = parser.parse_args()
    if args.sync_dispatch:
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    sizes = AUTOENCODER
    rounds = args.rounds
    if args.quick:
        sizes = tuple(max(2, s // 10) for s in sizes)
        rounds = min(rounds, 2)

    net, loss = make_loss(sizes)
    x = (jax.random.uniform(jax.random.PRNGKey(1), (args.batch_size, sizes[0])) > 0.5)
    x = x.astype(jnp.float32)
    params0 = net.init(jax.random.PRNGKey(0), x)

    adam = optax.adam(1e-3)

    @jax.jit
    def adam_step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = adam.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    adam_carry = [jax.tree.map(jnp.copy, params0), adam.init(params0)]

    def run_adam(n):
        for _ in range(n):
            adam_carry[0], adam_carry[1], _ = adam_step(adam_carry[0], adam_carry[1], x)
        block(adam_carry[0])

    runners, memory = {}, {}
    if not args.first_call:
        runners["adam"] = run_adam
        memory["adam"] = lambda: compiled_bytes(adam_step.lower(adam_carry[0], adam_carry[1], x))
    kfac_settings = (("kfac_adaptive", True),) + (() if args.first_call else (("kfac_fixed", False),))
    for name, adaptive in kfac_settings:
        opt, step_kwargs = make_kfac(loss, adaptive)
        carry = [jax.tree.map(jnp.copy, params0), None, jax.random.PRNGKey(2)]
        carry[1] = opt.init(carry[0], jax.random.PRNGKey(3), x)

        def run_kfac(n, opt=opt, carry=carry, step_kwargs=step_kwargs):
            for _ in range(n):
                carry[2], key = jax.random.split(carry[2])
                carry[0], carry[1], _ = opt.step(carry[0], carry[1], key, batch=x,
                                                 **step_kwargs)
            block(carry[0])

        runners[name] = run_kfac
        memory[name] = ft.partial(kfac_step_bytes, opt, carry, x, step_kwargs, adaptive)

    first = {}
    for name, run in runners.items():
        start = time.perf_counter()
        run(1)
        first[name] = time.perf_counter() - start
    if args.first_call:
        print(f"first_call_s {first['kfac_adaptive']:.2f}")
        return
    # Compile every variant (kfac-jax compiles separately the steps that adapt the damping).
    first_steps = {}
    for name, run in runners.items():
        start = time.perf_counter()
        run(2 * args.steps_per_round - 1)
        first_steps[name] = first[name] + time.perf_counter() - start

    times = {name: [] for name in runners}
    faults = dict.fromkeys(runners, 0)
    for _ in range(rounds):
        for name, run in runners.items():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            run(args.steps_per_round)
            times[name].append((time.perf_counter() - start) / args.steps_per_round)
            faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; sizes {sizes}; "
          f"B={args.batch_size}; {rounds} rounds x {args.steps_per_round} steps (alternated)")
    adam_median = statistics.median(times["adam"])
    mib = {name: f() / 2**20 for name, f in memory.items()}
    print(f"{'method':<16}{'median ms/step':>16}{'x Adam':>10}{'step MiB':>10}{'x Adam':>8}"
          f"{'faults/step':>13}{'first s':>9}{'x Adam':>8}{'steps s':>9}{'x Adam':>8}")
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"{name:<16}{1e3 * median:>16.2f}{median / adam_median:>10.2f}"
              f"{mib[name]:>10.0f}{mib[name] / mib['adam']:>8.2f}"
              f"{faults[name] / (rounds * args.steps_per_round):>13.0f}"
              f"{first[name]:>9.2f}{first[name] / first['adam']:>8.2f}"
              f"{first_steps[name]:>9.2f}{first_steps[name] / first_steps['adam']:>8.2f}")


if __name__ == "__main__":
    main()
