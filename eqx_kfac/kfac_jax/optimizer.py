"""`eqx_kfac.kfac_jax.Optimizer`: kfac-jax's `Optimizer`, its keywords and defaults, on
`eqx_kfac`'s parts."""

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
from jax.typing import ArrayLike

from .._core.compiled import COMPILER_OPTIONS
from .._optim.damping import AbstractDampingRule
from .._optim.direction import AbstractDirection
from .._optim.execution import MultiDevice, StepOptions
from .._optim.guard import StepGuard
from .._optim.hyperparameters import Schedule
from .._optim.optimizer import AbstractKFACOptimizer, build_value_function
from .._optim.preconditioner import CurvatureOptions, Preconditioner
from .._optim.refresh import AbstractRefreshSchedule
from .._optim.step_rule import AbstractStepRule
from .._optim.value_function import ValueFunction
from ._keywords import KEYWORDS, parts_from_keywords


def _devices(multi_device: bool, mesh: Any, axis_name: str, distributed_inverses: bool, shard_state: bool):
    if shard_state and not multi_device:
        raise ValueError("shard_state=True shards the state over the devices: it needs multi_device=True.")
    if not multi_device:
        return None
    return MultiDevice(mesh, axis_name, distributed_inverses, shard_state)


class Optimizer(AbstractKFACOptimizer):
    """kfac-jax's `Optimizer`: the same keywords, meanings and defaults, built from `eqx_kfac`'s
    parts (final). `import eqx_kfac.kfac_jax as kfac_jax` runs kfac-jax code; the defaults are
    kfac-jax's (no bounds or trust region on the adapted coefficients, no step rejection, every
    finite batch folded in, `min_damping=1e-8`, `initial_damping` required with adaptive damping,
    no stop after faults in a row). `eqx_kfac.Optimizer(value_and_grad_func)` is the recommended
    configuration instead; the "Migrating from kfac-jax" page lists the differences.
    """

    function: ValueFunction
    l2_reg: float = eqx.field(static=True)
    preconditioner: Preconditioner
    step_rule: AbstractStepRule
    damping_rule: AbstractDampingRule
    guard: StepGuard
    devices: MultiDevice | None
    options: StepOptions

    def __init__(
        self,
        value_and_grad_func: Callable[..., Any],
        l2_reg: float,
        value_func_has_aux: bool = False,
        value_func_has_state: bool = False,
        value_func_has_rng: bool = False,
        use_adaptive_learning_rate: bool = False,
        learning_rate_schedule: Schedule | None = None,
        use_adaptive_momentum: bool = False,
        momentum_schedule: Schedule | None = None,
        use_adaptive_damping: bool = False,
        damping_schedule: Schedule | None = None,
        initial_damping: float | None = None,
        min_damping: float = 1e-8,
        max_damping: float = math.inf,
        include_damping_in_quad_change: bool = False,
        damping_adaptation_interval: int = 5,
        damping_adaptation_decay: float = 0.9,
        damping_lower_threshold: float = 0.25,
        damping_upper_threshold: float = 0.75,
        always_use_exact_qmodel_for_damping_adjustment: bool = False,
        norm_constraint: float | None = None,
        num_burnin_steps: int = 10,
        estimation_mode: str = "ggn_curvature_prop",
        curvature_ema: float = 0.95,
        inverse_update_period: int = 5,
        use_exact_inverses: bool = False,
        batch_process_func: Callable[[Any], Any] | None = None,
        register_only_generic: bool = False,
        patterns_to_skip: Sequence[str] = (),
        auto_register_kwargs: Mapping[str, Any] | None = None,
        layer_tag_to_block_ctor: Mapping[str, Any] | None = None,
        multi_device: bool = False,
        mesh: Any = None,
        pmap_axis_name: str = "kfac_axis",
        batch_size_extractor: Callable[[Any], Any] | None = None,
        include_norms_in_stats: bool = False,
        include_per_param_norms_in_stats: bool = False,
        distributed_precon_apply: bool = True,
        distributed_inverses: bool = True,
        skip_non_finite: bool = True,
        *,
        use_step_rejection: bool = False,
        shard_state: bool = False,
        use_initial_damping_calibration: bool = False,
        reject_damping_increase_factor: float = 1.0,
        raise_damping_at_once: bool = False,
        adaptive_learning_rate_bounds: tuple[float, float] | None = None,
        adaptive_momentum_bounds: tuple[float, float] | None = None,
        max_predicted_decrease: float | None = None,
        max_statistics_growth: float | ArrayLike | None = None,
        max_consecutive_faults: int | None = None,
        max_consecutive_stalls: int | None = None,
        stop_in_program: bool = False,
        curvature_update_period: int = 1,
        value_func: Callable[..., Any] | None = None,
        value_func_for_estimator: Callable[..., Any] | None = None,
        donate_parameters: bool = False,
        donate_optimizer_state: bool = False,
        donate_batch_inputs: bool = False,
        donate_func_state: bool = False,
        inverse_solver: Any = None,
        on_unmatched: str = "warn",
        graph_patterns: Sequence[Any] | None = None,
        index_to_block_ctor: Mapping[Any, Any] | None = None,
        damping_rule: AbstractDampingRule | None = None,
        step_rule: AbstractStepRule | None = None,
        direction: AbstractDirection | None = None,
        refresh: AbstractRefreshSchedule | None = None,
        guard: StepGuard | None = None,
        compiler_options: Mapping[str, Any] | None = COMPILER_OPTIONS,
    ):
        """**Arguments:** kfac-jax's keywords (see its documentation and the "Migrating from
        kfac-jax" page); the ones after `skip_non_finite` are `eqx_kfac`'s, each a field of a part:

        - the guard (`StepGuard`): `skip_non_finite`, `use_step_rejection`,
          `max_consecutive_faults`, `max_consecutive_stalls`, `stop_in_program`;
        - the damping (`LevenbergMarquardtDamping`): `reject_damping_increase_factor`,
          `raise_damping_at_once`, `use_initial_damping_calibration`;
        - the step rule (`MomentumStep`): `adaptive_learning_rate_bounds`,
          `adaptive_momentum_bounds` (`None`: unbounded), `max_predicted_decrease`;
        - the refresh (`RefreshSchedule`): `curvature_update_period`, `max_statistics_growth`;
        - the curvature (`CurvatureOptions`): `inverse_solver`, `on_unmatched`,
          `graph_patterns`, `index_to_block_ctor`;
        - devices (`MultiDevice`): `shard_state`; the step (`StepOptions`): the `donate_*`
          flags, `compiler_options`;
        - `value_func`: the loss, when `value_and_grad_func` has no `__wrapped__`;
        - `damping_rule`, `step_rule`, `direction`, `refresh`, `guard`: parts given directly
          instead of through the keywords that build them (giving both raises `ValueError`).
        """
        arguments = dict(locals())
        keywords = {name: arguments[name] for part in KEYWORDS.values() for name in part}
        given = dict(damping_rule=damping_rule, step_rule=step_rule, direction=direction, refresh=refresh, guard=guard)
        parts = parts_from_keywords(keywords, given)
        self.devices = _devices(multi_device, mesh, pmap_axis_name, distributed_inverses, shard_state)
        self.function = build_value_function(
            value_and_grad_func, value_func, value_func_for_estimator,
            (value_func_has_aux, value_func_has_state, value_func_has_rng), batch_process_func,
        )
        self.l2_reg = l2_reg
        curvature = CurvatureOptions(
            estimation_mode=estimation_mode, layer_tag_to_block_ctor=layer_tag_to_block_ctor,
            index_to_block_ctor=index_to_block_ctor, auto_register_kwargs=auto_register_kwargs,
            inverse_solver=inverse_solver, on_unmatched=on_unmatched,
            batch_size_extractor=batch_size_extractor, graph_patterns=graph_patterns,
            patterns_to_skip=patterns_to_skip, register_only_generic=register_only_generic,
        )
        self.preconditioner = Preconditioner(curvature, parts.refresh, parts.direction)
        self.step_rule = parts.step_rule
        self.damping_rule = parts.damping_rule
        self.guard = parts.guard
        self.options = StepOptions(
            donate_parameters=donate_parameters, donate_optimizer_state=donate_optimizer_state,
            donate_batch_inputs=donate_batch_inputs, donate_func_state=donate_func_state,
            compiler_options=compiler_options, include_norms_in_stats=include_norms_in_stats,
            include_per_param_norms_in_stats=include_per_param_norms_in_stats,
        )
