"""A small jaxpr evaluator with a per-equation hook, shared by the tracer and the graph matcher.

`eval_jaxpr(closed_jaxpr, args, hook)` evaluates a `ClosedJaxpr` on concrete or traced values,
equation by equation, and returns the list of output values. Before evaluating an equation it calls
the hook; the hook may replace the equation's evaluation.

**The hook API.**

- `hook(eqn, invals) -> outvals | None`: `eqn` is the `JaxprEqn` about to be evaluated and `invals`
  the list of values of `eqn.invars` (literals already replaced by their values). Return `None` to
  evaluate the equation normally, or a list with one value per `eqn.outvars` to use instead (the
  hook may bind other primitives, e.g. insert a tag, to compute them). A plain function works.
- Higher-order equations are not passed to the hook as a whole; the evaluator descends into them
  and calls the hook on their inner equations:
  - `jit`/`pjit`/`closed_call`/`core_call`: inlined.
  - `remat2` (`jax.checkpoint`, `eqx.filter_checkpoint`): the evaluation of the inner jaxpr is
    wrapped again in `jax.checkpoint` with the same `policy` and `prevent_cse`. What the hook
    records while the body is evaluated are values of the checkpoint's own trace, which must not
    be kept past it: the evaluator calls `token = hook.begin_remat(eqn)` before the body and
    `recorded = hook.end_remat(token)` after it (both inside the checkpointed function;
    `end_remat` removes from the hook what it recorded since `begin_remat` and returns it as a
    PyTree), returns the array leaves of `recorded` as extra outputs of the checkpointed function,
    and calls `hook.exit_remat(eqn, recorded)` outside it with those outputs in their place. The
    hook may read values of the enclosing evaluation inside the body (`jax.checkpoint` takes them
    as inputs).
  - `custom_jvp_call`/`custom_vjp_call`: bound as they are (keeping their custom derivative rules,
    the hook is not called inside) unless `hook.descend_into(eqn)` is true, in which case the
    primal jaxpr is inlined (its custom derivative rule is then replaced by ordinary autodiff).
    For a `JaxprHook` that does not override `descend_into`, this is true when the primal jaxpr
    (recursively) contains an equation for which `hook.matches(eqn)` is true (`matches` is false
    for every equation by default); for a plain function hook it is always false.
  - `scan`: re-expressed as `jax.lax.scan` (same `length`, `reverse`, `unroll`) over a Python body
    that evaluates the body jaxpr with the hook (the hook may be called more than once per scan
    equation if JAX traces the body again).
  - Any other equation (`cond`, `while`, ...) is bound as it is; the hook is not called inside.
- Inside a scan body, a `JaxprHook` can take extra per-iteration inputs and give extra per-iteration
  outputs: before the scan, `xs = hook.enter_scan(eqn)` returns a PyTree of arrays with leading
  axis `length` (or `None`); in each iteration the evaluator calls `hook.begin_iteration(x)` with
  that iteration's slice, evaluates the body, and calls `ys = hook.end_iteration()` to get a PyTree
  of per-iteration values; after the scan it calls `hook.exit_scan(eqn, stacked_ys)` with those
  values stacked along a leading `length` axis. The hook keeps its own stack for nested scans.
- `hook.evaluates(eqn)` (true by default) is asked first, for every equation: when it is false
  the equation is not evaluated at all and its outputs get the placeholder `SKIPPED` (the tracer
  skips what the registered losses do not depend on). An evaluated equation that reads a
  `SKIPPED` value gets zeros of its type instead, so skip only equations whose outputs do not
  matter; `eval_jaxpr` may return `SKIPPED` for some outputs.
- `current_path()` returns, during evaluation, the positions of the enclosing equations from the
  top-level jaxpr down to the equation being evaluated, e.g. `(3, 0, 5)` for equation 5 of the
  scan body of equation 0 of the `jit` at equation 3. Paths are stable across evaluations of the
  same jaxpr, so they identify an equation occurrence (the same sub-jaxpr object called twice
  gives two paths).
"""

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, JaxprEqn, Literal, Var

_CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call"})
_CUSTOM_PRIMITIVES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


class _Skipped:
    def __repr__(self) -> str:
        return "SKIPPED"


SKIPPED = _Skipped()
"""The value of the outputs of an equation the hook chose not to evaluate."""


class JaxprHook:
    """Base class for hooks of `eval_jaxpr` that need more than a plain function.

    Override `__call__` to intercept equations, `matches` (or `descend_into`) to have the
    evaluator descend into custom-derivative functions, the scan methods to thread extra
    per-iteration inputs and outputs through interpreted scans, and the remat methods to hand what
    it records inside a checkpointed body out of it (see the module docstring).
    """

    def __call__(self, eqn: JaxprEqn, invals: list[Any]) -> list[Any] | None:
        """Returns the outputs to use for `eqn`, or `None` to evaluate it normally."""
        return None

    def matches(self, eqn: JaxprEqn) -> bool:
        """Whether the hook is interested in `eqn` (used to decide descending into custom calls)."""
        return False

    def evaluates(self, eqn: JaxprEqn) -> bool:
        """Whether to evaluate `eqn` at all (otherwise its outputs are `SKIPPED`)."""
        return True

    def descend_into(self, eqn: JaxprEqn) -> bool:
        """Whether to inline the primal jaxpr of a custom_jvp/custom_vjp equation."""
        return any(self.matches(e) for e in iter_eqns(eqn.params["call_jaxpr"].jaxpr))

    def enter_scan(self, eqn: JaxprEqn) -> Any:
        """Returns extra stacked per-iteration inputs for the scan `eqn` (or `None`)."""
        return None

    def begin_iteration(self, xs: Any) -> None:
        """Receives one iteration's slice of what `enter_scan` returned."""

    def end_iteration(self) -> Any:
        """Returns extra per-iteration outputs of the iteration being traced (or `None`)."""
        return None

    def exit_scan(self, eqn: JaxprEqn, ys: Any) -> None:
        """Receives the stacked extra per-iteration outputs of the scan `eqn`."""

    def begin_remat(self, eqn: JaxprEqn) -> Any:
        """Called inside the checkpointed function before the body of the remat `eqn`; returns a
        token for `end_remat`."""
        return None

    def end_remat(self, token: Any) -> Any:
        """Removes and returns (a PyTree) what the hook recorded since `begin_remat` gave `token`."""
        return None

    def exit_remat(self, eqn: JaxprEqn, recorded: Any) -> None:
        """Receives, outside the checkpoint, what `end_remat` returned, as outputs of the remat `eqn`."""


class _FunctionHook(JaxprHook):
    def __init__(self, fn: Callable[[JaxprEqn, list[Any]], list[Any] | None]):
        self.fn = fn

    def __call__(self, eqn, invals):
        return self.fn(eqn, invals)

    def descend_into(self, eqn):
        # A plain function cannot say what it matches; keep the custom rules.
        return False


def iter_eqns(jaxpr: Jaxpr) -> Iterator[JaxprEqn]:
    """Yields all equations of `jaxpr` and, recursively, of the jaxprs in their parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in subjaxprs(eqn):
            yield from iter_eqns(sub)


def subjaxprs(eqn: JaxprEqn) -> Iterator[Jaxpr]:
    """Yields the jaxprs found in an equation's parameters (e.g. a scan body, cond branches)."""
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, Jaxpr):
                yield v


def scan_consts_and_carry(eqn: JaxprEqn) -> tuple[int, int]:
    """The numbers of consts and of carries among a `scan` equation's invars (the rest are its xs)."""
    if "num_consts" in eqn.params:  # JAX 0.10 and older
        return eqn.params["num_consts"], eqn.params["num_carry"]
    # JAX 0.11 (jax-ml/jax 08958bd) groups the invars as a FlatTree `ft_in` of (consts, carry, xs).
    consts, carry, _ = eqn.params["ft_in"].unpack()
    return len(consts), len(carry)


_STATE = threading.local()


def current_path() -> tuple[int, ...]:
    """The positions of the enclosing equations and of the equation being evaluated."""
    return tuple(getattr(_STATE, "path", ()))


@contextlib.contextmanager
def _at(index: int) -> Iterator[None]:
    path = getattr(_STATE, "path", [])
    _STATE.path = path
    path.append(index)
    try:
        yield
    finally:
        path.pop()


def eval_jaxpr(
    closed_jaxpr: ClosedJaxpr,
    args: Sequence[Any],
    hook: JaxprHook | Callable[[JaxprEqn, list[Any]], list[Any] | None] | None = None,
) -> list[Any]:
    """Evaluates a closed jaxpr, calling `hook` on each equation (see the module docstring).

    **Arguments:**

    - `closed_jaxpr`: the jaxpr to evaluate.
    - `args`: one value per input variable.
    - `hook`: a `JaxprHook`, a function `hook(eqn, invals) -> outvals | None`, or `None`.

    **Returns:**

    The list of output values.
    """
    if hook is None:
        hook = JaxprHook()
    elif not isinstance(hook, JaxprHook):
        hook = _FunctionHook(hook)
    return _eval(closed_jaxpr.jaxpr, closed_jaxpr.consts, args, hook)


def _eval(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], hook: JaxprHook) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    if len(args) != len(jaxpr.invars):
        raise ValueError(f"The jaxpr takes {len(jaxpr.invars)} arguments, got {len(args)}.")
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for index, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        with _at(index):
            outvals = _eval_eqn(eqn, invals, hook)
        for v, val in zip(eqn.outvars, outvals):
            env[v] = val
    return [read(v) for v in jaxpr.outvars]


def _eval_eqn(eqn: JaxprEqn, invals: list[Any], hook: JaxprHook) -> Any:
    name = eqn.primitive.name
    if not hook.evaluates(eqn):
        return [SKIPPED] * len(eqn.outvars)
    # An input that only skipped equations would have used: any value of its type will do.
    invals = [jnp.zeros(v.aval.shape, v.aval.dtype) if x is SKIPPED else x for v, x in zip(eqn.invars, invals)]
    if name in _CALL_PRIMITIVES:
        sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        return _eval_sub(sub, invals, hook)
    if name == "remat2":
        return _eval_remat(eqn, invals, hook)
    if name in _CUSTOM_PRIMITIVES and hook.descend_into(eqn):
        return _eval_sub(eqn.params["call_jaxpr"], invals, hook)
    if name == "scan":
        return _eval_scan(eqn, invals, hook)
    outvals = hook(eqn, invals)
    if outvals is not None:
        return list(outvals)
    return _bind(eqn, invals)


def _bind(eqn: JaxprEqn, invals: list[Any]) -> list[Any]:
    # Evaluating a one-equation jaxpr through the public `jax.core.eval_jaxpr` keeps us independent of
    # how primitives spell their bind parameters (`get_bind_params` changed across JAX releases).
    invars = [Var(v.aval) for v in eqn.invars]
    outvars = [Var(v.aval) for v in eqn.outvars]
    debug = DebugInfo("eqx_kfac", eqn.primitive.name, None, None)
    jaxpr = Jaxpr([], invars, outvars, [eqn.replace(invars=invars, outvars=outvars)], eqn.effects, debug)
    return jax.core.eval_jaxpr(jaxpr, [], *invals)


def _eval_remat(eqn: JaxprEqn, invals: list[Any], hook: JaxprHook) -> list[Any]:
    body = eqn.params["jaxpr"]
    skipped: list[bool] = []
    recorded_static: list[Any] = []

    def remat_body(*xs):
        # Only arrays may leave `jax.checkpoint`, and only as outputs: skipped outputs are put back
        # outside it, and what the hook recorded inside leaves it as outputs too (kept aside, it
        # would be a tracer of the checkpoint's trace, leaked into the caller's).
        token = hook.begin_remat(eqn)
        outs = _eval(body, [], xs, hook)
        recorded, static = eqx.partition(hook.end_remat(token), eqx.is_array)
        skipped[:] = [o is SKIPPED for o in outs]
        recorded_static[:] = [static]
        return [o for o in outs if o is not SKIPPED], recorded

    checkpointed = jax.checkpoint(remat_body, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"])
    outs, recorded = checkpointed(*invals)
    hook.exit_remat(eqn, eqx.combine(recorded, recorded_static[0]))
    outs = iter(outs)
    return [SKIPPED if s else next(outs) for s in skipped]


def _eval_sub(sub: ClosedJaxpr | Jaxpr, invals: list[Any], hook: JaxprHook) -> list[Any]:
    if isinstance(sub, ClosedJaxpr):
        return _eval(sub.jaxpr, sub.consts, invals, hook)
    return _eval(sub, [], invals, hook)


def _eval_scan(eqn: JaxprEqn, invals: list[Any], hook: JaxprHook) -> list[Any]:
    params = eqn.params
    body: ClosedJaxpr = params["jaxpr"]
    n_consts, n_carry = scan_consts_and_carry(eqn)
    consts, init, xs = invals[:n_consts], invals[n_consts : n_consts + n_carry], invals[n_consts + n_carry :]
    extra_xs = hook.enter_scan(eqn)
    path = current_path()

    def step(carry, x):
        x_orig, x_extra = x
        # lax.scan traces the body outside of `_eval`'s dynamic extent; restore the path.
        saved = getattr(_STATE, "path", [])
        _STATE.path = list(path)
        try:
            hook.begin_iteration(x_extra)
            outs = _eval(body.jaxpr, body.consts, [*consts, *carry, *x_orig], hook)
            extra_ys = hook.end_iteration()
        finally:
            _STATE.path = saved
        return outs[:n_carry], (outs[n_carry:], extra_ys)

    carry, (ys, extra_ys) = jax.lax.scan(
        step,
        list(init),
        (list(xs), extra_xs),
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
    )
    hook.exit_scan(eqn, extra_ys)
    return [*carry, *ys]
