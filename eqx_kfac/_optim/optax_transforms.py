"""`kfac_preconditioner` and `kfac_optax`: K-FAC as optax transformations.

The preconditioner keeps the curvature estimate (moving averages and cached inverses) in its optax
state and maps gradients to `(C + (l2_reg + damping) I)⁻¹ g`, with the same `Preconditioner` as
`Optimizer`. Everything else (learning rate, momentum, clipping, weight decay, schedules, gradient
accumulation) is left to ordinary optax transformations around it; `kfac_optax` is the ready
recipe, guarded by the same `StepGuard` as `Optimizer` (`optax_guard.py`).
"""

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from .._core.compiled import compiled, ONE_OFF_COMPILER_OPTIONS
from .._core.control_flow import select_changed
from .._core.tree import all_finite
from .._curvature.blocks import CurvatureBlock
from .._curvature.blocks.linear_solver import SolverChoice
from .._curvature.estimators import EstimatorState
from .._tracing.host_constants import host_built
from .._tracing.layer_data import LayerSpec
from .arguments import tree_difference
from .direction import AbstractDirection
from .guard import StepGuard
from .optax_guard import check_restored, GuardedTransform, skip_non_finite, SkipNonFiniteState
from .optax_parts import PART_KEYWORDS, preconditioner_from_keywords
from .preconditioner import CurvatureOptions, Preconditioner
from .refresh import AbstractRefreshSchedule


class KFACPreconditionerState(eqx.Module):
    """The optax state of `kfac_preconditioner` (final).

    All leaves are arrays whose shapes and dtypes never change, so the state works with
    `optax.MultiSteps`, `jax.lax.cond` and `eqx.tree_serialise_leaves`.

    **Fields:**

    - `count`: the number of updates so far (`int32`).
    - `estimator_state`: the curvature estimator's state (moving averages and cached inverses).
    - `direction_state`: the direction's state (`None` for `PreconditionedGradient`; for
      `EigenbasisAdam`, its moments).
    """

    count: Int[Array, ""]
    estimator_state: EstimatorState
    direction_state: PyTree[Array]


def _loss_of(out: Any) -> Any:
    return out[0] if isinstance(out, tuple) else out


def _loss_args(num_loss_args: int, batch: Any, loss_args: Any) -> tuple[Any, ...]:
    """The arguments of the loss after the model, from `update`'s `batch=` or `loss_args=`."""
    if loss_args is None and num_loss_args == 1 and batch is not None:
        loss_args = (batch,)
    if loss_args is None or batch is not None and num_loss_args > 1:
        call = "batch=..." if num_loss_args == 1 else f"loss_args=(...{num_loss_args} arguments...)"
        raise ValueError(
            "kfac_preconditioner: update needs this step's arguments of loss_fn after the "
            f"model: call `update(grads, state, params, {call}, key=...)`."
        )
    if len(loss_args) != num_loss_args:
        raise ValueError(
            f"kfac_preconditioner: loss_args has {len(loss_args)} entries, but loss_fn takes "
            f"{num_loss_args} arguments after the model (as in example_args)."
        )
    return tuple(loss_args)


def _check_scalar_loss(loss_fn: Callable[..., Any], example_args: tuple[Any, ...]) -> None:
    out = eqx.filter_eval_shape(lambda args: _loss_of(loss_fn(*args)), example_args)
    if getattr(out, "shape", None) != ():
        raise ValueError(
            "kfac_preconditioner: loss_fn must return a scalar, the loss averaged over the batch, "
            f"but it returns {jax.tree.map(lambda x: getattr(x, 'shape', x), out)} on example_args. "
            "Average the per-example losses (`jnp.mean(losses)`); other outputs go after the loss "
            "as `(loss, aux)`."
        )


def _func_args(
    static_model: Any, num_loss_args: int, params: Any, batch: Any, loss_args: Any
) -> tuple[Any, ...]:
    """`loss_fn`'s arguments: the model from `params` (its inexact arrays) and the rest."""
    if params is None:
        raise ValueError(
            "kfac_preconditioner: update needs the current parameters: call "
            "`update(grads, state, params, batch=..., key=...)`."
        )
    rest = eqx.filter(params, eqx.is_inexact_array, inverse=True)
    # A whole model passed as `params` must compute what `example_args`' model computes (its
    # other leaves and static fields, e.g. an activation function, are those of `static_model`).
    difference = tree_difference(rest, static_model, "model") if jax.tree.leaves(rest) else None
    if difference is not None:
        path, here, there = difference
        raise ValueError(
            f"kfac_preconditioner: the model passed to update computes something else than the "
            f"model of example_args: `{path}` is {here} here, {there} in example_args. The curvature "
            "is that of example_args' model: build the optimizer with this model in example_args."
        )
    model = eqx.combine(eqx.filter(params, eqx.is_inexact_array), static_model)
    return (model, *_loss_args(num_loss_args, batch, loss_args))


def kfac_preconditioner(
    loss_fn: Callable[..., Any],
    example_args: Sequence[Any],
    *,
    damping: float | ArrayLike | optax.Schedule,
    l2_reg: float | ArrayLike = 0.0,
    curvature_ema: float | ArrayLike = 0.95,
    curvature_update_period: int = 1,
    inverse_update_period: int = 5,
    estimation_mode: str = "fisher_gradients",
    use_exact_inverses: bool = False,
    layer_tag_to_block_ctor: Mapping[str, Callable[[LayerSpec], CurvatureBlock]] | None = None,
    batch_size_extractor: Callable[[Any], Any] | None = None,
    inverse_solver: SolverChoice | None = None,
    on_unmatched: str = "warn",
    norm_constraint: float | ArrayLike | None = None,
    index_to_block_ctor: Mapping[Any, Callable[[LayerSpec], CurvatureBlock]] | None = None,
    graph_patterns: Sequence[Any] | None = None,
    patterns_to_skip: Sequence[str] = (),
    register_only_generic: bool = False,
    auto_register_kwargs: Mapping[str, Any] | None = None,
    max_statistics_growth: float | ArrayLike | None = 1e3,
    curvature: CurvatureOptions | None = None,
    refresh: AbstractRefreshSchedule | None = None,
    direction: AbstractDirection | None = None,
) -> optax.GradientTransformationExtraArgs:
    """K-FAC preconditioning as an optax transformation: `g ↦ (C + (l2_reg + damping) I)⁻¹ g`.

    `C` is the block-diagonal curvature estimate of `BlockDiagonalCurvature` (K-FAC blocks for
    dense and conv layers by default), kept in the optax state. `update` folds the batch into
    the estimate every `curvature_update_period` steps, refreshes the cached inverses (damped by
    `l2_reg + damping`) every `inverse_update_period` steps, and returns the preconditioned
    gradient. It returns a *descent direction*, not an update: follow it with a learning rate.

    **Matching `Optimizer`.** kfac-jax's update is `δ_k = m·δ_{k-1} − lr_k·P g_k`. Since
    `optax.trace(m)` computes `t_k = m·t_{k-1} + u_k`,

    - `optax.chain(kfac_preconditioner(...), optax.trace(m), optax.scale(-lr))` gives
      `−lr·t_k = m·(−lr·t_{k-1}) − lr·P g_k`: the same steps as `Optimizer` with fixed
      `learning_rate=lr, momentum=m, damping=d` (and `num_burnin_steps=0`), for a fixed `lr`;
    - `optax.chain(kfac_preconditioner(...), optax.scale_by_schedule(lambda k: -lr(k)),
      optax.trace(m))` puts the learning rate before the momentum, as kfac-jax does, and matches
      `Optimizer` with `learning_rate_schedule=lr` too. (With trace first, a changing learning
      rate would also rescale the accumulated velocity.)

    Pass the same PRNG key to `update` as to `Optimizer.step` for the same curvature samples.

    **Usage.**

    ```python
    precondition = eqx_kfac.kfac_preconditioner(loss, (model, batch), damping=1e-3)
    optimizer = optax.chain(precondition, optax.trace(0.9), optax.scale(-0.1))
    params = eqx.filter(model, eqx.is_inexact_array)
    opt_state = optimizer.init(params)
    grads = eqx.filter_grad(loss)(model, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params, batch=batch, key=key)
    model = eqx.apply_updates(model, updates)
    ```

    Under `optax.inject_hyperparams`, name the non-numeric arguments static:
    `optax.inject_hyperparams(eqx_kfac.kfac_preconditioner, static_args=("loss_fn",
    "curvature_update_period", "inverse_update_period", "batch_size_extractor"))`; `damping`,
    `l2_reg` and `curvature_ema` then become injectable hyperparameters. A part given there
    (`curvature=`, `refresh=`, `direction=`) is static too (a direction is callable, which
    `inject_hyperparams` would take for a schedule): list it in `static_args`.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch)`, or `loss_fn(model, *loss_args)` for other forms (e.g.
      `loss_fn(model, func_state, key, batch)` with an `eqx.nn.State` and a dropout key), the
      training loss or `(loss, anything)`; it must register its losses (e.g.
      `register_softmax_cross_entropy_loss`).
    - `example_args`: `(model, batch)` (or `(model, *loss_args)`) with the shapes of every later
      call. They fix the
      structure and the non-array parts of the model: `init`/`update` take only its inexact
      arrays (`eqx.filter(model, eqx.is_inexact_array)`; the full model is accepted too).
    - `damping`: the damping `d`: a number, or an optax schedule of the update count.
    - `l2_reg`: the L2 coefficient of the loss, added to the damping (the preconditioner does
      not add an L2 term to the gradient).
    - `curvature_ema`: decay of the curvature moving averages.
    - `curvature_update_period`: update the curvature on every `k`-th step (starting with the
      first).
    - `inverse_update_period`: refresh the cached inverses every `k`-th step; `1` uses no cache
      (the inverse of the current estimate at every step).
    - `estimation_mode`: one of `fisher_gradients`, `fisher_empirical`, `fisher_exact`,
      `fisher_curvature_prop`, `ggn_exact`, `ggn_curvature_prop`.
    - `use_exact_inverses`: invert Kronecker blocks exactly instead of with pi-adjusted damping.
    - `layer_tag_to_block_ctor`: block class per tag name, overriding the defaults;
      `index_to_block_ctor`: block class per layer (as for `BlockDiagonalCurvature`).
    - `graph_patterns`, `patterns_to_skip`, `register_only_generic`, `auto_register_kwargs`:
      which layers automatic registration finds (as for `Optimizer` and `auto_register_tags`).
    - `batch_size_extractor`: the batch size of `batch`; `None` (default): the leading dimension
      of the registered losses' inputs.
    - `inverse_solver`: the lineax solver of the blocks' inverses, as for
      `BlockDiagonalCurvature`: one solver (for every `Full` and Kronecker block), one per block
      (or `None`), or a function from a block to its solver (or `None`); e.g. `lineax.Cholesky()`
      or `lineax.CG(rtol, atol)`. It replaces the choice of `use_exact_inverses` for those
      blocks. With caching, the solver state is refreshed every `inverse_update_period` steps
      with the damping of that step. A failed solve (e.g. CG out of steps) gives NaNs: wrap the
      chain in `eqx_kfac.skip_non_finite` to skip such steps. (Under `optax.inject_hyperparams`, a
      function given here must be listed in `static_args` too.)
    - `norm_constraint`: `c`, or `None` (default): scale the preconditioned gradient `u = P g`
      by `min(1, sqrt(c / uᵀg))`, so that `uᵀg` (the step's squared length in the curvature's
      metric, and its first-order predicted decrease for a unit learning rate) is at most `c`.
      `Optimizer(norm_constraint=c_opt)` at learning rate `lr` takes the same steps with
      `c = c_opt / lr²`.
    - `on_unmatched`: what to do when a parameter falls back to a generic (diagonal) block
      because no layer accounts for it: `"warn"` (a `UserWarning` naming the parameters),
      `"error"` or `"ignore"`; see `BlockDiagonalCurvature`.
    - `max_statistics_growth`: a batch that makes the statistics (all blocks together) grow in norm
      by more than this factor is not folded in (an outlier batch); `None` folds in every finite
      batch.
    - `curvature`, `refresh`, `direction`: the parts `Optimizer` takes (see "Building a
      variant"), each replacing the keywords that build it: `curvature` (a `CurvatureOptions`)
      replaces `estimation_mode`, `layer_tag_to_block_ctor`, `index_to_block_ctor`,
      `graph_patterns`, `patterns_to_skip`, `register_only_generic`, `auto_register_kwargs`,
      `inverse_solver`, `on_unmatched` and `batch_size_extractor`; `refresh` (an
      `AbstractRefreshSchedule`) replaces `curvature_ema`, `curvature_update_period`,
      `inverse_update_period` and `max_statistics_growth`, and its burn-in (`num_burnin_steps`
      curvature updates on the first batch, statistics summed) runs in the first update as in
      `Optimizer`; `direction` (an `AbstractDirection`, e.g. `EigenbasisAdam()`) replaces
      `use_exact_inverses` and `norm_constraint`. Giving a part and one of its keywords raises
      `ValueError`.

    **Faults.** A step whose gradient, or loss passed as `value=` (optax's convention), is not
    finite, or whose batch has a class label outside `[0, classes)` on an example a registered
    categorical loss does not mask out (your loss would read -1 as the last class), folds nothing
    into the curvature and leaves the cached inverses as they are; a batch whose statistics are not finite (e.g. inputs so
    large that a second moment overflows) or grow beyond `max_statistics_growth` (an outlier
    batch, e.g. inputs 1e10 times their usual size) is not folded in either. The preconditioned gradient
    itself is returned as it is: wrap the chain in `eqx_kfac.skip_non_finite` (or use
    `kfac_optax`, which also skips a step whose loss passed as `value=` is not finite, and can reject
    one that raises it) to leave parameters and state unchanged on such a step. A `loss_fn` that does not return a
    scalar (per-example losses) raises `ValueError` here.

    The registration table (which block each parameter gets) is logged at INFO level on the
    `"eqx_kfac"` logger. When `example_args` are arrays, the loss is evaluated on them once: a
    loss summed over the batch instead of averaged raises `ValueError`.

    **Returns:**

    An `optax.GradientTransformationExtraArgs` whose `update(grads, state, params, *, batch,
    key, value=None)` needs the current `params` (or model), this step's `batch` (or, for a
    `loss_fn` with more arguments, `loss_args=` all the arguments after the model) and a PRNG
    `key` for the sampled estimation modes (ignored by the exact ones); `value` is the step's
    loss, when known. Its state is a `KFACPreconditionerState`.
    """
    keywords = {name: value for name, value in locals().items() if name in _DEFAULTS}
    return preconditioner_transform(
        loss_fn, example_args, damping, l2_reg, keywords, {}, "kfac_preconditioner"
    ).as_optax()


_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(kfac_preconditioner).parameters.items()
    if name in PART_KEYWORDS or any(name in names for names in PART_KEYWORDS.values())
}


def preconditioner_transform(
    loss_fn: Callable[..., Any],
    example_args: Sequence[Any],
    damping: Any,
    l2_reg: Any,
    keywords: Mapping[str, Any],
    defaults: Mapping[str, Any],
    who: str,
) -> "_PreconditionerTransform":
    """The transformation object of `kfac_preconditioner` and `kfac_optax`: the preconditioner of
    the parts (given, or built from `keywords`), its estimator (traced from `loss_fn`, the loss
    checked on `example_args`), and `init`/`update`.

    **Arguments:**

    - `loss_fn`, `example_args`, `damping`, `l2_reg`: as for `kfac_preconditioner`.
    - `keywords`: the parts (`curvature`, `refresh`, `direction`, `None` where not given) and
      the keywords that build them, by name, as given.
    - `defaults`: the caller's defaults of those keywords, where they differ from
      `kfac_preconditioner`'s (a keyword at its default is not given).
    - `who`: the caller's name, for the errors.

    **Returns:**

    A `_PreconditionerTransform`.
    """
    example_args = tuple(example_args)
    if len(example_args) < 2:
        raise ValueError(
            f"{who}: example_args must be `(model, batch)` (or `(model, *loss_args)`), "
            f"the arguments of loss_fn; got {len(example_args)} argument(s)."
        )
    _check_scalar_loss(loss_fn, example_args)
    preconditioner = preconditioner_from_keywords(keywords, {**_DEFAULTS, **defaults}, who)
    estimator = preconditioner.estimator(loss_fn, example_args, f"eqx_kfac.{who}", report=True)
    preconditioner.check_loss(_loss_of, example_args, estimator)
    return _PreconditionerTransform(
        preconditioner, estimator, eqx.filter(example_args[0], eqx.is_inexact_array, inverse=True),
        len(example_args) - 1, damping, l2_reg,
    )


class _PreconditionerTransform(eqx.Module):
    """`kfac_preconditioner`'s `init` and `update`, over its preconditioner and estimator."""

    preconditioner: Preconditioner
    estimator: Any
    static_model: Any
    num_loss_args: int = eqx.field(static=True)
    damping: Any
    l2_reg: Any

    def as_optax(self) -> optax.GradientTransformationExtraArgs:
        """`init` and `update` as an optax transformation."""
        return optax.GradientTransformationExtraArgs(self.init, self.update)

    def _new_state(self, params: PyTree) -> KFACPreconditionerState:
        return KFACPreconditionerState(
            jnp.zeros((), jnp.int32), self.preconditioner.init(self.estimator),
            self.preconditioner.direction.init(self.estimator, eqx.filter(params, eqx.is_inexact_array)),
        )

    def init(self, params: PyTree) -> KFACPreconditionerState:
        # Built as `Optimizer.init` builds its state (see `initial_state`): run eagerly, every
        # array of a new shape would compile a program of its own.
        return _NEW_STATE(self, params)

    def _check_configuration(self, state: KFACPreconditionerState, params: PyTree) -> None:
        """Raises `ValueError` when `state` was made by a `kfac_preconditioner` of another
        configuration (its blocks, their caches or the direction's state differ; checked once,
        when `update` is traced)."""
        expected = eqx.filter_eval_shape(self._new_state, params)
        for name in ("estimator_state", "direction_state"):
            difference = tree_difference(
                getattr(state, name), getattr(expected, name), name, dtypes=False
            )
            if difference is not None:
                path, here, there = difference
                raise ValueError(
                    "kfac_preconditioner: the state passed to update was made by a K-FAC "
                    "transformation of another configuration (their curvature blocks, caches or "
                    "directions differ: use_exact_inverses, inverse_solver, layer_tag_to_block_ctor / "
                    f"index_to_block_ctor, inverse_update_period, direction=): `{path}` is {here} in "
                    f"it, {there} in this transformation's state. Start from this optimizer's "
                    "`init(params)`, or load a saved state with "
                    "`eqx_kfac.load_state(path, optimizer.init(params))`."
                )

    def _key(self, key: PRNGKeyArray | None) -> PRNGKeyArray:
        mode = self.preconditioner.curvature.estimation_mode
        if key is None and not mode.endswith("_exact"):
            raise ValueError(
                f"kfac_preconditioner: estimation_mode={mode!r} samples, so update needs a PRNG "
                "key: call `update(grads, state, params, batch=..., key=...)`."
            )
        return jax.random.key(0) if key is None else key

    def targets_in_range(self, params: PyTree, extra_args: dict[str, Any]) -> Array:
        """Whether the batch of `update`'s `extra_args` has no invalid label
        (`Preconditioner.targets_in_range`), for `kfac_optax`'s guard."""
        func_args = _func_args(
            self.static_model, self.num_loss_args, params, extra_args.get("batch"),
            extra_args.get("loss_args"),
        )
        return self.preconditioner.targets_in_range(self.estimator, func_args)

    # Called eagerly, one compiled program (`compiled`): run one operation at a time, the
    # periodic refreshes (`lax.while_loop`s) compiled again at every call.
    @compiled
    def update(
        # `state` is checked by `check_restored` (a checkpoint restored without a template).
        self, updates: PyTree, state: Any, params: PyTree = None, *,
        batch: PyTree = None, key: PRNGKeyArray | None = None,
        loss_args: tuple[Any, ...] | None = None, value: ArrayLike | None = None,
        **extra_args: Any,
    ) -> tuple[PyTree, KFACPreconditionerState]:
        # Other transformations of a chain may take extra arguments of their own.
        del extra_args
        check_restored(state, KFACPreconditionerState, "kfac_preconditioner")
        func_args = _func_args(self.static_model, self.num_loss_args, params, batch, loss_args)
        self._check_configuration(state, params)
        key = self._key(key)
        preconditioner, estimator = self.preconditioner, self.estimator
        grads = eqx.filter(updates, eqx.is_inexact_array)
        finite = all_finite(grads) & preconditioner.targets_in_range(estimator, func_args)
        if value is not None:
            finite &= jnp.isfinite(value)
        damping = self.damping(state.count) if callable(self.damping) else self.damping
        identity_weight = self.l2_reg + jnp.asarray(damping)
        estimator_state = preconditioner.update_curvature(
            estimator, state.estimator_state, state.count, finite, key, func_args,
            preconditioner.batch_size(estimator, func_args), burnin_in_graph=True,
        )
        estimator_state = preconditioner.refresh_inverses(
            estimator, estimator_state, state.count, finite, identity_weight
        )
        direction = preconditioner.precondition(
            estimator, estimator_state, grads, state.direction_state, identity_weight, 1.0
        )
        preconditioned = jax.tree.map(lambda p, g: p.astype(g.dtype), direction.direction, grads)
        # A gradient that is not finite (or an invalid label) leaves the direction's state as it
        # was, as it leaves the statistics.
        direction_state = select_changed(finite, direction.state, state.direction_state)
        return preconditioned, KFACPreconditionerState(
            optax.safe_increment(state.count), estimator_state, direction_state
        )


# The states' programs run once: their constants made on the host, the rest compiled for compile time.
_ONE_OFF = dict(ONE_OFF_COMPILER_OPTIONS)
_NEW_STATE = host_built(_PreconditionerTransform._new_state, _ONE_OFF)


_OPTAX_NORM_CONSTRAINT = 0.1


def kfac_optax(
    loss_fn: Callable[..., Any],
    example_args: Sequence[Any],
    learning_rate: float | optax.Schedule = 0.1,
    *,
    damping: float | ArrayLike | optax.Schedule = 0.1,
    norm_constraint: float | ArrayLike | None = _OPTAX_NORM_CONSTRAINT,
    momentum: float | None = 0.9,
    use_step_rejection: bool = False,
    max_consecutive_faults: int | None = 20,
    max_consecutive_stalls: int | None = 50,
    stop_in_program: bool = False,
    **preconditioner_kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
    """K-FAC as a ready optax optimizer: the recipe that trains every model of the zoo as it is.

    `optax.chain(kfac_preconditioner(loss_fn, example_args, damping=damping,
    norm_constraint=norm_constraint, ...), optax.trace(momentum), optax.scale_by_learning_rate(
    learning_rate))`, guarded by the same `StepGuard` as `Optimizer` (see **Faults** below).

    The defaults (learning rate 0.1, damping 0.1, norm constraint 0.1, momentum 0.9) train the
    models of the "Model gallery" page (CNN, ResNet with BatchNorm, transformer, GRU, LSTM, scan
    over layers, ...) without tuning; without the norm constraint the same recipe diverges on most
    of them. The damping bounds how far the step follows the gradient where the curvature is
    small: with `learning_rate / damping` as large as 10 (damping 0.01), minibatch noise kept the
    digits MLP of `benchmarks/stability.py` at a loss of 0.026 after 2,000 steps, against 4e-6
    with damping 0.1 (Adam: 1e-4). The damping is absolute, though: where the curvature is much
    smaller, 0.1 swamps it and the loss barely moves (the GRU of Equinox's RNN example notebook
    stayed at `log 2` for 200 steps, and trained with `damping=1e-3`); `Optimizer` adapts its
    damping instead. Use it like any optax optimizer, passing this step's
    batch to `update` (see `kfac_preconditioner` for the other forms of `loss_fn`):

    ```python
    optimizer = eqx_kfac.kfac_optax(loss, (model, batch))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    value, grads = eqx.filter_value_and_grad(loss)(model, batch)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, opt_state = optimizer.update(grads, opt_state, params, batch=batch, key=key,
                                          value=value)
    model = eqx.apply_updates(model, updates)
    ```

    **Faults** (the "Faults and safeguards" table of the Optimizer page shows both paths):

    - A step whose loss, gradient or update is not finite (a NaN batch, an empty batch, a
      curvature estimate that overflowed), or whose batch has a class label outside
      `[0, classes)` on an example a registered categorical loss does not mask out (an invalid
      label, e.g. -1, which your loss would read as the last class), is skipped: its updates are
      zero. With a loss or gradient that is not finite, or an invalid label, the whole state stays
      as it was; with an update that is not finite the momentum stays and the rest (counters,
      curvature statistics) moves on, as in `Optimizer`. The loss checked is `value=` when given
      (optax's convention); without it the gradient is (a loss that is not finite makes it so),
      and no forward pass of the guard's own is added to your step (XLA did not always merge one
      with yours: Flax's lm1b step took 15% longer with it).
    - With `use_step_rejection=True` a step whose loss on the same batch rises after the update
      (by more than rounding, `StepGuard.rounding_tolerance`) or is not finite there is rejected:
      zero updates, the momentum kept, the rest moves on, so that e.g. a learning-rate schedule
      moves past a value far too large. It costs one more evaluation of the loss per step, two
      without `value=` (the loss before the update too). Off
      (the default), such a finite update is applied as it is.
    - The counts are in the state's `guard_state` (`total_skipped`, `total_rejected`,
      `consecutive_faults`, `fault_start`, `consecutive_stalls`). After
      `max_consecutive_faults` skipped or rejected steps in a row, or `max_consecutive_stalls`
      applied steps in a row whose update is below the parameters' resolution (e.g. a loss
      scaled by 1e-12), the update raises an error that names the first faulty step or the
      cause, in Python after the update's compiled program when called outside `jit`. Inside your
      `jit` the program holds no host callback: call `eqx_kfac.check_consecutive_faults(state)`
      after each step, or pass `stop_in_program=True` (see `skip_non_finite`).

    **Arguments:**

    - `loss_fn`, `example_args`: as for `kfac_preconditioner`.
    - `learning_rate`: a number or an optax schedule.
    - `damping`, `norm_constraint`: passed to `kfac_preconditioner` (see there).
    - `momentum`: the decay of `optax.trace`, or `None` for none.
    - `use_step_rejection`: reject a step that raises the loss on its batch (see above).
    - `max_consecutive_faults`, `max_consecutive_stalls`, `stop_in_program`: see above and
      `skip_non_finite`.
    - `**preconditioner_kwargs`: the other keywords of `kfac_preconditioner` (e.g.
      `inverse_update_period`, `estimation_mode`, `l2_reg`), and its parts `curvature=`,
      `refresh=` and `direction=` (which replaces `norm_constraint`: its default here is then
      not used; given a value of its own with `direction=`, it raises `ValueError`). A direction
      with a state (e.g. `EigenbasisAdam`) keeps it, like the momentum, on a step that is
      skipped or rejected.

    **Returns:**

    An `optax.GradientTransformationExtraArgs` whose `update` takes the arguments of
    `kfac_preconditioner`'s (and `value=`); its state is a `SkipNonFiniteState`.
    """
    example_args = tuple(example_args)
    unknown = sorted(set(preconditioner_kwargs) - set(inspect.signature(kfac_preconditioner).parameters))
    if unknown:
        raise TypeError(f"kfac_optax got unexpected keyword arguments {unknown}.")
    keywords = {**_DEFAULTS, **preconditioner_kwargs, "norm_constraint": norm_constraint}
    transform = preconditioner_transform(
        loss_fn, example_args, damping, preconditioner_kwargs.get("l2_reg", 0.0),
        {name: keywords[name] for name in _DEFAULTS}, {"norm_constraint": _OPTAX_NORM_CONSTRAINT},
        "kfac_optax",
    )
    chain = optax.chain(
        transform.as_optax(),
        *([] if momentum is None else [optax.trace(momentum)]),
        optax.scale_by_learning_rate(learning_rate),
    )
    static_model = eqx.filter(example_args[0], eqx.is_inexact_array, inverse=True)

    def loss(params: Any, extra_args: dict[str, Any]) -> Any:
        batch, loss_args = extra_args.get("batch"), extra_args.get("loss_args")
        return _loss_of(loss_fn(*_func_args(static_model, len(example_args) - 1, params, batch, loss_args)))

    guard = StepGuard(
        reject_loss_increase=use_step_rejection, max_consecutive_faults=max_consecutive_faults,
        max_consecutive_stalls=max_consecutive_stalls, stop_in_program=stop_in_program,
    )
    def kept_unless_applied(inner: tuple[Any, ...]) -> tuple[Any, ...]:
        # The direction's state (where it has one) and the momentum.
        direction_state = () if inner[0].direction_state is None else (inner[0].direction_state,)
        return direction_state + (() if momentum is None else (inner[1],))

    guarded = GuardedTransform(
        optax.with_extra_args_support(chain), guard, loss, kept_unless_applied,
        advance_on_fault=True, targets_in_range=transform.targets_in_range,
    )
    # The whole chain's state is built at once (see `_PreconditionerTransform.init`), and, called
    # eagerly, one program takes the whole update (`GuardedTransform.update`).
    return optax.GradientTransformationExtraArgs(host_built(guarded.init, _ONE_OFF), guarded.update)
