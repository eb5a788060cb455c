"""Registrations inside custom derivative rules.

FermiNet-style variational Monte Carlo computes its loss (the mean local energy) in a
`jax.custom_jvp` function whose rule gives the VMC gradient estimator, and registers `log|ψ|`
inside that rule, as kfac-jax users do. Tracing the function alone never runs the rule, so no loss
is found. When a function's jaxpr registers no loss but calls custom-derivative functions, the
tracer and the graph matcher trace it again under `eqx.filter_vjp` with respect to its
parameters: the rules then run (their primal computations, registrations included, are part of
the trace) and the function's outputs are unchanged. Uses of the parameters that the registered
losses do not depend on (the energy itself) do not affect the layers found.

`function_jaxpr` is that trace (and the plain one before it), cached per function and argument
signature (`cache_key`), so that `Optimizer.init`'s check of the loss's outputs
(`abstract_outputs`) and the graph matcher trace the loss once; whether a function registers
inside its rules is remembered across meshes, so a trace under `shard_map` (the multi-device
step) goes through the rules at once.
"""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr
from jaxtyping import PyTree

from .._core.lru_cache import LRUCache
from .jaxpr_interpreter import iter_eqns
from .tags import is_loss_tag_eqn

_CUSTOM = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
_CUSTOM_FUNCTIONS = (jax.custom_jvp, jax.custom_vjp)


def registers_inside_rules(jaxpr: Jaxpr) -> bool:
    """Whether `jaxpr` registers no loss but calls custom-derivative functions, whose rules might.

    **Arguments:**

    - `jaxpr`: a traced function's jaxpr.

    **Returns:**

    `True` when the function should be traced through its derivative rules.
    """
    return not _registers_loss(jaxpr) and any(e.primitive.name in _CUSTOM for e in iter_eqns(jaxpr))


def _registers_loss(jaxpr: Jaxpr) -> bool:
    return any(is_loss_tag_eqn(e) for e in iter_eqns(jaxpr))


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


def _aval_key(x: Any) -> Any:
    """What of an argument leaf its trace depends on: shape, dtype, weak type and the mesh axes it
    varies over (under `shard_map`), alike for arrays, tracers and `jax.ShapeDtypeStruct`s, so an
    abstract and a concrete argument share one trace."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return (tuple(x.shape), x.dtype, bool(getattr(x, "weak_type", False)), frozenset())
    if eqx.is_array(x):
        aval = jax.typeof(x)
        return (tuple(aval.shape), aval.dtype, bool(aval.weak_type), frozenset(getattr(aval, "vma", ())))
    return ("static", x)


def cache_key(func: Callable[..., Any], func_args: Sequence[Any], params_index: int) -> Any:
    """The key of a trace of `func(*func_args)`: the function, the arguments' structure, static
    values, shapes, dtypes, and the abstract mesh in force.

    **Arguments:**

    - `func`: the function.
    - `func_args`: its arguments (arrays, tracers, `jax.ShapeDtypeStruct`s or static values).
    - `params_index`: which argument holds the parameters.

    **Returns:**

    A hashable key (unless a static argument is unhashable).
    """
    # The abstract mesh in force (its axes Manual under `shard_map`, Auto in an SPMD program) is
    # part of every aval the trace holds: a trace made under `shard_map` and reused outside it
    # mixed the two meshes in one operation (`benchmarks/scale.py`'s replicated, then sharded
    # step).
    leaves, treedef = jax.tree.flatten(tuple(func_args))
    mesh = jax.sharding.get_abstract_mesh()
    return (func, params_index, treedef, tuple(_aval_key(x) for x in leaves), mesh)


_JAXPRS = LRUCache(maxsize=16)
_THROUGH_RULES = LRUCache(maxsize=64)


class _CapturedTracers(Exception):
    """A trace that holds values of an enclosing trace: used once, never cached."""

    def __init__(self, made: Any):
        super().__init__()
        self.made = made


def _cached_jaxpr(func: Callable[..., Any], func_args: Sequence[Any], key: Any) -> tuple[ClosedJaxpr, PyTree, PyTree]:
    """`eqx.filter_make_jaxpr(func)(*func_args)`, cached under `key` unless its constants are
    tracers (`func` closes over values of an enclosing trace)."""

    def make() -> tuple[ClosedJaxpr, PyTree, PyTree]:
        made = eqx.filter_make_jaxpr(func)(*func_args)
        if any(isinstance(c, jax.core.Tracer) for c in made[0].consts):
            raise _CapturedTracers(made)
        return made

    try:
        return _JAXPRS.get(key, make)
    except _CapturedTracers as captured:
        return captured.made


def function_jaxpr(
    func: Callable[..., Any], func_args: Sequence[Any], params_index: int
) -> tuple[ClosedJaxpr, PyTree, PyTree]:
    """`eqx.filter_make_jaxpr(func)(*func_args)`, traced through `func`'s derivative rules when it
    registers inside them (`registers_inside_rules`); both traces cached per `cache_key`.

    **Arguments:**

    - `func`: the function.
    - `func_args`: its arguments.
    - `params_index`: the position of the parameters among them.

    **Returns:**

    `(closed_jaxpr, out_struct, out_static)`, as `eqx.filter_make_jaxpr` returns them.
    """
    key = cache_key(func, func_args, params_index)
    # Whether `func` registers inside its rules depends on none of the mesh, the shapes (a
    # device's share of the batch) and the axes the arguments vary over: known from a trace at
    # `init`, it saves the plain trace under `shard_map` (and tracing through the rules is right
    # for any function, only slower).
    statics = tuple(k for k in key[3] if k[0] == "static")
    through_rules = _THROUGH_RULES.get((*key[:3], statics), lambda: [False])  # one mutable flag per key
    if not through_rules[0] and isinstance(func, _CUSTOM_FUNCTIONS):
        # The function is itself a custom-derivative function (FermiNet's energy): its rule is
        # traced first, and the plain trace (the whole primal computation, a Laplacian) only if
        # the rule registers no loss.
        made = _cached_jaxpr(through_derivative_rules(func, params_index), func_args, (key, True))
        if _registers_loss(made[0].jaxpr):
            through_rules[0] = True
            return made
    if not through_rules[0]:
        made = _cached_jaxpr(func, func_args, (key, False))
        if not registers_inside_rules(made[0].jaxpr):
            return made
        through_rules[0] = True
    return _cached_jaxpr(through_derivative_rules(func, params_index), func_args, (key, True))


def _zeros(out: jax.ShapeDtypeStruct) -> Any:
    """Zeros of this shape and dtype (a key's shape and dtype as they are)."""
    return out if jax.dtypes.issubdtype(out.dtype, jax.dtypes.extended) else jnp.zeros(out.shape, out.dtype)


def abstract_outputs(func: Callable[..., Any], params_index: int = 0) -> Callable[..., Any]:
    """`func` for abstract evaluation (`eqx.filter_eval_shape`): its outputs' shapes and dtypes
    from `function_jaxpr`'s cached trace (zeros, and its static outputs) instead of computing
    them, so that a check of the outputs at `init` and the graph matcher share one trace.

    **Arguments:**

    - `func`: the function.
    - `params_index`: the position of the parameters among its arguments.

    **Returns:**

    The function of the same arguments.
    """

    def outputs(*args: Any) -> Any:
        # Through the rules or not, the trace has the function's outputs.
        _, out_struct, out_static = function_jaxpr(func, args, params_index)
        return eqx.combine(jax.tree.map(_zeros, out_struct), out_static)

    return outputs
