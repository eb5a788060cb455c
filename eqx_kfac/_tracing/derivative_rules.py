"""Registrations inside custom derivative rules.

FermiNet-style variational Monte Carlo computes its loss (the mean local energy) in a
`jax.custom_jvp` function whose rule gives the VMC gradient estimator, and registers `log|ψ|`
inside that rule, as kfac-jax users do. Tracing the function alone never runs the rule, so no loss
is found. When a function's jaxpr registers no loss but calls custom-derivative functions, the
tracer and the graph matcher trace it again under `eqx.filter_vjp` with respect to its
parameters: the rules then run (their primal computations, registrations included, are part of
the trace) and the function's outputs are unchanged. Uses of the parameters that the registered
losses do not depend on (the energy itself) do not affect the layers found.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
from jax.extend.core import Jaxpr

from .jaxpr_interpreter import iter_eqns
from .tags import is_loss_tag_eqn

_CUSTOM = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


def registers_inside_rules(jaxpr: Jaxpr) -> bool:
    """Whether `jaxpr` registers no loss but calls custom-derivative functions, whose rules might.

    **Arguments:**

    - `jaxpr`: a traced function's jaxpr.

    **Returns:**

    `True` when the function should be traced through its derivative rules.
    """
    eqns = list(iter_eqns(jaxpr))
    return not any(is_loss_tag_eqn(e) for e in eqns) and any(e.primitive.name in _CUSTOM for e in eqns)


def through_derivative_rules(func: Callable[..., Any], params_index: int) -> Callable[..., Any]:
    """`func` evaluated under `eqx.filter_vjp` in its parameters: the same outputs, computed by
    the custom derivative rules' primal computations (so that registrations in them are traced).

    **Arguments:**

    - `func`: the function.
    - `params_index`: the position of the parameters among its arguments.

    **Returns:**

    A function with `func`'s signature and outputs.
    """

    def expanded(*args: Any) -> Any:
        def of_params(params: Any) -> Any:
            return func(*args[:params_index], params, *args[params_index + 1 :])

        out, _ = eqx.filter_vjp(of_params, args[params_index])
        return out

    return expanded
