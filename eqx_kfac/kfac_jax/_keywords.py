"""The translation of kfac-jax's `Optimizer` keywords into `eqx_kfac`'s parts.

`KEYWORDS` is the one place where the keywords that build a part, and their defaults (kfac-jax's),
are written (`eqx_kfac.kfac_jax.Optimizer.__init__` repeats the defaults in its signature for
users' sake; a test checks that they agree). `parts_from_keywords` builds each part from its
keywords, unless the part was given directly, in which case giving any of its keywords too is an
error. `REFUSED` and `IGNORED` are kfac-jax's keywords with no part of their own, `built` the
whole translation of the constructor's arguments.
"""

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from .._curvature.estimators import default_batch_size_extractor
from .._optim.execution import MultiDevice, StepOptions
from .._optim.optimizer import build_value_function
from .._optim.preconditioner import CurvatureOptions, Preconditioner
from .._optim.value_function import ValueFunction
from .curvature_blocks import check_block_ctors
from .._optim.damping import AbstractDampingRule, GivenDamping, LevenbergMarquardtDamping, ScheduledDamping
from .._optim.direction import AbstractDirection, PreconditionedGradient
from .._optim.guard import StepGuard
from .._optim.optax_parts import given_or_built
from .._optim.hyperparameters import (
    AbstractHyperparameter,
    AdaptiveHyperparameter,
    GivenHyperparameter,
    ScheduledHyperparameter,
)
from .._optim.refresh import AbstractRefreshSchedule, RefreshSchedule
from .._optim.step_rule import AbstractStepRule, MomentumStep

# The keywords each part replaces when it is given directly, with their defaults: kfac-jax's (no
# bounds or trust region on the adapted coefficients, no step rejection, every finite batch folded
# in, the damping's floor 1e-8, no stop after faults or stalls in a row).
KEYWORDS: Mapping[str, Mapping[str, Any]] = {
    "damping_rule": dict(
        use_adaptive_damping=False, damping_schedule=None, initial_damping=None, min_damping=1e-8,
        max_damping=math.inf, damping_adaptation_interval=5, damping_adaptation_decay=0.9,
        damping_lower_threshold=0.25, damping_upper_threshold=0.75,
        always_use_exact_qmodel_for_damping_adjustment=False, reject_damping_increase_factor=1.0,
        raise_damping_at_once=False, use_initial_damping_calibration=False,
    ),
    "step_rule": dict(
        use_adaptive_learning_rate=False, learning_rate_schedule=None, use_adaptive_momentum=False,
        momentum_schedule=None, include_damping_in_quad_change=False,
        adaptive_learning_rate_bounds=None, adaptive_momentum_bounds=None,
        max_predicted_decrease=None,
    ),
    "direction": dict(use_exact_inverses=False, norm_constraint=None, distributed_precon_apply=True),
    "refresh": dict(
        num_burnin_steps=10, curvature_update_period=1, inverse_update_period=5, curvature_ema=0.95,
        max_statistics_growth=None,
    ),
    "guard": dict(
        skip_non_finite=True, use_step_rejection=False, max_consecutive_faults=None,
        max_consecutive_stalls=None, stop_in_program=False,
    ),
}


class Parts(NamedTuple):
    """The parts the keywords describe (or that were given directly)."""

    damping_rule: AbstractDampingRule
    step_rule: AbstractStepRule
    direction: AbstractDirection
    refresh: AbstractRefreshSchedule
    guard: StepGuard


def _source(adaptive: bool, schedule: Any, bounds: tuple[float, float] | None, name: str) -> AbstractHyperparameter:
    if adaptive and schedule is not None:
        raise ValueError(
            f"use_adaptive_{name}=True and a {name}_schedule were both given; the {name} is either "
            "adapted or scheduled. Drop one of them."
        )
    if adaptive:
        lower, upper = (-math.inf, math.inf) if bounds is None else bounds
        return AdaptiveHyperparameter(float(lower), float(upper))
    return GivenHyperparameter() if schedule is None else ScheduledHyperparameter(schedule)


def _damping_rule(k: Mapping[str, Any]) -> AbstractDampingRule:
    if k["use_adaptive_damping"] and k["damping_schedule"] is not None:
        raise ValueError(
            "use_adaptive_damping=True and a damping_schedule were both given; the damping is "
            "either adapted or scheduled. Drop one of them."
        )
    if k["use_initial_damping_calibration"] and not k["use_adaptive_damping"]:
        raise ValueError(
            "use_initial_damping_calibration=True calibrates the adaptive damping's start: it "
            "needs use_adaptive_damping=True."
        )
    if k["use_adaptive_damping"]:
        if k["initial_damping"] is None:
            raise ValueError(
                "use_adaptive_damping=True needs initial_damping= (as in kfac-jax); 1e-2 suits "
                "losses of order one, and eqx_kfac.Optimizer's default damping rule starts there."
            )
        return LevenbergMarquardtDamping(
            initial_damping=k["initial_damping"], interval=k["damping_adaptation_interval"],
            decay=k["damping_adaptation_decay"], lower=k["damping_lower_threshold"],
            upper=k["damping_upper_threshold"], minimum=k["min_damping"], maximum=k["max_damping"],
            always_exact=k["always_use_exact_qmodel_for_damping_adjustment"],
            include_damping_in_quad_change=k["include_damping_in_quad_change"],
            fault_increase=k["reject_damping_increase_factor"],
            raise_at_once=k["raise_damping_at_once"], calibrate=k["use_initial_damping_calibration"],
        )
    if k["damping_schedule"] is not None:
        return ScheduledDamping(k["damping_schedule"])
    return GivenDamping()


def _step_rule(k: Mapping[str, Any]) -> AbstractStepRule:
    if k["norm_constraint"] is not None and k["use_adaptive_learning_rate"]:
        raise ValueError(
            "norm_constraint cannot be used with use_adaptive_learning_rate=True: the adaptive "
            "learning rate already chooses the step length. Drop one of them."
        )
    return MomentumStep(
        _source(k["use_adaptive_learning_rate"], k["learning_rate_schedule"],
                k["adaptive_learning_rate_bounds"], "learning_rate"),
        _source(k["use_adaptive_momentum"], k["momentum_schedule"],
                k["adaptive_momentum_bounds"], "momentum"),
        k["include_damping_in_quad_change"],
        k["max_predicted_decrease"],
    )


_BUILDERS: Mapping[str, Callable[[Mapping[str, Any]], Any]] = {
    "damping_rule": _damping_rule,
    "step_rule": _step_rule,
    "direction": lambda k: PreconditionedGradient(
        k["use_exact_inverses"], k["norm_constraint"], k["distributed_precon_apply"]
    ),
    # kfac-jax inverts at every step with `inverse_update_period=1` and has no fallback for a
    # failed inversion: a cache refreshed at every step gives its values and compiles no fallback.
    "refresh": lambda k: RefreshSchedule(
        k["num_burnin_steps"], k["curvature_update_period"], k["inverse_update_period"],
        k["curvature_ema"], k["max_statistics_growth"],
        cache_inverses=True if k["inverse_update_period"] == 1 else None,
    ),
    "guard": lambda k: StepGuard(
        k["skip_non_finite"], k["use_step_rejection"], k["max_consecutive_faults"],
        max_consecutive_stalls=k["max_consecutive_stalls"], stop_in_program=k["stop_in_program"],
    ),
}


# The fields of the parts that the keywords set, for errors raised by the parts themselves.
_FIELD_KEYWORDS = {
    "initial_damping": "initial_damping", "interval": "damping_adaptation_interval",
    "decay": "damping_adaptation_decay", "lower": "damping_lower_threshold",
    "upper": "damping_upper_threshold", "minimum": "min_damping", "maximum": "max_damping",
    "fault_increase": "reject_damping_increase_factor", "raise_at_once": "raise_damping_at_once",
}


def _in_keywords(part: str, error: ValueError) -> ValueError:
    named = [f"{field} is {keyword}" for field, keyword in _FIELD_KEYWORDS.items() if field in str(error)]
    hint = f" (from the kfac_jax.Optimizer keywords: {', '.join(named)})" if named and part == "damping_rule" else ""
    return ValueError(f"{error}{hint}")


def parts_from_keywords(keywords: Mapping[str, Any], given: Mapping[str, Any]) -> Parts:
    """Builds the parts from the kfac-jax keywords, or takes the ones given directly.

    **Arguments:**

    - `keywords`: every keyword of `KEYWORDS` by name (the constructor's values).
    - `given`: the parts given directly by name (`None` where not given).

    **Returns:**

    The `Parts`.
    """
    parts = {}
    for part, build in _BUILDERS.items():
        try:
            parts[part] = given_or_built(
                "kfac_jax.Optimizer", part, given[part], keywords, KEYWORDS[part],
                lambda build=build: build(keywords),
            )
        except ValueError as error:
            if given[part] is not None:
                raise
            raise _in_keywords(part, error) from None
    return Parts(**parts)


# kfac-jax's keywords with no part of their own: accepted at kfac-jax's default; another value
# raises `NotImplementedError` with what to do instead.
REFUSED: Mapping[str, tuple[Any, str]] = {
    "regularized_parameters_path_exclusions": (
        "", "l2_reg's curvature term covers every parameter here. Pass l2_reg=0.0 (your loss keeps "
        "its regulariser; only its curvature term, a diagonal l2_reg, is left out) or use "
        "eqx_kfac.Optimizer with the regulariser in the damping."
    ),
    "precon_damping_mult": (1.0, "the preconditioner uses the damping itself; scale the damping instead."),
    "precon_damping_schedule": (
        None, "the preconditioner uses the damping itself: give the schedule as damping_schedule=."
    ),
    "custom_estimator_ctor": (
        None, "the estimator is eqx_kfac's BlockDiagonalCurvature: choose its blocks with "
        "layer_tag_to_block_ctor= or index_to_block_ctor=, its patterns with graph_patterns=."
    ),
    "invalid_metric_value": (math.nan, "a statistic not computed at a step is NaN."),
    "include_registered_loss_in_stats": (
        False, "init checks the loss against its registrations; "
        "eqx_kfac.BlockDiagonalCurvature(loss, args).registrations() lists them."
    ),
    "num_estimator_samples": (1, "the estimates draw one sample per example; use a larger batch."),
    "norm_to_scale_identity_weight_per_block": (None, "every block gets the same damping."),
    "precon_power": (-1.0, "the preconditioner is the curvature's inverse (power -1)."),
}

# kfac-jax's keywords accepted at any value and ignored, each for the reason given.
IGNORED: Mapping[str, tuple[Any, str]] = {
    "debug": (False, "the step is an ordinary function: jax.disable_jit() runs it uncompiled."),
    "forbid_setting_attributes_after_finalize": (True, "the optimizer is an immutable eqx.Module."),
    "modifiable_attribute_exceptions": ((), "the optimizer is an immutable eqx.Module."),
    "should_vmap_estimator_samples": (False, "one sample per example (num_estimator_samples=1)."),
}

# The matrices of kfac-jax's exact quadratic model that eqx_kfac's is: the GGN, or the Fisher
# after the estimation mode, which are the same matrix for every registered negative
# log-likelihood of `eqx_kfac` (natural parameters of an exponential family).
QUAD_MODEL_MATRICES = ("ggn", "fisher")


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    if isinstance(default, float) and math.isnan(default):
        return isinstance(value, float) and math.isnan(value)
    try:
        return bool(value == default)
    except (TypeError, ValueError):  # an array's comparison
        return False


def _check_refused(arguments: Mapping[str, Any]) -> None:
    for name, (default, instead) in REFUSED.items():
        value = arguments[name]
        if name == "norm_to_scale_identity_weight_per_block" and value == "none":
            continue
        if not _is_default(value, default):
            raise NotImplementedError(
                f"kfac_jax.Optimizer({name}={value!r}) is not supported by eqx_kfac (only "
                f"{default!r}): {instead}"
            )
    if arguments["exact_quad_model_matrix_type"] not in QUAD_MODEL_MATRICES:
        raise NotImplementedError(
            f"kfac_jax.Optimizer(exact_quad_model_matrix_type={arguments['exact_quad_model_matrix_type']!r}) "
            f"is not supported by eqx_kfac: the exact quadratic model uses the GGN (equal to the "
            f"Fisher for the registered losses); pass one of {QUAD_MODEL_MATRICES}."
        )


class Built(NamedTuple):
    """Everything `eqx_kfac.kfac_jax.Optimizer` holds, built from its arguments."""

    function: ValueFunction
    preconditioner: Preconditioner
    parts: Parts
    devices: MultiDevice | None
    options: StepOptions


def _devices(a: Mapping[str, Any]) -> MultiDevice | None:
    if a["shard_state"] and not a["multi_device"]:
        raise ValueError("shard_state=True shards the state over the devices: it needs multi_device=True.")
    if not a["multi_device"]:
        return None
    return MultiDevice(a["mesh"], a["pmap_axis_name"], a["distributed_inverses"], a["shard_state"])


def _curvature(a: Mapping[str, Any]) -> CurvatureOptions:
    auto_register_kwargs = dict(a["auto_register_kwargs"] or {})
    if not a["use_automatic_registration"]:
        auto_register_kwargs["auto_register_tags"] = False
    extractor = a["batch_size_extractor"]
    return CurvatureOptions(
        estimation_mode=a["estimation_mode"] or "ggn_curvature_prop",
        layer_tag_to_block_ctor=a["layer_tag_to_block_ctor"], index_to_block_ctor=a["index_to_block_ctor"],
        auto_register_kwargs=auto_register_kwargs, inverse_solver=a["inverse_solver"],
        on_unmatched=a["on_unmatched"],
        # kfac-jax's default extractor (the first leaf's leading axis) is left to the registered
        # losses, which know the batch axis; an extractor of the user's is checked against them.
        batch_size_extractor=None if extractor is default_batch_size_extractor else extractor,
        graph_patterns=a["graph_patterns"], patterns_to_skip=a["patterns_to_skip"],
        register_only_generic=a["register_only_generic"],
    )


def built(a: Mapping[str, Any]) -> Built:
    """Translates `eqx_kfac.kfac_jax.Optimizer`'s arguments into its fields.

    **Arguments:**

    - `a`: every argument of the constructor by name.

    **Returns:**

    The `Built` fields; a keyword of `REFUSED` away from its default raises
    `NotImplementedError`, conflicting keywords `ValueError`.
    """
    _check_refused(a)
    check_block_ctors(a["layer_tag_to_block_ctor"])
    check_block_ctors(a["index_to_block_ctor"])
    keywords = {name: a[name] for part in KEYWORDS.values() for name in part}
    given = {part: a[part] for part in _BUILDERS}
    parts = parts_from_keywords(keywords, given)
    function = build_value_function(
        a["value_and_grad_func"], a["value_func"], a["value_func_for_estimator"],
        (a["value_func_has_aux"], a["value_func_has_state"], a["value_func_has_rng"]), a["batch_process_func"],
    )
    options = StepOptions(
        donate_parameters=a["donate_parameters"], donate_optimizer_state=a["donate_optimizer_state"],
        donate_batch_inputs=a["donate_batch_inputs"], donate_func_state=a["donate_func_state"],
        compiler_options=a["compiler_options"], include_norms_in_stats=a["include_norms_in_stats"],
        include_per_param_norms_in_stats=a["include_per_param_norms_in_stats"],
    )
    preconditioner = Preconditioner(_curvature(a), parts.refresh, parts.direction)
    return Built(function, preconditioner, parts, _devices(a), options)
