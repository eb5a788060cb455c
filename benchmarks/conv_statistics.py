"""Speed of the convolution curvature statistics, and of the K-FAC step of the zoo ResNet.

    python benchmarks/conv_statistics.py               # both tables
    python benchmarks/conv_statistics.py --quick       # fewer shapes and rounds, a smoke run
    python benchmarks/conv_statistics.py --no-resnet   # the statistics table only

**Statistics.** For each input shape (batch, channels, spatial size, kernel, stride, padding,
layout) the table gives the milliseconds of one compiled call of `patches_moments` with
`method="auto"` (the default: chunks of examples whose patches take at most 8 MiB) and
`method="patches"` (all patches at once), of the reference `patches_moments_explicit`
(`lax.conv_general_dilated_patches` and one product), and `auto`'s ratio to the reference.
Methods run alternately (A B C A B C ...); each entry is the minimum over rounds.

**ResNet step.** The zoo's ResNet (`benchmarks/model_zoo/resnet.py`: 3x3 convs with 16 channels
and BatchNorm under `eqx.nn.State`, 8x8 digits, batch 128, float32) trained by
`eqx_kfac.Optimizer` (learning rate 1e-3, momentum 0.9, damping 1e-2 given to each step;
`inverse_update_period=5`) and by `optax.adam`, both compiled, 5 steps per round (one cache
refresh per round). Ratios to Adam carry over between machines; absolute times do not. In the
same alternated run, each part alone and compiled: the gradient; the curvature statistics of all
blocks, and the same inside a one-trip `lax.fori_loop` as the step runs them (XLA:CPU canonicalises
the layout of top-level convolutions only, so the model's NCHW convolutions inside the loop run on
its generic emitter); the conv blocks' statistics (and their input factors `A` alone), their
preconditioning with cached inverses (`multiply_matpower(-1)`) and their cache refresh
(`update_cache`, once per 5 steps); then the conv blocks' share of the K-FAC step.
"""

import argparse
import functools
import os
import time
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_kfac
from benchmarks.model_zoo import resnet

# (batch, channels, spatial, kernel, stride, padding, layout)
SHAPES = (
    (128, 16, 8, 3, 1, "SAME", "NCHW"),  # the zoo ResNet's convs
    (128, 32, 8, 3, 1, "SAME", "NCHW"),
    (128, 1, 8, 3, 1, "SAME", "NCHW"),  # the zoo ResNet's stem
    (32, 1, 4, 3, 1, "SAME", "NCHW"),
    (256, 1, 28, 5, 1, "VALID", "NHWC"),
    (32, 3, 32, 3, 1, "SAME", "NHWC"),
    (256, 64, 4, 3, 1, "SAME", "NCHW"),
    (128, 64, 16, 1, 1, "VALID", "NHWC"),
    (256, 8, 32, 1, 2, "SAME", "NCHW"),
    (64, 64, 16, 3, 2, "SAME", "NCHW"),
    (128, 32, 16, 5, 1, "SAME", "NHWC"),
    (256, 16, 32, 3, 1, "SAME", "NHWC"),
    (32, 64, 32, 5, 2, "VALID", "NCHW"),
)
QUICK_SHAPES = SHAPES[:4]


def alternated(functions: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """The minimum over `rounds` of each function's seconds, the functions called alternately."""
    for f in functions.values():
        jax.block_until_ready(f())
    times = {name: [] for name in functions}
    for _ in range(rounds):
        for name, f in functions.items():
            start = time.perf_counter()
            jax.block_until_ready(f())
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def statistics_table(shapes, rounds: int) -> None:
    print(
        f"{'batch':>5} {'chan':>4} {'size':>4} {'k':>2} {'s':>2} {'pad':>5} {'fmt':>4} | "
        f"{'auto ms':>9} {'patches ms':>10} {'explicit ms':>11} | {'auto/explicit':>13}"
    )
    for batch, channels, size, kernel, stride, padding, layout in shapes:
        shape = (batch, channels, size, size) if layout == "NCHW" else (batch, size, size, channels)
        x = jax.random.normal(jax.random.key(0), shape, jnp.float32)
        options = dict(
            kernel_spatial_shape=kernel, strides=stride, padding=padding, data_format=layout
        )
        calls = {
            "auto": functools.partial(eqx_kfac.patches_moments, **options),
            "patches": functools.partial(eqx_kfac.patches_moments, method="patches", **options),
            "explicit": functools.partial(eqx_kfac.patches_moments_explicit, **options),
        }
        t = alternated(
            {name: functools.partial(jax.jit(f), x) for name, f in calls.items()}, rounds
        )
        print(
            f"{batch:>5} {channels:>4} {size:>4} {kernel:>2} {stride:>2} {padding:>5} {layout:>4} | "
            f"{t['auto'] * 1e3:>9.2f} {t['patches'] * 1e3:>10.2f} {t['explicit'] * 1e3:>11.2f} | "
            f"{t['auto'] / t['explicit']:>13.2f}",
            flush=True,
        )


def _input_moments(spec: eqx_kfac.LayerSpec, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`patches_moments` of a conv layer's input, as its Kronecker-factored block calls it."""
    dnums = spec.get("dimension_numbers")
    return eqx_kfac.patches_moments(
        x,
        tuple(spec.param_shapes[0][i] for i in dnums.rhs_spec[2:]),
        strides=spec.get("window_strides"),
        padding=spec.get("padding"),
        dimension_numbers=dnums,
        inputs_dilation=spec.get("lhs_dilation"),
        kernel_dilation=spec.get("rhs_dilation"),
    )


def _per_step(step: Callable[[], object], steps: int) -> Callable[[], object]:
    """`steps` calls of `step` (the last result is waited for); timed, then divided by `steps`."""

    def run():
        for _ in range(steps):
            out = step()
        return out

    return run


def _training_steps(problem, optimizer, batch, steps: int) -> dict[str, Callable[[], object]]:
    """K-FAC's and Adam's steps on `batch` (learning rate, momentum and damping given to K-FAC),
    each `steps` calls."""
    model, func_state = problem.model, problem.func_state
    value_and_grad = optimizer.function.value_and_grad
    hyper = dict(learning_rate=1e-3, momentum=0.9, damping=1e-2)
    adam = optax.adam(1e-3)

    @eqx.filter_jit
    def adam_step(model, opt_state, func_state, batch):
        (_, func_state), grads = value_and_grad(model, func_state, batch)
        updates, opt_state = adam.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, func_state

    kfac = [model, optimizer.init(model, jax.random.key(1), batch, func_state=func_state), func_state]
    plain = [model, adam.init(eqx.filter(model, eqx.is_inexact_array)), func_state]
    keys = iter(jax.random.split(jax.random.key(2), 10**5))

    def kfac_step():
        kfac[:3] = optimizer.step(*kfac[:2], next(keys), batch=batch, func_state=kfac[2], **hyper)[:3]
        return kfac[0]

    def adam_step_():
        plain[:] = adam_step(*plain, batch)
        return plain[0]

    return {"K-FAC step": _per_step(kfac_step, steps), "Adam step": _per_step(adam_step_, steps)}


def _conv_data(convs: list) -> list:
    """Random `EstimationData` of each conv block's shapes (timing is data-independent)."""
    data = []
    for i, block in enumerate(convs):
        k = jax.random.split(jax.random.key(10 + i), 4)
        spec = block.spec
        data.append(
            eqx_kfac.EstimationData(
                params=tuple(jnp.zeros(s, jnp.float32) for s in spec.param_shapes),
                inputs=(jax.random.normal(k[0], spec.input_shapes[0]),),
                outputs=(jax.random.normal(k[1], spec.output_shapes[0]),),
                outputs_tangent=(jax.random.normal(k[2], (1, *spec.output_shapes[0])),),
                params_tangent=tuple(jnp.zeros((1, *s), jnp.float32) for s in spec.param_shapes),
            )
        )
    return data


def _conv_parts(convs: list, steps: int) -> dict[str, Callable[[], object]]:
    """The conv blocks alone: statistics, input factors, preconditioning and cache refresh."""
    data = _conv_data(convs)
    damping = jnp.asarray(1e-2, jnp.float32)

    @eqx.filter_jit
    def conv_statistics(states, data):
        return [b.update_curvature_matrix_estimate(s, d, 0.95, 1.0, 128) for b, s, d in zip(convs, states, data)]

    @eqx.filter_jit
    def conv_input_factors(data):
        return [_input_moments(b.spec, d.inputs[0]) for b, d in zip(convs, data)]

    @eqx.filter_jit
    def conv_refresh(states):
        return [b.update_cache(s, damping, None, (-1,)) for b, s in zip(convs, states)]

    @eqx.filter_jit
    def conv_preconditioning(states, vectors):
        return [b.multiply_matpower(s, v, damping, -1, False, True) for b, s, v in zip(convs, states, vectors)]

    states = conv_refresh(conv_statistics([b.init(jax.random.key(0), None, (-1,)) for b in convs], data))
    vectors = [tuple(jnp.ones(s, jnp.float32) for s in b.spec.param_shapes) for b in convs]
    return {
        "conv blocks: statistics (A and G)": lambda: conv_statistics(states, data),
        "conv blocks: A (patches_moments)": lambda: conv_input_factors(data),
        "conv blocks: preconditioning": lambda: conv_preconditioning(states, vectors),
        f"conv blocks: cache refresh / {steps}": lambda: conv_refresh(states),
    }


def _estimator_parts(estimator, value_and_grad, func_args) -> dict[str, Callable[[], object]]:
    """The gradient and the curvature statistics of all blocks (also in a one-trip loop)."""
    estimator_state = estimator.init(jax.random.key(0), None, (-1,))

    @eqx.filter_jit
    def statistics(state, func_args, trips):
        def update(_, state):
            return estimator.update_curvature_matrix_estimate(state, 0.95, 1.0, 128, jax.random.key(3), func_args)

        if trips is None:
            return update(0, state)
        return jax.lax.fori_loop(0, trips, update, state)

    gradient = eqx.filter_jit(lambda args: value_and_grad(*args))
    one_trip = jnp.asarray(1)
    return {
        "gradient (value_and_grad)": lambda: gradient(func_args),
        "curvature statistics, all blocks": lambda: statistics(estimator_state, func_args, None),
        "  the same in a one-trip fori_loop": lambda: statistics(estimator_state, func_args, one_trip),
    }


def _print_resnet_table(times: dict[str, float], convs: int, rounds: int, steps: int) -> None:
    step = times["K-FAC step"]
    print(
        f"\nResNet (batch 128), {convs} conv blocks; K-FAC with learning rate, momentum and "
        f"damping given, inverse_update_period={steps}; minimum over {rounds} alternated rounds"
    )
    print(f"{'part':<38} {'ms':>8} {'/ K-FAC step':>13} {'/ Adam step':>12}")
    for name, t in times.items():
        print(f"{name:<38} {t * 1e3:>8.2f} {t / step:>13.2f} {t / times['Adam step']:>12.2f}")
    conv_names = ("conv blocks: statistics (A and G)", "conv blocks: preconditioning", f"conv blocks: cache refresh / {steps}")
    conv_share = sum(times[name] for name in conv_names)
    print(
        f"K-FAC step / Adam step: {step / times['Adam step']:.2f}; conv blocks' share of the "
        f"K-FAC step: {conv_share / step:.0%}"
    )


def resnet_tables(rounds: int, steps: int = 5) -> None:
    """The ResNet's K-FAC step against Adam's, and the parts of the step, alternated."""
    problem = resnet.problem(jax.random.key(0), batch_size=128)
    model, func_state = problem.model, problem.func_state
    batch = problem.next_batch(model, 0, None, None)
    value_and_grad = eqx.filter_value_and_grad(resnet.loss, has_aux=True)
    # The learning rate, momentum and damping passed to every step.
    optimizer = eqx_kfac.Optimizer(
        value_and_grad, value_func_has_state=True, step_rule=eqx_kfac.MomentumStep(),
        damping_rule=eqx_kfac.GivenDamping(), refresh=eqx_kfac.RefreshSchedule(inverse_update_period=steps),
    )
    func_args = (model, func_state, batch)
    estimator, _ = optimizer.estimators(func_args)
    convs = [b for b in estimator.blocks if isinstance(b, eqx_kfac.Conv2DTwoKroneckerFactored)]
    parts = {
        **_training_steps(problem, optimizer, batch, steps),
        **_estimator_parts(estimator, value_and_grad, func_args),
        **_conv_parts(convs, steps),
    }
    times = alternated(parts, rounds)
    for name in ("K-FAC step", "Adam step", f"conv blocks: cache refresh / {steps}"):
        times[name] /= steps
    _print_resnet_table(times, len(convs), rounds, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and rounds")
    parser.add_argument("--no-resnet", action="store_true", help="skip the ResNet step")
    parser.add_argument("--rounds", type=int, default=None, help="alternated rounds per table")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} cores\n")
    statistics_table(QUICK_SHAPES if args.quick else SHAPES, rounds)
    if not args.no_resnet:
        resnet_tables(rounds)


if __name__ == "__main__":
    main()
