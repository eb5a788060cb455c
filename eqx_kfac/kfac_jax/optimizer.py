"""`eqx_kfac.kfac_jax.Optimizer`: kfac-jax's `Optimizer`, its keywords, defaults and calling
convention, on `eqx_kfac`'s parts."""

import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import equinox as eqx
from jax.typing import ArrayLike
from jaxtyping import Array, Key, PRNGKeyArray, PyTree, UInt32

from .._core.compiled import COMPILER_OPTIONS
from .._core.methods import pytree_method
from .._optim.damping import AbstractDampingRule
from .._optim.direction import AbstractDirection
from .._optim.execution import MultiDevice, StepOptions
from .._optim.guard import StepGuard
from .._optim.hyperparameters import Schedule
from .._optim.optimizer import AbstractKFACOptimizer
from .._optim.optimizer_state import OptimizerState
from .._optim.preconditioner import Preconditioner
from .._optim.refresh import AbstractRefreshSchedule
from .._optim.step_rule import AbstractStepRule
from .._optim.arguments import check_func_state
from .._optim.compilation import device_mesh
from .._optim.value_function import ValueFunction
from ._keywords import built
from .utils import Array as Array, Numeric as Numeric, ScheduleType as ScheduleType
from .utils import ValueAndGradFunc as ValueAndGradFunc, ValueFunc as ValueFunc
from ._replicated import first_copy_on_host, is_per_device, merged_batch, merged_batch_shapes, replicated, unreplicated
from .utils import replicated_in_program

# kfac-jax's names of the function's argument and output forms.
FuncArgsVariants = tuple[Any, ...]
FuncOutputs = Array | tuple[Array, Any]

# A key, or one key per device (kfac-jax's replicated convention).
PerDeviceKeys = PRNGKeyArray | Key[Array, " devices"] | UInt32[Array, "devices 2"]


class Optimizer(AbstractKFACOptimizer):
    """kfac-jax's `Optimizer` (final): the keywords of kfac-jax's HEAD, in its order, with its
    defaults, meanings and calling convention, built from `eqx_kfac`'s parts. With
    `import eqx_kfac.kfac_jax as kfac_jax`, kfac-jax code runs unchanged: no bounds or trust region
    on the adapted coefficients, no step rejection, every finite batch folded in,
    `min_damping=1e-8`, `initial_damping` required with adaptive damping, the estimation mode
    `ggn_curvature_prop`, no stop after faults in a row. `eqx_kfac.Optimizer(value_and_grad_func)`
    is the recommended configuration instead; the "Migrating from kfac-jax" page lists the
    differences and the keywords refused.
    """

    function: ValueFunction
    l2_reg: float = eqx.field(static=True)
    preconditioner: Preconditioner
    step_rule: AbstractStepRule
    damping_rule: AbstractDampingRule
    guard: StepGuard
    devices: MultiDevice | None
    options: StepOptions
    warm_start: None = None  # (kfac-jax has none; `eqx_kfac.Optimizer(warm_start=...)`)

    def __init__(
        self, value_and_grad_func: Callable[..., Any], l2_reg: Numeric,
        regularized_parameters_path_exclusions: str = "",
        value_func_has_aux: bool = False, value_func_has_state: bool = False, value_func_has_rng: bool = False,
        value_func_for_estimator: Callable[..., Any] | None = None,
        use_adaptive_learning_rate: bool = False, learning_rate_schedule: Schedule | None = None,
        use_adaptive_momentum: bool = False, momentum_schedule: Schedule | None = None,
        use_adaptive_damping: bool = False, damping_schedule: Schedule | None = None,
        initial_damping: Numeric | None = None, use_initial_damping_calibration: bool = False,
        min_damping: Numeric = 1e-8, max_damping: Numeric = math.inf, include_damping_in_quad_change: bool = False,
        damping_adaptation_interval: int = 5, damping_adaptation_decay: Numeric = 0.9,
        damping_lower_threshold: Numeric = 0.25, damping_upper_threshold: Numeric = 0.75,
        always_use_exact_qmodel_for_damping_adjustment: bool = False,
        precon_damping_mult: Numeric = 1.0, precon_damping_schedule: Schedule | None = None,
        use_step_rejection: bool = False, reject_damping_increase_factor: Numeric = 1.0,
        norm_constraint: Numeric | None = None, num_burnin_steps: int = 10, estimation_mode: str | None = None,
        custom_estimator_ctor: Callable[..., Any] | None = None, curvature_ema: Numeric = 0.95,
        curvature_update_period: int = 1, inverse_update_period: int = 5, use_exact_inverses: bool = False,
        batch_process_func: Callable[[Any], Any] | None = None, register_only_generic: bool = False,
        patterns_to_skip: Sequence[str] = (), use_automatic_registration: bool = True,
        auto_register_kwargs: Mapping[str, Any] | None = None,
        layer_tag_to_block_ctor: Mapping[str, Any] | None = None, multi_device: bool = False,
        debug: bool = False, invalid_metric_value: Numeric = math.nan,
        batch_size_extractor: Callable[[Any], Any] | None = None, pmap_axis_name: str = "batch_axis",
        forbid_setting_attributes_after_finalize: bool = True, modifiable_attribute_exceptions: Sequence[str] = (),
        include_norms_in_stats: bool = False, include_per_param_norms_in_stats: bool = False,
        include_registered_loss_in_stats: bool = False, distributed_precon_apply: bool = True,
        distributed_inverses: bool = True, num_estimator_samples: int = 1,
        should_vmap_estimator_samples: bool = False, norm_to_scale_identity_weight_per_block: str | None = None,
        precon_power: Numeric = -1.0, exact_quad_model_matrix_type: str = "ggn",
        *,
        skip_non_finite: bool = True, raise_damping_at_once: bool = False,
        adaptive_learning_rate_bounds: tuple[float, float] | None = None,
        adaptive_momentum_bounds: tuple[float, float] | None = None, max_predicted_decrease: float | None = None,
        max_statistics_growth: float | ArrayLike | None = None, max_consecutive_faults: int | None = None,
        max_consecutive_stalls: int | None = None, stop_in_program: bool = False,
        value_func: Callable[..., Any] | None = None, mesh: Any = None, shard_state: bool = False,
        donate_parameters: bool = False, donate_optimizer_state: bool = False,
        donate_batch_inputs: bool = False, donate_func_state: bool = False, inverse_solver: Any = None,
        on_unmatched: str = "warn", graph_patterns: Sequence[Any] | None = None,
        index_to_block_ctor: Mapping[Any, Any] | None = None, damping_rule: AbstractDampingRule | None = None,
        step_rule: AbstractStepRule | None = None, direction: AbstractDirection | None = None,
        refresh: AbstractRefreshSchedule | None = None, guard: StepGuard | None = None,
        compiler_options: Mapping[str, Any] | None = COMPILER_OPTIONS,
    ):
        """**Arguments:** kfac-jax's keywords, in kfac-jax's order (see its documentation and the
        "Migrating from kfac-jax" page). `estimation_mode=None` is `"ggn_curvature_prop"`;
        `batch_size_extractor=None` (or `kfac_jax.utils.default_batch_size_extractor`) reads the
        batch size off the registered losses. Keywords of kfac-jax's that map onto no part of
        `eqx_kfac` (`precon_power`, `precon_damping_mult`, `custom_estimator_ctor`, ...) are
        accepted at kfac-jax's default and raise `NotImplementedError` otherwise, saying what to
        do; `debug`, `forbid_setting_attributes_after_finalize`, `modifiable_attribute_exceptions`
        and `should_vmap_estimator_samples` are ignored (the reasons are in `_keywords.IGNORED`).

        The keyword-only arguments are `eqx_kfac`'s, each a field of a part: the guard's
        (`skip_non_finite`, `max_consecutive_faults`, `max_consecutive_stalls`,
        `stop_in_program`), the damping's (`raise_damping_at_once`), the step rule's
        (`adaptive_learning_rate_bounds`, `adaptive_momentum_bounds`, `max_predicted_decrease`),
        the refresh's (`max_statistics_growth`), the curvature's (`inverse_solver`,
        `on_unmatched`, `graph_patterns`, `index_to_block_ctor`), the devices' (`mesh`,
        `shard_state`), the step's (the `donate_*` flags, `compiler_options`); `value_func` is
        the loss when `value_and_grad_func` has no `__wrapped__`; `damping_rule`, `step_rule`,
        `direction`, `refresh`, `guard` are parts given directly instead of through the keywords
        that build them (giving both raises `ValueError`).
        """
        arguments = dict(locals())
        parts = built(arguments)
        self.function = parts.function
        self.l2_reg = l2_reg
        self.preconditioner = parts.preconditioner
        self.step_rule = parts.parts.step_rule
        self.damping_rule = parts.parts.damping_rule
        self.guard = parts.parts.guard
        self.devices = parts.devices
        self.options = parts.options

    @pytree_method
    def _replicated_convention(self, rng: Any) -> bool:
        return self.multi_device and is_per_device(rng)

    def init(
        self, params: PyTree, rng: PerDeviceKeys, batch: PyTree, func_state: PyTree = None
    ) -> OptimizerState:
        """Creates the optimizer state, as `eqx_kfac.Optimizer.init`. Under `multi_device=True`
        with one key per device (kfac-jax's replicated convention: `params` and `func_state`
        replicated over the local devices, `batch` with a leading device axis), the state comes
        back replicated too.

        **Arguments:**

        - `params`, `rng`, `batch`, `func_state`: as for `eqx_kfac.Optimizer.init`, or in
          kfac-jax's replicated convention.

        **Returns:**

        An `Optimizer.State` (replicated in kfac-jax's convention).
        """
        if not self._replicated_convention(rng):
            return super().init(params, rng, batch, func_state)
        # One copy read on the host and the batch's shapes: `init` traces the batch, and one
        # compiled program builds the state from one copy and lays out a copy per device.
        copies = functools.partial(replicated_in_program, axis_name=self.pmap_axis_name)
        return self._init(
            first_copy_on_host(params), first_copy_on_host(rng), merged_batch_shapes(batch),
            first_copy_on_host(func_state), lay_out=copies,
        )

    @pytree_method
    def step(
        self, params: PyTree, state: OptimizerState, rng: PerDeviceKeys, data_iterator: Any = None,
        batch: PyTree = None, func_state: PyTree = None, learning_rate: ArrayLike | None = None,
        momentum: ArrayLike | None = None, damping: ArrayLike | None = None, global_step_int: int | None = None,
    ) -> tuple[Any, ...]:
        """Takes one K-FAC step, as `eqx_kfac.Optimizer.step`. Under `multi_device=True` with one
        key per device (kfac-jax's replicated convention), `params`, `state`, `func_state` and
        the given `learning_rate`, `momentum`, `damping` are replicated over the local devices,
        the batches have a leading device axis (merged, devices first, into the global batch),
        and every output comes back replicated, `stats` included (as kfac-jax's `pmap` returns
        it: `stats["loss"][0]`).

        **Arguments:**

        - as for `eqx_kfac.Optimizer.step`, or in kfac-jax's replicated convention.

        **Returns:**

        `(params, state, stats)`, or `(params, state, func_state, stats)` when
        `value_func_has_state` (replicated in kfac-jax's convention).
        """
        if not self._replicated_convention(rng):
            return super().step(
                params, state, rng, data_iterator, batch, func_state, learning_rate, momentum, damping, global_step_int
            )
        iterator = None if data_iterator is None else _merged_batches(data_iterator)
        # One program takes the first copies of them all (one dispatch per step, not seven).
        params, state, rng, func_state, *hyper = unreplicated(
            (params, state, rng, func_state, learning_rate, momentum, damping), device_mesh(self)
        )
        out = super().step(
            params, state, rng, iterator, None if batch is None else merged_batch(batch), func_state, *hyper,
            global_step_int,
        )
        return replicated(out, self.pmap_axis_name)


def _merged_batches(data_iterator: Iterator[Any]) -> Iterator[Any]:
    return (merged_batch(batch) for batch in data_iterator)


def _forms(has_aux: bool, has_state: bool, has_rng: bool) -> ValueFunction:
    """A `ValueFunction` used only for its argument and output forms (`args`, `split`); its
    functions are `_forms` itself, never called."""
    return ValueFunction(_forms, _forms, _forms, has_aux, has_state, has_rng, None)


def make_func_args(
    params: PyTree, func_state: PyTree, rng: PRNGKeyArray | None, batch: PyTree, has_state: bool, has_rng: bool
) -> FuncArgsVariants:
    """The model function's arguments `(params, [func_state], [rng], batch)` (kfac-jax's function).

    **Arguments:**

    - `params`, `func_state`, `rng`, `batch`: the arguments (`func_state` and `rng` may be
      `None` when the function takes none; a `func_state` given to a function without one is
      left out, as kfac-jax does).
    - `has_state`, `has_rng`: whether the function takes a state and a key.

    **Returns:**

    The tuple of arguments.
    """
    # As kfac-jax's: a state given to a function without one is left out (examples/training.py
    # passes `()`), one missing where the function has one is an error.
    check_func_state(has_state, func_state if has_state else None)
    if has_rng and rng is None:
        raise ValueError("make_func_args: rng=None, but has_rng=True; pass the key.")
    return _forms(False, has_state, has_rng).args(params, func_state, rng, batch)


def extract_func_outputs(
    raw_outputs: FuncOutputs, has_aux: bool, has_state: bool
) -> tuple[Array, Any, Any]:
    """`(loss, func_state, aux)` of the model function's output (kfac-jax's function; `None`
    where the function returns none).

    **Arguments:**

    - `raw_outputs`: `loss`, `(loss, aux)`, `(loss, func_state)` or `(loss, (func_state, aux))`.
    - `has_aux`, `has_state`: the form.

    **Returns:**

    The triple.
    """
    return _forms(has_aux, has_state, False).split(raw_outputs)
