"""`ValueFunction`: the user's loss function in the form `Optimizer` calls it."""

from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._core import distributed as _distributed


def recover_value_func(value_and_grad_func: Callable[..., Any]) -> Callable[..., Any] | None:
    """The loss function behind `value_and_grad_func`, from its `__wrapped__` chain.

    `jax.value_and_grad`, `eqx.filter_value_and_grad`, `jax.jit` and `functools.wraps` set
    `__wrapped__`. The chain is followed through plain wrappers but stops at a `jax.custom_jvp` /
    `jax.custom_vjp` function: its own `__wrapped__` is the bare primal, which would lose the
    registrations made inside the derivative rule (FermiNet registers `log|ψ|` in the JVP rule of
    its energy).

    **Arguments:**

    - `value_and_grad_func`: the function given to `Optimizer`.

    **Returns:**

    The loss function, or `None` when there is no `__wrapped__`.
    """
    func = getattr(value_and_grad_func, "__wrapped__", None)
    while func is not None and not isinstance(func, (jax.custom_jvp, jax.custom_vjp)):
        inner = getattr(func, "__wrapped__", None)
        if inner is None:
            break
        func = inner
    return func


class ValueFunction(eqx.Module):
    """The loss function, its gradient and the forms of their arguments and outputs (final).

    **Fields:**

    - `value_and_grad`: `value_and_grad(params, [func_state], [rng], batch) -> (out, grads)`.
    - `value`: the loss function itself (same arguments, returns `out`).
    - `for_estimator`: the function whose registrations the estimator traces.
    - `has_aux`, `has_state`, `has_rng`: the forms: `out` is `loss`, `(loss, aux)`,
      `(loss, func_state)` or `(loss, (func_state, aux))`; `rng` comes before the batch.
    - `process_batch`: applied to every batch before use, or `None`.
    """

    value_and_grad: Callable[..., Any] = eqx.field(static=True)
    value: Callable[..., Any] = eqx.field(static=True)
    for_estimator: Callable[..., Any] = eqx.field(static=True)
    has_aux: bool = eqx.field(static=True)
    has_state: bool = eqx.field(static=True)
    has_rng: bool = eqx.field(static=True)
    process_batch: Callable[[Any], Any] | None = eqx.field(static=True)

    def process(self, batch: PyTree) -> PyTree:
        """The batch after `process_batch`."""
        return batch if self.process_batch is None else self.process_batch(batch)

    def keys(
        self, rng: PRNGKeyArray, axis_name: Hashable | None
    ) -> tuple[PRNGKeyArray, PRNGKeyArray | None]:
        """This device's key for the curvature's sampling, and one for the function's randomness
        (`None` without `has_rng`)."""
        rng = _distributed.fold_in_device(rng, axis_name)
        return tuple(jax.random.split(rng)) if self.has_rng else (rng, None)

    def keyed_args(
        self, params: PyTree, func_state: PyTree, rng: PRNGKeyArray, batch: PyTree, axis_name: Hashable | None
    ) -> tuple[PRNGKeyArray, tuple[Any, ...]]:
        """This device's key for the curvature's sampling, and the function's arguments with its
        own key (`keys`, then `args`): as the step makes them, so that a trace made elsewhere
        (`init`'s) is the step's."""
        key, func_key = self.keys(rng, axis_name)
        return key, self.args(params, func_state, func_key, batch)

    def args(self, params: PyTree, func_state: PyTree, rng: Any, batch: PyTree) -> tuple[Any, ...]:
        """The function's arguments `(params, [func_state], [rng], batch)`."""
        args = (params,)
        if self.has_state:
            args += (func_state,)
        if self.has_rng:
            args += (rng,)
        return args + (batch,)

    def loss_of(self, out: Any) -> Array:
        """The loss value in the function's output."""
        return out[0] if (self.has_aux or self.has_state) else out

    def split(self, out: Any) -> tuple[Array, Any, Any]:
        """`(loss, func_state, aux)` of the function's output (`None` where absent)."""
        if not (self.has_aux or self.has_state):
            return out, None, None
        loss, other = out
        if self.has_aux and self.has_state:
            return loss, other[0], other[1]
        if self.has_aux:
            return loss, None, other
        return loss, other, None
