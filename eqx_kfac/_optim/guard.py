"""The step guard: whether a proposed update is applied, and what happens when none is for long.

A step is *skipped* when its loss, gradient or update is not finite, and *rejected* (with step
rejection) when the loss on its batch rises after the update. Either way the parameters and the
step rule's state stay as they were. The guard counts such steps in a row and stops the run with
an error that says what happened once there are `max_consecutive_faults` of them, instead of
skipping for ever in silence: in Python after a directly called `Optimizer.step` (`check`), in
the program inside a trace (`checked`, a host callback), or in Python on any optimizer state
(`check_consecutive_faults`), which keeps a user's jitted step free of host callbacks and so
storable in JAX's persistent compilation cache.
"""

import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PyTree

from .._core.compilation_cache import persistent_cache_enabled
from .._core.tree import all_finite


class GuardState(eqx.Module):
    """The state of a `StepGuard` (final).

    **Fields:**

    - `consecutive_faults`: the number of steps in a row that were skipped or rejected.
    """

    consecutive_faults: Int[Array, ""]


class GuardDecision(eqx.Module):
    """What the guard decided about one step (final).

    **Fields:**

    - `applied`: the update is applied.
    - `skipped`: it is not, because the loss, gradient or update is not finite.
    - `rejected`: it is not, because the loss on the step's batch rose (step rejection).
    """

    applied: Bool[Array, ""]
    skipped: Bool[Array, ""]
    rejected: Bool[Array, ""]


_FAULTS_MESSAGE = (
    "eqx_kfac: {n} consecutive steps were not applied: each had a loss, gradient or update that "
    "was not finite (skipped), or a loss that rose after the update (rejected). Parameters and "
    "optimizer state are as they were before these steps. Check the batches for NaN or Inf, the "
    "model's numerics (overflow in float16/bfloat16), the loss's scale and the damping (raise "
    "initial_damping / min_damping); stats['skipped'] and stats['rejected'] show which. Rejected "
    "steps in a row are also what a run on one fixed batch can do once it has converged, when its "
    "loss is near zero and rounds by more than `rounding_tolerance` (StepGuard) units in its last "
    "place (e.g. an exact fit); there, stop training. Pass "
    "max_consecutive_faults=None to keep skipping instead of stopping."
)

_CACHE_WARNING = (
    "eqx_kfac: JAX's persistent compilation cache is on, but this jitted step will not be stored "
    "in it: the step guard's stop after max_consecutive_faults faults in a row is a host callback "
    "(eqx.error_if), and JAX does not store programs that hold one, so every process compiles the "
    "step again. To have it stored, pass max_consecutive_faults=None (to kfac_optax, "
    "skip_non_finite or Optimizer) and call "
    "eqx_kfac.check_consecutive_faults(opt_state, {n}) after each step; or call Optimizer.step "
    "outside your own jit, where the check is made in Python."
)


class StepGuard(eqx.Module):
    """Decides whether each proposed update is applied (final).

    **Fields:**

    - `skip_non_finite`: skip a step whose loss, gradient or update is not finite (else it is
      applied as it is).
    - `reject_loss_increase`: reject a step whose loss on the same batch rises after the update,
      or is not finite there (kfac-jax's `use_step_rejection`; costs one more evaluation of the
      loss per step).
    - `rounding_tolerance`: a rise of at most `rounding_tolerance · eps · |loss|` (`eps` of the
      loss's dtype) is rounding, not a rise, and does not reject the step. Without it a converged
      full-batch run rejected every step: `benchmarks/run.py`'s classifier, trained by K-FAC
      for 3,000 steps in float32, rejected rises of 1-11 units in the last place of its loss from
      step 2,046 on, and 20 in a row stopped it (its damping, doubled at each, overflowed to
      `inf` by step 2,500 with the limit off).
    - `max_consecutive_faults`: stop with an error after this many skipped or rejected steps in a
      row (`None`: never).
    """

    skip_non_finite: bool = eqx.field(static=True, default=True)
    reject_loss_increase: bool = eqx.field(static=True, default=False)
    max_consecutive_faults: int | None = eqx.field(static=True, default=20)
    rounding_tolerance: float = eqx.field(static=True, default=32.0)

    def __check_init__(self):
        if not self.rounding_tolerance >= 0:
            raise ValueError(f"rounding_tolerance must be >= 0, got {self.rounding_tolerance!r}.")
        n = self.max_consecutive_faults
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"max_consecutive_faults must be None or an integer >= 1, got {n!r}.")

    def init(self) -> GuardState:
        """The guard's state before the first step."""
        return GuardState(jnp.zeros((), jnp.int32))

    def decide(
        self,
        loss: Float[Array, ""],
        grads: PyTree[Array],
        delta: PyTree[Array],
        new_loss: Float[Array, ""] | None,
    ) -> GuardDecision:
        """The decision on one step.

        **Arguments:**

        - `loss`, `grads`: the step's loss and gradient.
        - `delta`: the proposed update.
        - `new_loss`: the loss after the update on the same batch (required with
          `reject_loss_increase`, else ignored).

        **Returns:**

        A `GuardDecision`.
        """
        if self.skip_non_finite:
            # `all_finite(grads)` is the step's own check of the gradient, which XLA computes once.
            skipped = ~(jnp.isfinite(loss) & all_finite(grads) & all_finite(delta))
        else:
            skipped = jnp.zeros((), bool)
        if self.reject_loss_increase:
            rounding = self.rounding_tolerance * jnp.finfo(loss.dtype).eps * jnp.abs(loss)
            rejected = ~skipped & ~(new_loss <= loss + rounding)
        else:
            rejected = jnp.zeros((), bool)
        return GuardDecision(~(skipped | rejected), skipped, rejected)

    def update(self, state: GuardState, decision: GuardDecision) -> GuardState:
        """The state after a step (pure: see `check` and `checked` for the error).

        **Arguments:**

        - `state`: the guard's state.
        - `decision`: this step's decision.

        **Returns:**

        The new `GuardState`.
        """
        count = jnp.where(decision.applied, 0, state.consecutive_faults + 1).astype(jnp.int32)
        return GuardState(count)

    def _failed(self, count: Any) -> Any:
        return self.max_consecutive_faults is not None and count >= self.max_consecutive_faults

    def check(self, state: GuardState) -> None:
        """Raises `RuntimeError` (in Python, on a concrete state) when the faults in a row reached
        `max_consecutive_faults`. Reading the count waits for the step that computed it.

        **Arguments:**

        - `state`: the guard's state after a step.
        """
        if self._failed(int(state.consecutive_faults)):
            raise RuntimeError(_FAULTS_MESSAGE.format(n=self.max_consecutive_faults))

    def checked(self, state: GuardState) -> GuardState:
        """`state`, raising at run time (inside `jit` too, through `eqx.error_if`) when the faults
        in a row reached `max_consecutive_faults`. The error is a host callback: JAX's persistent
        compilation cache does not store programs that contain one, so `Optimizer.step` called
        directly checks in Python (`check`) instead, and with the cache on, tracing this check
        warns (`_CACHE_WARNING`) so that the program's recompilation in every process is not a
        silent surprise.

        **Arguments:**

        - `state`: the guard's state after a step.

        **Returns:**

        The same state.
        """
        if self.max_consecutive_faults is None:
            return state
        n = self.max_consecutive_faults
        if persistent_cache_enabled():
            warnings.warn(_CACHE_WARNING.format(n=n), UserWarning, stacklevel=2)
        count = state.consecutive_faults
        message = _FAULTS_MESSAGE.format(n=n)
        return GuardState(eqx.error_if(count, self._failed(count), message))


def check_consecutive_faults(state: PyTree, max_consecutive_faults: int) -> None:
    """Raises `RuntimeError` when a step guard in `state` counts `max_consecutive_faults` or more
    steps in a row that were not applied: the check that `kfac_optax` (and `skip_non_finite`)
    compile into your step by default, made in Python instead.

    With `kfac_optax(..., max_consecutive_faults=None)` your jitted step holds no host callback,
    so JAX's persistent compilation cache (`eqx_kfac.enable_compilation_cache`) can store it; call
    this on the optimizer state after each step so that a run still never skips for ever in
    silence. Reading the count waits for the step that computed it.

    **Arguments:**

    - `state`: an optimizer state, or any PyTree holding one (an optax chain's state, a tuple of
      parameters and states): every step guard's count in it is checked.
    - `max_consecutive_faults`: the number of faults in a row that raises (at least 1).

    **Returns:**

    Nothing; raises `RuntimeError` with the guard's message when the limit is reached, and
    `ValueError` when `state` holds no step guard.
    """
    guard = StepGuard(max_consecutive_faults=max_consecutive_faults)
    guards = [
        leaf for leaf in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, GuardState))
        if isinstance(leaf, GuardState)
    ]
    if not guards:
        raise ValueError(
            "check_consecutive_faults found no step guard in this state: pass the state of "
            "kfac_optax, skip_non_finite or Optimizer (or a PyTree that holds it)."
        )
    for guard_state in guards:
        guard.check(guard_state)
