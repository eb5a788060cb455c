"""The state of `Optimizer`: each part's own state, the estimator's, and the counters."""

import functools
import io
import pathlib
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from .._curvature.estimators import BlockDiagonalCurvature, EstimatorState
from .abstract_optimizer import AbstractOptimizer
from .guard import GuardState

_LOW_WORD = 2**30


class ExampleCount(eqx.Module):
    """A count of examples that does not overflow 32-bit integers: `high · 2³⁰ + low` (final).

    (An `int32` counter wraps after 2³¹ examples, where a schedule of `data_seen` would jump.)

    **Fields:**

    - `high`, `low`: the two words, `0 <= low < 2³⁰`.
    """

    high: Int[Array, ""]
    low: Int[Array, ""]

    @classmethod
    def zero(cls) -> "ExampleCount":
        """No examples."""
        return cls(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))

    def add(self, count: ArrayLike) -> "ExampleCount":
        """The count plus `count` examples (`count < 2³⁰`)."""
        low = self.low + jnp.asarray(count, jnp.int32)
        return ExampleCount(self.high + low // _LOW_WORD, low % _LOW_WORD)

    def as_int(self) -> int:
        """The exact count as a Python integer (reads the two words from the device).

        **Returns:**

        `high · 2³⁰ + low`.
        """
        return int(self.high) * _LOW_WORD + int(self.low)

    @property
    def value(self) -> Float[Array, ""]:
        """The count as a float of the default dtype (exact up to 2²⁴ in float32, 2⁵³ in float64)."""
        dtype = jnp.result_type(float)
        return self.high.astype(dtype) * _LOW_WORD + self.low.astype(dtype)


class OptimizerState(eqx.Module):
    """The state of `Optimizer` (also available as `Optimizer.State`; final).

    **Fields:**

    - `direction_state`: the direction's state (`None` for `PreconditionedGradient`; for
      `EigenbasisAdam`, its moments).
    - `step_rule_state`: the step rule's state (for `MomentumStep`, a `MomentumState` with the
      previous update).
    - `damping_state`: the damping rule's state (for the built-in rules, a `DampingState`).
    - `guard_state`: the step guard's `GuardState` (faults in a row).
    - `estimator_state`: the curvature estimator's state (moving averages and cached inverses).
    - `examples_seen`: the number of examples processed (`ExampleCount`; `data_seen` reads it).
    - `step_counter`: the number of K-FAC steps taken (a warm start's steps are not counted).
    - `warm_start_state`: the `WarmStart`'s `WarmStartState`, or `None` without one.
    - `batch_signature`, `params_signature`: (static) the structure, shapes and dtypes of the
      batch and parameters given to `init`; `step` rejects others.
    """

    direction_state: PyTree[Array]
    step_rule_state: PyTree[Array]
    damping_state: PyTree[Array]
    guard_state: GuardState
    estimator_state: EstimatorState
    examples_seen: ExampleCount
    step_counter: Int[Array, ""]
    warm_start_state: PyTree[Array] | None
    batch_signature: Any = eqx.field(static=True)
    params_signature: Any = eqx.field(static=True)

    @property
    def velocities(self) -> PyTree[Array]:
        """The step rule's velocity (the previous update, for `MomentumStep`)."""
        return self.step_rule_state.velocity

    @property
    def damping(self) -> Float[Array, ""]:
        """The damping rule's current damping (for the built-in rules)."""
        return self.damping_state.damping

    @property
    def data_seen(self) -> Float[Array, ""]:
        """The number of examples processed, as a float (see `ExampleCount`)."""
        return self.examples_seen.value


def new_state(
    optimizer: AbstractOptimizer, estimator: BlockDiagonalCurvature, filtered: PyTree, rng: PRNGKeyArray,
    batch_signature: Any, params_signature: Any,
) -> OptimizerState:
    """The state `optimizer.init` makes (uncompiled).

    **Arguments:**

    - `optimizer`: the optimizer.
    - `estimator`: its curvature estimator for the `init` arguments.
    - `filtered`: the trained parameters (`eqx.filter(params, eqx.is_inexact_array)`).
    - `rng`: the blocks' PRNG key.
    - `batch_signature`, `params_signature`: the state's static fields.

    **Returns:**

    The initial state.
    """
    dtype = jnp.result_type(*jax.tree.leaves(filtered), jnp.float32)
    return OptimizerState(
        direction_state=optimizer.direction.init(estimator, filtered),
        step_rule_state=optimizer.step_rule.init(filtered),
        damping_state=optimizer.damping_rule.init(dtype),
        guard_state=optimizer.guard.init(),
        estimator_state=optimizer.preconditioner.init(estimator, rng),
        examples_seen=ExampleCount.zero(),
        step_counter=jnp.zeros((), jnp.int32),
        warm_start_state=None if optimizer.warm_start is None else optimizer.warm_start.init(filtered),
        batch_signature=batch_signature,
        params_signature=params_signature,
    )


# What differs when a state does not fit an optimizer, for its messages.
OTHER_CONFIGURATION = (
    "an optimizer of another configuration (e.g. PreconditionedGradient's exact_inverses, the "
    "blocks chosen by layer_tag_to_block_ctor / index_to_block_ctor, the direction, the step rule "
    "or the damping rule) or for other parameters or batch"
)


class _Mismatch(ValueError):
    """A saved state that does not fit the template (Equinox wraps it in its `TreePathError`)."""


def _shape_and_dtype(x: Any) -> str:
    return f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}"


def _load_leaf(path: str, last: bool, f: io.IOBase, like: Any) -> Any:
    """Equinox's deserialisation of one leaf, refused where the saved leaf does not fit `like`."""
    try:
        value = eqx.default_deserialise_filter_spec(f, like)
    except (EOFError, ValueError, OSError) as error:
        raise _Mismatch(
            f"Cannot load the optimizer state: the file ends, or holds something else, where "
            f"`{path}` should be ({error}). It was saved by {OTHER_CONFIGURATION}."
        ) from None
    if _shape_and_dtype(value) != _shape_and_dtype(like):
        raise _Mismatch(
            f"Cannot load the optimizer state: `{path}` is {_shape_and_dtype(value)} in the file but "
            f"{_shape_and_dtype(like)} in this optimizer's state. It was saved by "
            f"{OTHER_CONFIGURATION}: load it with an optimizer built as the one that saved it, or "
            "start from this optimizer's `init`."
        )
    if last and f.read(1):
        raise _Mismatch(
            "Cannot load the optimizer state: the file holds more arrays than this optimizer's "
            f"state. It was saved by {OTHER_CONFIGURATION}."
        )
    return value


def load_state(path_or_file: str | pathlib.Path | io.IOBase, template: PyTree) -> PyTree:
    """`eqx.tree_deserialise_leaves(path_or_file, template)`, refused with a `ValueError` that
    names the first leaf whose saved array does not fit (or a file with more arrays): a state
    saved by an optimizer of another configuration. For any optimizer state: `Optimizer.load_state`
    builds the template with `init`; for `kfac_optax` (or any optax chain holding
    `kfac_preconditioner`), pass `optimizer.init(params)`.

    **Arguments:**

    - `path_or_file`: what `eqx.tree_serialise_leaves` wrote the state to.
    - `template`: this optimizer's state (from its `init`).

    **Returns:**

    The loaded state.
    """
    paths = [jax.tree_util.keystr(p).lstrip(".") for p, _ in jax.tree_util.tree_leaves_with_path(template)]
    specs = [functools.partial(_load_leaf, path, i == len(paths) - 1) for i, path in enumerate(paths)]
    try:
        return eqx.tree_deserialise_leaves(
            path_or_file, template, filter_spec=jax.tree.unflatten(jax.tree.structure(template), specs)
        )
    except RuntimeError as error:
        cause = error
        while cause is not None and not isinstance(cause, _Mismatch):
            cause = cause.__cause__
        if cause is None:
            raise
        raise ValueError(*cause.args) from None
