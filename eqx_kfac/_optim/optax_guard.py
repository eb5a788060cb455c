"""The step guard around an optax transformation: `skip_non_finite`, and `kfac_optax`'s guard.

The same `StepGuard` as `Optimizer`'s decides each update: skipped when the loss, the incoming
gradient or the outgoing update is not finite, or (`kfac_optax`) a class label of the batch is
invalid, rejected (with step rejection, which needs the loss) when the loss on the batch rises
after the update, and counted as a stall when it is below the parameters' resolution. Called outside a trace the update runs as one compiled program and
the guard's counts are checked in Python after it; inside a trace, in the program (`checked`).
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int, PyTree

from .._core.compiled import compiled
from .._core.control_flow import select_changed
from .._core.tree import all_finite, any_traced
from .guard import GuardState, StepGuard


def check_restored(state: Any, expected: type, who: str) -> None:
    """Raises `TypeError` when `state` is not an `expected` (a checkpoint restored without a
    template comes back as plain dicts)."""
    if not isinstance(state, expected):
        raise TypeError(
            f"{who}: the state is a {type(state).__name__}, not the {expected.__name__} that init "
            "made. A checkpoint restored without a template (e.g. orbax's restore without "
            "`item=`/`target=`) comes back as plain dicts: restore it into the structure of "
            "`optimizer.init(params)` (orbax: pass that as the template; Equinox: "
            "`eqx.tree_deserialise_leaves(path, optimizer.init(params))`)."
        )


class SkipNonFiniteState(eqx.Module):
    """The optax state of `skip_non_finite` and `kfac_optax` (final).

    **Fields:**

    - `inner_state`: the wrapped transformation's state.
    - `guard_state`: the step guard's `GuardState`: its counts of steps (`steps`), skipped and
      rejected steps (`total_skipped`, `total_rejected`), faults and stalls in a row
      (`consecutive_faults`, `fault_start`, `consecutive_stalls`, `stall_cause`).
    """

    inner_state: PyTree
    guard_state: GuardState

    @property
    def total_skipped(self) -> Int[Array, ""]:
        """The number of skipped updates so far (`guard_state.total_skipped`)."""
        return self.guard_state.total_skipped


class GuardedTransform(eqx.Module):
    """An optax transformation guarded by a `StepGuard` (final).

    **Fields:**

    - `inner`: the guarded transformation (with extra-arguments support).
    - `guard`: the `StepGuard`.
    - `loss`: `loss(params, extra_args)`, the loss on the step's batch at `params`, for step
      rejection (`None`: no step rejection). Without rejection the guard checks the `value=`
      passed to `update` only.
    - `kept_unless_applied`: where the inner state keeps what only an applied step may change
      (the momentum, a direction's state such as `EigenbasisAdam`'s moments), as a node or a
      tuple of nodes for `eqx.tree_at`; or `None`.
    - `advance_on_fault`: a step that is not applied but whose loss and gradient are finite (and
      labels valid) keeps only what `kept_unless_applied` selects and lets the rest of the inner
      state (counters, curvature statistics) move on, as `Optimizer` does; otherwise it keeps the
      whole inner state.
    - `targets_in_range`: `targets_in_range(params, extra_args)`, whether the step's batch has no
      invalid label (`Preconditioner.targets_in_range`; `None`: not checked). A batch with one is
      skipped and keeps the whole inner state.
    """

    inner: optax.GradientTransformationExtraArgs
    guard: StepGuard
    loss: Callable[[Any, dict[str, Any]], Any] | None = None
    kept_unless_applied: Callable[[Any], Any] | None = None
    advance_on_fault: bool = eqx.field(static=True, default=False)
    targets_in_range: Callable[[Any, dict[str, Any]], Any] | None = None

    def init(self, params: PyTree) -> SkipNonFiniteState:
        return SkipNonFiniteState(self.inner.init(params), self.guard.init())

    def update(
        self, updates: PyTree, state: Any, params: PyTree = None, **extra_args: Any
    ) -> tuple[PyTree, SkipNonFiniteState]:
        """The guarded update: inside a trace with the guard's check in the program; otherwise
        one compiled program, and the check in Python after it (no host callback)."""
        if any_traced((updates, state, params, extra_args)):
            return self._update(updates, state, params, True, **extra_args)
        new_updates, new_state = _compiled_update(self, updates, state, params, False, **extra_args)
        self.guard.check(new_state.guard_state)
        return new_updates, new_state

    def _update(
        self, updates: PyTree, state: Any, params: PyTree, check: bool, **extra_args: Any
    ) -> tuple[PyTree, SkipNonFiniteState]:
        check_restored(state, SkipNonFiniteState, "eqx_kfac (kfac_optax / skip_non_finite)")
        value = extra_args.get("value")
        # Without `value=`, the loss is evaluated only where step rejection compares it: XLA does
        # not always merge that forward pass with the caller's (Flax's lm1b step took 15% longer
        # with it; tests/test_optax_guard_cost.py), and a loss that is not finite makes the
        # gradient so, which the guard checks.
        if value is None and self.loss is not None and self.guard.reject_loss_increase:
            value = self.loss(params, extra_args)
            extra_args = {**extra_args, "value": value}
        new_updates, new_inner = self.inner.update(updates, state.inner_state, params, **extra_args)
        new_loss = None
        if self.guard.reject_loss_increase:
            new_loss = self.loss(optax.apply_updates(params, new_updates), extra_args)
        loss = jnp.zeros(()) if value is None else jnp.asarray(value)
        valid = None if self.targets_in_range is None else self.targets_in_range(params, extra_args)
        decision = self.guard.decide(loss, updates, new_updates, new_loss, params, valid)
        applied = decision.applied
        new_updates = jax.tree.map(lambda u: jnp.where(applied, u, jnp.zeros_like(u)), new_updates)
        batch_finite = jnp.isfinite(loss) & all_finite(updates)
        if valid is not None:
            batch_finite &= valid
        guard_state = self.guard.update(state.guard_state, decision)
        if check:
            guard_state = self.guard.checked(guard_state)
        inner = self._kept(applied, batch_finite, new_inner, state.inner_state)
        return new_updates, SkipNonFiniteState(inner, guard_state)

    def _kept(self, applied: Array, batch_finite: Array, new: PyTree, old: PyTree) -> PyTree:
        """The inner state after a step (see `advance_on_fault`)."""
        if not self.advance_on_fault:
            return select_changed(applied, new, old)
        if self.kept_unless_applied is not None:
            where = self.kept_unless_applied
            new = eqx.tree_at(where, new, select_changed(applied, where(new), where(old)))
        return select_changed(batch_finite, new, old)


@compiled
def _compiled_update(
    transform: GuardedTransform, updates: PyTree, state: Any, params: PyTree, check: bool,
    **extra_args: Any,
) -> tuple[PyTree, SkipNonFiniteState]:
    return transform._update(updates, state, params, check, **extra_args)


def skip_non_finite(
    inner: optax.GradientTransformation,
    max_consecutive_faults: int | None = 20,
    *,
    max_consecutive_stalls: int | None = 50,
    stop_in_program: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax transformation so that a step with anything non-finite changes nothing.

    Unlike `optax.apply_if_finite`, which only looks at the incoming gradient, the step is skipped
    (zero updates, the inner state kept as it was) when the incoming gradient, the outgoing
    updates, or the loss passed as `value=` (optax's convention; when given) are not finite: the
    outgoing updates see what a K-FAC preconditioner made of them (a failed solve, a curvature
    estimate that overflowed). After `max_consecutive_faults` skipped steps in a row, or
    `max_consecutive_stalls` applied steps in a row whose updates are below the parameters'
    resolution (zero, or of norm at most `eps` times the parameters'; `params` must be passed to
    `update` for the second), the run stops with an error that says what happened. Called outside
    `jit`, the update is one compiled program and the error is raised in Python after it; inside
    your `jit` it is raised at run time by a host callback, which JAX 0.10's persistent
    compilation cache does not store (0.11 and later do): to have your jitted step stored there,
    pass `max_consecutive_faults=None` and call `eqx_kfac.check_consecutive_faults(state, n)`
    after each step instead (under JAX 0.10, tracing the step with the cache on and the check
    compiled in warns).

    **Arguments:**

    - `inner`: the transformation to guard (e.g. a chain with `kfac_preconditioner`).
    - `max_consecutive_faults`: the number of skipped steps in a row that raises (`None`: not
      checked in the program, neither are the stalls; see above).
    - `max_consecutive_stalls`: the number of stalled steps in a row that raises (`None`: never).
    - `stop_in_program`: inside your `jit`, raise from the program (see above).

    **Returns:**

    An `optax.GradientTransformationExtraArgs` whose state is a `SkipNonFiniteState`.
    """
    guard = StepGuard(
        max_consecutive_faults=max_consecutive_faults, max_consecutive_stalls=max_consecutive_stalls,
        stop_in_program=stop_in_program,
    )
    guarded = GuardedTransform(optax.with_extra_args_support(inner), guard)
    return optax.GradientTransformationExtraArgs(guarded.init, guarded.update)
