"""The `CurvatureBlock` extension point.

A curvature block approximates the curvature (Fisher / GGN) of one registered layer. Blocks are
immutable `eqx.Module`s built from a `LayerSpec`; everything that changes lives in a separate
state PyTree that the block's methods take and return.

**How subclassing works.** The public methods of `CurvatureBlock` are final: they normalise
arguments and `jax.vmap` the per-slice hooks (`slice_init`, `slice_update_statistics`, ...; each
named after the method it serves) over the stack axis of a layer applied inside `jax.lax.scan`.
Two private methods see the whole block and answer `eqx_kfac.damped_block_operator` and
`eqx_kfac.solve_block`: `_damped_operator` and `_solve` (defaults through `as_linear_operator`;
the Kronecker form, `AbstractKroneckerFormBlock`, solves on its canonical array).
"""

import abc
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Float, PRNGKeyArray

from ..operators.block_operators import (
    AbstractCurvatureOperator,
    AbstractSliceCurvatureOperator,
    flatten_vector as flatten_vector,
    KroneckerCurvatureOperator,
    ReshapeLayout,
    StackedCurvatureOperator,
    unflatten_vector as unflatten_vector,
    unstack_block_diagonal,
)
from ..._core.linalg import map_slices
from ..._tracing.layer_data import EstimationData, LayerSpec
from .powers import normalize_powers as normalize_powers, Power as Power, PowersLike as PowersLike
from .statistics import statistics_dtype


def _fits(cls: type, tag: str) -> bool:
    return cls.supported_tags is None or tag in cls.supported_tags


def _concrete_blocks(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        if not getattr(sub, "__abstractmethods__", None):
            found.append(sub)
        found.extend(_concrete_blocks(sub))
    return found


def blocks_that_fit(tag: str) -> tuple[str, ...]:
    """Names of the (imported) concrete curvature blocks that accept a layer tag.

    **Arguments:**

    - `tag`: a layer tag name such as `"dense"` or `"generic"`.

    **Returns:**

    The sorted class names of the non-abstract `CurvatureBlock` subclasses that fit `tag`.
    """
    return tuple(sorted({c.__name__ for c in _concrete_blocks(CurvatureBlock) if _fits(c, tag)}))


class CurvatureBlock(eqx.Module):
    """The extension point for curvature approximations of one layer (abstract).

    A block is an immutable module holding a static `LayerSpec`; its moving-average statistics and
    caches are a separate state PyTree (an `eqx.Module` of arrays with static shapes) returned by
    `init` and threaded through every method. `(C + λ I)^p` below is the block's curvature
    estimate `C` damped by `identity_weight = λ` and raised to the power `p`.

    **To write a block**, subclass a family (`Diagonal`, `Full`, `KroneckerFactored`, see their
    docstrings) or this class directly ("Writing a block" in `docs/extending.md`). A direct
    subclass declares the field `spec: LayerSpec = eqx.field(static=True)` (then its other
    fields, all in the final class), sets the class variable `supported_tags` (`None` when it
    only uses `params_tangent`, which fits every tag), may override `_check_spec()` to raise
    `ValueError` for specs it cannot handle, and implements the per-slice hooks `slice_init`,
    `slice_update_statistics`, `slice_eigenvalues`, `slice_to_dense_matrix` and, where the
    defaults do not fit, `slice_update_cache`, `slice_multiply_matpower` and `slice_operator`.
    The hooks see one ordinary layer (no stack axis); call the public methods, which handle
    stacked layers. `takes_solver` is `True` only for `AbstractKroneckerFormBlock`s (`Full`,
    `KroneckerFactored`), whose field `solver` `BlockDiagonalCurvature(inverse_solver=)` sets.

    **Fields:**

    - `spec`: the `LayerSpec` of the layer (static).
    """

    spec: eqx.AbstractVar[LayerSpec]
    supported_tags: ClassVar[frozenset[str] | None] = None
    takes_solver: ClassVar[bool] = False

    def __check_init__(self):
        if not _fits(type(self), self.spec.tag):
            fitting = ", ".join(blocks_that_fit(self.spec.tag))
            expected = ", ".join(repr(t) for t in sorted(type(self).supported_tags))
            if self.spec.tag == "generic":
                why = (
                    "a 'generic' tag carries only parameters, no layer inputs or outputs, so "
                    "only blocks that use parameter gradients fit it"
                )
            else:
                why = f"{type(self).__name__} only handles tags {expected}"
            raise ValueError(
                f"{type(self).__name__} cannot approximate the {self.spec.describe}: {why}. "
                f"Blocks that fit tag '{self.spec.tag}': {fitting}. Choose one of them for this "
                "layer (e.g. through `layer_tag_to_block_ctor`)."
            )
        self._check_spec()

    def _check_spec(self) -> None:
        """Raises `ValueError` for a spec this block cannot handle (default: accepts all)."""

    # --- static structure -------------------------------------------------------------------

    @property
    def param_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of the parameters as this block's vectors carry them (stack axis included)."""
        stack = () if self.spec.stack_size is None else (self.spec.stack_size,)
        return tuple(stack + tuple(s) for s in self.spec.param_shapes)

    @property
    def slice_dim(self) -> int:
        """Number of parameter elements of one slice (the whole layer when not stacked)."""
        return int(sum(np.prod(s, dtype=int) for s in self.spec.param_shapes))

    @property
    def dim(self) -> int:
        """Number of parameter elements covered by the block."""
        return self.slice_dim * (self.spec.stack_size or 1)

    @property
    def dtype(self) -> Any:
        """The dtype of the block's statistics (float32 or wider)."""
        return statistics_dtype(self.spec)

    def _stacked(self, fn: Callable, *args: Any, one_slice_at_a_time: bool = False) -> Any:
        """Calls the per-slice `fn(*args)`, vmapped over the stack axis for stacked layers.

        With `one_slice_at_a_time`, the slices are visited in a loop (`lax.map`) on CPU instead
        (`linalg.map_slices`): a lineax solver's factorisations would otherwise become batched
        LAPACK calls, which can deadlock XLA's CPU thread pool (see `eqx_kfac._core.linalg`).
        Arguments that are not PyTrees
        of arrays with a leading stack axis must be closed over.
        """
        if self.spec.stack_size is None:
            return fn(*args)
        if not jax.tree.leaves(args):
            # vmap needs a mapped input; a stateless slice is the same for every stack entry.
            size = self.spec.stack_size
            return jax.tree.map(lambda x: jnp.broadcast_to(x, (size, *x.shape)), fn(*args))
        if one_slice_at_a_time:
            return map_slices(fn, *args)
        return jax.vmap(fn)(*args)

    def _factorises_with_solver(self, power: Power) -> bool:
        """Whether power `power` goes through a lineax solver's factorisations (default: never;
        `AbstractKroneckerFormBlock` says so for power -1 when its `solver` is set)."""
        del power
        return False

    def _check_vector(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        vector = tuple(vector)
        shapes = tuple(tuple(v.shape) for v in vector)
        if shapes != self.param_shapes:
            raise ValueError(
                f"{type(self).__name__} for the {self.spec.describe} expects a vector with "
                f"shapes {self.param_shapes}, got {shapes}."
            )
        return vector

    # --- public API -------------------------------------------------------------------------

    def init(
        self,
        key: PRNGKeyArray | None = None,
        exact_powers_to_cache: PowersLike = None,
        approx_powers_to_cache: PowersLike = None,
        cache_eigenvalues: bool = False,
    ) -> eqx.Module:
        """Creates the block's state: empty statistics and zeroed caches.

        **Arguments:**

        - `key`: a PRNG key (unused by the built-in blocks; part of the interface).
        - `exact_powers_to_cache`: the exact powers that will be used with `use_cached=True`.
        - `approx_powers_to_cache`: the approximate powers that will be used with
          `use_cached=True`.
        - `cache_eigenvalues`: whether `eigenvalues(..., use_cached=True)` will be used.

        **Returns:**

        The state, an `eqx.Module` PyTree of arrays whose shapes depend only on the spec and on
        these arguments.
        """
        del key
        state = self.slice_init(
            normalize_powers(exact_powers_to_cache),
            normalize_powers(approx_powers_to_cache),
            bool(cache_eigenvalues),
        )
        if self.spec.stack_size is None:
            return state
        size = self.spec.stack_size
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (size, *x.shape)), state)

    def update_curvature_matrix_estimate(
        self,
        state: eqx.Module,
        estimation_data: EstimationData,
        ema_old: ArrayLike,
        ema_new: ArrayLike,
        batch_size: ArrayLike,
    ) -> eqx.Module:
        """Folds one batch's statistics into the moving averages.

        **Arguments:**

        - `state`: the block's state.
        - `estimation_data`: the layer's data; tangents carry a leading vector axis `V` (for
          stacked layers the stack axis follows it).
        - `ema_old`: decay of the old estimate (`0` replaces it).
        - `ema_new`: weight of the new estimate.
        - `batch_size`: the number of examples the data was computed from; statistics are sums
          over examples and vectors divided by it.

        **Returns:**

        The updated state (caches untouched).
        """
        data = estimation_data
        if self.spec.stack_size is not None:
            data = EstimationData(
                params=data.params,
                inputs=data.inputs,
                outputs=data.outputs,
                outputs_tangent=tuple(jnp.moveaxis(t, 1, 0) for t in data.outputs_tangent),
                params_tangent=tuple(jnp.moveaxis(t, 1, 0) for t in data.params_tangent),
            )
        return self._stacked(
            lambda s, d: self.slice_update_statistics(s, d, ema_old, ema_new, batch_size), state, data
        )

    def update_cache(
        self,
        state: eqx.Module,
        identity_weight: ArrayLike,
        exact_powers: PowersLike = None,
        approx_powers: PowersLike = None,
        eigenvalues: bool = False,
    ) -> eqx.Module:
        """Recomputes the cached factorisations from the current statistics.

        **Arguments:**

        - `state`: the block's state.
        - `identity_weight`: the damping used for cached approximate powers (cached exact powers
          store an eigendecomposition and take the damping at multiplication time).
        - `exact_powers`: exact powers to refresh (must have been given to `init`).
        - `approx_powers`: approximate powers to refresh (must have been given to `init`).
        - `eigenvalues`: whether to refresh the cached eigenvalues.

        **Returns:**

        The state with updated caches.
        """
        exact = normalize_powers(exact_powers)
        approx = normalize_powers(approx_powers)
        return self._stacked(
            lambda s: self.slice_update_cache(s, identity_weight, exact, approx, bool(eigenvalues)),
            state,
            one_slice_at_a_time=self._factorises_with_solver(-1),
        )

    def multiply_matpower(
        self,
        state: eqx.Module,
        vector: Sequence[Array],
        identity_weight: ArrayLike,
        power: Power,
        exact_power: bool,
        use_cached: bool,
    ) -> tuple[Array, ...]:
        """Computes `(C + identity_weight I) ** power @ vector`.

        **Arguments:**

        - `state`: the block's state.
        - `vector`: a tuple of arrays shaped like the block's parameters.
        - `identity_weight`: the damping `λ`. With `use_cached=True` a block may use the damping
          given to the last `update_cache` instead (cached approximate powers do).
        - `power`: any real power (a Python number).
        - `exact_power`: `True` for the exact power; `False` allows the block's approximation
          (pi-adjusted damping for Kronecker blocks; exact for the others).
        - `use_cached`: use the factorisation stored by `update_cache` (at least as fresh as the
          last call with this power) instead of factorising the current statistics.

        **Returns:**

        A tuple of arrays shaped like `vector`.
        """
        vector = self._check_vector(vector)
        return self._stacked(
            lambda s, v: self.slice_multiply_matpower(
                s, v, identity_weight, power, bool(exact_power), bool(use_cached)
            ),
            state,
            vector,
            one_slice_at_a_time=self._factorises_with_solver(power),
        )

    def multiply(
        self,
        state: eqx.Module,
        vector: Sequence[Array],
        identity_weight: ArrayLike,
        exact_power: bool = True,
        use_cached: bool = False,
    ) -> tuple[Array, ...]:
        """Computes `(C + identity_weight I) @ vector`; see `multiply_matpower`.

        **Arguments:**

        - `state`, `vector`, `identity_weight`, `exact_power`, `use_cached`: as for
          `multiply_matpower`.

        **Returns:**

        A tuple of arrays shaped like `vector`.
        """
        return self.multiply_matpower(state, vector, identity_weight, 1, exact_power, use_cached)

    def multiply_inverse(
        self,
        state: eqx.Module,
        vector: Sequence[Array],
        identity_weight: ArrayLike,
        exact_power: bool = True,
        use_cached: bool = False,
    ) -> tuple[Array, ...]:
        """Computes `(C + identity_weight I)^-1 @ vector`; see `multiply_matpower`.

        **Arguments:**

        - `state`, `vector`, `identity_weight`, `exact_power`, `use_cached`: as for
          `multiply_matpower`.

        **Returns:**

        A tuple of arrays shaped like `vector`.
        """
        return self.multiply_matpower(state, vector, identity_weight, -1, exact_power, use_cached)

    def eigenvalues(self, state: eqx.Module, use_cached: bool = False) -> Float[Array, " dim"]:
        """The eigenvalues of the (undamped) curvature estimate, in no particular order.

        **Arguments:**

        - `state`: the block's state.
        - `use_cached`: return the eigenvalues stored by the last `update_cache` (requires
          `cache_eigenvalues=True` or exact powers at `init`).

        **Returns:**

        A flat array of `dim` eigenvalues.
        """
        values = self._stacked(lambda s: self.slice_eigenvalues(s, bool(use_cached)), state)
        return jnp.reshape(values, (-1,))

    def to_dense_matrix(self, state: eqx.Module) -> Float[Array, "dim dim"]:
        """The curvature estimate as a dense `(dim, dim)` matrix.

        Rows and columns follow the block's parameters in tag order, each flattened row-major and
        concatenated (stacked parameters include their stack axis).

        **Arguments:**

        - `state`: the block's state.

        **Returns:**

        The undamped curvature estimate as a matrix.
        """
        dense = self._stacked(self.slice_to_dense_matrix, state)
        if self.spec.stack_size is None:
            return dense
        return unstack_block_diagonal(dense, self.spec.param_shapes)

    def as_linear_operator(
        self, state: eqx.Module, identity_weight: ArrayLike = 0.0
    ) -> AbstractCurvatureOperator:
        """The damped curvature `C + identity_weight I` as a structured, PSD lineax operator.

        Its input structure is the tuple of the parameters' `jax.ShapeDtypeStruct`s (in the
        statistics dtype). The operator keeps the block's structure (Kronecker factors, an
        eigenbasis, a diagonal, ...; see `slice_operator`), so `eqx_kfac.trace`, `logdet`,
        `eigenvalues`, `frobenius_norm` and `matpower` work on it without forming a dense
        matrix; a stacked layer gives a `StackedCurvatureOperator` over its slices.

        **Arguments:**

        - `state`: the block's state.
        - `identity_weight`: damping added to the curvature.

        **Returns:**

        An `AbstractCurvatureOperator`, tagged symmetric and positive semidefinite for lineax.
        """
        weight = jnp.asarray(identity_weight, self.dtype)
        operator = self._stacked(lambda s: self.slice_operator(s, weight), state)
        if self.spec.stack_size is None:
            return operator
        return StackedCurvatureOperator(operator)

    # --- per-slice hooks (subclasses) ---------------------------------------------------------

    @abc.abstractmethod
    def slice_init(
        self,
        exact_powers: tuple[float, ...],
        approx_powers: tuple[float, ...],
        cache_eigenvalues: bool,
    ) -> eqx.Module:
        """The state of one slice (the hook of `init`): empty statistics and zeroed caches.

        **Arguments:**

        - `exact_powers`, `approx_powers`: the powers to cache, sorted tuples of floats.
        - `cache_eigenvalues`: whether to make room for cached eigenvalues.

        **Returns:**

        An `eqx.Module` of arrays whose shapes depend only on the spec and the arguments.
        """

    @abc.abstractmethod
    def slice_update_statistics(
        self,
        state: eqx.Module,
        data: EstimationData,
        ema_old: ArrayLike,
        ema_new: ArrayLike,
        batch_size: ArrayLike,
    ) -> eqx.Module:
        """Folds one batch into one slice's moving averages (the hook of
        `update_curvature_matrix_estimate`).

        **Arguments:**

        - `state`: the slice's state.
        - `data`: the layer's `EstimationData` without a stack axis; tangents lead with the vector
          axis `V`, then the batch.
        - `ema_old`, `ema_new`: the weights of the old and the new estimate.
        - `batch_size`: the divisor of the sums over examples and vectors.

        **Returns:**

        The state with new statistics (caches untouched).
        """

    def slice_update_cache(
        self,
        state: eqx.Module,
        identity_weight: ArrayLike,
        exact_powers: tuple[float, ...],
        approx_powers: tuple[float, ...],
        eigenvalues: bool,
    ) -> eqx.Module:
        """Refreshes one slice's caches from its statistics (the hook of `update_cache`; default:
        a block that caches nothing).

        **Arguments:**

        - `state`: the slice's state.
        - `identity_weight`: the damping of cached approximate powers.
        - `exact_powers`, `approx_powers`: the powers to refresh (given to `init`).
        - `eigenvalues`: whether to refresh the cached eigenvalues.

        **Returns:**

        The state with refreshed caches.
        """
        del identity_weight, exact_powers, approx_powers, eigenvalues
        return state

    def slice_multiply_matpower(
        self,
        state: eqx.Module,
        vector: tuple[Array, ...],
        identity_weight: ArrayLike,
        power: Power,
        exact_power: bool,
        use_cached: bool,
    ) -> tuple[Array, ...]:
        """`(C + λ I)^p v` for one slice (the hook of `multiply_matpower`; default: the power of
        `slice_operator`, for structures whose powers are exact and cheap, such as a diagonal).

        **Arguments:**

        - `state`, `identity_weight`, `power`, `exact_power`, `use_cached`: as for
          `multiply_matpower` (`power` a Python number).
        - `vector`: a tuple of arrays shaped like `spec.param_shapes`.

        **Returns:**

        A tuple of arrays shaped like `vector`.
        """
        del exact_power, use_cached
        return self.slice_operator(state, identity_weight).matpower(power).mv(vector)

    @abc.abstractmethod
    def slice_eigenvalues(self, state: eqx.Module, use_cached: bool) -> Float[Array, " slice_dim"]:
        """The eigenvalues of one slice's undamped curvature (the hook of `eigenvalues`).

        **Arguments:**

        - `state`: the slice's state.
        - `use_cached`: return those stored by the last `slice_update_cache`.

        **Returns:**

        A flat array of `slice_dim` eigenvalues, in any order.
        """

    @abc.abstractmethod
    def slice_to_dense_matrix(self, state: eqx.Module) -> Float[Array, "slice_dim slice_dim"]:
        """One slice's undamped curvature as a dense matrix (the hook of `to_dense_matrix`).

        **Arguments:**

        - `state`: the slice's state.

        **Returns:**

        The `(slice_dim, slice_dim)` matrix, rows in tag order, each parameter flattened row-major.
        """

    def slice_operator(
        self, state: eqx.Module, identity_weight: ArrayLike
    ) -> AbstractSliceCurvatureOperator:
        """One slice's damped curvature as a structured operator (the hook of
        `as_linear_operator`).

        The families return their structure (`KroneckerCurvatureOperator`,
        `EigenbasisCurvatureOperator`, `DiagonalCurvatureOperator`, ...). The default sees the
        block as its dense matrix (a one-factor Kronecker operator on the flat parameters,
        `O(slice_dim²)` memory): override it to keep a structure.

        **Arguments:**

        - `state`: the slice's state.
        - `identity_weight`: the damping `λ` (a scalar in the statistics dtype).

        **Returns:**

        An `AbstractSliceCurvatureOperator` for `C + λ I`.
        """
        layout = ReshapeLayout(self.spec.param_shapes, (self.slice_dim,))
        return KroneckerCurvatureOperator((self.slice_to_dense_matrix(state),), identity_weight, layout)

    def _damped_operator(
        self, state: eqx.Module, identity_weight: ArrayLike
    ) -> lx.AbstractLinearOperator:
        """`C + λI` in the form the solvers take (`eqx_kfac.damped_block_operator`; default:
        `as_linear_operator`)."""
        return self.as_linear_operator(state, identity_weight)

    def _solve(
        self,
        state: eqx.Module,
        vector: tuple[Array, ...],
        identity_weight: ArrayLike,
        solver: lx.AbstractLinearSolver | None,
    ) -> tuple[Array, ...]:
        """`(C + λI)⁻¹ v` with a lineax solver (`eqx_kfac.solve_block`; default: `solver`, else
        `lineax.AutoLinearSolver(well_posed=True)`, on `as_linear_operator`)."""
        solver = lx.AutoLinearSolver(well_posed=True) if solver is None else solver
        operator = self.as_linear_operator(state, identity_weight)
        cast = tuple(v.astype(self.dtype) for v in vector)
        return tuple(lx.linear_solve(operator, cast, solver).value)

    def _missing_cache(self, what: str, argument: str) -> ValueError:
        return ValueError(
            f"{type(self).__name__} for the {self.spec.describe} has no cached {what}: pass it "
            f"to `init(..., {argument}=...)` and call `update_cache` before using "
            "`use_cached=True`."
        )
