"""`Optimizer`: the K-FAC optimizer as a pure, Equinox-native step, built from parts.

The optimizer is built from parts, each an `eqx.Module` (see "Building a variant"):

- a `Preconditioner`: the curvature estimate (`BlockDiagonalCurvature`, traced from the loss on
  first use), its `AbstractRefreshSchedule` and the `AbstractDirection` it gives (shared with
  `kfac_preconditioner`);
- an `AbstractStepRule`: the update from the direction and the previous update (learning rate and
  momentum given, scheduled, or from the exact quadratic model within bounds);
- an `AbstractDampingRule`: the damping `λ` (given, scheduled, or Levenberg-Marquardt from `ρ`);
- a `StepGuard`: whether the update is applied (non-finite steps skipped, steps that raise the
  loss rejected, an error after too many in a row).

`AbstractKFACOptimizer` holds `init` and `step`; `Optimizer`'s constructor takes the parts (with
the recommended ones as defaults), and `eqx_kfac.kfac_jax.Optimizer`'s builds them from kfac-jax's
keywords. The step itself is `optimizer_step.step_body`; every decision that depends on the step counter is taken
inside the compiled graph, but for the burn-in of a directly called step (its updates run as
programs of their own before the step, see `burnin.py`), so `step` gives the same result
called directly or inside a user's `jit`.
"""

import dataclasses
import functools
import io
import itertools
import pathlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import PRNGKeyArray, PyTree

from .._core.methods import pytree_method
from .._core.tree import signature
from .._tracing.derivative_rules import abstract_outputs
from .._curvature.estimators import BlockDiagonalCurvature, ImplicitExactCurvature
from .abstract_optimizer import AbstractOptimizer
from .arguments import (
    check_batch, check_func_state, check_not_deleted, check_params, check_scalar_loss, params_signature,
)
from .burnin import BurnedIn, run_burnin, undone_if_not_processed
from .calibration import calibrated
from .compilation import as_the_step_traces, compiled_step, initial_state
from .damping import AbstractDampingRule, LevenbergMarquardtDamping
from .direction import AbstractDirection, PreconditionedGradient
from .execution import MultiDevice, StepOptions
from .guard import StepGuard
from .hyperparameters import AdaptiveHyperparameter
from .optimizer_state import load_state, OptimizerState
from .preconditioner import CurvatureOptions, Preconditioner
from .refresh import AbstractRefreshSchedule, RefreshSchedule
from .step_context import GivenValues
from .step_rule import AbstractStepRule, MomentumStep
from .value_function import recover_value_func, ValueFunction
from .warm_start import WarmStart
from .warm_start_step import warm_counts, warm_step

# The recommended parts (`Optimizer`'s defaults; docs/optimizer.md, "The recommended configuration").
DEFAULT_STEP_RULE = MomentumStep(
    AdaptiveHyperparameter(0.0, 10.0), AdaptiveHyperparameter(-0.95, 0.95), max_predicted_decrease=0.5
)
DEFAULT_DAMPING = LevenbergMarquardtDamping(1e-2, minimum=1e-6, fault_increase=2.0)


def build_value_function(
    value_and_grad_func: Callable[..., Any],
    value_func: Callable[..., Any] | None,
    value_func_for_estimator: Callable[..., Any] | None,
    flags: tuple[bool, bool, bool],
    batch_process_func: Callable[[Any], Any] | None,
) -> ValueFunction:
    """The `ValueFunction` of these arguments, the loss recovered from `value_and_grad_func`'s
    `__wrapped__` when `value_func` is not given (a `ValueError` says what to do otherwise)."""
    value_func = value_func or recover_value_func(value_and_grad_func)
    if value_func is None:
        # Tracing through `value_and_grad_func` would show the tracer the backward pass too,
        # whose uses of the weights look like extra layers: ask for the loss instead.
        raise ValueError(
            "Cannot recover the loss function from value_and_grad_func: it has no "
            "`__wrapped__` attribute. Build it with eqx.filter_value_and_grad(loss) or "
            "jax.value_and_grad(loss) (or functools.wraps(loss)), or pass value_func=loss."
        )
    return ValueFunction(
        value_and_grad_func, value_func, value_func_for_estimator or value_func, *flags,
        batch_process_func,
    )


class AbstractKFACOptimizer(AbstractOptimizer):
    """`init`, `step` and what they share, for `Optimizer` (the parts-based core) and
    `eqx_kfac.kfac_jax.Optimizer` (kfac-jax's keywords), which differ in their constructors only.
    """

    State: ClassVar[type[OptimizerState]] = OptimizerState

    def estimators(
        self, func_args: Sequence[Any], report: bool = False
    ) -> tuple[BlockDiagonalCurvature, ImplicitExactCurvature]:
        """The curvature estimators for function arguments of this structure and these shapes.

        Built (tracing the loss once, logging the registration report at INFO level on the
        `"eqx_kfac"` logger and reporting fallbacks as `on_unmatched` says) on first use, and
        cached afterwards for every optimizer with the same loss and curvature options (outside
        the optimizer, which holds no mutable state).

        **Arguments:**

        - `func_args`: the arguments of the value function, `(params, [func_state], [rng], batch)`.
        - `report`: report for a cached estimator too, as `init` does (every optimizer reports).

        **Returns:**

        `(block_diagonal, implicit_exact)`: the K-FAC estimator and the exact products used by the
        quadratic model.
        """
        block_diagonal = self.preconditioner.estimator(
            self.function.for_estimator, func_args, "eqx_kfac.Optimizer", report
        )
        # The exact products of the loss the estimator traces (with its layer tags, which change
        # no value) share its trace: the loss is traced once per step, not once more for them.
        same = self.function.for_estimator is self.function.value
        implicit = ImplicitExactCurvature(
            block_diagonal.func if same else self.function.value, params_index=0,
            batch_size_extractor=self.preconditioner.curvature.batch_size_extractor,
        )
        return block_diagonal, implicit

    def init(
        self, params: PyTree, rng: PRNGKeyArray, batch: PyTree, func_state: PyTree = None
    ) -> OptimizerState:
        """Creates the optimizer state, and checks the loss against its registrations.

        The loss is evaluated once on `batch`: a loss that is not a scalar, or summed over the
        batch (instead of averaged, as the curvature is), raises `ValueError`; an explicit
        `batch_size_extractor` that disagrees with the registered losses' batch dimension warns.

        **Arguments:**

        - `params`: the parameters (a PyTree or an `eqx.Module`; its inexact arrays are trained).
        - `rng`: a PRNG key (for the blocks' initialisation).
        - `batch`: an example batch with the shapes every `step` will use.
        - `func_state`: an example function state (required when `value_func_has_state`).

        **Returns:**

        An `Optimizer.State`.
        """
        return self._init(params, rng, batch, func_state)

    def _init(
        self, params: PyTree, rng: PRNGKeyArray, batch: PyTree, func_state: PyTree,
        lay_out: Callable[[OptimizerState], Any] | None = None,
    ) -> OptimizerState:
        """`init`, the state passed through `lay_out` in the program that builds it (`batch` may
        be `jax.ShapeDtypeStruct`s under `multi_device`: only its shapes are traced)."""
        check_func_state(self.function.has_state, func_state)

        def checked_estimator(func_args: tuple[Any, ...]) -> BlockDiagonalCurvature:
            # Checked on the trace the graph matcher reuses (the loss is traced once, not twice).
            check_scalar_loss(abstract_outputs(self.function.value), self.function.loss_of, func_args)
            return self.estimators(func_args, report=True)[0]

        if self.multi_device:
            # (The loss may use collectives, which need the step's map: no check evaluates it.)
            estimator = as_the_step_traces(self, checked_estimator, params, func_state, rng, batch)
        else:
            func_args = self.function.args(params, func_state, rng, self.function.process(batch))
            estimator = checked_estimator(func_args)
            self.preconditioner.check_loss(self.function.loss_of, func_args, estimator)
        filtered, signatures = eqx.filter(params, eqx.is_inexact_array), (signature(batch), params_signature(params))
        return initial_state(self, estimator, filtered, rng, signatures, lay_out=lay_out)

    def load_state(
        self, path_or_file: str | pathlib.Path | io.IOBase, params: PyTree, rng: PRNGKeyArray,
        batch: PyTree, func_state: PyTree = None,
    ) -> OptimizerState:
        """Loads a state saved with `eqx.tree_serialise_leaves(path_or_file, state)`.

        `eqx.tree_deserialise_leaves(path_or_file, optimizer.init(params, rng, batch))`, but a
        file saved by an optimizer of another configuration (other blocks, cached powers, step
        or damping rule), or for other parameters or batch, raises `ValueError` naming the first
        leaf of the state that does not fit (Equinox's error names a leaf of another part of the
        state, or none).

        **Arguments:**

        - `path_or_file`: the file (or its path) the state was saved to.
        - `params`, `rng`, `batch`, `func_state`: as for `init`, which builds the template.

        **Returns:**

        The loaded `Optimizer.State`.
        """
        return load_state(path_or_file, self.init(params, rng, batch, func_state))

    def state_for_batch(self, state: OptimizerState, batch: PyTree) -> OptimizerState:
        """`state`, made to accept batches shaped like `batch` in `step` (e.g. an epoch's smaller
        last batch, or another sequence length), with everything it holds kept: statistics,
        cached inverses, damping, velocity and counters. (`init` with the new batch would
        restart them.) Each new batch shape compiles the step once more, as long as the first
        step's compilation, so keep the shapes few: drop or pad the last batch, or bucket
        sequence lengths.

        **Arguments:**

        - `state`: the optimizer state.
        - `batch`: a batch of the new shapes, with the structure and dtypes of `init`'s batch.

        **Returns:**

        The state, whose `step` takes batches of `batch`'s shapes (and no longer the old ones).
        """
        check_batch(state.batch_signature, batch, "batch given to state_for_batch", shapes=False)
        return dataclasses.replace(state, batch_signature=signature(batch))

    @pytree_method
    def _check_step_arguments(
        self, params: Any, state: Any, rng: Any, batch: Any, func_state: Any, given: GivenValues
    ) -> None:
        if not isinstance(state, OptimizerState):
            raise TypeError(
                f"state must be an Optimizer.State (from init), got {type(state).__name__}. A "
                "checkpoint restored without a template comes back as plain containers: load it "
                "with `optimizer.load_state(path, params, rng, batch)`."
            )
        self.step_rule.check(given)
        self.damping_rule.check(given)
        check_func_state(self.function.has_state, func_state)
        check_params(state.params_signature, params)
        if not isinstance(state.step_counter, jax.core.Tracer):
            check_not_deleted((params, state, rng, batch, func_state), self.donated)

    @pytree_method
    def step(
        self,
        params: PyTree,
        state: OptimizerState,
        rng: PRNGKeyArray,
        data_iterator: Any = None,
        batch: PyTree = None,
        func_state: PyTree = None,
        learning_rate: ArrayLike | None = None,
        momentum: ArrayLike | None = None,
        damping: ArrayLike | None = None,
        global_step_int: int | None = None,
    ) -> tuple[Any, ...]:
        """Takes one K-FAC step.

        **Arguments:**

        - `params`: the current parameters.
        - `state`: the optimizer state.
        - `rng`: a PRNG key, different at every step.
        - `data_iterator`: an iterator of batches (burn-in batches at step 0, then one per step);
          not usable inside `jit`. Exactly one of `data_iterator` and `batch` is required.
        - `batch`: the batch of this step (also the burn-in batch at step 0). Called outside jit,
          the burn-in's updates run before the step, each a compiled program of its own, as with
          `data_iterator`; inside a user's jit, the step's program runs them in a loop (the same
          result).
        - `func_state`: the function state, when `value_func_has_state`.
        - `learning_rate`, `momentum`, `damping`: required when the quantity is neither adaptive
          nor scheduled, forbidden otherwise.
        - `global_step_int`: the step counter as a Python int. Outside jit, with a burn-in or the
          initial damping calibration configured, `step` otherwise reads it from the device at
          every call (as kfac-jax does), which waits for the previous step to finish.

        **Returns:**

        `(params, state, stats)`, or `(params, state, func_state, stats)` when
        `value_func_has_state`. `stats` has `loss`, `learning_rate`, `momentum`, `damping`, `rho`,
        `new_loss`, `quad_model_change`, `step`, `data_seen`, `batch_size`, `skipped` (not applied:
        a loss, gradient or update that is not finite), `rejected` (not applied: the loss rose),
        `stalled` (applied, but below the parameters' resolution),
        `invalid_targets` (a class
        label outside `[0, classes)` on an unmasked example: the step is skipped),
        `curvature_update_dropped` (the batch's statistics were not finite), `aux` when the
        function has auxiliary outputs, and norms when requested. A `WarmStart`'s steps give
        `loss`, `step` (K-FAC's counter, still 0), `warm_start_step`, `batch_size`,
        `data_seen`, `skipped` and `aux`.
        """
        given = self._checked_arguments(
            params, state, rng, data_iterator, batch, func_state, (learning_rate, momentum, damping),
            global_step_int,
        )
        in_graph = data_iterator is None and isinstance(state.step_counter, jax.core.Tracer)
        step_int = global_step_int
        if step_int is None and not in_graph and self._needs_step_int():
            step_int = int(state.step_counter)
        if in_graph:  # inside a user's jit with `batch=`: the program runs the burn-in
            burned = BurnedIn(state, batch)
        else:
            batches = itertools.repeat(batch) if data_iterator is None else data_iterator
            done = 0
            if self.warm_start is not None and step_int == 0:
                counts = warm_counts(state)
                warm, batches = warm_step(
                    self, params, state, rng, batches, func_state, given, counts, data_iterator is not None
                )
                if warm is not None:
                    return warm
                done = counts[1]
            burned = run_burnin(
                self, params, state, rng, batches, func_state, given, step_int, data_iterator is not None, done
            )
        args = calibrated(self, (params, burned.state, rng, burned.batch, func_state, given), in_graph, step_int)
        out = compiled_step(self, args, in_graph)
        return self._checked_faults(undone_if_not_processed(state, burned.state, out, step_int))

    @pytree_method
    def _needs_step_int(self) -> bool:
        return self.refresh.num_burnin_steps > 0 or self.damping_rule.calibrates() or self.warm_start is not None

    @pytree_method
    def _checked_arguments(
        self, params: Any, state: Any, rng: Any, data_iterator: Any, batch: Any, func_state: Any,
        values: tuple[Any, Any, Any], global_step_int: int | None,
    ) -> GivenValues:
        """`step`'s arguments checked (a `ValueError` or `TypeError` that says what to pass),
        and the given learning rate, momentum and damping."""
        if (data_iterator is None) == (batch is None):
            raise ValueError("Pass exactly one of data_iterator= and batch= to step.")
        if data_iterator is not None and not isinstance(data_iterator, Iterator):
            raise TypeError(
                "Optimizer.step(params, state, rng, data_iterator=None, batch=None, ...): the fourth "
                f"positional argument is `data_iterator`, an iterator of batches, but got a "
                f"{type(data_iterator).__name__}. Pass a single batch by keyword: "
                "`optimizer.step(params, state, rng, batch=batch)`."
            )
        given = GivenValues(*(None if v is None else jnp.asarray(v) for v in values))
        self._check_step_arguments(params, state, rng, batch, func_state, given)
        if batch is not None:
            check_batch(state.batch_signature, batch, "batch")
        if data_iterator is not None and isinstance(state.step_counter, jax.core.Tracer) and global_step_int is None:
            # The batches would be drawn once, while tracing, and every call would reuse them.
            raise ValueError(
                "data_iterator cannot be used inside jit (batches are drawn in Python); pass "
                "batch= instead, or call step outside jit."
            )
        return given

    @pytree_method
    def check(self, state: OptimizerState) -> None:
        """Raises `RuntimeError` when the guard's limits are reached: `max_consecutive_faults`
        steps in a row not applied (naming the first), or `max_consecutive_stalls` applied steps
        in a row that left the parameters as they were (naming the cause). A directly called
        `step` makes this check itself; after a step inside your own `jit`, call it on the
        returned state (it reads two counters, waiting for the step), unless the guard was built
        with `stop_in_program=True`.

        **Arguments:**

        - `state`: the state a step returned.
        """
        self.guard.check(state.guard_state)

    @pytree_method
    def _checked_faults(self, out: tuple[Any, ...]) -> tuple[Any, ...]:
        """The step's outputs, once the guard has checked its count of faults in a row: in
        Python when the step ran (its compiled program then holds no host callback, so it
        exports, and JAX 0.10's persistent compilation cache can store it), inside the caller's
        trace only with the guard's `stop_in_program`."""
        new_state = out[1]
        if isinstance(new_state.step_counter, jax.core.Tracer):
            checked = self.guard.checked(new_state.guard_state)
            return (out[0], eqx.tree_at(lambda s: s.guard_state, new_state, checked), *out[2:])
        self.check(new_state)
        return out


def _default_guard(damping_rule: AbstractDampingRule) -> StepGuard:
    """The recommended guard: steps that raise the loss are rejected when the damping adapts
    (the damping then rises), not when it is given or scheduled (nothing would change)."""
    return StepGuard(reject_loss_increase=isinstance(damping_rule, LevenbergMarquardtDamping))


class Optimizer(AbstractKFACOptimizer):
    """The K-FAC optimizer, built from parts (final).

    `Optimizer(value_and_grad_func)` is the recommended configuration: the learning rate and
    momentum adapted by the exact quadratic model (bounded, within a trust region), the damping
    adapted by Levenberg-Marquardt from `1e-2` (floor `1e-6`), a step that raises the loss
    rejected, curvature statistics every step and inverses refreshed every 5. Each part is
    replaced by passing another (see "Building a variant"); kfac-jax's keywords are those of
    `eqx_kfac.kfac_jax.Optimizer`, which builds the same parts. `init` creates an
    `Optimizer.State`; `step` returns new parameters, state and statistics. Both are pure: call
    `step` directly (it is compiled once per argument structure and cached) or inside your own
    `eqx.filter_jit` / `jax.jit`.
    """

    function: ValueFunction
    l2_reg: float = eqx.field(static=True)
    preconditioner: Preconditioner
    step_rule: AbstractStepRule
    damping_rule: AbstractDampingRule
    guard: StepGuard
    devices: MultiDevice | None
    options: StepOptions
    warm_start: WarmStart | None

    def __init__(
        self,
        value_and_grad_func: Callable[..., Any],
        l2_reg: float = 0.0,
        *,
        value_func_has_aux: bool = False,
        value_func_has_state: bool = False,
        value_func_has_rng: bool = False,
        value_func: Callable[..., Any] | None = None,
        curvature: CurvatureOptions | None = None,
        refresh: AbstractRefreshSchedule | None = None,
        direction: AbstractDirection | None = None,
        step_rule: AbstractStepRule | None = None,
        damping_rule: AbstractDampingRule | None = None,
        guard: StepGuard | None = None,
        devices: MultiDevice | None = None,
        options: StepOptions | None = None,
        warm_start: WarmStart | None = None,
    ):
        """**Arguments:**

        - `value_and_grad_func`: `value_and_grad_func(params, [func_state], [rng], batch)` returns
          `(out, grads)` as `eqx.filter_value_and_grad(loss)` or `jax.value_and_grad(loss)` do;
          `out` is `loss`, `(loss, aux)`, `(loss, func_state)` or `(loss, (func_state, aux))`.
          The loss must register its losses and be averaged over the batch.
        - `l2_reg`: the L2 coefficient used in the loss (added to the damping and the model).
        - `value_func_has_aux`, `value_func_has_state`, `value_func_has_rng`: the forms above.
        - `value_func`: the loss itself, when `value_and_grad_func` has no `__wrapped__` to
          recover it from.
        - `curvature`: how the estimator is built (`CurvatureOptions`: estimation mode, blocks,
          graph patterns, solver, the function the estimator traces); default `fisher_gradients`.
        - `refresh`: when statistics and inverses are refreshed (default `RefreshSchedule()`: a
          burn-in of 10, statistics every step, inverses every 5, moving average 0.95).
        - `direction`: the direction from the gradient (default `PreconditionedGradient()`).
        - `step_rule`: the update from the direction (default: `MomentumStep` with the learning
          rate in `[0, 10]` and the momentum in `[-0.95, 0.95]` adapted, trust region 0.5).
          `MomentumStep()` takes both from `step`'s `learning_rate=` and `momentum=`.
        - `damping_rule`: the damping (default `LevenbergMarquardtDamping(1e-2, minimum=1e-6,
          fault_increase=2.0)`); `GivenDamping()` takes it from `step`'s `damping=`.
        - `guard`: whether each update is applied (default `StepGuard()`, rejecting steps that
          raise the loss when the damping rule is Levenberg-Marquardt).
        - `devices`: a `MultiDevice` to run the step on several devices (default: one device).
        - `options`: `StepOptions` (buffer donation, XLA compiler options, norms in `stats`).
        - `warm_start`: a `WarmStart`: a directly called `step` takes that many steps of an optax
          transformation while the K-FAC programs compile in the background (default `None`:
          K-FAC from the first step). One device only; nothing changes inside your own `jit`.
        """
        damping_rule = DEFAULT_DAMPING if damping_rule is None else damping_rule
        curvature = CurvatureOptions() if curvature is None else curvature
        self.function = build_value_function(
            value_and_grad_func, value_func, None, (value_func_has_aux, value_func_has_state, value_func_has_rng), None,
        )
        self.l2_reg = l2_reg
        self.preconditioner = Preconditioner(
            curvature,
            RefreshSchedule() if refresh is None else refresh,
            PreconditionedGradient() if direction is None else direction,
        )
        self.step_rule = DEFAULT_STEP_RULE if step_rule is None else step_rule
        self.damping_rule = damping_rule
        self.guard = _default_guard(damping_rule) if guard is None else guard
        self.devices = devices
        self.options = StepOptions() if options is None else options
        if warm_start is not None and devices is not None:
            raise ValueError(
                "Optimizer(warm_start=..., devices=...): the warm start runs on one device only. "
                "Drop warm_start (the first step then compiles before it runs), or devices."
            )
        self.warm_start = warm_start
