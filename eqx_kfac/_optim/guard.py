"""The step guard: whether a proposed update is applied, and what happens when none is for long,
or when the applied ones stop changing the parameters.

A step is *skipped* when its loss, gradient or update is not finite, or its batch has a class
label outside `[0, classes)` on an example a categorical loss does not mask out (an invalid label,
which the user's loss would read as another class), and *rejected* (with step rejection) when the
loss on its batch rises after the update. Either way the parameters and the step rule's state
stay as they were. An applied step *stalls* when its update is below the
parameters' resolution (it is zero, or its norm is at most `eps` of their dtype times theirs).
The guard counts faults and stalls in a row and stops the run with an error that says what
happened once there are `max_consecutive_faults` (or `max_consecutive_stalls`) of them, instead of
going on in silence: in Python after a directly called `Optimizer.step` or `kfac_optax` update
(`check`), in the program inside a trace (`checked`, one host callback, compiled in only with
`max_consecutive_faults`), or in Python on any optimizer state (`check_consecutive_faults`), which
keeps a user's jitted step free of host callbacks, so that it exports and JAX 0.10's persistent
compilation cache stores it. `Optimizer` and the optax transformations share this one guard.
"""

import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int, PyTree

from .._core.compilation_cache import CACHE_STORES_HOST_CALLBACKS, persistent_cache_enabled
from .._core.methods import pytree_method
from .._core.tree import all_finite, inner_products


class GuardState(eqx.Module):
    """The state of a `StepGuard` (final).

    **Fields:**

    - `steps`: the number of steps decided so far (skipped and rejected ones included).
    - `consecutive_faults`: the number of steps in a row that were skipped or rejected.
    - `fault_start`: the index (in `steps`' count, from 0) of the first step of the current run
      of faults (meaningful while `consecutive_faults > 0`).
    - `consecutive_stalls`: the number of applied steps in a row that stalled.
    - `stall_cause`: why the last step stalled (`GuardDecision.stall_cause`).
    - `total_skipped`, `total_rejected`: the numbers of skipped and rejected steps so far.
    - `last_loss`: the last step's loss (float32), for the messages.
    - `last_fault`: why the last step was not applied (`GuardDecision.fault`), for the messages.
    """

    steps: Int[Array, ""]
    consecutive_faults: Int[Array, ""]
    fault_start: Int[Array, ""]
    consecutive_stalls: Int[Array, ""]
    stall_cause: Int[Array, ""]
    total_skipped: Int[Array, ""]
    total_rejected: Int[Array, ""]
    last_loss: Float[Array, ""]
    last_fault: Int[Array, ""]


class GuardDecision(eqx.Module):
    """What the guard decided about one step (final).

    **Fields:**

    - `applied`: the update is applied.
    - `skipped`: it is not, because the loss, gradient or update is not finite, or a label of
      the batch is invalid.
    - `rejected`: it is not, because the loss on the step's batch rose (step rejection).
    - `stall_cause`: `0` unless the step is applied and stalls: `1` the gradient is zero, `2` the
      update is zero though the gradient is not (a learning rate of 0), `3` the update is not zero
      but below the parameters' resolution.
    - `loss`: the step's loss.
    - `fault`: `0` when applied; `1` the loss or gradient is not finite, `2` both are finite but
      the update is not (the direction: e.g. a linear solve that did not converge), `3` a label
      of the batch is invalid, `4` rejected.
    """

    applied: Bool[Array, ""]
    skipped: Bool[Array, ""]
    rejected: Bool[Array, ""]
    stall_cause: Int[Array, ""]
    loss: Float[Array, ""]
    fault: Int[Array, ""]

    @property
    def stalled(self) -> Bool[Array, ""]:
        """The step is applied but leaves the parameters (nearly) as they were."""
        return self.stall_cause > 0


_FAULTS_MESSAGE = (
    "eqx_kfac: {n} consecutive steps were not applied{first}: each was skipped (a loss, gradient "
    "or update that was not finite, or invalid labels: a class label outside [0, classes) of a "
    "registered categorical loss, e.g. -1 for padding, on an example it does not mask out) or "
    "rejected (its loss on the batch rose after the update). "
    "None of these {n} steps changed the parameters or the momentum (velocity). {before} Check the "
    "batches for NaN or Inf (an empty batch gives a NaN loss) and for invalid labels (give such "
    "examples mask=0 in the register_* call, or drop them), the model's numerics (overflow in "
    "float16/bfloat16), the learning rate and its schedule, the loss's scale and the damping "
    "(raise LevenbergMarquardtDamping's initial_damping / minimum; kfac_jax: initial_damping / "
    "min_damping); stats['skipped'], stats['invalid_targets'] and "
    "stats['rejected'] (Optimizer), or the optimizer state's "
    "guard_state (kfac_optax, skip_non_finite), show which. Rejected steps in a row are also what "
    "a run on one fixed batch can do once it has converged, when its loss is near zero and rounds "
    "by more than `rounding_tolerance` (StepGuard) units in its last place (e.g. an exact fit); "
    "there, stop training. Pass max_consecutive_faults=None to keep skipping instead of stopping."
)

# What the last of the faults was (`GuardDecision.fault`), for the message.
_LAST_FAULT = (
    "",
    " The last of them had a loss or gradient that was not finite.",
    " The last of them had a finite loss and gradient but an update that was not: the direction "
    "was not finite. A linear solve that did not converge gives NaN (an iterative inverse_solver "
    "such as lineax.CG or lineax.GMRES out of max_steps, or a solve of an indefinite matrix): "
    "raise the solver's max_steps or loosen its rtol/atol, raise the damping, or drop "
    "inverse_solver for the exact factor-wise inverses. A curvature estimate that overflowed does "
    "this too.",
    " The last of them had invalid labels.",
    " The last of them was rejected (its loss rose).",
)

_BEFORE = {
    (True, True): "Steps before them were applied only where their update was finite and their "
    "loss on the batch did not rise (step rejection).",
    (True, False): "Step rejection is off, so before these steps an update that was finite but "
    "raised the loss (e.g. a learning rate far too large at one step) was applied as it was: the "
    "parameters may have been damaged before the first of them (a loss that is NaN from some step "
    "on is the sign). Build the guard with StepGuard(reject_loss_increase=True) (Optimizer's "
    "guard=; kfac_optax(use_step_rejection=True); one more evaluation of the loss per step) to "
    "reject such updates.",
    (False, True): "skip_non_finite is off: updates that were not finite were applied, and the "
    "parameters may hold NaN or Inf.",
    (False, False): "skip_non_finite and step rejection are off: every update was applied as it "
    "was, and the parameters may be damaged.",
}

_IN_JIT = (
    " (Inside jit this message cannot name the first step of the run: it is "
    "`guard_state.fault_start` of the state this step was given; or leave stop_in_program off and "
    "call Optimizer.check(state) or eqx_kfac.check_consecutive_faults(state) after each step, "
    "which names it.)"
)

_STALL_MESSAGE = (
    "eqx_kfac: {n} steps in a row were applied but left the parameters as they were{loss}: {cause} "
    "Pass max_consecutive_stalls=None to go on regardless."
)

_STALL_CAUSES = (
    "the gradient is exactly zero. A run that has converged exactly gets here: stop training. "
    "Otherwise the loss does not depend on the parameters (a stop_gradient, units that are all "
    "inactive).",
    "the update is exactly zero though the gradient is not: the learning rate is 0 and so is the "
    "momentum term (a learning-rate schedule at 0, or the adapted learning rate at its lower bound "
    "of adaptive_learning_rate_bounds because the quadratic model finds no decrease along the "
    "direction). Check the schedule or the bounds.",
    "the update is not zero but below the parameters' resolution (its norm is at most eps of "
    "their dtype times theirs), so adding it changes next to nothing. The usual cause is the "
    "loss's scale: a loss multiplied by a tiny factor (e.g. 1e-12) keeps the curvature of its "
    "registered losses (register_*_loss) as it was while its gradient shrinks by the factor, so "
    "every step shrinks by it too (and the damping, being absolute, swamps a curvature scaled "
    "down with the loss). Remove the factor, or register the losses with weight= the same factor "
    "and scale the damping (LevenbergMarquardtDamping's initial_damping and minimum; "
    "kfac_optax's damping) with it; or raise the learning rate. A learning-rate schedule that decays to about zero, or a run that "
    "has converged, gets here too.",
)

_CACHE_WARNING = (
    "eqx_kfac: JAX's persistent compilation cache is on, but this jitted step will not be stored "
    "in it: StepGuard(stop_in_program=True) stops the run from inside the program with a host "
    "callback (eqx.error_if), and JAX before 0.11 does not store programs that hold one, so "
    "every process compiles the step again. To have it stored, use JAX 0.11 or later, or leave "
    "stop_in_program off (the default) and call eqx_kfac.check_consecutive_faults(state, {n}) "
    "(or Optimizer.check(state)) on the state after each step."
)


def _check_limit(name: str, n: Any) -> None:
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"{name} must be None or an integer >= 1, got {n!r}.")


def _resolution(params: PyTree) -> PyTree[Array]:
    """Each parameter times the `eps` of its dtype, in at least float32: the size below which an
    update leaves it as it is."""
    return jax.tree.map(
        lambda p: p.astype(jnp.promote_types(p.dtype, jnp.float32)) * jnp.finfo(p.dtype).eps,
        eqx.filter(params, eqx.is_inexact_array),
    )


class StepGuard(eqx.Module):
    """Decides whether each proposed update is applied, and stops a run that faults or stalls
    (final).

    **Fields:**

    - `skip_non_finite`: skip a step whose loss, gradient or update is not finite, or whose batch
      has an invalid label (else it is applied as it is).
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
    - `stop_in_program`: inside your own `jit`, stop with an error raised by the program (a host
      callback, `eqx.error_if`). Off (the default), the step inside `jit` holds no host callback,
      so it exports (`jax.export`, for GPUs and TPUs) and JAX's persistent compilation cache
      stores it: call `Optimizer.check(state)` (or `eqx_kfac.check_consecutive_faults`) on the
      returned state in Python instead. A directly called step checks in Python either way.
    - `max_consecutive_stalls`: stop with an error that names the cause after this many applied
      steps in a row whose update is below the parameters' resolution: zero, or of norm at most
      `eps` (of each parameter's dtype) times the parameters' norm (`None`: never; costs one pass
      over the parameters, gradient and update per step).
    """

    skip_non_finite: bool = eqx.field(static=True, default=True)
    reject_loss_increase: bool = eqx.field(static=True, default=False)
    max_consecutive_faults: int | None = eqx.field(static=True, default=20)
    rounding_tolerance: float = eqx.field(static=True, default=32.0)
    max_consecutive_stalls: int | None = eqx.field(static=True, default=50)
    stop_in_program: bool = eqx.field(static=True, default=False)

    def __check_init__(self):
        if not self.rounding_tolerance >= 0:
            raise ValueError(f"rounding_tolerance must be >= 0, got {self.rounding_tolerance!r}.")
        _check_limit("max_consecutive_faults", self.max_consecutive_faults)
        _check_limit("max_consecutive_stalls", self.max_consecutive_stalls)

    def init(self) -> GuardState:
        """The guard's state before the first step."""
        zero = jnp.zeros((), jnp.int32)
        return GuardState(zero, zero, zero, zero, zero, zero, zero, jnp.zeros((), jnp.float32), zero)

    def decide(
        self,
        loss: Float[Array, ""],
        grads: PyTree[Array],
        delta: PyTree[Array],
        new_loss: Float[Array, ""] | None,
        params: PyTree | None = None,
        targets_in_range: Bool[Array, ""] | None = None,
    ) -> GuardDecision:
        """The decision on one step.

        **Arguments:**

        - `loss`, `grads`: the step's loss and gradient.
        - `delta`: the proposed update.
        - `new_loss`: the loss after the update on the same batch (required with
          `reject_loss_increase`, else ignored).
        - `params`: the parameters before the update, for the stall check (`None`: only a zero
          update stalls).
        - `targets_in_range`: whether the batch's labels are valid (`Preconditioner.targets_in_range`;
          `None`: not checked).

        **Returns:**

        A `GuardDecision`.
        """
        loss = jnp.asarray(loss)
        inputs_finite = jnp.isfinite(loss) & all_finite(grads)
        valid = jnp.ones((), bool) if targets_in_range is None else targets_in_range
        if self.skip_non_finite:
            # `all_finite(grads)` is the step's own check of the gradient, which XLA computes once.
            skipped = ~(inputs_finite & all_finite(delta) & valid)
        else:
            skipped = jnp.zeros((), bool)
        if self.reject_loss_increase:
            rounding = self.rounding_tolerance * jnp.finfo(loss.dtype).eps * jnp.abs(loss)
            rejected = ~skipped & ~(new_loss <= loss + rounding)
        else:
            rejected = jnp.zeros((), bool)
        applied = ~(skipped | rejected)
        cause = jnp.where(applied, self._stall_cause(grads, delta, params), 0)
        fault = jnp.select(
            [applied, rejected, ~valid, ~inputs_finite], [0, 4, 3, 1], 2
        ).astype(jnp.int32)
        return GuardDecision(applied, skipped, rejected, cause, loss.astype(jnp.float32), fault)

    def _stall_cause(self, grads: PyTree, delta: PyTree, params: PyTree | None) -> Int[Array, ""]:
        """`GuardDecision.stall_cause` of an applied step (one pass over the three vectors)."""
        if self.max_consecutive_stalls is None:
            return jnp.zeros((), jnp.int32)
        scale = jax.tree.map(jnp.zeros_like, delta) if params is None else _resolution(params)
        grad_sq, delta_sq, scale_sq = inner_products([(grads, grads), (delta, delta), (scale, scale)])
        cause = jnp.where(grad_sq == 0, 1, jnp.where(delta_sq == 0, 2, 3))
        return jnp.where(delta_sq <= scale_sq, cause, 0).astype(jnp.int32)

    def update(self, state: GuardState, decision: GuardDecision) -> GuardState:
        """The state after a step (pure: see `check` and `checked` for the error).

        **Arguments:**

        - `state`: the guard's state.
        - `decision`: this step's decision.

        **Returns:**

        The new `GuardState`.
        """
        faulted = ~decision.applied
        starts = faulted & (state.consecutive_faults == 0)
        stalls = jnp.where(decision.stalled, state.consecutive_stalls + 1, 0)
        return GuardState(
            steps=optax.safe_increment(state.steps),
            consecutive_faults=jnp.where(faulted, state.consecutive_faults + 1, 0).astype(jnp.int32),
            fault_start=jnp.where(starts, state.steps, state.fault_start),
            consecutive_stalls=jnp.where(faulted, state.consecutive_stalls, stalls).astype(jnp.int32),
            stall_cause=decision.stall_cause,
            total_skipped=state.total_skipped + decision.skipped.astype(jnp.int32),
            total_rejected=state.total_rejected + decision.rejected.astype(jnp.int32),
            last_loss=decision.loss,
            last_fault=decision.fault,
        )

    def _failed(self, count: Any) -> Any:
        return self.max_consecutive_faults is not None and count >= self.max_consecutive_faults

    def _stalled(self, count: Any) -> Any:
        return self.max_consecutive_stalls is not None and count >= self.max_consecutive_stalls

    def _faults_message(self, first: str, last_fault: int = 0) -> str:
        before = _BEFORE[self.skip_non_finite, self.reject_loss_increase]
        message = _FAULTS_MESSAGE.format(n=self.max_consecutive_faults, first=first, before=before)
        return message + _LAST_FAULT[last_fault]

    def _stall_message(self, cause: int, loss: str) -> str:
        return _STALL_MESSAGE.format(n=self.max_consecutive_stalls, loss=loss, cause=_STALL_CAUSES[cause - 1])

    @pytree_method
    def check(self, state: GuardState) -> None:
        """Raises `RuntimeError` (in Python, on a concrete state) when the faults in a row reached
        `max_consecutive_faults` (naming the first of them), or the stalls in a row
        `max_consecutive_stalls` (naming the cause). Reading the counts waits for the step that
        computed them; a count without a limit is not read.

        **Arguments:**

        - `state`: the guard's state after a step.
        """
        # A count without a limit is not read: reading it waits for the step (kfac-jax's
        # defaults, no limits, leave the step asynchronous).
        if self.max_consecutive_faults is not None and self._failed(int(state.consecutive_faults)):
            first = f" (the first of them was step {int(state.fault_start)}, counting from 0)"
            raise RuntimeError(self._faults_message(first, int(state.last_fault)))
        if self.max_consecutive_stalls is not None and self._stalled(int(state.consecutive_stalls)):
            loss = f" (the last loss: {float(state.last_loss):.4g})"
            raise RuntimeError(self._stall_message(int(state.stall_cause), loss))

    def checked(self, state: GuardState) -> GuardState:
        """`state`, raising at run time (inside `jit` too, through `eqx.branched_error_if`) when
        the faults or the stalls in a row reached their limit. The error is a host callback,
        compiled in only with `stop_in_program` and `max_consecutive_faults` (otherwise the
        program has none, and
        `check_consecutive_faults` checks both counts in Python): `jax.export` refuses programs
        that contain one, and JAX 0.10's persistent compilation cache does not store them, so
        `Optimizer.step` and `kfac_optax` called directly check in Python (`check`) instead, and
        with the cache on under JAX 0.10, tracing this check warns (`_CACHE_WARNING`) so that the
        program's recompilation in every process is not a silent surprise (JAX 0.11 and later
        store it). Its messages are fixed when the program is traced, so they cannot
        name the first step of a run of faults or the loss.

        **Arguments:**

        - `state`: the guard's state after a step.

        **Returns:**

        The same state.
        """
        if self.max_consecutive_faults is None or not self.stop_in_program:
            return state
        if persistent_cache_enabled() and not CACHE_STORES_HOST_CALLBACKS:
            warnings.warn(_CACHE_WARNING.format(n=self.max_consecutive_faults), UserWarning, stacklevel=2)
        failed = self._failed(state.consecutive_faults)
        stalled = self._stalled(state.consecutive_stalls)
        messages = [self._faults_message("") + _IN_JIT]
        if self.max_consecutive_stalls is not None:
            messages += [self._stall_message(cause, "") for cause in (1, 2, 3)]
        index = jnp.where(failed, 0, state.stall_cause)
        steps = eqx.branched_error_if(state.steps, failed | stalled, index, messages)
        return eqx.tree_at(lambda s: s.steps, state, steps)


def check_consecutive_faults(
    state: PyTree, max_consecutive_faults: int = 20, max_consecutive_stalls: int | None = 50
) -> None:
    """Raises `RuntimeError` when a step guard in `state` counts `max_consecutive_faults` or more
    steps in a row that were not applied (naming the first of them), or `max_consecutive_stalls`
    or more applied steps in a row that left the parameters as they were (naming the cause): the
    checks that a directly called `Optimizer.step` or `kfac_optax` update makes itself.

    Inside your own `jit` the step holds no host callback (unless its guard has
    `stop_in_program=True`), so `jax.export` and JAX's persistent compilation cache
    (`eqx_kfac.enable_compilation_cache`) take it: call this on the optimizer state after each
    step so that a run still never skips, or stalls, for ever in silence. Reading the counts waits
    for the step that computed them.

    **Arguments:**

    - `state`: an optimizer state, or any PyTree holding one (an optax chain's state, a tuple of
      parameters and states): every step guard's counts in it are checked.
    - `max_consecutive_faults`: the number of faults in a row that raises (at least 1).
    - `max_consecutive_stalls`: the number of stalled steps in a row that raises (`None`: not
      checked).

    **Returns:**

    Nothing; raises `RuntimeError` with the guard's message when a limit is reached, and
    `ValueError` when `state` holds no step guard.
    """
    guard = StepGuard(
        max_consecutive_faults=max_consecutive_faults, max_consecutive_stalls=max_consecutive_stalls
    )
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
