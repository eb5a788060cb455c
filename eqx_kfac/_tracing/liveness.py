"""Liveness: which equations and values of a traced function the registered losses depend on.

The curvature of the registered losses only involves the part of the function their inputs are
computed from. A regulariser added to the loss value, a metric returned beside it, or the local
energy of variational Monte Carlo (which evaluates the network again, inside `jax.grad` and
`jax.hessian`, to form a Laplacian) lies outside it. `liveness` walks a jaxpr backwards from the
loss tags (or, in a function that registers no loss, from its outputs) and records, for the
jaxpr and for each sub-jaxpr it descends into, which equations are *live* (some output reaches a
registered loss, or it is or contains a loss tag) and which of their inputs are. Uses:

- the graph matcher counts only live uses of a parameter and matches only live computations;
- the tracer ignores layer tags that are not live (the registrations the losses depend on define
  the blocks, as in kfac-jax) and evaluates only live equations when it differentiates the
  function for the curvature (which also spares it the dead part's derivative rules).

A sub-jaxpr is described under the path of the equation holding it (as `current_path()` of
`jaxpr_interpreter` numbers equations). A live `scan` keeps its whole body live, since its carries
feed the next step.
"""

from collections.abc import Callable, Iterable

import equinox as eqx
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Var

from .jaxpr_interpreter import iter_eqns, subjaxprs
from .tags import is_loss_tag_eqn

# The sub-jaxprs a walk descends into; their invars are the equation's invars, in order.
_ONE_TO_ONE = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat2": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "call_jaxpr",
    "scan": "jaxpr",
}


class Liveness(eqx.Module):
    """What the registered losses depend on in one jaxpr (final).

    **Fields:**

    - `inputs`: for every equation (by index), the positions of its inputs that are live.
    - `outputs`: the positions of the jaxpr's outputs that are live.
    - `eqns`: the indices of the live equations.
    - `invars`: the positions of the jaxpr's inputs that are live.
    """

    inputs: dict[int, frozenset[int]]
    outputs: frozenset[int]
    eqns: frozenset[int]
    invars: frozenset[int]


LiveTable = dict[tuple[int, ...], Liveness]


def inner_jaxpr(eqn: JaxprEqn) -> Jaxpr | None:
    """The sub-jaxpr that the walks descend into (its invars are the equation's), or `None`."""
    key = _ONE_TO_ONE.get(eqn.primitive.name)
    if key is None:
        return None
    sub = eqn.params[key]
    return sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub


def has_loss_tag(jaxprs: Iterable[Jaxpr]) -> bool:
    """Whether any of `jaxprs` (or a jaxpr nested in them) binds the loss tag."""
    return any(is_loss_tag_eqn(e) for jaxpr in jaxprs for e in iter_eqns(jaxpr))


def liveness(jaxpr: Jaxpr, opaque: Callable[[JaxprEqn], bool] | None = None) -> LiveTable:
    """Finds the live equations and values of a function's jaxpr.

    **Arguments:**

    - `jaxpr`: the function's jaxpr.
    - `opaque`: equations not to descend into although they hold a sub-jaxpr (they are then live
      with all their inputs as soon as one output is): the tracer binds custom-derivative
      functions without tags as a whole. `None`: descend into all of them.

    **Returns:**

    A `Liveness` per path: `()` for `jaxpr` itself, the path of the equation holding each
    sub-jaxpr descended into.
    """
    table: LiveTable = {}
    outs = frozenset() if has_loss_tag((jaxpr,)) else frozenset(range(len(jaxpr.outvars)))
    _walk(jaxpr, outs, (), table, opaque or (lambda eqn: False))
    return table


def live_paths(table: LiveTable) -> frozenset[tuple[int, ...]]:
    """The paths of all live equations of a `liveness` table."""
    return frozenset((*prefix, i) for prefix, live in table.items() for i in live.eqns)


def _walk(
    jaxpr: Jaxpr,
    live_outs: frozenset[int],
    prefix: tuple[int, ...],
    table: LiveTable,
    opaque: Callable[[JaxprEqn], bool],
) -> frozenset[int]:
    """Records the liveness of `jaxpr` (and of what it descends into) given its live outputs, and
    returns the live positions of `jaxpr.invars`."""
    live = {v for k, v in enumerate(jaxpr.outvars) if k in live_outs and isinstance(v, Var)}
    inputs: dict[int, frozenset[int]] = {}
    eqns: set[int] = set()
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        outs = frozenset(k for k, v in enumerate(eqn.outvars) if v in live)
        inner = None if opaque(eqn) else inner_jaxpr(eqn)
        if inner is not None:
            if outs and eqn.primitive.name == "scan":
                # The carries feed the next step, so a live scan keeps its whole body live.
                outs = frozenset(range(len(inner.outvars)))
            positions = _walk(inner, outs, (*prefix, i), table, opaque)
            is_live = bool(outs) or bool(table[(*prefix, i)].eqns)
        else:
            is_live = bool(outs) or is_loss_tag_eqn(eqn) or has_loss_tag(subjaxprs(eqn))
            positions = frozenset(range(len(eqn.invars))) if is_live else frozenset()
        inputs[i] = positions
        if is_live:
            eqns.add(i)
        live.update(v for k in positions if isinstance(v := eqn.invars[k], Var))
    invars = frozenset(k for k, v in enumerate(jaxpr.invars) if v in live)
    table[prefix] = Liveness(inputs, live_outs, frozenset(eqns), invars)
    return invars
