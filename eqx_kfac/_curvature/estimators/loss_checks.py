"""Checks of a loss function against its registrations, for the user mistakes that otherwise
fail silently (K-FAC then diverges or learns nothing, with no error).

- **A loss summed over the batch.** K-FAC's curvature is that of the registered losses averaged
  over the batch; a loss summed over it has gradients `B` times larger than the curvature
  expects, and the steps are `B` times too long.
- **A loss averaged over more axes than the batch** (a per-token mean over `(batch, positions)`,
  or a masked mean divided by the number of unmasked examples) registered with the batch
  convention: its curvature is `positions` (or `examples / B`) times too large, and the steps
  that many times too short. Registering with `mean_over="all"` fixes the scale.
- **A batch size that is not the registrations'.** Curvature statistics are divided by the batch
  size; an extractor that reads it off the wrong array (e.g. the first weight of a frozen model
  passed in the batch) scales the curvature wrongly.
- **A loss the parameters do not reach** (registered on `stop_gradient(logits)`, or on the
  targets): it adds no curvature, and the steps are unbounded.
- **The same loss registered twice on one tensor**: its curvature counts twice.
- **Class labels outside `[0, classes)`** (e.g. `-1` for "ignore") on examples that are not
  masked out: lookups would wrap them.
"""

import itertools
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..._core.compiled import ONE_OFF_COMPILER_OPTIONS
from ..._core.tree import any_traced, under_a_trace
from ..._tracing.losses import CategoricalLogitsNegativeLogProbLoss
from ..._tracing.losses.base import examples_counted
from ..._tracing.losses.custom import CustomLoss
from ..._tracing.tracer import registered_losses, registration_problems, trace
from .fallbacks import user_stacklevel


def _what_to_check(func, func_args, params_index) -> tuple[bool, tuple[bool, ...]]:
    """Whether the registered losses' sum can be evaluated (every loss has targets, or is a
    custom loss, which evaluates without), and which losses are categorical (their labels are
    checked): known from the trace, before anything is evaluated."""
    traced = trace(func, func_args, params_index)
    evaluable = all(
        has_targets or issubclass(cls, CustomLoss)
        for cls, has_targets in zip(traced.loss_classes, traced.loss_has_targets, strict=True)
    )
    return evaluable, tuple(issubclass(cls, CategoricalLogitsNegativeLogProbLoss) for cls in traced.loss_classes)


@eqx.filter_jit(compiler_options=dict(ONE_OFF_COMPILER_OPTIONS))
def _loss_facts(func, loss_of, func_args, params_index, evaluable, categorical):
    """The returned loss and, per registered loss, its sum over the examples, the examples a mean
    over all its leading axes counts (`examples_counted`; `None` for a mask of another shape) and
    its class name and inputs' shape (all `None` unless `evaluable`), and each registered loss's
    count of labels out of range (0 for a loss that is not categorical)."""
    losses = registered_losses(func, func_args, params_index)
    labels = [loss.targets_out_of_range() if c else 0 for loss, c in zip(losses, categorical)]
    if not evaluable:
        return None, None, labels
    facts = [
        (jnp.sum(loss.evaluate()), examples_counted(loss.inputs[0], getattr(loss, "mask", None)),
         (type(loss).__name__, loss.inputs[0].shape))
        for loss in losses
    ]
    return loss_of(func(*func_args)), facts, labels


def _concrete_facts(func, loss_of, func_args, batch_size, params_index):
    """`_loss_facts` on concrete arguments; `None` for abstract ones, inside a trace, or when
    there is nothing to check (no categorical loss, and no sum to compare: a loss without
    targets, or one example), which then compiles and evaluates nothing."""
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(func_args)):
        return None
    evaluable, categorical = _what_to_check(func, func_args, params_index)
    evaluable = evaluable and batch_size >= 2
    if not (evaluable or any(categorical)):
        return None
    if any_traced(func_args) or under_a_trace():
        return None  # called inside a trace (e.g. a transformation rebuilt under jit): no values
    return _loss_facts(func, loss_of, tuple(func_args), params_index, evaluable, categorical)


def check_loss_values(
    func: Callable[..., Any],
    loss_of: Callable[[Any], Any],
    func_args: Sequence[Any],
    batch_size: int,
    params_index: int = 0,
) -> None:
    """Raises `ValueError` when, on concrete arguments, `func` returns its registered losses
    summed over the batch, or averaged over more leading axes than the batch (see
    `_check_extra_means`), or a categorical loss is registered with labels outside `[0, classes)`.

    Evaluates the function once (compiled, with `ONE_OFF_COMPILER_OPTIONS`); skipped for abstract
    arguments or inside a trace. The loss counts as summed when it is within 5% of `batch_size`
    times the registered losses' mean and far from the mean itself; a regulariser or other terms
    added to the loss leave room for that. Those checks are skipped when the registered losses
    have no targets (they cannot be evaluated) or the batch has one example.

    **Arguments:**

    - `func`: the loss function.
    - `loss_of`: maps `func`'s output to the loss value.
    - `func_args`: its arguments.
    - `batch_size`: the number of examples in them.
    - `params_index`: position of the parameters among the arguments.
    """
    facts = _concrete_facts(func, loss_of, func_args, batch_size, params_index)
    if facts is None:
        return
    returned, per_loss, labels = facts
    if per_loss is not None:
        mean = sum(float(total) for total, _, _ in per_loss) / batch_size
        _check_averaged(float(returned), mean, batch_size)
        _check_extra_means(float(returned), mean, per_loss, batch_size)
    _check_labels(labels)


def _check_averaged(returned: float, mean: float, batch_size: int) -> None:
    if not (np.isfinite(returned) and np.isfinite(mean)) or mean == 0:
        return
    if abs(returned / (batch_size * mean) - 1) < 0.05 and abs(returned / mean - 1) > 0.5:
        raise ValueError(
            f"The loss function returns {returned:.6g}, {batch_size} (the batch size) times the mean "
            f"of its registered losses ({mean:.6g}): it sums the losses over the batch. K-FAC "
            "approximates the curvature of the loss averaged over the batch, so with a summed loss "
            "every step would be that many times too long. Average the loss over the batch (e.g. "
            "`jnp.mean` instead of `jnp.sum`), or register the losses with `weight=` the factor "
            "you sum with."
        )


def _means_of(count: Any, shape: tuple[int, ...], batch_size: int) -> list[tuple[float, str, str]]:
    """The ways a training loss may average one registered loss beyond the batch: `(factor of its
    registered value, what it averages over, that factor as the user would write it)`, the batch
    mean first."""
    means = [(1.0, "", "")]
    positions = math.prod(shape[1:-1])
    if positions > 1:
        means.append((1 / positions, f"its {positions} positions per example", f"1/{positions}"))
    kept = None if count is None else float(count)
    # Against the loss's own examples (not `batch_size`, which an explicit `batch_size_extractor`
    # may count otherwise): without a mask, or with nothing masked, there is no masked mean.
    if kept and not math.isclose(kept, shape[0] * positions):
        what = f"its {kept:g} unmasked examples (the mask's sum)"
        means.append((batch_size / kept, what, f"{batch_size} / jnp.sum(mask)"))
    return means


def _check_extra_means(returned: float, mean: float, per_loss: Sequence[Any], batch_size: int) -> None:
    """Raises when the returned loss is the registered losses with some of them averaged over
    their other leading axes too (a per-token mean, a masked mean over the unmasked examples), and
    not their batch `mean`: within 5% when that is 25% or more from the mean (terms the loss adds,
    such as an L2 penalty, leave room for that), within 1e-4 when it is 1% or more from it (one
    small loss among others, averaged over its positions)."""
    if not (np.isfinite(returned) and np.isfinite(mean)) or mean == 0 or abs(returned / mean - 1) < 0.01:
        return
    tolerance = 0.05 if abs(returned / mean - 1) >= 0.25 else 1e-4
    sums = [float(total) for total, _, _ in per_loss]
    options = [_means_of(count, shape, batch_size) for _, count, (_, shape) in per_loss]
    for combination in itertools.islice(itertools.product(*options), 1024):
        value = sum(factor * total for (factor, _, _), total in zip(combination, sums)) / batch_size
        if value != 0 and abs(returned / value - 1) < tolerance:
            raise ValueError(_extra_means_message(returned, mean, batch_size, combination, per_loss))


def _times(factor: float) -> str:
    """How a registered curvature compares with the loss's, `factor` being the loss's over it."""
    return f"{1 / factor:.4g} times too large" if factor < 1 else f"{factor:.4g} times too small"


def _extra_means_message(returned, mean, batch_size, combination, per_loss) -> str:
    averaged = [
        f"registered loss #{k} ({name}, inputs of shape {shape}) over {what}: its curvature "
        f"would be {_times(factor)} (or multiply its `weight` by {weight})"
        for k, ((factor, what, weight), (*_, (name, shape))) in enumerate(zip(combination, per_loss))
        if what
    ]
    return (
        f"eqx_kfac: the loss function returns {returned:.6g}, but its registered losses average "
        f"{mean:.6g} over the batch ({batch_size} examples): it also averages "
        + "; ".join(averaged)
        + ". K-FAC's curvature of a registered loss is averaged over the batch (the leading axis) "
        "and summed over its other leading axes, so the steps would be off by as much (too short "
        "for a curvature too large). Register it with `mean_over=\"all\"` (a mean over every "
        "leading axis; with `mask=`, over the unmasked examples) on the batched outputs (inside "
        "`jax.vmap` the registration sees one example)."
    )


def _check_labels(labels: Sequence[Any]) -> None:
    for k, count in enumerate(labels):
        if int(count):
            raise ValueError(
                f"eqx_kfac: registered loss #{k} (a categorical loss) has {int(count)} labels outside "
                "[0, classes) (e.g. -1 used as 'ignore') on examples it does not mask out. Give such "
                "examples `mask=0` in the register_* call (a masked example may carry any label). "
                "In a step, a batch with such a label is skipped (stats['invalid_targets']), "
                "never trained on a wrapped class."
            )


def check_batch_size(
    func: Callable[..., Any],
    func_args: Sequence[Any],
    batch_size: Any,
    params_index: int = 0,
) -> None:
    """Warns when an explicit batch size differs from the registered losses' batch dimension.

    **Arguments:**

    - `func`: the loss function.
    - `func_args`: its arguments.
    - `batch_size`: what the user's `batch_size_extractor` gave (checked when it is a number).
    - `params_index`: position of the parameters among the arguments.
    """
    registered = trace(func, func_args, params_index).loss_batch_size
    try:
        given = int(batch_size)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return
    if given != registered:
        warnings.warn(
            f"eqx_kfac: batch_size_extractor gives {given} examples, but the registered losses' "
            f"inputs have {registered} along their leading (batch) dimension. Curvature statistics "
            "are divided by the batch size, so they would be scaled by "
            f"{registered / given:.4g}. Check what the extractor reads (`default_batch_size_extractor` "
            "reads the first array of the batch, which may be a weight of a frozen model passed in "
            "it), or leave `batch_size_extractor=None` to use the losses' batch dimension.",
            UserWarning,
            stacklevel=user_stacklevel(sys._getframe()),
        )


def warn_about_registrations(func: Callable[..., Any], func_args: Sequence[Any], params_index: int = 0) -> None:
    """Warns (at the user's call) about each problem `registration_problems` finds: a registered
    loss the parameters do not reach, a tensor registered twice as the input of the same loss.

    **Arguments:**

    - `func`: the loss function.
    - `func_args`: its arguments (arrays or `jax.ShapeDtypeStruct`s).
    - `params_index`: position of the parameters among the arguments.
    """
    for problem in registration_problems(trace(func, func_args, params_index), func_args):
        warnings.warn(f"eqx_kfac: {problem}", UserWarning, stacklevel=user_stacklevel(sys._getframe()))
