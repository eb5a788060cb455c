"""`host_built`: a program whose outputs are mostly constants, its constants made on the host.

An optimizer's initial state is mostly zeros, identities and counters, and compiling the program
that creates it was most of what building it cost: XLA compiles a kernel per output
(FermiNet's He state, 64 arrays: 0.10 s of a 0.95 s `init`; 64 arrays of zeros compile in
0.33 s with `ONE_OFF_COMPILER_OPTIONS`, against 3 ms to put them on the device from NumPy).
`host_built(fn)` traces `fn` once per argument signature and evaluates with NumPy every output
that depends on none of its array arguments through a few exact operations (broadcasts, dtype
conversions, iotas, comparisons, selections, reshapes: no rounding that XLA could do otherwise).
Each is put where the program would have put it, with the sharding its compiled output reports:
its sharding constraint's (without mesh axes of size 1), or, in a program without constraints,
the one device the arguments are committed to, else the default device, uncommitted. Only the
other outputs (keys split from a PRNG argument, copies of the parameters) are compiled, as one
program, cached with the trace. Where that placement cannot be told without compiling (an
unconstrained output of a program with constraints or of arguments on several devices) or an
output is weakly typed, the output is compiled with the rest.
"""

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, jaxpr_as_fun, Literal
from jax.interpreters import partial_eval as pe

from .._core.lru_cache import LRUCache
from .._core.tree import any_traced
from .jaxpr_interpreter import iter_eqns


def _broadcast_in_dim(x: np.ndarray, *, shape: Sequence[int], broadcast_dimensions: Sequence[int], **_) -> np.ndarray:
    kept = dict(zip(broadcast_dimensions, x.shape))
    return np.broadcast_to(np.reshape(x, [kept.get(d, 1) for d in range(len(shape))]), shape)


def _iota(*, dtype: Any, shape: Sequence[int], dimension: int, **_) -> np.ndarray:
    along = np.arange(shape[dimension], dtype=dtype)
    return np.broadcast_to(np.reshape(along, [-1 if d == dimension else 1 for d in range(len(shape))]), shape)


def _convert(x: np.ndarray, *, new_dtype: Any, **_: Any) -> np.ndarray | None:
    """`x` in `new_dtype`, where NumPy converts as XLA does: not a complex number to a real, nor
    a float that is not finite or out of range to an integer."""
    x = np.asarray(x)
    if np.iscomplexobj(x) and not np.issubdtype(new_dtype, np.complexfloating):
        return None
    if np.issubdtype(x.dtype, np.inexact) and np.issubdtype(new_dtype, np.integer):
        limits = np.iinfo(new_dtype)
        if not (np.all(np.isfinite(x)) and np.all((x >= limits.min) & (x <= limits.max))):
            return None
    return x.astype(new_dtype)


def _select_n(which: np.ndarray, *cases: np.ndarray) -> np.ndarray:
    return np.choose(np.asarray(which, np.int32), np.broadcast_arrays(*cases))


def _exact(op: Callable[..., np.ndarray], integers_only: bool = True) -> Callable[..., np.ndarray | None]:
    """`op` where it is exact: on integer or boolean operands (wrapping around as XLA's does), or
    on any (a comparison) unless `integers_only`; `None` (not evaluated on the host) otherwise."""

    def rule(*xs: np.ndarray, **_: Any) -> np.ndarray | None:  # (parameters such as a result's dtype: checked after)
        exact = not integers_only or all(np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_ for x in xs)
        return op(*xs) if exact else None

    return rule


# The operations evaluated on the host: exact in NumPy as in XLA (no arithmetic that rounds).
_RULES: dict[str, Callable[..., np.ndarray | None]] = {
    "broadcast_in_dim": _broadcast_in_dim,
    "convert_element_type": _convert,
    "iota": _iota,
    "select_n": _select_n,
    "reshape": lambda x, *, new_sizes, **_: np.reshape(x, new_sizes),
    "squeeze": lambda x, *, dimensions: np.squeeze(x, axis=tuple(dimensions)),
    "transpose": lambda x, *, permutation: np.transpose(x, permutation),
    "concatenate": lambda *xs, dimension: np.concatenate(xs, axis=dimension),
    "copy": np.array,
    "copy_p": np.array,
    **{name: _exact(op, integers_only=False) for name, op in dict(
        eq=np.equal, ne=np.not_equal, lt=np.less, le=np.less_equal, gt=np.greater, ge=np.greater_equal,
    ).items()},
    **{name: _exact(op) for name, op in dict(
        add=np.add, sub=np.subtract, mul=np.multiply, neg=np.negative, max=np.maximum, min=np.minimum,
        **{"and": np.bitwise_and, "or": np.bitwise_or, "not": np.invert, "xor": np.bitwise_xor},
    ).items()},
}


def _numpy_dtype(aval: Any) -> bool:
    return not jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)


def _read(values: dict[Any, np.ndarray], v: Any) -> np.ndarray | None:
    """`v`'s host value, `None` if it has none (a jaxpr's literals are not hashable: read apart)."""
    if isinstance(v, Literal):
        return np.asarray(v.val, dtype=v.aval.dtype) if _numpy_dtype(v.aval) else None
    return values.get(v)


def _host_values(jaxpr: Jaxpr, values: dict[Any, np.ndarray]) -> dict[Any, Any]:
    """Adds to `values` (the host values of some of `jaxpr`'s variables) those of every variable
    computed from them by `_RULES` (nested `jit`s included); returns the sharding constraint on
    each constrained one."""
    constrained: dict[Any, Any] = {}
    for eqn in jaxpr.eqns:
        ins = [_read(values, v) for v in eqn.invars]
        if any(x is None for x in ins):
            continue
        name = eqn.primitive.name
        if name == "sharding_constraint":
            (values[eqn.outvars[0]],) = ins
            constrained[eqn.outvars[0]] = _as_compiled(eqn.params["sharding"])
        elif name in ("jit", "pjit"):  # (a nested `jit`: "pjit" before JAX 0.10)
            inner = eqn.params["jaxpr"]
            inner_values = _known(inner.jaxpr.constvars, inner.consts) | dict(zip(inner.jaxpr.invars, ins))
            _host_values(inner.jaxpr, inner_values)
            for o, i in zip(eqn.outvars, inner.jaxpr.outvars):
                if (value := _read(inner_values, i)) is not None:
                    values[o] = value
        elif name in _RULES:
            (aval,) = (o.aval for o in eqn.outvars)
            try:
                out = _RULES[name](*ins, **eqn.params)
            except Exception:  # noqa: BLE001 -- a case the rule does not cover: compiled instead
                out = None
            if out is not None and _numpy_dtype(aval) and np.shape(out) == aval.shape:
                values[eqn.outvars[0]] = np.asarray(out).astype(aval.dtype, copy=False)
    return constrained


def _known(constvars: Sequence[Any], consts: Sequence[Any]) -> dict[Any, np.ndarray]:
    """The host values of a jaxpr's constants (not those of another trace, nor keys)."""
    return {
        v: np.asarray(c) for v, c in zip(constvars, consts)
        if _numpy_dtype(v.aval) and not isinstance(c, jax.core.Tracer)
    }


def _default_placement(dynamic: Sequence[Any]) -> Any:
    """Where `jit` puts an unconstrained output of these arguments: the device they are committed
    to, `None` for the default device (uncommitted), or `False` when that depends on compiling
    (arguments on several devices)."""
    arrays = [x for x in dynamic if isinstance(x, jax.Array)]
    if any(len(x.sharding.device_set) != 1 for x in arrays):
        return False
    committed = {next(iter(x.sharding.device_set)) for x in arrays if x.committed}
    if len(committed) > 1:
        return False
    return jax.sharding.SingleDeviceSharding(committed.pop()) if committed else None


def _as_compiled(sharding: Any) -> Any:
    """A constraint's sharding as a compiled program's output reports it: a `NamedSharding`'s
    spec without the mesh axes of size 1 and without trailing `None`s (the same layout, but not
    an equal sharding, and a step compiled for one is another program: FermiNet's first step
    through the drop-in took 1.3 s longer on `P('qmc_pmap_axis')` over one device than on `P()`)."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    spec = []
    for entry in sharding.spec:
        names = tuple(n for n in (entry if isinstance(entry, tuple) else (entry,)) if n is not None)
        kept = tuple(n for n in names if sharding.mesh.shape[n] > 1)
        if not kept:
            spec.append(None)
        else:
            spec.append(kept if isinstance(entry, tuple) else kept[0])
    while spec and spec[-1] is None:
        spec.pop()
    return sharding.update(spec=jax.sharding.PartitionSpec(*spec))


class _Plan(eqx.Module):
    """A traced program: which outputs are made on the host (by position, with their shardings),
    and the compiled program of the others with the inputs it uses. (The host values are made
    again at each call: an identity matrix of a large layer is no memory kept.)"""

    program: ClosedJaxpr
    host: dict[int, Any]
    compiled: Callable[..., Any] | None
    used_inputs: tuple[bool, ...]
    out_struct: Any
    out_static: Any


def _host_outputs(program: ClosedJaxpr) -> tuple[list[np.ndarray | None], dict[Any, Any]]:
    """Each output's host value (`None` where it has none), and the constrained variables' shardings."""
    values = _known(program.jaxpr.constvars, program.consts)
    constrained = _host_values(program.jaxpr, values)
    return [_read(values, v) for v in program.jaxpr.outvars], constrained


def _plan(fn: Callable[..., Any], compiler_options: dict[str, Any], args: tuple[Any, ...], placement: Any) -> _Plan:
    closed, out_struct, out_static = eqx.filter_make_jaxpr(fn)(*args)
    # The program as it runs: without what no output depends on (a dead sharding constraint
    # included).
    jaxpr, live_inputs = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    program = ClosedJaxpr(jaxpr, closed.consts)
    if any(e.primitive.name == "sharding_constraint" for e in iter_eqns(jaxpr)):
        # A program with sharding constraints puts its unconstrained outputs where XLA decides
        # (on one device: a `NamedSharding` over the constraint's mesh).
        placement = False
    values, constrained = _host_outputs(program)
    host = {}
    for k, (v, value) in enumerate(zip(jaxpr.outvars, values)):
        sharding = placement if isinstance(v, Literal) else constrained.get(v, placement)
        placeable = sharding is None or isinstance(sharding, jax.sharding.Sharding)
        if value is not None and not v.aval.weak_type and placeable:
            host[k] = sharding
    unconstrained = [isinstance(v, Literal) or v not in constrained for v in jaxpr.outvars]
    if placement is False and any(k not in host and u for k, u in enumerate(unconstrained)):
        # (Its outputs computed apart would be on other devices: compiled whole.)
        host = {}
    rest = [k not in host for k in range(len(jaxpr.outvars))]
    compiled, used = None, [False] * len(live_inputs)
    if any(rest):
        pruned, used_live = pe.dce_jaxpr(jaxpr, rest)
        compiled = jax.jit(jaxpr_as_fun(ClosedJaxpr(pruned, closed.consts)), compiler_options=compiler_options)
        used_of_live = iter(used_live)
        used = [live and next(used_of_live) for live in live_inputs]
    return _Plan(program, host, compiled, tuple(used), out_struct, out_static)


def _run(plan: _Plan, leaves: Sequence[Any]) -> list[Any]:
    """The plan's outputs: made on the host and put on the devices (two transfers: to the
    default device, and placed), and computed by the compiled program."""
    outs: list[Any] = [None] * len(plan.program.jaxpr.outvars)
    # (Nothing evaluated on the host for a plan that compiles every output.)
    values = _host_outputs(plan.program)[0] if plan.host else []
    for placed in (False, True):
        ks = [k for k, sharding in plan.host.items() if (sharding is not None) == placed]
        if ks:
            shardings = [plan.host[k] for k in ks] if placed else None
            outs_placed = jax.device_put([values[k] for k in ks], shardings)
            for k, x in zip(ks, outs_placed):
                outs[k] = x
    if plan.compiled is not None:
        rest = iter(plan.compiled(*(x for x, u in zip(leaves, plan.used_inputs) if u)))
        outs = [next(rest) if k not in plan.host else x for k, x in enumerate(outs)]
    return outs


_PLANS = LRUCache(maxsize=32)


def host_built(fn: Callable[..., Any], compiler_options: dict[str, Any]) -> Callable[..., Any]:
    """`eqx.filter_jit(fn, compiler_options=compiler_options)`, with the outputs that depend on no
    array argument made on the host (see the module's docs); inside a caller's trace (`jit`,
    `eval_shape`, ...), `eqx.filter_jit(fn)`, traced into it.

    **Arguments:**

    - `fn`: the function (its non-array arguments static and hashable, as for `eqx.filter_jit`).
    - `compiler_options`: XLA's options for the compiled part.

    **Returns:**

    The function of the same arguments, returning what `fn` returns.
    """
    traced_into = eqx.filter_jit(fn)

    def call(*args: Any) -> Any:
        if any_traced(args):  # (inside a caller's trace: JAX takes options on an outermost `jit` only)
            return traced_into(*args)
        # (Hashed leaf by leaf, as `eqx.filter_jit` does: a module's dict field is no leaf.)
        every, treedef = jax.tree.flatten(args)
        leaves = [x for x in every if eqx.is_array(x)]
        placement = _default_placement(leaves)
        signature: Hashable = (
            fn, treedef, tuple(None if eqx.is_array(x) else x for x in every),
            tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves), placement,
        )
        plan = _PLANS.get(signature, lambda: _plan(fn, dict(compiler_options), args, placement))
        outs = _run(plan, leaves)
        return eqx.combine(jax.tree.unflatten(jax.tree.structure(plan.out_struct), outs), plan.out_static)

    return call
