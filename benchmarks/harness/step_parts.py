"""The parts of an `eqx_kfac.Optimizer` step, callable one at a time, for the benchmarks that
compile or time them alone (`compile_time.py`, `step_time.py`).

They reach into the optimizer's parts (its estimators, its value function, the quadratic model's
context), which the public API does not promise to keep: a redesign of those parts is followed here,
once, for every benchmark.
"""

from typing import Any

import jax.numpy as jnp

import eqx_kfac


def quadratic_model(
    optimizer: eqx_kfac.Optimizer, estimator_state: Any, func_args: tuple, grads: Any, vectors: list
) -> Any:
    """The exact quadratic model of the adaptive learning rate and momentum along `vectors`.

    **Arguments:**

    - `optimizer`: the optimizer (its estimators, estimation mode, `l2_reg` and value function).
    - `estimator_state`: the curvature's state.
    - `func_args`: the loss's arguments.
    - `grads`: the gradient.
    - `vectors`: the directions (the preconditioned gradient and the velocity).

    **Returns:**

    The `eqx_kfac.exact_quadratic_model` of the step.
    """
    block_diagonal, implicit = optimizer.estimators(func_args)
    context = eqx_kfac.StepContext(
        step=jnp.zeros((), int),
        data_seen=jnp.zeros((), int),
        func_args=func_args,
        loss=jnp.zeros(()),
        grads=grads,
        estimator=block_diagonal,
        estimator_state=estimator_state,
        implicit=implicit,
        estimation_mode=optimizer.preconditioner.curvature.estimation_mode,
        l2_reg=optimizer.l2_reg,
        axis_name=None,
        value_func=optimizer.function.value,
        loss_of=lambda out: out,
        given=eqx_kfac.GivenValues(),
    )
    return eqx_kfac.exact_quadratic_model(context, vectors)
